"""`plgpu.kernel`: a kernel over a mesh of CUDA blocks and their warpgroups.

`kernel(body, out_type=, grid=, grid_names=, cluster=, cluster_names=,
num_threads=, thread_name=)` runs `body(*in_refs, *out_refs, *scratch_refs)`
once per warpgroup ("thread") of every block: the refs are whole arrays in
GMEM, `lax.axis_index(name)` gives the block's coordinates along the grid
and cluster axes and the warpgroup's along `thread_name`. The warpgroups of
a block run at the same time and meet at mbarriers; they share the
allocations of `pl.run_scoped(..., collective_axes=thread_name)` and the
kernel's scratch.

dsl runs it as a `pallas_call` over the named grid `(*grid, *cluster,
num_threads)` whose compiler params carry the `Mesh`: the interpret backend
sees the mesh and runs the warpgroups of each block together
(dsl/interpret/warpgroups.py) instead of one grid point after another.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Sequence

import jax
from jax import tree_util

from dsl.core import backends

from dsl.core.errors import KernelError, api_boundary, kernel_name, user_frame
from dsl.core.pallas_call import pallas_call
from dsl.core.primitives import run_scoped
from dsl.mosaic_gpu.compiler_params import CompilerParams
from dsl.mosaic_gpu.memory import GMEM, BlockSpec

_MAX_THREADS = 2048 // 128


@dataclasses.dataclass(frozen=True)
class Mesh:
  """Blocks along `grid` (named `grid_names`), grouped in clusters of
  `cluster` (named `cluster_names`), each of `num_threads` warpgroups
  (named `thread_name`)."""
  grid: Sequence[int] = ()
  grid_names: Sequence[str] = ()
  cluster: Sequence[int] = ()
  cluster_names: Sequence[str] = ()
  num_threads: int | None = None
  thread_name: str | None = None
  kernel_name: str | None = None

  def __post_init__(self):
    for field in ("grid", "grid_names", "cluster", "cluster_names"):
      object.__setattr__(self, field, tuple(getattr(self, field)))
    problems = [
        (len(self.grid_names) != len(self.grid),
         f"grid_names {self.grid_names} must name each dim of grid "
         f"{self.grid}"),
        (len(self.cluster_names) != len(self.cluster),
         f"cluster_names {self.cluster_names} must name each dim of cluster "
         f"{self.cluster}"),
        (len(self.cluster) > 3, f"cluster {self.cluster} has more than 3 dims"),
        ((self.num_threads is None) != (self.thread_name is None),
         "num_threads and thread_name go together"),
        (self.num_threads is not None and not 1 <= self.num_threads
         <= _MAX_THREADS, f"num_threads must be between 1 and "
         f"{_MAX_THREADS} (warpgroups of 128 CUDA threads), got "
         f"{self.num_threads}"),
        (any(not isinstance(d, int) or d < 1 for d in self.grid + self.cluster),
         f"grid {self.grid} and cluster {self.cluster} must be positive ints"),
    ]
    for bad, message in problems:
      if bad:
        raise ValueError(f"plgpu.Mesh: {message}")

  @property
  def shape(self) -> dict:
    """Axis name -> size, blocks first, warpgroups last."""
    names = (*self.grid_names, *self.cluster_names)
    sizes = (*self.grid, *self.cluster)
    if self.num_threads is not None:
      names, sizes = (*names, self.thread_name), (*sizes, self.num_threads)
    return dict(zip(names, sizes))

  @property
  def named_grid(self) -> tuple[tuple[str, int], ...]:
    """The named grid of the pallas_call that runs the kernel."""
    return tuple(self.shape.items())

  @property
  def block_rank(self) -> int:
    """Grid dims of the pallas_call that index blocks (the rest: the
    warpgroup's)."""
    return len(self.grid) + len(self.cluster)


def _is_shape(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def kernel(body=None, *, out_type: Any = (), scratch_types: Any = (),
           compiler_params: CompilerParams | None = None,
           cost_estimate=None, grid: Sequence[int] = (),
           grid_names: Sequence[str] = (), cluster: Sequence[int] = (),
           cluster_names: Sequence[str] = (), num_threads: int | None = None,
           thread_name: str | None = None, interpret: Any = None,
           debug: bool = False, backend: str | None = None, name=None,
           **mesh_kwargs):
  """Decorator (or call): `body` becomes a function of arrays that runs it
  over the mesh (see the module docstring); it returns outputs shaped like
  `out_type`."""
  if body is None:
    return functools.partial(
        kernel, out_type=out_type, scratch_types=scratch_types,
        compiler_params=compiler_params, cost_estimate=cost_estimate,
        grid=grid, grid_names=grid_names, cluster=cluster,
        cluster_names=cluster_names, num_threads=num_threads,
        thread_name=thread_name, interpret=interpret, debug=debug,
        backend=backend, name=name, **mesh_kwargs)
  where = user_frame()
  kname = name or mesh_kwargs.get("kernel_name") or kernel_name(body)
  try:
    mesh = Mesh(grid, grid_names, cluster, cluster_names, num_threads,
                thread_name, **mesh_kwargs)
  except (TypeError, ValueError) as e:
    raise KernelError(kname, str(e), where, operand="mesh") from None
  params = compiler_params or CompilerParams()
  if not isinstance(params, CompilerParams):
    raise KernelError(kname, "plgpu.kernel takes plgpu.CompilerParams, got "
                      f"{type(params).__name__}", where,
                      operand="compiler_params")
  params = dataclasses.replace(params, mesh=mesh)
  single = not isinstance(out_type, (tuple, list))
  outs = (out_type,) if single else tuple(out_type)
  whole = BlockSpec(memory_space=GMEM)

  threads = () if thread_name is None else (thread_name,)

  def with_scratch(*refs):
    # The kernel's scratch is shared by the warpgroups of a block.
    named = isinstance(scratch_types, Mapping)
    run_scoped(functools.partial(body, *refs),
               *(() if named else scratch_types), collective_axes=threads,
               **(scratch_types if named else {}))
  with_scratch.__name__ = with_scratch.__qualname__ = kname
  kernel_fn = with_scratch   # (as Pallas: a scope even without scratch)

  @functools.wraps(body)
  @api_boundary
  def call(*args):
    __tracebackhide__ = True
    in_specs = tuple(tree_util.tree_map(lambda _: whole, a) for a in args)
    out_specs = tree_util.tree_map(lambda _: whole, outs, is_leaf=_is_shape)
    results = pallas_call(
        kernel_fn, outs, grid=mesh.named_grid, in_specs=in_specs,
        out_specs=out_specs, compiler_params=params, backend=backend,
        interpret=bool(interpret), name=kname, debug=debug,
        cost_estimate=cost_estimate)(*args)
    return results[0] if single else results
  call.kernel_body = body
  call.mesh = mesh
  return call


def force_gpu_interpret_mode(params=None):
  """A context manager: inside it, kernels that name no backend run on the
  interpret backend (`dsl.default_backend("interpret")`); Pallas's
  interpret-mode `params` have no counterpart and are ignored."""
  del params
  return backends.default_backend("interpret")


def set_gpu_interpret_mode(params=None) -> None:
  """From now on, kernels that name no backend run on the interpret
  backend (the option `jax_pallas_default_backend`)."""
  del params
  jax.config.update("jax_pallas_default_backend", "interpret")
