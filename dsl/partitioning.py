"""How a pallas_call partitions itself under a sharded `jax.jit`.

A grid dim is *partitionable* when every output block belongs to one index
along it and every operand that follows it does so one block per index:

- every output has exactly one array dim whose block index is that grid
  index, and that array dim is a whole number of blocks, one per index;
- every input either has such a dim or does not depend on the grid dim at all
  (then every device reads it whole);
- the kernel does not revisit output blocks along it (a reduction or an
  accumulation), does not carry scratch along it, is not told it is
  `arbitrary`, and talks to no other device.

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
import logging
import math
import threading

import jax
import numpy as np
from jax._src import core, sharding_impls
from jax._src import mesh as mesh_lib
from jax._src.interpreters import mlir
from jax.experimental.custom_partitioning import (
    ArrayMapping, CompoundFactor, SdyShardingRule, custom_partitioning)
from jax.sharding import NamedSharding, PartitionSpec

from dsl import config
from dsl.blockspec import Element
from dsl.index_maps import varies_along
from dsl.jaxpr_walk import sub_jaxprs

logger = logging.getLogger("dsl.partitioning")


@dataclasses.dataclass(frozen=True)
class Layout:
  """Which grid dim each array dim of each operand follows.

  `dims[t][d]`: the partitionable grid dim that array dim `d` of operand `t`
  follows (operands: scalar prefetch, inputs, then outputs), or None.
  `why[t][d]`: for a dim that follows none, why it is read whole.
  """
  grid: tuple[int, ...]
  num_operands: int
  dims: tuple[tuple[int | None, ...], ...]
  blocks: tuple[tuple[int, ...], ...]
  why: tuple[tuple[str | None, ...], ...]
  origins: tuple[str, ...]

  @property
  def partitionable(self) -> tuple[int, ...]:
    return tuple(sorted({j for ds in self.dims for j in ds if j is not None}))


_COMM_PRIMITIVES = ("axis_index", "dma_start", "semaphore_signal")


def _talks_to_devices(jaxpr: core.Jaxpr) -> bool:
  """Device ids, remote DMAs or remote signals: meant for shard_map."""
  from dsl.tpu_primitives import unpack
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "axis_index":
      return True
    if name in _COMM_PRIMITIVES and "layout" in eqn.params:
      if unpack(eqn.invars, eqn.params["layout"]).get("device_id"):
        return True
    if any(_talks_to_devices(sub) for sub in sub_jaxprs(eqn.params)):
      return True
  return False


def _grid_reasons(spec, plan) -> dict[int, str]:
  """Why each grid dim that cannot be partitioned cannot be."""
  gm = spec.grid_mapping
  rank, hidden = len(gm.grid), gm.num_hidden_axes
  why = {}
  if _talks_to_devices(spec.jaxpr.jaxpr):
    return {j: "the kernel talks to other devices (call it inside "
            "jax.shard_map)" for j in range(rank)}
  for j in range(rank):
    if j not in plan.parallel:
      why[j] = (f"the kernel revisits output blocks along grid dim "
                f"{j - hidden} (it reduces or accumulates over it, or is told "
                "it is 'arbitrary')")
  return why


def _follows(bm, idx, j) -> tuple[int | None, bool]:
  """(the array dim of `bm` whose block index is grid index j, whether the
  mapping depends on j at all)."""
  if idx is None:
    return None, True
  if not varies_along(idx, j):
    return None, False
  coord = np.indices(idx.shape[:-1])[j]
  hits = [d for d in range(idx.shape[-1])
          if np.array_equal(idx[..., d], coord)]
  others = [d for d in range(idx.shape[-1])
            if d not in hits and varies_along(idx, j, d)]
  if len(hits) != 1 or others:
    return None, True
  d = hits[0]
  if (isinstance(bm.block_shape[d], Element)
      or bm.array_aval.shape[d] != idx.shape[j] * bm.block_sizes[d]):
    return None, True
  return d, True


@functools.lru_cache(maxsize=256)
def layout_of(spec) -> Layout:
  gm = spec.grid_mapping
  grid = tuple(gm.grid)
  plan = gm.plan(spec.compiler_params, spec.jaxpr)
  why = _grid_reasons(spec, plan)
  bms = gm.block_mappings
  idxs = [gm.block_indices(bm) for bm in bms]
  follows = [[None] * len(grid) for _ in bms]
  for j in range(len(grid)):
    if grid[j] == 1:
      why.setdefault(j, "the grid has one index along it")
    for t, (bm, idx) in enumerate(zip(bms, idxs)):
      d, depends = _follows(bm, idx, j)
      follows[t][j] = d
      if d is None and (depends or t >= gm.num_inputs):
        why.setdefault(j, f"{bm.origin} does not take one whole block per "
                       f"index of grid dim {j - gm.num_hidden_axes}")
  for i, o in spec.input_output_aliases:
    i -= gm.num_scalar_prefetch
    if 0 <= i < gm.num_inputs:
      for j in range(len(grid)):
        if follows[i][j] != follows[gm.num_inputs + o][j]:
          why.setdefault(j, f"input {i} is aliased to output {o} but they "
                         "follow the grid differently")
  dims, blocks, reasons, origins = [], [], [], []
  for aval in gm.prefetch_avals:
    rank = len(aval.shape)
    dims.append((None,) * rank)
    blocks.append((1,) * rank)
    reasons.append(("scalar prefetch is read whole",) * rank)
    origins.append("scalar prefetch")
  for t, bm in enumerate(bms):
    per_dim = [None] * len(bm.block_shape)
    per_why = ["it reads the dim whole"] * len(bm.block_shape)
    for j, d in enumerate(follows[t]):
      if d is None:
        continue
      if j in why:
        per_why[d] = why[j]
      else:
        per_dim[d], per_why[d] = j, None
    dims.append(tuple(per_dim))
    blocks.append(tuple(bm.block_sizes))
    reasons.append(tuple(per_why))
    origins.append(bm.origin)
  return Layout(grid, gm.num_scalar_prefetch + gm.num_inputs, tuple(dims),
                tuple(blocks), tuple(reasons), tuple(origins))


def sharding_rule(layout: Layout) -> SdyShardingRule:
  """The Shardy rule: grid dim j is factor `g{j}`; an array dim that follows
  it is `g{j}` or `(g{j} b)` with b its block size; other dims get a factor
  of their own (they are never partitioned)."""
  mappings, sizes, whole = [], {}, set()
  for t, (ds, bs) in enumerate(zip(layout.dims, layout.blocks)):
    entry = []
    for d, (j, b) in enumerate(zip(ds, bs)):
      if j is None:
        entry.append(f"r{t}_{d}")
      elif b == 1:
        entry.append(f"g{j}")
        whole.add(j)
      else:
        entry.append(CompoundFactor(f"g{j}", f"b{t}_{d}"))
        sizes[f"b{t}_{d}"] = b
    mappings.append(tuple(entry))
  for j in layout.partitionable:
    if j not in whole:
      sizes[f"g{j}"] = layout.grid[j]
  n = layout.num_operands
  return SdyShardingRule(tuple(ArrayMapping(*m) for m in mappings[:n]),
                         tuple(ArrayMapping(*m) for m in mappings[n:]),
                         **sizes)


def _axes(spec_entry) -> tuple[str, ...]:
  if spec_entry is None:
    return ()
  return tuple(spec_entry) if isinstance(spec_entry, tuple) else (spec_entry,)


def _spec_axes(sharding, rank) -> list[tuple[str, ...]]:
  spec = tuple(getattr(sharding, "spec", ()) or ())
  return [_axes(spec[d]) if d < len(spec) else () for d in range(rank)]


_LOGGED: set = set()


def _log_once(kernel: str, message: str) -> None:
  key = (kernel, message)
  if key in _LOGGED or not config.verbose_errors():
    return
  _LOGGED.add(key)
  logger.warning("kernel '%s': %s", kernel, message)


def choose_axes(name, layout: Layout, shardings, mesh_shape) -> dict:
  """grid dim -> mesh axes it is split over, read from the operands'
  `shardings` (one per operand, then per output; the first that names axes
  for the dim wins). Splits that are not whole blocks are dropped."""
  chosen, taken = {}, set()
  for j in layout.partitionable:
    axes = ()
    for ds, sh in zip(layout.dims, shardings):
      got = _spec_axes(sh, len(ds)) if sh is not None else [()] * len(ds)
      axes = next((got[d] for d, jj in enumerate(ds) if jj == j and got[d]),
                  ())
      if axes:
        break
    if not axes:
      continue
    n = math.prod(mesh_shape[a] for a in axes)
    if layout.grid[j] % n or set(axes) & taken:
      _log_once(name, f"grid dim {j} ({layout.grid[j]} blocks) is not split "
                f"over mesh axes {axes}: it does not divide into {n} whole "
                "shards of blocks, or the axes split another dim")
      continue
    chosen[j] = axes
    taken |= set(axes)
  return chosen


def _pspec(ds, chosen) -> PartitionSpec:
  parts = []
  for j in ds:
    axes = chosen.get(j, ()) if j is not None else ()
    parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*parts)


@functools.lru_cache(maxsize=256)
def local_spec(spec, splits: tuple[tuple[int, int], ...]):
  """The kernel each device runs: the grid divided along `splits`
  ((grid dim, shards), ...) and the operands shrunk to their shards."""
  layout = layout_of(spec)
  split = dict(splits)
  gm = spec.grid_mapping
  grid = tuple(g // split.get(j, 1) for j, g in enumerate(gm.grid))
  bms = []
  n_pf = gm.num_scalar_prefetch
  for t, bm in enumerate(gm.block_mappings):
    shape = [n // split.get(j, 1) if j is not None else n
             for n, j in zip(bm.array_aval.shape, layout.dims[n_pf + t])]
    bms.append(dataclasses.replace(
        bm, array_aval=bm.array_aval.update(shape=tuple(shape))))
  new_gm = dataclasses.replace(gm, grid=grid, block_mappings=tuple(bms))
  local = spec.replace(grid_mapping=new_gm, local=True)
  if reads_program_ids(spec) & set(split):
    local = _with_grid_offsets(local)
  return local


def reads_program_ids(spec) -> set[int]:
  """The grid dims whose program_id the kernel body reads."""
  jaxpr = spec.jaxpr.jaxpr
  used = {v for e in jaxpr.eqns for v in e.invars if isinstance(v, core.Var)}
  used |= {v for v in jaxpr.outvars if isinstance(v, core.Var)}
  rank = len(spec.grid_mapping.grid)
  return {j for j, v in enumerate(jaxpr.invars[:rank]) if v in used}


def _with_grid_offsets(local):
  """`local` with one more scalar-prefetch operand first, int32[rank]: the
  offset of this device's grid indices; the body sees global program ids
  (index maps, being per shard, do not)."""
  from dsl.blockspec import BlockSpec, squeezed
  from dsl.pallas_call import build_spec
  from dsl.tracing import program_id
  gm = local.grid_mapping
  n, n_pf = len(gm.grid), gm.num_scalar_prefetch

  def body(*refs):
    offsets, rest = refs[0], refs[1:]
    ids = [program_id(d) + offsets[d] for d in range(n)]
    core.eval_jaxpr(local.jaxpr.jaxpr, local.jaxpr.consts, *ids, *rest)

  def spec_of(bm):
    def index_map(*args):       # the offsets are not an index map's argument
      return tuple(core.jaxpr_as_fun(bm.index_map_jaxpr)(*args[:n],
                                                         *args[n + 1:]))
    shape = tuple(None if d is squeezed else d for d in bm.block_shape)
    return BlockSpec(shape, index_map, memory_space=bm.memory_space)

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
      where=local.where)
  new_gm = dataclasses.replace(new.grid_mapping,
                               num_hidden_axes=gm.num_hidden_axes)
  return new.replace(grid_mapping=new_gm, kernel_src=local.kernel_src,
                     local=True, meta=("grid_offsets",))


def _grid_offsets(local_grid, chosen):
  """int32[rank]: where this device's part of the grid starts."""
  import jax.numpy as jnp
  from jax import lax
  offs = [lax.axis_index(chosen[j]) * g if j in chosen else 0
          for j, g in enumerate(local_grid)]
  return jnp.asarray(offs, jnp.int32)


def _log_gathered(spec, layout, arg_shapes, chosen):
  for t, (a, ds) in enumerate(zip(arg_shapes, layout.dims)):
    got = _spec_axes(getattr(a, "sharding", None), len(ds))
    for d, axes in enumerate(got):
      if axes and (ds[d] is None or ds[d] not in chosen):
        reason = layout.why[t][d] or "the split is not whole blocks"
        _log_once(spec.name, f"{layout.origins[t]} is gathered along dim {d} "
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
  from dsl.pallas_call import pallas_call_p
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

  arg_sh = tuple(NamedSharding(mesh, _pspec(ds, chosen))
                 for ds in layout.dims[:n])
  out_sh = [NamedSharding(mesh, _pspec(ds, chosen))
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
  from dsl.pallas_call import pallas_call_p

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
  from dsl import backends
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
      from dsl.errors import BackendError
      raise BackendError(spec.name, f"the partitioned kernel needs {len(new)} "
                         f"host callbacks, more than {len(slots.targets)}",
                         spec.where)
    slots.targets[:len(new)] = new
  return out


def explicit_out_shardings(spec, avals, mesh):
  """The outputs' shardings under jit over a mesh with Explicit axes: split
  as the inputs imply along partitionable grid dims, replicated elsewhere."""
  layout = layout_of(spec)
  n = layout.num_operands
  explicit = set(mesh.explicit_axes)
  shardings = []
  for a in avals:
    sh = getattr(a, "sharding", None)
    axes = _spec_axes(sh, len(a.shape)) if sh is not None else []
    shardings.append(NamedSharding(mesh, PartitionSpec(*[
        (ax if set(ax) <= explicit else ()) or None for ax in axes])))
  sub = Layout(layout.grid, 0, layout.dims[:n], (), (), ())
  chosen = choose_axes(spec.name, sub, shardings, dict(mesh.shape))
  return [NamedSharding(mesh, _pspec(ds, chosen)) for ds in layout.dims[n:]]
