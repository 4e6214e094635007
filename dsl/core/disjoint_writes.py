"""Grid steps that write apart: sequential grid dims whose steps could run
at once.

The grid plan (`dsl.core.grid_plan`) runs a grid dim in order when its
steps revisit an output block. A kernel written for Triton often takes its
outputs whole (no BlockSpec) and stores each step's part through masked
stores at coordinates computed from the program id (a column of a
reduction, a slice of a vector): every step "revisits" the whole output, so
the dim runs in order, yet no step reads what another wrote. Where that is
proven, a backend whose kernels store straight into the output arrays (the
Triton backend: no block is copied back) may launch those steps as separate
programs and get what the steps in order would give.

Proven means: the kernel only stores to its outputs (the range analysis
meets no read of one, and none escapes it), aliases none of them to an
input, carries no scratch from step to step, declares the dim no
"arbitrary" and knows its size at trace time; and, the range analysis run
once per step of the dim, the elements each step can store to (clipped to
the array) are apart from every other step's.
"""
from __future__ import annotations

import weakref

import numpy as np

from dsl.core import ranges
from dsl.core.grid_plan import carried_scratch, declared_semantics

# Dims with more steps stay in order (the analysis runs once per step).
MAX_STEPS = 512

_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def disjoint_write_dims(spec) -> tuple[int, ...]:
  """The sequential grid dims of `spec`'s plan whose steps store to
  outputs apart from one another and read none (cached per spec)."""
  hit = _CACHE.get(spec)
  if hit is None:
    hit = _CACHE[spec] = _dims(spec)
  return hit


def _dims(spec) -> tuple[int, ...]:
  gm = spec.grid_mapping
  rank = len(gm.grid)
  plan = gm.plan(spec.compiler_params, spec.jaxpr)
  sem = declared_semantics(spec.compiler_params, rank, gm.num_hidden_axes)
  dims = [d for d in plan.sequential if d not in gm.dynamic_dims
          and 1 < gm.grid[d] <= MAX_STEPS
          and not (sem and sem[d] == "arbitrary")]
  if (not dims or spec.input_output_aliases
      or carried_scratch(spec.jaxpr, len(gm.scratch_avals))):
    return ()
  outputs = {bm.origin: bm for bm in gm.out_mappings}
  whole = ranges.analyze_kernel(spec)
  if (whole.read | whole.escaped) & set(outputs):
    return ()
  return tuple(d for d in dims if _apart(spec, d, outputs))


def _footprints(result: ranges.KernelRanges, outputs) -> dict | None:
  """Per output origin, the hull (lo, hi per array dim) of the elements the
  accesses of `result` can store to, clipped to the array; None when some
  coordinate is unknown."""
  out: dict = {}
  for _, access in result.items():
    if access.origin not in outputs:
      continue
    if any(c is None for c in access.coords):
      return None
    shape = access.array_shape
    lo = [max(c.lo, 0) for c in access.coords]
    hi = [min(c.hi, n - 1) for c, n in zip(access.coords, shape)]
    if any(a > b for a, b in zip(lo, hi)):
      continue                    # every lane lies outside: nothing stored
    if access.origin in out:
      old_lo, old_hi = out[access.origin]
      lo = [min(a, b) for a, b in zip(lo, old_lo)]
      hi = [max(a, b) for a, b in zip(hi, old_hi)]
    out[access.origin] = (lo, hi)
  return out


def _apart(spec, d: int, outputs) -> bool:
  """Whether the steps along grid dim `d` store to disjoint elements."""
  boxes: dict[str, list] = {}
  for v in range(int(spec.grid_mapping.grid[d])):
    found = _footprints(ranges.analyze_at(spec, {d: v}), outputs)
    if found is None:
      return False
    for origin, box in found.items():
      boxes.setdefault(origin, []).append(box)
  return all(_disjoint(np.array([b[0] for b in bs]),
                       np.array([b[1] for b in bs]))
             for bs in boxes.values())


def _disjoint(lo: np.ndarray, hi: np.ndarray) -> bool:
  """Whether the boxes `lo[k] <= x <= hi[k]` (one row per step) meet
  pairwise nowhere."""
  meet = np.ones((len(lo), len(lo)), bool)
  for j in range(lo.shape[1]):
    meet &= (lo[:, None, j] <= hi[None, :, j]) & (lo[None, :, j]
                                                 <= hi[:, None, j])
  np.fill_diagonal(meet, False)
  return not meet.any()
