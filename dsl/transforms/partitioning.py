"""How a pallas_call partitions itself under a sharded `jax.jit`, over the
grid dims that dsl.core.sharding finds *partitionable* (its docstring says
when a dim is).

A kernel that reads `program_id` of a partitioned dim gets its device's grid
offsets as one more scalar-prefetch operand: its program ids stay global.

Under `jax.jit` over several devices a pallas_call lowers through
`jax.experimental.custom_partitioning` with a Shardy sharding rule in which
each partitionable grid dim is a factor shared by the array dims that follow
it. Each device then runs the same kernel on its shards with a grid smaller
along the partitioned dims. Array dims that follow no partitionable grid dim
are gathered; the reason is logged once per kernel and operand (with
`jax_pallas_verbose_errors`). Inside `shard_map` a kernel is already per
device and is not partitioned again.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from dsl.core.jax_internals import core, mesh as mesh_lib, mlir, sharding_impls
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from dsl.core.sharding import (Layout, choose_axes, layout_of, log_once, pspec,
                               reads_program_ids, sharding_rule, spec_axes)
from dsl.core import backends
from dsl.core.errors import BackendError
from dsl.core.kernel_layout import KernelLayout
from dsl.core.pallas_call import build_spec, pallas_call_p
from dsl.core.tracing import program_id

@functools.lru_cache(maxsize=256)
def local_spec(spec, splits: tuple[tuple[int, int], ...]):
  """The kernel each device runs: the grid divided along `splits`
  ((grid dim, shards), ...) and the operands shrunk to their shards."""
  layout = layout_of(spec)
  split = dict(splits)
  gm = spec.grid_mapping
  grid = tuple(g // split.get(j, 1) for j, g in enumerate(gm.grid))
  bms = []
  dims = gm.ref_layout().only("prefetch", "inputs", "outputs").split(
      layout.dims)
  for bm, bm_dims in zip(gm.block_mappings, dims.inputs + dims.outputs):
    shape = [n // split.get(j, 1) if j is not None else n
             for n, j in zip(bm.array_aval.shape, bm_dims)]
    bms.append(dataclasses.replace(
        bm, array_aval=bm.array_aval.update(shape=tuple(shape))))
  new_gm = dataclasses.replace(gm, grid=grid, block_mappings=tuple(bms))
  local = spec.replace(grid_mapping=new_gm, local=True)
  if reads_program_ids(spec) & set(split):
    local = _with_grid_offsets(local)
  return local


def _with_grid_offsets(local):
  """`local` with one more scalar-prefetch operand first, int32[rank]: the
  offset of this device's grid indices; the body sees global program ids
  (index maps, being per shard, do not)."""
  gm = local.grid_mapping
  n, n_pf = len(gm.grid), gm.num_scalar_prefetch

  refs_layout = KernelLayout.of(offsets=1, refs=None)
  map_layout = KernelLayout.of(ids=n, offsets=1, prefetch=None)

  def body(*refs):
    (offsets,), rest = refs_layout.split(refs)
    ids = [program_id(d) + offsets[d] for d in range(n)]
    core.eval_jaxpr(local.jaxpr.jaxpr, local.jaxpr.consts, *ids, *rest)

  def spec_of(bm):
    def index_map(*args):       # the offsets are not an index map's argument
      ids, _, pf = map_layout.split(args)
      return tuple(core.jaxpr_as_fun(bm.index_map_jaxpr)(*ids, *pf))
    return bm.to_spec(index_map)

  sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  args = ([jax.ShapeDtypeStruct((n,), np.int32)]
          + [sds(a.inner_aval) for a in gm.prefetch_avals]
          + [sds(bm.array_aval) for bm in gm.in_mappings])
  new, _ = build_spec(
      body, tuple(args), [sds(a) for a in gm.out_avals], name=local.name,
      grid=gm.grid, in_specs=[spec_of(bm) for bm in gm.in_mappings],
      out_specs=[spec_of(bm) for bm in gm.out_mappings],
      scratch_shapes=list(gm.scratch_avals), num_scalar_prefetch=n_pf + 1,
      input_output_aliases={i + 1: o for i, o in local.input_output_aliases},
      backend=local.backend, compiler_params=local.compiler_params,
      where=local.where, metadata=local.metadata)
  new_gm = dataclasses.replace(new.grid_mapping,
                               num_hidden_axes=gm.num_hidden_axes)
  return new.replace(grid_mapping=new_gm, kernel_src=local.kernel_src,
                     local=True, meta=("grid_offsets",))


def _grid_offsets(local_grid, chosen):
  """int32[rank]: where this device's part of the grid starts."""
  offs = [lax.axis_index(chosen[j]) * g if j in chosen else 0
          for j, g in enumerate(local_grid)]
  return jnp.asarray(offs, jnp.int32)


def _log_gathered(spec, layout, arg_shapes, chosen):
  for t, (a, ds) in enumerate(zip(arg_shapes, layout.dims)):
    got = spec_axes(getattr(a, "sharding", None), len(ds))
    for d, axes in enumerate(got):
      if axes and (ds[d] is None or ds[d] not in chosen):
        reason = layout.why[t][d] or "the split is not whole blocks"
        log_once(spec.name, f"{layout.origins[t]} is gathered along dim {d} "
                  f"(sharded over {axes}): {reason}")


def _decoded(shape, mesh):
  """`shape` (a ShapeDtypeStruct) with its sharding over the mesh's axes, or
  none when it is not one (Shardy may split a factor over part of an axis,
  which is not whole blocks per device)."""
  sh = getattr(shape, "sharding", None)
  if sh is not None and not isinstance(sh, NamedSharding):
    try:
      spec = sharding_impls.parse_flatten_op_sharding(
          sh._to_xla_hlo_sharding(len(shape.shape)), mesh)[0]
      sh = NamedSharding(mesh, PartitionSpec(
          *spec, *(None,) * (len(shape.shape) - len(spec))))
    except Exception:  # noqa: BLE001 - not expressible over the mesh axes
      sh = None
  return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sh)


def _partition(spec, mesh, arg_shapes, result_shape):
  layout = layout_of(spec)
  arg_shapes = [_decoded(a, mesh) for a in arg_shapes]
  results = [_decoded(r, mesh) for r in result_shape]
  shardings = ([getattr(a, "sharding", None) for a in arg_shapes]
               + [getattr(r, "sharding", None) for r in results])
  # Results first: Shardy has chosen their sharding from every operand.
  n = layout.num_operands
  order = list(range(n, len(shardings))) + list(range(n))
  ordered = Layout(layout.grid, 0, tuple(layout.dims[i] for i in order),
                   (), (), ())
  chosen = choose_axes(spec.name, ordered, [shardings[i] for i in order],
                       dict(mesh.shape))
  _log_gathered(spec, layout, arg_shapes, chosen)
  splits = tuple(sorted(
      (j, math.prod(mesh.shape[a] for a in axes))
      for j, axes in chosen.items()))
  local = local_spec(spec, splits)
  offsets = local.meta == ("grid_offsets",)

  def lower_fn(*xs):
    if offsets:
      xs = (_grid_offsets(local.grid_mapping.grid, chosen), *xs)
    return pallas_call_p.bind(*xs, spec=local)

  arg_sh = tuple(NamedSharding(mesh, pspec(ds, chosen))
                 for ds in layout.dims[:n])
  out_sh = [NamedSharding(mesh, pspec(ds, chosen))
            for ds in layout.dims[n:]]
  return mesh, lower_fn, out_sh, arg_sh


# Host callbacks (of the host backends) that a partitioned kernel may emit.
_MAX_CALLBACKS = 8


class _CallbackSlots:
  """Host callbacks reserved in the module being lowered for a kernel that
  is partitioned later, while XLA compiles it.

  JAX numbers a module's host callbacks; the per-device module that the
  partitioner builds has its own numbering, which the compiled executable
  does not know. So the outer module reserves `_MAX_CALLBACKS` trampolines,
  and the per-device lowering puts its callbacks at their numbers
  (`lower_local`).
  """

  def __init__(self, module_context):
    self.start = len(module_context.host_callbacks)
    self.targets = [None] * _MAX_CALLBACKS
    for i in range(_MAX_CALLBACKS):
      module_context.add_host_callback(functools.partial(self._call, i))

  def _call(self, i, *args):
    return self.targets[i](*args)


_PENDING = threading.local()


def _partitioned_call(spec, slots):

  def run_whole(*xs):   # its types; it is not lowered on several devices
    return pallas_call_p.bind(*xs, spec=spec)

  def partition(mesh, arg_shapes, result_shape):
    _PENDING.slots = slots   # taken by the per-device kernel's lowering
    return _partition(spec, mesh, arg_shapes, result_shape)

  fn = custom_partitioning(run_whole)
  fn.def_partition(partition=partition, decode_shardings=False,
                   sharding_rule=sharding_rule(layout_of(spec)))
  return fn


def lower_partitioned(ctx, *args, spec):
  """Lowers `spec` under jit over several devices (not inside shard_map)."""
  # Only the host backends put host callbacks in a kernel's lowering.
  slots = (_CallbackSlots(ctx.module_context)
           if backends.runs_on_host(spec.backend) else None)
  fn = _partitioned_call(spec, slots)
  return mlir.lower_fun(lambda *xs: fn(*xs), multiple_results=True)(
      ctx, *args)


def lower_local(rule, ctx, *args, spec):
  """Lowers the kernel one device runs on its shards with backend `rule`.

  Its operands are plain arrays: no mesh is in scope (the caller's
  `jax.set_mesh` would otherwise add sharding annotations inside the
  per-device module).
  """
  slots = getattr(_PENDING, "slots", None)
  _PENDING.slots = None
  callbacks = ctx.module_context.host_callbacks
  if slots is not None and len(callbacks) <= slots.start:
    callbacks.extend([None] * (slots.start - len(callbacks)))
  else:
    slots = None
  with mesh_lib.use_abstract_mesh(mesh_lib.empty_abstract_mesh):
    plain = lambda avals: [core.ShapedArray(a.shape, a.dtype) for a in avals]
    ctx = ctx.replace(avals_in=plain(ctx.avals_in),
                      avals_out=plain(ctx.avals_out))
    out = rule(ctx, *args, spec=spec)
  if slots is not None:
    new = callbacks[slots.start:]
    if len(new) > len(slots.targets):
      raise BackendError(spec.name, f"the partitioned kernel needs {len(new)} "
                         f"host callbacks, more than {len(slots.targets)}",
                         spec.where)
    slots.targets[:len(new)] = new
  return out


