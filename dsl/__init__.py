"""A kernel-authoring DSL in the style of JAX's Pallas.

    import dsl as pl

Kernels are Python functions on refs; `pallas_call` (or `@kernel`) runs them
over a grid of blocks described by BlockSpecs.
"""
from dsl.core.jax_internals import TransformedRef

from dsl.core import refs as _refs  # installs the static index checks
from dsl.core.backends import BACKENDS, default_backend
from dsl.core.blockspec import (BlockDim, BlockMapping, BlockSpec, Blocked,
                                Buffered, Element, RevisitMode, Squeezed,
                                squeezed)
from dsl.core.compiler_params import CompilerParams
from dsl.core.shape_helpers import (align_to, broadcast_to, empty,
                                    empty_like, next_power_of_2,
                                    no_block_spec, strides_from_shape)
from dsl.core.semaphores import DeviceIdType
from dsl.tpu.primitives import semaphore_read, semaphore_signal, semaphore_wait
from dsl.core.errors import (BackendError, KernelCheckError,
                             KernelDeadlockError, KernelError,
                             KernelRuntimeError, KernelTypeError,
                             KernelWarning, kernel_error_of)
from dsl.core.gridspec import GridMapping, GridSpec, PrefetchScalarGridSpec
from dsl.kernel import kernel
from dsl.tools.autotuning import autotune
from dsl.tools.cost_estimate import estimate_cost
from dsl.tools.profiling import profile
from dsl.core.memory import ANY, MemoryRef, MemorySpace
from dsl.core.pallas_call import (CostEstimate, KernelSpec, pallas_call,
                                  pallas_call_p)
from dsl.core.primitives import (cdiv, debug_print, loop, max_contiguous,
                                 multiple_of, run_scoped, when)
from dsl.core.checks import debug_check
from dsl.core.state_scopes import get_global, run_state
from dsl.core.ref_ops import load, store, atomic_add, atomic_cas
from dsl.core.refs import Slice, ds, dslice
from dsl.core.tracing import num_programs, program_id
from dsl.core import config
enable_debug_checks = config.enable_debug_checks_option
enable_poison_buffers = config.poison_buffers_option
from dsl import errors, mosaic_gpu, triton, tpu
from dsl import transforms as _transforms  # registers jvp/vmap/vjp rules

__all__ = [
    "ANY", "BACKENDS", "BackendError", "BlockMapping", "BlockSpec", "Blocked",
    "autotune", "profile", "estimate_cost",
    "Element", "GridMapping", "GridSpec", "KernelCheckError",
    "KernelDeadlockError", "KernelError", "KernelRuntimeError", "KernelSpec",
    "KernelTypeError", "KernelWarning", "kernel_error_of", "MemoryRef", "MemorySpace", "PrefetchScalarGridSpec",
    "Slice", "Squeezed", "TransformedRef", "cdiv", "debug_check",
    "debug_print", "ds", "dslice", "kernel", "load", "loop", "max_contiguous",
    "multiple_of", "num_programs", "pallas_call", "CostEstimate", "pallas_call_p",
    "program_id", "run_scoped", "squeezed", "store", "tpu", "triton", "when",
    "mosaic_gpu", "errors",
    "BlockDim", "Buffered", "RevisitMode", "CompilerParams", "DeviceIdType",
    "semaphore_read", "semaphore_signal", "semaphore_wait", "align_to",
    "broadcast_to", "next_power_of_2", "strides_from_shape",
    "enable_debug_checks", "enable_poison_buffers", "empty", "empty_like",
    "no_block_spec", "default_backend", "get_global", "run_state",
]
