"""Which grid dims a pallas_call can partition over, and how its operands
and outputs follow them (the analysis behind dsl.transforms.partitioning).

A grid dim is *partitionable* when every output block belongs to one index
along it and every operand that follows it does so one block per index:

- every output has exactly one array dim whose block index is that grid
  index, and that array dim is a whole number of blocks, one per index;
- every input either has such a dim or does not depend on the grid dim at all
  (then every device reads it whole);
- the kernel does not revisit output blocks along it (a reduction or an
  accumulation), does not carry scratch along it, is not told it is
  `arbitrary`, and talks to no other device.

`layout_of(spec)` says, per operand and array dim, which partitionable grid
dim it follows (or why it is read whole); `sharding_rule` is the Shardy rule
of that layout; `choose_axes` picks the mesh axes each grid dim is split
over from the operands' shardings; `explicit_out_shardings` gives the
outputs' shardings under a mesh with Explicit axes (pallas_call's abstract
evaluation).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math

import numpy as np
from dsl.core.jax_internals import core
from jax.experimental.custom_partitioning import (
    ArrayMapping, CompoundFactor, SdyShardingRule)
from jax.sharding import NamedSharding, PartitionSpec

from dsl.core import config
from dsl.core.blockspec import Element
from dsl.core.index_maps import varies_along
from dsl.core.jaxpr_walk import sub_jaxprs
from dsl.core.operand_layout import unpack

logger = logging.getLogger("dsl.transforms.partitioning")  # its messages' channel


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
  by_role = gm.split_blocks(follows)
  for i, o in spec.input_output_aliases:
    group, i = gm.aliased_operand(i)
    if group == "inputs":
      for j in range(len(grid)):
        if by_role.inputs[i][j] != by_role.outputs[o][j]:
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
  return Layout(grid, gm.ref_layout().start("outputs"), tuple(dims),
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


def spec_axes(sharding, rank) -> list[tuple[str, ...]]:
  spec = tuple(getattr(sharding, "spec", ()) or ())
  return [_axes(spec[d]) if d < len(spec) else () for d in range(rank)]


_LOGGED: set = set()


def forget_logged() -> None:
  """Forgets which messages were logged, so they are logged again."""
  _LOGGED.clear()


def log_once(kernel: str, message: str) -> None:
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
      got = spec_axes(sh, len(ds)) if sh is not None else [()] * len(ds)
      axes = next((got[d] for d, jj in enumerate(ds) if jj == j and got[d]),
                  ())
      if axes:
        break
    if not axes:
      continue
    n = math.prod(mesh_shape[a] for a in axes)
    if layout.grid[j] % n or set(axes) & taken:
      log_once(name, f"grid dim {j} ({layout.grid[j]} blocks) is not split "
                f"over mesh axes {axes}: it does not divide into {n} whole "
                "shards of blocks, or the axes split another dim")
      continue
    chosen[j] = axes
    taken |= set(axes)
  return chosen


def pspec(ds, chosen) -> PartitionSpec:
  parts = []
  for j in ds:
    axes = chosen.get(j, ()) if j is not None else ()
    parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*parts)


def reads_program_ids(spec) -> set[int]:
  """The grid dims whose program_id the kernel body reads."""
  jaxpr = spec.jaxpr.jaxpr
  used = {v for e in jaxpr.eqns for v in e.invars if isinstance(v, core.Var)}
  used |= {v for v in jaxpr.outvars if isinstance(v, core.Var)}
  rank = len(spec.grid_mapping.grid)
  return {j for j, v in enumerate(jaxpr.invars[:rank]) if v in used}


def explicit_out_shardings(spec, avals, mesh):
  """The outputs' shardings under jit over a mesh with Explicit axes: split
  as the inputs imply along partitionable grid dims, replicated elsewhere."""
  layout = layout_of(spec)
  n = layout.num_operands
  explicit = set(mesh.explicit_axes)
  shardings = []
  for a in avals:
    sh = getattr(a, "sharding", None)
    axes = spec_axes(sh, len(a.shape)) if sh is not None else []
    shardings.append(NamedSharding(mesh, PartitionSpec(*[
        (ax if set(ax) <= explicit else ()) or None for ax in axes])))
  sub = Layout(layout.grid, 0, layout.dims[:n], (), (), ())
  chosen = choose_axes(spec.name, sub, shardings, dict(mesh.shape))
  return [NamedSharding(mesh, pspec(ds, chosen)) for ds in layout.dims[n:]]
