"""Shipped GPU defaults: measured winning configs and backend choices, as data.

Two JSON tables ship in `dsl/tools/data/` (`python -m benchmarks.gpu_check`
measures and refreshes them on a GPU; docs/autotune.md describes them):

- `gpu_configs.json`: per device kind, `"<kernel>/<backend>/<size>"` ->
  `{"config": {...}, "source": "...", "measured": {...}}`. `<size>` is a size
  key as the autotuning cache writes it (`4096x4096x4096:bfloat16`) or a
  pattern with `*` for any dim or dtype (`*x*x*x128:bfloat16`, `*:float32`).
- `gpu_backends.json`: per device kind, `"<kernel>"` ->
  `{"backend": "triton" | "mosaic_gpu", "source": "..."}`.

A lookup tries the device kind's own entries, then its family's (`hopper`,
`ampere`: from the compute capability, else the device kind's name), then
gives None: the caller's own heuristic (the code's default) applies. Within
one tier the exact size wins, then the pattern with the most fixed parts.
Nothing here applies to CPU backends, or where no GPU is present (unless
`for_device` names one, e.g. to compile for a GPU ahead of time), or with
`DSL_GPU_DEFAULTS=0` (the code's own defaults everywhere: for sweeps and
comparisons).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import os
from typing import Any

import jax

from dsl.tools.autotune_cache import size_key

FORMAT = 1
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
CONFIGS_PATH = os.path.join(DATA, "gpu_configs.json")
BACKENDS_PATH = os.path.join(DATA, "gpu_backends.json")
GPU_BACKENDS = ("triton", "mosaic_gpu")
ENV_SWITCH = "DSL_GPU_DEFAULTS"
FALLBACK_BACKEND = "triton"

# family -> (compute capability majors, substrings of device kinds). The
# compute capability decides when it is known; the names are the fallback.
FAMILIES = {
    "hopper": (("9",), ("H100", "H200", "H800", "H20", "GH200")),
    "ampere": (("8",), ("A100", "A800", "A10", "A30", "A40", "A6000",
                        "RTX 30")),
}


@dataclasses.dataclass(frozen=True)
class Device:
  kind: str                            # e.g. "NVIDIA H200"
  compute_capability: str | None = None   # e.g. "9.0"


@dataclasses.dataclass(frozen=True)
class Default:
  """One table entry that matched, and where it matched."""
  config: dict
  source: str          # the record it came from, or "unmeasured heuristic"
  where: str           # the device kind, or "<family> family"
  key: str             # the entry's key in the table


_TARGET: contextvars.ContextVar[Device | None] = contextvars.ContextVar(
    "dsl_gpu_defaults_target", default=None)


@contextlib.contextmanager
def for_device(kind: str, compute_capability: str | None = None):
  """Look up defaults as if running on this GPU (e.g. "NVIDIA H100 80GB
  HBM3"), also on a machine without one: for compiling ahead of time.

  It applies to kernels traced inside it. JAX caches the traces of
  `custom_vjp` functions (the kernels of kernels/ are), so call
  `jax.clear_caches()` before tracing the same kernel for another device.
  """
  token = _TARGET.set(Device(kind, compute_capability))
  try:
    yield
  finally:
    _TARGET.reset(token)


def enabled() -> bool:
  return os.environ.get(ENV_SWITCH, "1").strip().lower() not in (
      "0", "false", "off", "no")


def current_device() -> Device | None:
  """The GPU lookups are for: `for_device`'s, else JAX's first device when
  it is a GPU, else None."""
  target = _TARGET.get()
  if target is not None:
    return target
  if jax.default_backend() != "gpu":
    return None
  d = jax.devices()[0]
  cc = getattr(d, "compute_capability", None)
  return Device(d.device_kind, str(cc) if cc else None)


def family(device: Device) -> str | None:
  """'hopper', 'ampere' or None for a device."""
  if device.compute_capability:
    major = str(device.compute_capability).split(".")[0]
    for name, (majors, _) in FAMILIES.items():
      if major in majors:
        return name
    return None
  for name, (_, kinds) in FAMILIES.items():
    if any(k in device.kind for k in kinds):
      return name
  return None


@functools.lru_cache(maxsize=None)
def _load_cached(path: str, mtime: float) -> dict:
  del mtime   # part of the cache key: a rewritten file is read again
  with open(path) as f:
    data = json.load(f)
  if not isinstance(data, dict) or data.get("format") != FORMAT:
    raise ValueError(f"{path}: not a format-{FORMAT} defaults table")
  return data


def load(path: str) -> dict:
  """A table (read once per process and file version); an empty one when
  the file is missing."""
  try:
    return _load_cached(path, os.path.getmtime(path))
  except FileNotFoundError:
    return {"format": FORMAT, "devices": {}, "families": {}}


def _tiers(table: dict, device: Device):
  """(where, entries) in lookup order: the device kind, then its family."""
  yield device.kind, table.get("devices", {}).get(device.kind, {})
  fam = family(device)
  if fam is not None:
    yield f"{fam} family", table.get("families", {}).get(fam, {})


def match(pattern: str, key: str) -> int | None:
  """How specific `pattern` is when it matches size key `key` (more fixed
  parts: higher), or None. A dims part of '*' alone matches any rank
  ('*:float32', '*'); otherwise each dim is fixed or '*'."""
  dims, _, dtype = key.partition(":")
  pdims, _, pdtype = pattern.partition(":")
  if pdtype not in ("", "*", dtype):
    return None
  fixed_dtype = int(pdtype not in ("", "*"))
  if pdims == "*":
    return fixed_dtype
  pd, kd = pdims.split("x"), dims.split("x")
  if len(pd) != len(kd) or any(p not in ("*", k) for p, k in zip(pd, kd)):
    return None
  return sum(p != "*" for p in pd) + fixed_dtype


def _best(entries: dict, prefix: str, key: str):
  """The matching entry with the most specific size pattern, or None."""
  best = None
  for name in sorted(entries):
    if not name.startswith(prefix):
      continue
    score = match(name[len(prefix):], key)
    if score is not None and (best is None or score > best[0]):
      best = (score, name)
  return best and best[1]


def lookup(kernel: str, dims, dtype, backend: str, *,
           device: Device | None = None, path: str | None = None
           ) -> Default | None:
  """The shipped config of `kernel` (a benchmark or `kernels.<name>`) at
  size `dims` / `dtype` on GPU `backend`, for `device` (default: this
  machine's GPU), or None: no GPU, a CPU backend, or no entry."""
  device = device or current_device()
  if device is None or backend not in GPU_BACKENDS or not enabled():
    return None
  key = size_key(dims, dtype)
  prefix = f"{kernel}/{backend}/"
  for where, entries in _tiers(load(path or CONFIGS_PATH), device):
    name = _best(entries, prefix, key)
    if name is not None:
      e = entries[name]
      return Default(dict(e["config"]), e.get("source", ""), where, name)
  return None


@dataclasses.dataclass(frozen=True)
class BackendChoice:
  backend: str         # "triton" or "mosaic_gpu"
  source: str
  where: str           # the device kind, "<family> family", or "-"


def backend_for(kernel: str, *, device: Device | None = None,
                path: str | None = None) -> BackendChoice | None:
  """The GPU backend `kernel` (e.g. "kernels.softmax") runs on when its
  caller gives none, or None where no GPU is present. An entry for the
  kernel, else the tier's "*" entry; without any: Triton, the GPU backend
  every kernel supports."""
  device = device or current_device()
  if device is None:
    return None
  if not enabled():
    return BackendChoice(FALLBACK_BACKEND, f"{ENV_SWITCH}=0", "-")
  for where, entries in _tiers(load(path or BACKENDS_PATH), device):
    e = entries.get(kernel) or entries.get("*")
    if e is not None:
      return BackendChoice(e["backend"], e.get("source", ""), where)
  return BackendChoice(FALLBACK_BACKEND, "no entry for this device: the "
                       "default GPU backend", "-")


def write(path: str, table: dict[str, Any]) -> None:
  """Writes a table the way the files are kept (sorted keys, one entry per
  few lines), atomically."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(table, f, indent=1, sort_keys=True)
    f.write("\n")
  os.replace(tmp, path)
