"""The backend registry: one record per backend, and the one function that
says which backend runs a kernel.

A `Backend` record says what dsl needs to know of a backend before its
package is imported: its name, the package that implements it, the
platforms it lowers for, whether it runs on the host, what code it builds,
how the kernels it receives are normalized, which compiler-params class it
reads and whether its kernels copy HBM blocks into VMEM. The package fills
in the rest when it is imported (`register_backend`): its pallas_call
lowering rule and its rule table. dsl imports the package the first time a
kernel asks for the backend, so `import dsl` stays light and a missing
optional dependency (triton) fails only for the backend that needs it.

`resolve(backend, interpret=..., platform=...)` is the one place that turns
`pallas_call`'s `backend=` and `interpret=`, `jax_pallas_use_mosaic_gpu`
and the platform into the backend that runs. docs/architecture.md, "How to
add a backend", says how a new one joins.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
from typing import Any, Callable

import jax

from dsl.core import config
from dsl.core.errors import BackendError
from dsl.core.normalize import missing as missing_rules, normalize


@dataclasses.dataclass
class Backend:
  """What dsl knows of one backend."""
  name: str
  # The package that registers its lowering when imported (None: whoever
  # registers the record gives the lowering with it).
  package: str | None
  # The JAX lowering platforms it lowers for ("cpu", "cuda", "rocm", "tpu").
  platforms: tuple[str, ...]
  # Whether it runs kernels on the host (in host callbacks), not a device.
  on_host: bool
  # What it builds: "jax" (plain JAX ops), "triton" (Triton source),
  # "mosaic" (Mosaic TPU MLIR), "mosaic_gpu" (Mosaic GPU MLIR), or a new
  # backend's own word.
  code: str
  # How the kernels it receives are normalized (dsl.core.normalize): None, not
  # at all (it runs every JAX primitive); else whether slices of values
  # become round trips through memory (a TPU slices vectors in registers
  # only at static offsets).
  values_in_memory: bool | None = False
  # "module:Class" of the compiler params it reads, or None.
  compiler_params: str | None = None
  # Whether kernels traced for it copy blocks of operands in HBM into VMEM
  # before using them (`emit_pipeline`); False where HBM refs are global
  # memory the kernel addresses directly (GPUs).
  copies_hbm_blocks: bool = True
  # Whether it runs grids with a dim whose size is traced
  # (dsl.core.dynamic_grid); those that cannot refuse such kernels.
  dynamic_grid_sizes: bool = False
  # Filled by its package (`register_backend`): the MLIR lowering rule of
  # pallas_call, `lowering(ctx, *args, spec)`, and the RuleTable its walker
  # dispatches through (None where it lowers no jaxpr itself).
  lowering: Callable | None = None
  rules: Any = None

  def compiler_params_class(self) -> type | None:
    """The class of the compiler params it reads, or None."""
    if self.compiler_params is None:
      return None
    module, _, name = self.compiler_params.partition(":")
    return getattr(importlib.import_module(module), name)

  def prepare(self, spec):
    """`spec` as this backend's lowering rule receives it."""
    if self.values_in_memory is None:
      return spec
    missing = (missing_rules(self.rules) if self.rules is not None
               else frozenset())
    return normalize(spec, values_in_memory=self.values_in_memory,
                     missing=missing)


_ANY_PLATFORM = ("cpu", "cuda", "rocm", "tpu")

_BUILT_IN = (
    Backend("interpret", "dsl.interpret", _ANY_PLATFORM, on_host=True,
            code="jax", values_in_memory=None, dynamic_grid_sizes=True),
    Backend("triton", "lowering_triton", ("cuda", "rocm"), on_host=False,
            code="triton", compiler_params="dsl.triton:CompilerParams",
            copies_hbm_blocks=False),
    Backend("triton_interpret", "lowering_triton", _ANY_PLATFORM,
            on_host=True, code="triton",
            compiler_params="dsl.triton:CompilerParams",
            copies_hbm_blocks=False),
    Backend("mosaic", "lowering_mosaic.tpu", ("tpu",), on_host=False,
            code="mosaic", values_in_memory=True,
            compiler_params="dsl.tpu:CompilerParams",
            dynamic_grid_sizes=True),
    Backend("mosaic_interpret", "lowering_mosaic.tpu", _ANY_PLATFORM,
            on_host=True, code="mosaic", values_in_memory=True,
            compiler_params="dsl.tpu:CompilerParams",
            dynamic_grid_sizes=True),
    Backend("mosaic_gpu", "lowering_mosaic.gpu", ("cuda",), on_host=False,
            code="mosaic_gpu", values_in_memory=True,
            compiler_params="dsl.mosaic_gpu:CompilerParams",
            copies_hbm_blocks=False),
)

# backend name -> its record.
REGISTRY: dict[str, Backend] = {b.name: b for b in _BUILT_IN}

# The backends that ship with dsl (`pl.BACKENDS`).
BACKENDS = tuple(b.name for b in _BUILT_IN)

# platform -> backend chosen when `backend=None` (on "cuda",
# `jax_pallas_use_mosaic_gpu=True` chooses "mosaic_gpu" instead).
DEFAULT_FOR_PLATFORM = {
    "cpu": "interpret",
    "cuda": "triton",
    "rocm": "triton",
    "tpu": "mosaic",
}

# JAX's platform names (`jax.default_backend()`) -> the keys above: JAX
# calls CUDA and ROCm devices "gpu".
_PLATFORM_KEYS = {"gpu": "cuda"}


def register(record: Backend) -> Backend:
  """Adds (or replaces) the record of a backend; returns it."""
  REGISTRY[record.name] = record
  return record


def register_backend(name: str, lowering: Callable, rules=None) -> None:
  """Called by a backend's package when imported: `lowering(ctx, *args,
  spec)` lowers a pallas_call for backend `name`; `rules` is the RuleTable
  its walker dispatches through."""
  record = REGISTRY[name]
  record.lowering = lowering
  if rules is not None:
    record.rules = rules


def requested(backend: str | None = None, interpret=False) -> str | None:
  """The backend that `pallas_call(backend=..., interpret=...)` asks for,
  None for automatic: `interpret=True` is "interpret" unless a backend is
  named, `interpret="<name>"` names a backend."""
  if isinstance(interpret, str):
    return interpret
  if interpret and backend is None:
    return "interpret"
  return backend


def lowering_platform(platform: str | None = None) -> str:
  """The lowering platform ("cpu", "cuda", "rocm", "tpu") of a JAX platform
  name (None: JAX's default platform here)."""
  if platform is None:
    platform = jax.default_backend()
  return _PLATFORM_KEYS.get(platform, platform)


def platform_default(platform: str | None = None) -> str:
  """The backend `backend=None` runs on for `platform` (a JAX platform name
  such as "gpu", or a lowering platform such as "cuda"; None: JAX's default
  platform here): the one `jax_pallas_default_backend` names (`with
  dsl.default_backend(name)`) if set, else the platform's, honouring
  `jax_pallas_use_mosaic_gpu` on CUDA."""
  chosen = config.default_backend()
  if chosen is not None:
    return chosen
  platform = lowering_platform(platform)
  if platform == "cuda" and config.use_mosaic_gpu():
    return "mosaic_gpu"
  return DEFAULT_FOR_PLATFORM.get(platform, "interpret")


def resolve(backend: str | None = None, *, interpret=False,
            platform: str | None = None) -> str:
  """The backend that runs a kernel: the one `backend`/`interpret` ask
  for, else the default of `platform` (None: JAX's default platform)."""
  return requested(backend, interpret) or platform_default(platform)


def record(name: str | None, kernel: str = "<kernel>",
           where: str | None = None) -> Backend:
  """The record of backend `name` (None: automatic, on JAX's default
  platform)."""
  name = resolve(name)
  found = REGISTRY.get(name)
  if found is None:
    raise BackendError(kernel, f"unknown backend {name!r}; choose one of "
                       f"{', '.join(REGISTRY)} or None for automatic", where)
  return found


def runs_on_host(name: str | None) -> bool:
  """Whether backend `name` (None: automatic) runs on the host here."""
  return record(name).on_host


def lowering_rule(name: str, kernel: str, where: str | None) -> Callable:
  """The pallas_call lowering rule of backend `name`, importing its package
  the first time."""
  found = record(name, kernel, where)
  if found.lowering is None and found.package is not None:
    try:
      importlib.import_module(found.package)
    except ImportError as e:
      raise BackendError(kernel, f"backend '{name}' needs the package "
                         f"'{found.package}', which failed to import: {e}",
                         where) from e
  if found.lowering is None:
    raise BackendError(
        kernel, f"backend '{name}' is not available yet: the "
        f"'{found.package}' package does not provide it in this version. "
        "Use backend='interpret' (or interpret=True) to run on any platform.",
        where)
  return found.lowering


def default_backend(name: str | None):
  """A context manager: inside it, kernels that name no backend (and are
  not asked to interpret) run on backend `name` (None: the platform's
  default again). It sets the JAX option `jax_pallas_default_backend`, so
  jitted functions traced under another default are traced again.

      with dsl.default_backend("mosaic_interpret"):
        out = some_library_op(x)     # its pallas_calls name no backend
  """
  check_backend_name(name, "dsl.default_backend", None)
  return config.default_backend_option(name)


# The backend the kernel being traced is for (None: automatic).
_TRACED_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "dsl_traced_for", default=None)


@contextlib.contextmanager
def tracing_for(name: str | None):
  """Names the backend (None: automatic) of the kernel traced inside, for
  the front-end code that depends on it (`emit_pipeline`)."""
  token = _TRACED_FOR.set(name)
  try:
    yield
  finally:
    _TRACED_FOR.reset(token)


def traced_backend() -> Backend:
  """The record of the backend the kernel being traced is for (the
  automatic backend counts as the default of JAX's platform)."""
  return record(_TRACED_FOR.get())


def rule_table(name: str):
  """The RuleTable backend `name` lowers kernel jaxprs with (importing its
  package), or None for a backend without one."""
  lowering_rule(name, "<rule table>", None)
  return REGISTRY[name].rules


def prepare(spec, name: str):
  """`spec` as backend `name`'s lowering receives it."""
  return record(name, spec.name, spec.where).prepare(spec)


def check_backend_name(name, kernel: str, where: str) -> None:
  if name is not None and name not in REGISTRY:
    raise BackendError(kernel, f"unknown backend {name!r}; choose one of "
                       f"{', '.join(REGISTRY)} or None for automatic", where)
