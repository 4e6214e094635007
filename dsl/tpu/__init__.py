"""TPU-flavoured kernel API (mirrors the names of Pallas's TPU module).

Memory spaces, scratch shapes, scalar prefetch, compiler parameters, DMAs,
semaphores, device ids and the cheap vector helpers (`roll`, `repeat`,
`bitcast`). The primitives live in `dsl.tpu.primitives` and
`dsl.tpu.vector`; `lowering_mosaic`
lowers them to the Mosaic `tpu` dialect and the `"interpret"` backend
discharges them (see that module's docstring for their meaning there).
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

from dsl.core.compiler_params import CompilerParams as BaseCompilerParams
from dsl.core.errors import BackendError
from dsl.core.gridspec import PrefetchScalarGridSpec
from dsl.core.memory import ANY, MemoryRef, MemorySpace
from dsl.core.semaphores import (BarrierSemaphore, DeviceIdType,
                                 SemaphoreShape, SemaphoreSpace, SemaphoreType)
from dsl.tpu.primitives import (AsyncCopyDescriptor, async_copy, device_id,
                                get_barrier_semaphore, make_async_copy,
                                make_async_remote_copy, semaphore_read,
                                semaphore_signal, semaphore_wait)
from dsl.tpu.helpers import (async_remote_copy, is_tpu_device, load,
                             reciprocal, store, sync_copy)
from dsl.tpu.pipeline import emit_pipeline
from dsl.tpu.prng import (prng_random_bits, prng_seed, stateful_bernoulli,
                          stateful_bits, stateful_normal, stateful_uniform)
from dsl.tpu.vector import bitcast, repeat, roll
from dsl.tpu.mesh import (CoreType, TensorCoreMesh, core_barrier,
                          create_tensorcore_mesh, run_on_first_core)

VMEM = MemorySpace.VMEM
SMEM = MemorySpace.SMEM
HBM = MemorySpace.HBM
SEMAPHORE = MemorySpace.SEMAPHORE
TPUMemorySpace = MemorySpace
# The dtype of a DMA semaphore scratch (`SemaphoreType.DMA` makes one).
dma_semaphore = SemaphoreType.DMA


class GridDimensionSemantics(enum.Enum):
  """How a grid dimension may be run: in parallel or in order."""
  PARALLEL = "parallel"
  ARBITRARY = "arbitrary"
  CORE_PARALLEL = "core_parallel"

  def __str__(self):
    return self.value


PARALLEL = GridDimensionSemantics.PARALLEL
ARBITRARY = GridDimensionSemantics.ARBITRARY
CORE_PARALLEL = GridDimensionSemantics.CORE_PARALLEL

DEFAULT_VMEM_LIMIT_BYTES = 16 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class CompilerParams(BaseCompilerParams):
  """Mosaic compiler parameters.

  dimension_semantics: one of "parallel"/"arbitrary" (or PARALLEL/ARBITRARY)
    per grid dim; None means all "arbitrary".
  vmem_limit_bytes: the VMEM budget the rule checker and Mosaic use
    (default 16 MiB).
  collective_id: the barrier semaphore's collective id (kernels that use
    `get_barrier_semaphore`); 0 when not given.
  has_side_effects: the kernel writes outside its outputs (keep it alive).
  shape_invariant_numerics: results do not depend on the shapes the TPU
    compiler picks (JAX's default, True).
  """
  dimension_semantics: tuple[Any, ...] | None = None
  vmem_limit_bytes: int | None = None
  allow_input_fusion: Any = None
  collective_id: int | None = None
  has_side_effects: bool = False
  internal_scratch_in_bytes: int | None = None
  disable_bounds_checks: bool = False
  flags: Any = None
  shape_invariant_numerics: bool = True
  # Accepted so that Pallas code runs unchanged; the Mosaic backend does not
  # pass these to the TPU compiler (see docs/pallas-compat.md).
  serialization_format: int = 1
  disable_semaphore_checks: bool = False
  skip_device_barrier: bool = False
  allow_collective_id_without_custom_barrier: bool = False
  use_tc_tiling_on_sc: bool | None = None
  needs_layout_passes: bool = True
  fuse_transposed_lhs_in_matmul: bool = False
  opt_level: Any = None

  def __post_init__(self):
    if self.dimension_semantics is not None:
      object.__setattr__(self, "dimension_semantics",
                         tuple(self.dimension_semantics))
    if isinstance(self.allow_input_fusion, list):
      object.__setattr__(self, "allow_input_fusion",
                         tuple(self.allow_input_fusion))
    if isinstance(self.flags, dict):
      object.__setattr__(self, "flags", tuple(sorted(self.flags.items())))


TPUCompilerParams = CompilerParams
# Code that catches Pallas's TPU lowering errors catches the backend's own.
LoweringException = BackendError

__all__ = ["VMEM", "SMEM", "HBM", "ANY", "SEMAPHORE", "MemorySpace",
           "TPUMemorySpace", "MemoryRef", "PrefetchScalarGridSpec",
           "CompilerParams", "TPUCompilerParams", "GridDimensionSemantics",
           "PARALLEL", "ARBITRARY", "CORE_PARALLEL", "SemaphoreType",
           "SemaphoreShape", "SemaphoreSpace", "DeviceIdType",
           "BarrierSemaphore", "AsyncCopyDescriptor", "make_async_copy",
           "async_copy", "make_async_remote_copy", "semaphore_signal",
           "semaphore_wait", "semaphore_read", "get_barrier_semaphore",
           "device_id", "roll", "repeat", "bitcast", "sync_copy", "load",
           "store", "reciprocal", "async_remote_copy", "dma_semaphore", "emit_pipeline", "prng_seed", "is_tpu_device",
           "prng_random_bits", "stateful_bits", "stateful_uniform",
           "stateful_bernoulli", "stateful_normal",
           "LoweringException", "CoreType", "TensorCoreMesh", "core_barrier",
           "create_tensorcore_mesh", "run_on_first_core",
           "DEFAULT_VMEM_LIMIT_BYTES"]
