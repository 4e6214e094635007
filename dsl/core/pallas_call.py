"""`pallas_call`: the primitive that runs a kernel over a grid.

This module defines the primitive (`pallas_call_p`, its KernelSpec, its
evaluation and abstract evaluation) and the user's entry point
`pallas_call`, which resolves the specs and traces the kernel once
(`build_spec`). The primitive's other rules (jvp, vmap, transpose,
checkify, and its MLIR lowering, which runs the backend the registry
resolves) are registered by dsl.transforms.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import tree_util
from dsl.core.jax_internals import (ClosedJaxpr, core, dispatch,
                                    mesh as mesh_lib)
from jax.extend.core import Primitive

from dsl.core import (backends, checks, config, dynamic_grid, host_failures,
                      named_axes, sharding)
from dsl.core.compiler_params import tuned_params
from dsl.core.errors import (KernelError, KernelTypeError, api_boundary,
                             function_location, kernel_error_of, kernel_name,
                             user_frame)
from dsl.core.gridspec import (GridMapping, GridSpec, check_in_specs,
                               is_shape_tuple, resolve_grid_mapping)
from dsl.core.index_maps import check_block_indices
from dsl.core.grid_plan import check_parallel_carries, check_semantics
from dsl.core.tracing import kernel_ref_names, trace_kernel


@dataclasses.dataclass(frozen=True)
class CostEstimate:
  """What a kernel costs, for the compiler's scheduling (passed through to
  the TPU custom call): floating-point operations, transcendental
  operations, bytes read and written, and bytes sent to other devices."""
  flops: int
  transcendentals: int
  bytes_accessed: int
  remote_bytes_transferred: int = 0

  def __post_init__(self):
    for k, v in dataclasses.asdict(self).items():
      if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"CostEstimate.{k} must be an int, got "
                         f"{type(v).__name__} {v!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class KernelSpec:
  """Everything a backend needs to run one kernel."""
  name: str
  jaxpr: ClosedJaxpr
  grid_mapping: GridMapping
  input_output_aliases: tuple[tuple[int, int], ...] = ()
  compiler_params: Any = None
  backend: str | None = None
  debug: bool = False
  where: str = "<unknown>"
  kernel_src: str = "<unknown>"
  cost_estimate: Any = None
  # How this kernel was derived by a transformation, e.g. ("linear", spec, nz).
  meta: tuple = ()
  # The user's name of each kernel ref (its parameter: `x_ref`, `sem`,
  # `bufs[1]`), None where unknown; see `ref_labels`.
  ref_names: tuple = ()
  # Runs on each device's shards on its own (partitioned under a sharded
  # jit, see dsl.transforms.partitioning): it is not partitioned again.
  local: bool = False
  # `pallas_call(metadata=)`: (key, value) string pairs, sorted; the Mosaic
  # lowering puts them in the TPU call's `kernel_metadata`.
  metadata: tuple = ()
  # A kernel of reverse mode: its compiler params are those of the kernel
  # it was derived from, whose launch parameters (num_warps, num_stages)
  # were chosen for other work; a backend may choose its own for it.
  launch_inherited: bool = False

  def ref_labels(self) -> list[str]:
    """A name per kernel ref for messages and generated code: the user's
    parameter name, else the spec it comes from (`in_specs[0]`,
    `scratch_shapes[1]`, `scalar prefetch 0`)."""
    origins = self.grid_mapping.ref_origins
    names = list(self.ref_names) + [None] * (len(origins) - len(self.ref_names))
    return [n or o for n, o in zip(names, origins)]

  def __repr__(self):
    gm = self.grid_mapping
    blocks = ", ".join(f"{bm.origin}={_block_str(bm)}" for bm in gm.block_mappings)
    return (f"<kernel {self.name} grid={gm.grid} {blocks} at {self.kernel_src}>"
            f"\n{self.jaxpr}")

  def replace(self, **kw) -> "KernelSpec":
    return dataclasses.replace(self, **kw)


def _block_str(bm) -> str:
  return f"{bm.array_aval.str_short()}/{tuple(bm.block_shape)}"


pallas_call_p = Primitive("pallas_call")
pallas_call_p.multiple_results = True
# Under a sharded jit it lowers through custom_partitioning, which needs the
# devices while lowering.
dispatch.prim_requires_devices_during_lowering.add(pallas_call_p)


@pallas_call_p.def_impl
def _pallas_call_impl(*args, spec: KernelSpec):
  # A kernel that fails on a host backend raises its KernelError in a host
  # callback; XLA hands back an error of its own (a JaxRuntimeError, or a
  # ValueError from jit's fast path): the KernelError is re-raised instead.
  try:
    outs = dispatch.apply_primitive(pallas_call_p, *args, spec=spec)
    if backends.runs_on_host(spec.backend):
      jax.block_until_ready(outs)
    return outs
  except Exception as e:  # noqa: BLE001 - JaxRuntimeError or ValueError
    err = kernel_error_of(e)
    if err is None or err is e:
      raise
    host_failures.forget_failed_runs()
    raise err.with_traceback(None) from None


@pallas_call_p.def_abstract_eval
def _pallas_call_abstract_eval(*avals, spec: KernelSpec):
  # Inside shard_map, outputs vary over the manual axes the inputs vary over.
  outs = spec.grid_mapping.out_avals
  if spec.local:   # one device's part of a partitioned kernel: plain arrays
    with mesh_lib.use_abstract_mesh(mesh_lib.empty_abstract_mesh):
      return [core.ShapedArray(a.shape, a.dtype) for a in outs]
  varying = [a for a in avals if getattr(getattr(a, "mat", None), "varying",
                                         None)]
  if not varying:
    mesh = _explicit_mesh(avals)
    if mesh is not None:
      # Under jit over a mesh with Explicit axes: outputs are split as the
      # inputs imply along the grid dims the kernel partitions over
      # (dsl.core.sharding), replicated elsewhere.
      operands = spec.grid_mapping.split_operands(avals)
      shardings = sharding.explicit_out_shardings(
          spec, operands.prefetch + operands.inputs, mesh)
      return [core.ShapedArray(a.shape, a.dtype, sharding=sh)
              for a, sh in zip(outs, shardings)]
    return [core.ShapedArray(a.shape, a.dtype) for a in outs]
  like = max(varying, key=lambda a: len(a.mat.varying))
  mesh = like.sharding.mesh
  return [core.ShapedArray(
      a.shape, a.dtype, manual_axis_type=like.mat,
      sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
          for a in outs]


def _explicit_mesh(avals):
  """The mesh of operands that live on a mesh with Explicit axes, or None."""
  for a in avals:
    mesh = getattr(getattr(a, "sharding", None), "mesh", None)
    if mesh is not None and getattr(mesh, "explicit_axes", ()):
      return mesh
  return None


def _sharded_explicitly(aval) -> bool:
  sharding = getattr(aval, "sharding", None)
  explicit = set(getattr(getattr(sharding, "mesh", None), "explicit_axes", ()))
  for p in getattr(sharding, "spec", ()) if explicit else ():
    if set(p if isinstance(p, tuple) else (p,)) & explicit:
      return True
  return False


def sharded_like(x, aval):
  """`x`, resharded to `aval`'s sharding where that names Explicit axes."""
  if aval is None or not _sharded_explicitly(aval):
    return x
  if getattr(core.typeof(x), "sharding", None) == aval.sharding:
    return x
  return jax.sharding.reshard(x, aval.sharding)


def _leaf_aval(kernel: str, x, what: str, where: str):
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    # A weakly typed array (one made from a Python scalar) stays weak, as in
    # JAX and Pallas: the kernel's value of it follows JAX's promotion.
    weak = bool(getattr(x, "weak_type", False))
    return core.ShapedArray(tuple(x.shape), jnp.dtype(x.dtype),
                            weak_type=weak)
  raise KernelTypeError(kernel, f"expected an array or jax.ShapeDtypeStruct, "
                        f"got {x!r}", where, operand=what)


def _out_aval(kernel: str, x, i: int, where: str):
  if is_shape_tuple(x):
    raise KernelTypeError(
        kernel, f"out_shape gives each output's shape and dtype: got the "
        f"shape {tuple(x)} alone; write jax.ShapeDtypeStruct({tuple(x)}, "
        "dtype) (a tuple or list of them for several outputs)", where,
        operand=f"out_shape[{i}]")
  return _leaf_aval(kernel, x, f"out_shape[{i}]", where)


def as_operand(x):
  """A pallas_call operand as an array: a Python scalar (bool, int, float,
  complex) becomes a weakly typed scalar of JAX's default dtype for it, as
  Pallas takes it (`jnp.asarray`); arrays and numpy scalars pass as they
  are."""
  if isinstance(x, (bool, int, float, complex)):
    return jnp.asarray(x)
  return x


_PY_SCALARS = (bool, int, float, complex)


def check_operands(kernel: str, args, where: str) -> None:
  """A Python list or tuple of numbers among the operands is not an array
  (pytrees of arrays are operands, each leaf one): it would become one
  scalar operand per element. Says so, with the fix."""
  for i, x in enumerate(args):
    if not isinstance(x, (list, tuple)):
      continue
    leaves = tree_util.tree_leaves(x)
    numbers = sum(isinstance(v, _PY_SCALARS) for v in leaves)
    if numbers:
      raise KernelTypeError(
          kernel, f"got a Python {type(x).__name__} of {len(leaves)} "
          f"elements ({numbers} of them Python numbers); a {type(x).__name__} "
          "is not an array, and each of its elements would be an operand of "
          f"its own: convert it with jnp.asarray(...) first", where,
          operand=f"argument {i}")


def _check_aliases(name, aliases, in_avals_all, out_avals, where):
  """The `input_output_aliases` as (input, output) pairs; errors in
  Pallas's wording, so code that matches its errors matches ours."""
  out = []
  for i, o in dict(aliases or {}).items():
    mapping = f"input_output_aliases contains the mapping '{i}:{o}'"
    if not 0 <= i < len(in_avals_all):
      raise KernelError(name, f"{mapping} with input index {i} outside the "
                        f"range [0, {len(in_avals_all)})", where,
                        operand="input_output_aliases")
    if not 0 <= o < len(out_avals):
      raise KernelError(name, f"{mapping} with output index {o} outside the "
                        f"range [0, {len(out_avals)})", where,
                        operand="input_output_aliases")
    a, b = in_avals_all[i], out_avals[o]
    if (a.shape, a.dtype) != (b.shape, b.dtype):
      raise KernelError(
          name, f"{mapping} referring to input[{i}] with abstract value "
          f"{a.str_short()} and to output[{o}] with a different abstract "
          f"value {b.str_short()}: aliased buffers must have the same shape "
          "and dtype", where, operand="input_output_aliases")
    out.append((int(i), int(o)))
  return tuple(out)


def _hashable(x):
  try:
    hash(x)
    return x
  except TypeError:
    if isinstance(x, (list, tuple)):
      return tuple(_hashable(v) for v in x)
    if isinstance(x, dict):
      return tuple(sorted((k, _hashable(v)) for k, v in x.items()))
    raise


_SPEC_CACHE: dict = {}


def _option_key() -> tuple:
  """The options a KernelSpec depends on (how its checks run, what its fresh
  buffers hold): a spec built under other values is another spec, so a
  backend lowers (and caches) it anew."""
  return (config.enable_runtime_assert(), config.enable_debug_checks(),
          config.poison_buffers(), config.default_backend())


def pallas_call(kernel: Callable[..., None], out_shape: Any, *, grid=(),
                in_specs=None, out_specs=None, grid_spec: GridSpec | None = None,
                scratch_shapes=(), input_output_aliases=None,
                interpret: bool = False, debug: bool = False,
                name: str | None = None, compiler_params=None,
                cost_estimate=None, backend: str | None = None,
                metadata: dict[str, str] | None = None):
  """Returns a function that runs `kernel` over `grid` on its arguments.

  The kernel reads blocks of the inputs through refs and writes blocks of the
  outputs; `in_specs`/`out_specs` say which block each grid point sees.
  A `grid` entry may be a traced integer scalar (under `jax.jit`): that dim's
  size is known when the kernel runs (dsl.core.dynamic_grid).
  `metadata` (str -> str) is recorded with the kernel, as in Pallas: the
  Mosaic lowering puts it in the TPU call's `kernel_metadata`.
  """
  name = name or kernel_name(kernel)
  if isinstance(out_shape, list):   # as Pallas: the results come as a tuple
    out_shape = tuple(out_shape)
  num_scalar_prefetch = 0
  if grid_spec is not None:
    grid, in_specs, out_specs = grid_spec.grid, grid_spec.in_specs, grid_spec.out_specs
    scratch_shapes = grid_spec.scratch_shapes or scratch_shapes
    num_scalar_prefetch = getattr(grid_spec, "num_scalar_prefetch", 0)
  backend = backends.requested(backend, interpret)
  meta_items = _metadata_items(name, metadata)
  check_in_specs(name, in_specs)

  @api_boundary
  def wrapped(*args):
    __tracebackhide__ = True
    where = user_frame()
    params = compiler_params
    if params is None:
      runs_on = backends.record(backend, name, where)
      params = tuned_params(runs_on.compiler_params_class())
    check_operands(name, args, where)
    args = tree_util.tree_map(as_operand, args)
    flat_args = tree_util.tree_leaves(args)
    static_grid, sizes = dynamic_grid.lift_traced_sizes(name, grid, where)
    spec, out_tree = build_spec(
        kernel, args, out_shape, name=name, grid=static_grid,
        in_specs=in_specs,
        out_specs=out_specs, scratch_shapes=scratch_shapes,
        num_scalar_prefetch=num_scalar_prefetch,
        input_output_aliases=input_output_aliases, backend=backend,
        debug=debug, compiler_params=params,
        cost_estimate=cost_estimate, where=where, metadata=meta_items)
    check_semantics(spec.name, params, len(spec.grid_mapping.grid),
                    where)
    check_parallel_carries(spec, params, where)
    outs = pallas_call_p.bind(*sizes, *flat_args, spec=spec)
    return tree_util.tree_unflatten(out_tree, outs)

  return wrapped


def _metadata_items(name, metadata) -> tuple:
  """`pallas_call(metadata=)` as sorted (key, value) pairs of strings."""
  if metadata is None:
    return ()
  if not isinstance(metadata, Mapping) or not all(
      isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
    raise KernelError(name, f"metadata must be a dict of str to str, got "
                      f"{metadata!r}", user_frame(), operand="metadata")
  return tuple(sorted(metadata.items()))


def build_spec(kernel, args, out_shape, *, name, grid=(), in_specs=None,
               out_specs=None, scratch_shapes=(), num_scalar_prefetch=0,
               input_output_aliases=None, backend=None, debug=False,
               compiler_params=None, cost_estimate=None, where=None,
               meta: tuple = (), metadata: tuple = ()):
  """Resolves specs and traces `kernel` for arguments like `args` (cached)."""
  where = where or user_frame()
  backends.check_backend_name(backend, name, where)
  named_axes.check_not_shadowing(name, grid, where)
  flat_args, _ = tree_util.tree_flatten(args)
  avals = [_leaf_aval(name, a, f"argument {i}", where)
           for i, a in enumerate(flat_args)]
  if len(args) < num_scalar_prefetch:
    raise KernelError(name, f"expects {num_scalar_prefetch} scalar-prefetch "
                      f"operands first, got {len(args)} arguments", where)
  in_tree = tree_util.tree_structure(tuple(args[num_scalar_prefetch:]))
  pf_tree = tree_util.tree_structure(tuple(args[:num_scalar_prefetch]))
  n_pf_leaves = len(tree_util.tree_leaves(tuple(args[:num_scalar_prefetch])))
  out_leaves, out_tree = tree_util.tree_flatten(
      out_shape, is_leaf=lambda x: (hasattr(x, "shape") and hasattr(x, "dtype"))
      or is_shape_tuple(x))
  out_avals = [_out_aval(name, o, i, where) for i, o in enumerate(out_leaves)]
  try:
    key = (kernel, name, tuple(avals), pf_tree, in_tree, tuple(out_avals),
           out_tree,
           _hashable(grid), _hashable(in_specs), _hashable(out_specs),
           _hashable(scratch_shapes), num_scalar_prefetch,
           _hashable(input_output_aliases), backend, debug,
           _hashable(compiler_params), meta, metadata, _option_key())
    hash(key)
  except TypeError:
    key = None
  spec = _SPEC_CACHE.get(key) if key is not None else None
  if spec is None:
    gm = resolve_grid_mapping(
        name, grid=grid, in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=scratch_shapes, num_scalar_prefetch=n_pf_leaves,
        prefetch_avals=avals[:n_pf_leaves], in_avals=avals[n_pf_leaves:],
        in_tree=in_tree, out_avals=out_avals, out_tree=out_tree, where=where,
        prefetch_tree=pf_tree)
    check_block_indices(name, gm, where)
    with backends.tracing_for(backend):
      jaxpr = trace_kernel(kernel, name, gm, where)
    jaxpr = checks.set_check_mode(jaxpr, config.enable_runtime_assert(),
                                  config.enable_debug_checks())
    aliases = _check_aliases(name, input_output_aliases, avals, out_avals,
                             where)
    spec = KernelSpec(
        name, jaxpr, gm, input_output_aliases=aliases,
        compiler_params=compiler_params, backend=backend, debug=debug,
        where=where, kernel_src=function_location(kernel),
        cost_estimate=cost_estimate, meta=meta, metadata=metadata,
        ref_names=kernel_ref_names(kernel, gm))
    if debug:
      print(f"--- kernel {name} ({spec.kernel_src})\n{jaxpr}")
    if key is not None:
      _SPEC_CACHE[key] = spec
  return spec, out_tree
