"""JAX's private names, in one place.

Everything the library takes from `jax._src` (JAX's tracing core, its state
and partial-evaluation machinery, the MLIR bindings and dialects jaxlib
ships) comes through this module: `from dsl.core.jax_internals import core`.
No other module imports `jax._src` (tests/pallas/test_layout.py holds that),
so a new JAX release is a change to this file.

Names resolve lazily (PEP 562): `import dsl` does not load the MLIR bindings
or the TPU dialect until a backend asks for them.

The supported releases are `SUPPORTED_JAX` (pyproject.toml says the same).
Where releases differ, the difference lives here:

- jax 0.12 folded `ClosedJaxpr` into `core.Jaxpr`: a jaxpr carries the
  values of its constant inputs, `jaxpr.jaxpr` is the jaxpr itself, and a
  `Jaxpr` built with constvars but no consts treats them as leading invars.
  `ClosedJaxpr` below is the type of a jaxpr *with* its consts on every
  release (for `isinstance` and annotations); `close_jaxpr` builds one and
  `JAXPR_CARRIES_CONSTS` says which form is installed.
- jax 0.12's Pallas names the Mosaic module after its kernel
  (`module @kernel attributes {...}`); 0.11's leaves it unnamed.
  `MOSAIC_MODULE_NAMED` says which the installed release does, and the Mosaic
  lowering follows it (the golden tests compare with the installed Pallas).
- jax 0.12's Pallas waits for a DMA with `tpu.wait_dma`, which names the
  whole copy (source, target, both semaphores, the peer device) and the end
  awaited (`wait_target`); 0.11's with `tpu.wait_dma2`, which names the
  semaphore awaited (a send's wait with the ends swapped). Both jaxlibs have
  both operations, so it is the release, not a capability, that decides:
  `DMA_WAIT_NAMES_COPY`.
- jax 0.12's Pallas computes a device's mesh coordinate from `tpu.device_id`
  with unsigned division and remainder (`divui`/`remui`; a device id is never
  negative), 0.11's with signed ones: `DEVICE_COORDINATES_UNSIGNED`.
- jax 0.12's Pallas lowers `lax.bitcast_convert_type` between dtypes of one
  MLIR type (uint32 and int32 are both `i32`) to nothing, 0.11's to a
  `tpu.bitcast` of the type to itself: `BITCAST_TO_SAME_TYPE_ELIDED`.
"""
from __future__ import annotations

import importlib
from typing import Any

import jax
import jaxlib

# The releases this library is tested against: (oldest, first unsupported).
SUPPORTED_JAX = ((0, 11, 2), (0, 13))
SUPPORTED_RANGE_TEXT = "jax and jaxlib >=0.11.2,<0.13"


def _version_tuple(text: str) -> tuple[int, ...]:
  parts = []
  for piece in text.split("."):
    digits = "".join(ch for ch in piece if ch.isdigit())
    if not digits:
      break
    parts.append(int(digits))
  return tuple(parts)


def check_supported_jax(jax_version: str = jax.__version__,
                        jaxlib_version: str = jaxlib.__version__) -> None:
  """Raises ImportError naming the supported range when the installed
  jax/jaxlib is outside it."""
  low, high = SUPPORTED_JAX
  for name, text in (("jax", jax_version), ("jaxlib", jaxlib_version)):
    version = _version_tuple(text)
    if not low <= version < high:
      raise ImportError(
          f"dsl supports {SUPPORTED_RANGE_TEXT}; this environment has "
          f"{name} {text}. Install a supported release, e.g. "
          f"`pip install -c constraints.txt jax jaxlib` from the repository.")


check_supported_jax()

JAX_VERSION = _version_tuple(jax.__version__)

# The Mosaic forms that follow the installed release's Pallas (see above).
MOSAIC_MODULE_NAMED = JAX_VERSION >= (0, 12)
DMA_WAIT_NAMES_COPY = JAX_VERSION >= (0, 12)
DEVICE_COORDINATES_UNSIGNED = JAX_VERSION >= (0, 12)
BITCAST_TO_SAME_TYPE_ELIDED = JAX_VERSION >= (0, 12)

# name -> (module, attribute): `attribute` None means the module itself; a
# tuple of modules names where releases keep it, newest first.
_TABLE: dict[str, tuple[str | tuple[str, ...], str | None]] = {
    # tracing core
    "core": ("jax._src.core", None),
    "config": ("jax._src.config", None),
    "effects": ("jax._src.effects", None),
    "linear_util": ("jax._src.linear_util", None),
    "api_util": ("jax._src.api_util", None),
    "source_info_util": ("jax._src.source_info_util", None),
    "traceback_util": ("jax._src.traceback_util", None),
    "dtypes": ("jax._src.dtypes", None),
    "pretty_printer": ("jax._src.pretty_printer", None),
    "tree_util": ("jax._src.tree_util", None),
    # JAX's PRNG implementations (the registry `prngs`), for the tests that
    # load Pallas's PRNG ops twice.
    "prng": (("jax._src.random.prng", "jax._src.prng"), None),
    # JAX's Threefry-2x32 hash as jax.numpy operations (the TPU's
    # `threefry2x32` rule lowers it unrolled, as Pallas does)
    "threefry2x32_hash": (("jax._src.random.threefry2x32", "jax._src.prng"),
                          "_threefry2x32_lowering"),
    # transformations
    "ad": ("jax._src.interpreters.ad", None),
    "ad_util": ("jax._src.ad_util", None),
    "ad_checkpoint": ("jax._src.ad_checkpoint", None),
    "batching": ("jax._src.interpreters.batching", None),
    "partial_eval": ("jax._src.interpreters.partial_eval", None),
    "custom_derivatives": ("jax._src.custom_derivatives", None),
    "checkify": ("jax._src.checkify", None),
    "pjit": ("jax._src.pjit", None),
    # lax internals
    "lax_internal": ("jax._src.lax.lax", None),
    "lax_control_flow": ("jax._src.lax.control_flow", None),
    "lax_parallel": ("jax._src.lax.parallel", None),
    "lax_special": ("jax._src.lax.special", None),
    # state (refs)
    "state_types": ("jax._src.state.types", None),
    "state_indexing": ("jax._src.state.indexing", None),
    "state_primitives": ("jax._src.state.primitives", None),
    "state_discharge": ("jax._src.state.discharge", None),
    "TransformedRef": ("jax._src.state.types", "TransformedRef"),
    "NDIndexer": ("jax._src.state.indexing", "NDIndexer"),
    "Slice": ("jax._src.state.indexing", "Slice"),
    "ds": ("jax._src.state.indexing", "ds"),
    "get_ref_and_transforms": ("jax._src.state.primitives",
                               "get_ref_and_transforms"),
    "pp_ref_transforms": ("jax._src.state.primitives", "pp_ref_transforms"),
    # devices, meshes, sharding, dispatch, callbacks
    "mesh": ("jax._src.mesh", None),
    "sharding_impls": ("jax._src.sharding_impls", None),
    "dispatch": ("jax._src.dispatch", None),
    "xla_bridge": ("jax._src.xla_bridge", None),
    "distributed": ("jax._src.distributed", None),
    "debugging": ("jax._src.debugging", None),
    "tpu_info": ("jax._src.tpu_info", None),
    "tpu_custom_call": ("jax._src.tpu_custom_call", None),
    # lowering to StableHLO and jaxlib's MLIR bindings
    "mlir": ("jax._src.interpreters.mlir", None),
    "ir": ("jax._src.lib.mlir", "ir"),
    "passmanager": ("jax._src.lib.mlir", "passmanager"),
    "arith": ("jax._src.lib.mlir.dialects", "arith"),
    "cf": ("jax._src.lib.mlir.dialects", "cf"),
    "func": ("jax._src.lib.mlir.dialects", "func"),
    "gpu": ("jax._src.lib.mlir.dialects", "gpu"),
    "llvm": ("jax._src.lib.mlir.dialects", "llvm"),
    "mlir_math": ("jax._src.lib.mlir.dialects", "math"),
    "memref": ("jax._src.lib.mlir.dialects", "memref"),
    "nvvm": ("jax._src.lib.mlir.dialects", "nvvm"),
    "scf": ("jax._src.lib.mlir.dialects", "scf"),
    "vector": ("jax._src.lib.mlir.dialects", "vector"),
    "tpu": ("jax._src.lib", "tpu"),
    "mosaic_gpu_dialect": ("jax._src.lib", "mosaic_gpu_dialect"),
    "gpu_triton": ("jax._src.lib", "gpu_triton"),
    # JAX's test base classes, for the stand-in of Pallas's test utilities
    # that runs JAX's Pallas test files on dsl (tests/pallas/pallas_suite.py)
    "test_util": ("jax._src.test_util", None),
}


def _import_first(names: str | tuple[str, ...]):
  """The first of the modules `names` that imports."""
  names = (names,) if isinstance(names, str) else names
  for candidate in names[:-1]:
    try:
      return importlib.import_module(candidate)
    except ImportError:
      continue
  return importlib.import_module(names[-1])


def _resolve(name: str) -> Any:
  module_name, attribute = _TABLE[name]
  module = _import_first(module_name)
  module_name = module.__name__
  if attribute is None:
    return module
  try:
    return getattr(module, attribute)
  except AttributeError:
    return importlib.import_module(f"{module_name}.{attribute}")


def __getattr__(name: str) -> Any:
  if name not in _TABLE:
    raise AttributeError(
        f"dsl.core.jax_internals has no {name!r}; add JAX's private name to "
        f"its table (the one place the library reaches into jax._src)")
  value = _resolve(name)
  globals()[name] = value
  return value


def __dir__():
  return sorted({*globals(), *_TABLE})


# --- jaxprs with their consts -------------------------------------------------

_core = importlib.import_module("jax._src.core")

JAXPR_CARRIES_CONSTS = not hasattr(_core, "ClosedJaxpr")

# The type of a jaxpr together with its consts.
ClosedJaxpr = _core.Jaxpr if JAXPR_CARRIES_CONSTS else _core.ClosedJaxpr


def close_jaxpr(jaxpr, consts=()) -> Any:
  """`jaxpr` (whose constvars take `consts`) with its consts attached."""
  return ClosedJaxpr(jaxpr, list(consts))


def is_closed_jaxpr(value) -> bool:
  """Whether `value` is a jaxpr with its consts (every jaxpr on jax 0.12)."""
  return isinstance(value, ClosedJaxpr)
