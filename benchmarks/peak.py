"""The device's attainable peak, measured in the same process as the kernels:
a large matmul (bf16 on GPU/TPU, f32 on CPU) for FLOP/s, and a large
device-to-device copy for memory bandwidth (bytes read + bytes written per
second). On accelerators both are timed with calls queued back to back
(`time_queued`, as the GPU scripts time everything: no host latency between
calls); on a CPU each call is waited for (queued CPU calls each page-fault a
fresh output). The median of the repeats; once per process and device.

No memory-bound row may run above the copy: a row above 100% means the copy
was under-measured. `settle` measures it once more (larger, more repeats)
and keeps the faster; rows still above it are reported, never hidden.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dsl.tools.timing import measure, time_queued

# bytes copied (each read once and written once) and the matmul size
COPY_BYTES = {"cpu": 64 << 20}
GPU_COPY_BYTES = 1 << 30
MATMUL = {"cpu": (2048, jnp.float32)}
GPU_MATMUL = (8192, jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class Peak:
  flops: float           # FLOP/s
  bandwidth: float       # bytes/s
  matmul_desc: str
  copy_desc: str

  def as_dict(self):
    return {"flop_per_s": self.flops, "bytes_per_s": self.bandwidth,
            "matmul": self.matmul_desc, "copy": self.copy_desc}


def copy_rate(nbytes: float, seconds: float) -> float:
  """Bytes per second of a copy of `nbytes`: each byte is read and written."""
  return 2.0 * nbytes / seconds


def matmul_rate(n: int, seconds: float) -> float:
  return 2.0 * n ** 3 / seconds


def _negate(x):
  return -x      # one read, one write: a kernel XLA can neither elide nor alias


def _time(fn, args, repeats: int, queued: bool) -> float:
  if queued:
    return time_queued(jax.jit(fn), *args, repeats=repeats)
  return measure(fn, args, repeats=repeats, keep_output=False).median


def time_copy(nbytes: int, dtype=jnp.bfloat16, repeats: int = 5,
              queued: bool = True) -> float:
  """Median seconds of one device-to-device copy of `nbytes`."""
  x = jnp.ones((nbytes // jnp.dtype(dtype).itemsize,), dtype)
  return _time(_negate, (x,), repeats, queued)


def _measure(platform: str, scale: int, repeats: int) -> Peak:
  nbytes = COPY_BYTES.get(platform, GPU_COPY_BYTES) * scale
  n, dtype = MATMUL.get(platform, GPU_MATMUL)
  queued = platform != "cpu"
  a = jnp.ones((n, n), dtype)
  mm = _time(jnp.dot, (a, a), repeats, queued)
  del a
  cp = time_copy(nbytes, repeats=repeats, queued=queued)
  return Peak(matmul_rate(n, mm), copy_rate(nbytes, cp),
              f"{jnp.dtype(dtype).name} matmul {n}^3",
              f"copy {nbytes >> 20} MiB")


@functools.lru_cache(maxsize=None)
def measure_peak(platform: str, device_kind: str | None = None,
                 repeats: int = 5) -> Peak:
  """The peak of this process's device (cached per platform and device
  kind: measured once per process)."""
  del device_kind   # part of the cache key only
  return _measure(platform, 1, repeats)


def remeasure(platform: str) -> Peak:
  """A second, more careful measurement: twice the bytes, twice the
  repeats (not cached)."""
  return _measure(platform, 2, 10)


def fraction(throughput: float, unit: str, peak: Peak) -> float:
  """A row's throughput as a fraction of the peak of its kind."""
  return throughput / (peak.flops if unit == "FLOP/s" else peak.bandwidth)


def over_peak(rows, peak: Peak) -> list:
  """The memory-bound rows faster than the measured copy."""
  return [r for r in rows if r.throughput is not None and
          r.throughput_unit == "B/s" and r.throughput > peak.bandwidth]


def settle(rows, peak: Peak, again) -> tuple[Peak, list[str]]:
  """No row above 100% of the copy: when rows are, the copy was
  under-measured, so it is measured once more (`again()`, a Peak) and the
  faster copy kept; the rows' fractions follow. Rows still above it are
  named in the returned notes."""
  if not over_peak(rows, peak):
    return peak, []
  second = again()
  if second.bandwidth > peak.bandwidth:
    peak = dataclasses.replace(
        peak, bandwidth=second.bandwidth,
        copy_desc=f"{second.copy_desc}, re-measured: a row outran "
        f"the first copy ({peak.bandwidth / 1e9:.0f} GB/s)")
  for r in rows:
    if r.throughput is not None:
      r.peak_fraction = fraction(r.throughput, r.throughput_unit, peak)
  still = over_peak(rows, peak)
  if not still:
    return peak, []
  names = ", ".join(f"{r.case.label} ({r.throughput / 1e9:.0f} GB/s)"
                    for r in still)
  return peak, [
      f"%peak: {len(still)} row(s) ran above the measured copy "
      f"({peak.bandwidth / 1e9:.0f} GB/s) after measuring it twice: {names}."
      " The copy is under-measured on this device (on a CPU, small operands "
      "run from cache); read their %peak (marked !) as relative only."]
