"""The backend registry: backend name -> lowering rule.

Lowering packages register themselves when imported; dsl imports them by name
the first time a kernel asks for their backend, so `import dsl` stays light.
"""
from __future__ import annotations

import importlib
from typing import Callable

from dsl.errors import BackendError

BACKENDS = ("interpret", "triton", "triton_interpret", "mosaic",
            "mosaic_interpret", "mosaic_gpu")

# backend name -> package that registers it.
_PACKAGES = {
    "triton": "lowering_triton",
    "triton_interpret": "lowering_triton",
    "mosaic": "lowering_mosaic",
    "mosaic_interpret": "lowering_mosaic",
    "mosaic_gpu": "lowering_mosaic.gpu",
}

# platform -> backend chosen when `backend=None` (on "cuda",
# `jax_pallas_use_mosaic_gpu=True` chooses "mosaic_gpu" instead).
DEFAULT_FOR_PLATFORM = {
    "cpu": "interpret",
    "cuda": "triton",
    "rocm": "triton",
    "tpu": "mosaic",
}

# backends that run kernels on the host (through host callbacks).
HOST_BACKENDS = ("interpret", "triton_interpret", "mosaic_interpret")

_RULES: dict[str, Callable] = {}


def runs_on_host(name: str | None) -> bool:
  """Whether backend `name` (None: automatic) runs on the host here."""
  if name is None:
    import jax
    name = DEFAULT_FOR_PLATFORM.get(jax.default_backend(), "interpret")
  return name in HOST_BACKENDS


def register_backend(name: str, lowering: Callable) -> None:
  """`lowering(ctx, *args, spec)` lowers a pallas_call for backend `name`."""
  _RULES[name] = lowering


def lowering_rule(name: str, kernel: str, where: str | None) -> Callable:
  if name in _RULES:
    return _RULES[name]
  package = _PACKAGES.get(name)
  if package is not None:
    try:
      importlib.import_module(package)
    except ImportError as e:
      raise BackendError(kernel, f"backend '{name}' needs the package "
                         f"'{package}', which failed to import: {e}",
                         where) from e
  if name not in _RULES:
    raise BackendError(
        kernel, f"backend '{name}' is not available yet: the '{package}' "
        f"package does not provide it in this version. Use "
        f"backend='interpret' (or interpret=True) to run on any platform.",
        where)
  return _RULES[name]


def check_backend_name(name, kernel: str, where: str) -> None:
  if name is not None and name not in BACKENDS:
    raise BackendError(kernel, f"unknown backend {name!r}; choose one of "
                       f"{', '.join(BACKENDS)} or None for automatic", where)
