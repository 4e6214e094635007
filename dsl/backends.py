"""The backend registry: backend name -> lowering rule.

Lowering packages register themselves when imported; dsl imports them by name
the first time a kernel asks for their backend, so `import dsl` stays light.
"""
from __future__ import annotations

import importlib
from typing import Callable

import jax

from dsl import config
from dsl.errors import BackendError
from dsl.normalize import normalize

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

# JAX's platform names (`jax.default_backend()`) -> the keys above: JAX
# calls CUDA and ROCm devices "gpu".
_PLATFORM_KEYS = {"gpu": "cuda"}

# backends that run kernels on the host (through host callbacks).
HOST_BACKENDS = ("interpret", "triton_interpret", "mosaic_interpret")

_RULES: dict[str, Callable] = {}


def platform_default(platform: str | None = None) -> str:
  """The backend `backend=None` runs on for `platform` (a JAX platform name
  such as "gpu", or a lowering platform such as "cuda"; None: JAX's default
  platform here), honouring `jax_pallas_use_mosaic_gpu` on CUDA."""
  if platform is None:
    platform = jax.default_backend()
  platform = _PLATFORM_KEYS.get(platform, platform)
  if platform == "cuda" and config.use_mosaic_gpu():
    return "mosaic_gpu"
  return DEFAULT_FOR_PLATFORM.get(platform, "interpret")


def runs_on_host(name: str | None) -> bool:
  """Whether backend `name` (None: automatic) runs on the host here."""
  return (name or platform_default()) in HOST_BACKENDS


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


def prepare(spec, name: str):
  """`spec` as backend `name`'s lowering receives it: its kernel jaxpr in
  the primitives every lowering handles (the interpret backend runs every
  JAX primitive and takes it as it is)."""
  if name == "interpret":
    return spec
  return normalize(spec, values_in_memory=name.startswith("mosaic"))


def check_backend_name(name, kernel: str, where: str) -> None:
  if name is not None and name not in BACKENDS:
    raise BackendError(kernel, f"unknown backend {name!r}; choose one of "
                       f"{', '.join(BACKENDS)} or None for automatic", where)
