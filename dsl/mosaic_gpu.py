"""Mosaic GPU compiler parameters (`backend="mosaic_gpu"`).

The lowering chooses a kernel's schedule on its own (see
docs/mosaic-gpu.md); these fields override its choice:

- `dimension_semantics`: "parallel"/"arbitrary" per grid dim, as for the TPU
  (None: sequential dims are found from the kernel, as for every backend).
- `warp_specialize`: True: a producer warpgroup issues the TMA copies of the
  blocks that move along the sequential grid dims into a ring of shared
  memory slots and consumer warpgroups compute (the kernel must have such
  blocks); False: one warpgroup copies and computes (the double-buffered
  loop); None: the lowering decides (warp-specialized whenever blocks move).
- `pipeline_depth`: the slots of that ring (blocks in flight); None: as many
  as shared memory holds, at most 4.
- `num_consumers`: consumer warpgroups of a warp-specialized kernel; each
  runs the kernel body on its own point of one parallel grid dim (a CTA
  covers `num_consumers` blocks along it, sharing the blocks that do not
  depend on it); None: 2 where the grid allows, else 1.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from dsl.core.compiler_params import CompilerParams as BaseCompilerParams


@dataclasses.dataclass(frozen=True)
class CompilerParams(BaseCompilerParams):
  """Schedule overrides for the Mosaic GPU lowering (None: its choice)."""
  dimension_semantics: tuple[Any, ...] | None = None
  warp_specialize: bool | None = None
  pipeline_depth: int | None = None
  num_consumers: int | None = None

  def __post_init__(self):
    if self.dimension_semantics is not None:
      object.__setattr__(self, "dimension_semantics",
                         tuple(self.dimension_semantics))


__all__ = ["CompilerParams"]
