"""TPU-flavoured kernel API (mirrors the names of Pallas's TPU module).

Memory spaces, scratch shapes, scalar prefetch and compiler parameters; DMA
and semaphore operations arrive with the Mosaic lowering.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from dsl.gridspec import PrefetchScalarGridSpec
from dsl.memory import ANY, MemoryRef, MemorySpace

VMEM = MemorySpace.VMEM
SMEM = MemorySpace.SMEM
HBM = MemorySpace.HBM
TPUMemorySpace = MemorySpace


@dataclasses.dataclass(frozen=True)
class CompilerParams:
  """Mosaic compiler parameters."""
  dimension_semantics: tuple[str, ...] | None = None
  vmem_limit_bytes: int | None = None
  allow_input_fusion: Any = None


__all__ = ["VMEM", "SMEM", "HBM", "ANY", "MemorySpace", "TPUMemorySpace",
           "MemoryRef", "PrefetchScalarGridSpec", "CompilerParams"]
