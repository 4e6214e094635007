"""Mosaic GPU compiler parameters (`backend="mosaic_gpu"`, and
`plgpu.kernel`).

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
  as shared memory holds, at most 4. `max_concurrent_steps` is Pallas's
  name for it (given alone, it sets `pipeline_depth`).
- `num_consumers`: consumer warpgroups of a warp-specialized kernel; each
  runs the kernel body on its own point of one parallel grid dim (a CTA
  covers `num_consumers` blocks along it, sharing the blocks that do not
  depend on it); None: 2 where the grid allows, else 1.

Pallas's other fields are accepted, so that a kernel written against
Pallas's Mosaic GPU module runs by changing its import: they tune
code generation on the GPU (`approx_math`, `lowering_semantics`,
`unsafe_no_auto_barriers`, `reduction_scratch_bytes`, the profiler's
`profile_*`, `skip_device_barrier`, `is_multi_process`, `delay_release`) and
change no value a kernel computes on the interpret backend.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

from dsl.core.compiler_params import CompilerParams as BaseCompilerParams


class TraceScope(enum.Enum):
  """What the profiler traces: each warp or each warpgroup."""
  WARP = "warp"
  WARPGROUP = "warpgroup"


class LoweringSemantics(enum.Enum):
  """How a Mosaic GPU kernel body is written: per warpgroup (Pallas's
  default; arrays are a warpgroup's) or per lane."""
  Lane = "lane"
  Warpgroup = "warpgroup"


@dataclasses.dataclass(frozen=True)
class CompilerParams(BaseCompilerParams):
  """Schedule overrides for the Mosaic GPU lowering (None: its choice), and
  Pallas's Mosaic GPU options."""
  dimension_semantics: tuple[Any, ...] | None = None
  warp_specialize: bool | None = None
  pipeline_depth: int | None = None
  num_consumers: int | None = None
  # Pallas's fields (see the module docstring).
  approx_math: bool = False
  max_concurrent_steps: int | None = None
  delay_release: int = 0
  unsafe_no_auto_barriers: bool = False
  reduction_scratch_bytes: int = 128 * 4 * 4
  profile_space: int = 0
  profile_dir: str = ""
  profile_trace_scope: Any = None
  profile_bounds_check: bool = False
  lowering_semantics: LoweringSemantics = LoweringSemantics.Warpgroup
  skip_device_barrier: bool = False
  is_multi_process: bool = False
  # The blocks and warpgroups of a `plgpu.kernel` (set by it; a
  # `dsl.mosaic_gpu.kernel.Mesh`): the backend runs them as such.
  mesh: Any = None

  def __post_init__(self):
    if self.dimension_semantics is not None:
      object.__setattr__(self, "dimension_semantics",
                         tuple(self.dimension_semantics))
    steps = self.max_concurrent_steps
    if steps is not None:
      if self.pipeline_depth is None:
        object.__setattr__(self, "pipeline_depth", steps)
      elif self.pipeline_depth != steps:
        raise ValueError(
            f"CompilerParams: max_concurrent_steps={steps} and "
            f"pipeline_depth={self.pipeline_depth} name the same ring depth; "
            "give one")
    if not isinstance(self.lowering_semantics, LoweringSemantics):
      raise TypeError("CompilerParams.lowering_semantics must be a "
                      "plgpu.LoweringSemantics, got "
                      f"{self.lowering_semantics!r}")


__all__ = ["CompilerParams", "LoweringSemantics", "TraceScope"]
