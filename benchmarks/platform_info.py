"""What this machine can run: platform, device, dsl backends, peers."""
from __future__ import annotations

import functools
import importlib.metadata
import os

import jax

from dsl.core import backends

DSL_BACKENDS = backends.BACKENDS


@functools.lru_cache(maxsize=None)
def platform() -> str:
  """'cpu', 'gpu' or 'tpu' (JAX's default backend)."""
  return jax.default_backend()


def has_gpu() -> bool:
  return platform() == "gpu"


def has_tpu() -> bool:
  return platform() == "tpu"


@functools.lru_cache(maxsize=None)
def device_kind() -> str:
  d = jax.devices()[0]
  kind = getattr(d, "device_kind", d.platform)
  return "cpu" if d.platform == "cpu" else kind


def version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def describe() -> dict:
  d = jax.devices()[0]
  return {"platform": platform(), "device_kind": device_kind(),
          "device_count": jax.device_count(), "cpu_count": os.cpu_count(),
          "jax": version("jax"), "jaxlib": version("jaxlib"),
          "triton": version("triton"), "device": str(d)}


def default_backend() -> str:
  return backends.platform_default(platform())


@functools.lru_cache(maxsize=None)
def backend_unavailable(name: str) -> str | None:
  """None if dsl can run backend `name` here, else the one-line reason."""
  if name not in DSL_BACKENDS:
    return (f"unknown backend {name!r}; choose from {', '.join(DSL_BACKENDS)}")
  if name == "triton" and not has_gpu():
    return "backend 'triton' needs a GPU; this machine has none (try interpret)"
  if name == "mosaic" and not has_tpu():
    return "backend 'mosaic' needs a TPU; this machine has none (try interpret)"
  if name == "mosaic_gpu" and not has_gpu():
    return ("backend 'mosaic_gpu' needs an NVIDIA Hopper GPU; this machine has "
            "none (try interpret)")
  try:
    backends.lowering_rule(name, "benchmarks", None)
  except Exception as e:  # BackendError, or a lowering package half-built
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    msg = msg.replace("kernel 'benchmarks': ", "").split(". Use backend=")[0]
    if msg.startswith(f"backend '{name}'"):
      return msg
    return f"backend {name!r} is not usable here: {msg}"
  return None


def pallas_mode(backend: str) -> str:
  """How jax.experimental.pallas runs the peer of a dsl backend's row."""
  if backends.REGISTRY[backend].on_host:
    return "interpret"
  return {"triton": "triton", "mosaic": "mosaic",
          "mosaic_gpu": "mosaic_gpu"}[backend]


def pallas_unavailable(mode: str) -> str | None:
  if mode in ("triton", "mosaic_gpu") and not has_gpu():
    return "n/a: no GPU"
  if mode == "mosaic" and not has_tpu():
    return "n/a: no TPU"
  try:
    import jax.experimental.pallas  # noqa: F401
    if mode == "triton":
      import jax.experimental.pallas.triton  # noqa: F401
    if mode == "mosaic":
      import jax.experimental.pallas.tpu  # noqa: F401
    if mode == "mosaic_gpu":
      import jax.experimental.pallas.mosaic_gpu  # noqa: F401
  except Exception as e:
    return f"n/a: {type(e).__name__}"
  return None
