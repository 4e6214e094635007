"""The autotuning cache: winning kernel configs on disk, keyed by device kind
and jax/triton versions (`python -m benchmarks --autotune` fills it; kernels in
`kernels/` read it when their caller gives no block sizes).

The cache is `$DSL_AUTOTUNE_CACHE`, else `~/.cache/dsl/autotune.json`. Nothing
here imports jax until a device kind or default backend is needed.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import tempfile
from typing import Any

import jax
import numpy as np

FORMAT = 1
ENV_VAR = "DSL_AUTOTUNE_CACHE"


def cache_path() -> str:
  path = os.environ.get(ENV_VAR)
  if path:
    return os.path.expanduser(path)
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
      os.path.expanduser("~"), ".cache")
  return os.path.join(base, "dsl", "autotune.json")


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "none"


def _current_device_kind() -> str:
  d = jax.devices()[0]
  return "cpu" if d.platform == "cpu" else getattr(d, "device_kind", d.platform)


def device_key(device_kind: str | None = None) -> str:
  """'<device kind>|jax=<version>|triton=<version>'."""
  kind = device_kind or _current_device_kind()
  return f"{kind}|jax={_version('jax')}|triton={_version('triton')}"


def size_key(dims, dtype=None) -> str:
  """(1024, 1024, 1024), float32 -> '1024x1024x1024:float32'.

  dims are the kernel's size as the benchmarks name it: add (N,), matmul
  (M, K, N), softmax / layer_norm (ROWS, COLS).
  """
  key = "x".join(str(int(d)) for d in dims)
  if dtype is not None:
    try:
      name = np.dtype(dtype).name
    except TypeError:
      name = str(dtype)
    key += f":{name}"
  return key


def entry_key(kernel: str, backend: str, size: str) -> str:
  return f"{kernel}/{backend}/{size}"


def load(path: str | None = None) -> dict:
  path = path or cache_path()
  try:
    with open(path) as f:
      data = json.load(f)
  except FileNotFoundError:
    return {"format": FORMAT, "devices": {}}
  except (OSError, ValueError):
    return {"format": FORMAT, "devices": {}}   # unreadable cache: start over
  if not isinstance(data, dict) or data.get("format") != FORMAT:
    return {"format": FORMAT, "devices": {}}
  data.setdefault("devices", {})
  return data


def _default_backend() -> str:
  return {"gpu": "triton", "tpu": "mosaic"}.get(jax.default_backend(),
                                                 "interpret")


def lookup(kernel: str, size: str, backend: str | None = None,
           device_kind: str | None = None, path: str | None = None
           ) -> dict[str, Any] | None:
  """The cached winning config of `kernel` at `size` (a `size_key`), or None.

  backend defaults to the platform's default dsl backend; device_kind to the
  first JAX device's kind. Never raises for a missing or corrupt cache.
  """
  backend = backend or _default_backend()
  entries = load(path)["devices"].get(device_key(device_kind), {})
  hit = entries.get(entry_key(kernel, backend, size))
  return dict(hit["config"]) if hit and "config" in hit else None


def store(kernel: str, size: str, backend: str, config: dict, *,
          median_s: float, candidates: int, device_kind: str | None = None,
          path: str | None = None, extra: dict | None = None) -> None:
  """Records a winner (read-merge-write, atomic replace)."""
  path = path or cache_path()
  data = load(path)
  dev = data["devices"].setdefault(device_key(device_kind), {})
  dev[entry_key(kernel, backend, size)] = {
      "config": dict(config), "median_s": median_s, "candidates": candidates,
      "tuned_at": datetime.datetime.now().isoformat(timespec="seconds"),
      **(extra or {})}
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=".autotune.", dir=os.path.dirname(
      os.path.abspath(path)))
  with os.fdopen(fd, "w") as f:
    json.dump(data, f, indent=1, sort_keys=True)
  os.replace(tmp, path)
