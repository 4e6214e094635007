"""Grid dims whose size is a traced value.

`pallas_call(..., grid=(tiles_n, num_tiles, tiles_k))` under `jax.jit`, where
`num_tiles` is computed from data (an int32 scalar tracer), has a dynamic
dim. dsl keeps its grid static and carries the traced sizes beside it:

- the GridMapping's grid holds `DYNAMIC` for each such dim (`gm.dynamic_dims`
  lists them); everything that needs a size at trace time (index-map
  analysis, views, revisit checks, partitioning) treats a dynamic dim as
  unknown;
- the sizes are the leading operands of `pallas_call_p`, one int32 scalar
  per dynamic dim in grid order, before the scalar-prefetch operands
  (`gm.split_operands(args).sizes`); the user's `input_output_aliases` do
  not count them;
- inside the kernel, `pl.num_programs(d)` of a dynamic dim is a
  `num_programs` equation (`num_programs_p`, param `axis`: the grid dim,
  counting the axes vmap adds in front, as the kernel jaxpr's program ids
  do; vmap shifts it, `shift_axes`). It is always bound at the kernel
  jaxpr's top level, where it is called (a use inside `pl.when` or a loop
  closes over it), and the transformations keep it there, so a backend
  finds it there: the interpret backend substitutes the size
  (`sizes_as_inputs`), the Mosaic lowering emits `tpu.iteration_bound`.

Backends whose record says `dynamic_grid_sizes=False` (Triton, Mosaic GPU:
their launch grids are host-side ints) refuse such kernels with a
KernelError naming the dim (`check_backend`).
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive

from dsl.core.errors import KernelError, KernelTypeError
from dsl.core.jax_internals import close_jaxpr, ClosedJaxpr, core, mlir
from dsl.core.jaxpr_walk import sub_jaxprs


class DynamicSize:
  """The size of a grid dim that is only known when the kernel runs."""

  def __repr__(self):
    return "dynamic"

  def __reduce__(self):
    return "DYNAMIC"


DYNAMIC = DynamicSize()


def is_dynamic(size) -> bool:
  return size is DYNAMIC


# ------------------------------------------------------------ the sizes

def _traced_scalar(kernel: str, i: int, g, where: str):
  """The traced grid entry `g` (grid[i]) as an int32 scalar."""
  shape, dtype = tuple(np.shape(g)), getattr(g, "dtype", None)
  if shape not in ((), (1,)) or dtype is None or not (
      jnp.issubdtype(dtype, jnp.integer)):
    raise KernelTypeError(
        kernel, f"grid[{i}] must be a positive integer or a traced integer "
        f"scalar, got a traced {getattr(g, 'aval', g)}", where,
        operand="grid")
  if shape:
    g = jnp.reshape(g, ())
  return g if g.dtype == np.int32 else lax.convert_element_type(g, np.int32)


def _concrete_int(g):
  """`g` as a Python int when it is a concrete integer array of one
  element (not traced), else `g`."""
  if isinstance(g, core.Tracer) or not hasattr(g, "dtype"):
    return g
  if np.size(g) == 1 and jnp.issubdtype(g.dtype, jnp.integer):
    return int(np.asarray(g).reshape(()))
  return g


def lift_traced_sizes(kernel: str, grid, where: str) -> tuple[Any, tuple]:
  """(`grid` with each traced size replaced by DYNAMIC, the traced sizes as
  int32 scalars, in grid order). A concrete integer array becomes an int;
  a named axis (`("i", n)`) needs a static size."""
  if isinstance(grid, core.Tracer) or hasattr(grid, "dtype"):
    grid = (grid,)
  if not isinstance(grid, (tuple, list)):
    return grid, ()
  out, sizes = [], []
  for i, g in enumerate(grid):
    named = isinstance(g, tuple) and len(g) == 2 and isinstance(g[0], str)
    size = _concrete_int(g[1] if named else g)
    if not isinstance(size, core.Tracer):
      out.append((g[0], size) if named else size)
      continue
    if named:
      raise KernelError(kernel, f"grid[{i}] names the axis {g[0]!r} but its "
                        "size is traced; a named grid axis needs a static "
                        "size", where, operand="grid")
    sizes.append(_traced_scalar(kernel, i, size, where))
    out.append(DYNAMIC)
  return tuple(out), tuple(sizes)


def full_grid(grid: Sequence, sizes: Sequence) -> tuple:
  """The grid with each DYNAMIC replaced by its size (from `sizes`, in
  order): what a backend iterates over when the kernel runs."""
  it = iter(sizes)
  out = tuple(next(it) if is_dynamic(g) else g for g in grid)
  if next(it, None) is not None:
    raise ValueError(f"more sizes than dynamic dims in the grid {grid}")
  return out


def check_backend(spec, record) -> None:
  """Raises KernelError when backend `record` cannot run `spec`'s grid
  (it has a dynamic dim and the backend needs static grid sizes)."""
  gm = spec.grid_mapping
  if not gm.dynamic_dims or record.dynamic_grid_sizes:
    return
  owner = getattr(record.rules, "owner", None) or f"backend '{record.name}'"
  dim = gm.dynamic_dims[0] - gm.num_hidden_axes
  raise KernelError(spec.name, f"grid dim {dim} has a traced size; {owner} "
                    "needs static grid sizes (its launch grid is fixed when "
                    "the kernel is compiled); run it with backend="
                    "'interpret', 'mosaic' or 'mosaic_interpret', or give "
                    "the grid a static bound and skip the steps past the "
                    "traced one with pl.when", spec.where, operand="grid")


# ------------------------------------------------------------ in the kernel

num_programs_p = Primitive("num_programs")


@num_programs_p.def_abstract_eval
def _num_programs_abstract_eval(*, axis):
  del axis
  return core.ShapedArray((), jnp.int32)


def _no_lowering(ctx, *, axis):
  raise ValueError(f"internal error: num_programs({axis}) of a dynamic grid "
                   "dim reached JAX's lowering; the backend should have "
                   "given its size")


mlir.register_lowering(num_programs_p, _no_lowering)


def bind_num_programs(trace, axis: int):
  """`num_programs_p` bound in `trace` (the kernel's top-level trace), so
  that the equation sits at the kernel jaxpr's top level wherever the
  body calls `pl.num_programs`."""
  with core.set_current_trace(trace):
    return num_programs_p.bind(axis=axis)


def current_trace():
  """The trace being traced into (a kernel body's, in `trace_kernel`)."""
  return core.trace_ctx.trace


def _nested_use(jaxpr: core.Jaxpr) -> bool:
  return any(e.primitive is num_programs_p or _nested_use(j)
             for e in jaxpr.eqns for j in sub_jaxprs(e.params))


def _top_level(closed: ClosedJaxpr) -> core.Jaxpr:
  j = closed.jaxpr
  if any(_nested_use(s) for e in j.eqns for s in sub_jaxprs(e.params)):
    raise ValueError("internal error: num_programs of a dynamic grid dim "
                     "inside a kernel's control flow")
  return j


def shift_axes(closed: ClosedJaxpr, by: int) -> ClosedJaxpr:
  """`closed` with the grid dim of each `num_programs` equation moved by
  `by` (vmap puts a grid axis in front of the kernel's)."""
  j = _top_level(closed)
  if not any(e.primitive is num_programs_p for e in j.eqns):
    return closed
  eqns = [e.replace(params={"axis": e.params["axis"] + by})
          if e.primitive is num_programs_p else e for e in j.eqns]
  return close_jaxpr(j.replace(eqns=eqns), closed.consts)


@functools.lru_cache(maxsize=256)
def sizes_as_inputs(closed: ClosedJaxpr, dims: tuple[int, ...]) -> ClosedJaxpr:
  """`closed` taking the size of each grid dim of `dims` as a leading
  input, in that order, in place of its `num_programs` equations (at its
  top level)."""
  j = _top_level(closed)
  axes = list(dims)
  new_in = [core.Var(core.ShapedArray((), jnp.int32)) for _ in axes]
  subst: dict = {}
  eqns = []
  for eqn in j.eqns:
    if eqn.primitive is num_programs_p:
      subst[eqn.outvars[0]] = new_in[axes.index(eqn.params["axis"])]
      continue
    eqns.append(eqn.replace(invars=[subst.get(v, v) if isinstance(v, core.Var)
                                    else v for v in eqn.invars]))
  outvars = [subst.get(v, v) if isinstance(v, core.Var) else v
             for v in j.outvars]
  info = j.debug_info
  info = info.with_unknown_names() if hasattr(info, "with_unknown_names") \
      else info
  new = j.replace(invars=new_in + list(j.invars), outvars=outvars,
                  eqns=eqns, debug_info=info)
  return close_jaxpr(new, closed.consts)
