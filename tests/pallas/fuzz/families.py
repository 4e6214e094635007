"""The table of kernel families: name -> how to draw a case and its body.

A family's `generate(draw, seed, index, tpu)` returns a `Case` (with
`tpu=True` its blocks follow the TPU tiling rule); its `body(case, ctx)`
is the kernel body, run on refs by `render.KernelCtx` and on numpy by
`reference.RefCtx`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from tests.pallas.fuzz import family_accumulate as acc
from tests.pallas.fuzz import family_map
from tests.pallas.fuzz import family_memory as mem
from tests.pallas.fuzz import family_prng, family_strided, family_window


@dataclasses.dataclass(frozen=True)
class Family:
  generate: Callable
  body: Callable
  weight: float          # how often it is drawn
  tpu_share: float       # how often its cases follow the TPU tiling rule
  # A family whose results no reference can know (random bits) runs its
  # own `run(case, build)` on a backend, and `derive(case, got)` gives the
  # results a correct kernel has for what the backend drew.
  run: Callable | None = None
  derive: Callable | None = None


FAMILIES: dict[str, Family] = {
    "map": Family(family_map.generate, family_map.body, 5, 0.3),
    "reduce": Family(acc.generate_reduce, acc.body_reduce, 2, 0.3),
    "matmul": Family(acc.generate_matmul, acc.body_matmul, 1, 0.3),
    "carry": Family(acc.generate_carry, acc.body_carry, 1, 0.4),
    "tail": Family(mem.generate_tail, mem.body_tail, 1.5, 0.0),
    "dma": Family(mem.generate_dma, mem.body_dma, 0.7, 1.0),
    "window": Family(family_window.generate, family_window.body, 1.2, 0.0),
    "strided": Family(family_strided.generate, family_strided.body, 1, 0.4),
    "order": Family(acc.generate_order, acc.body_order, 0.8, 0.4),
    "prng": Family(family_prng.generate, family_prng.body, 0.5, 1.0,
                   family_prng.run, family_prng.derive),
}


def generate_case(seed: int, index: int):
  """The case `index` of the run seeded `seed` (the same on every machine)."""
  from tests.pallas.fuzz.common import Draw
  d = Draw(seed, index)
  names = sorted(FAMILIES)
  weights = [FAMILIES[n].weight for n in names]
  total = sum(weights)
  name = names[int(d.rng.choice(len(names), p=[w / total for w in weights]))]
  fam = FAMILIES[name]
  return fam.generate(d, seed, index, d.chance(fam.tpu_share))
