"""The device's attainable peak, measured in the same run as the kernels:
a large matmul (bf16 on GPU/TPU, f32 on CPU) for FLOP/s, and a device-to-
device copy for memory bandwidth (bytes read + bytes written per second)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dsl.timing import measure


@dataclasses.dataclass
class Peak:
  flops: float           # FLOP/s
  bandwidth: float       # bytes/s
  matmul_desc: str
  copy_desc: str

  def as_dict(self):
    return {"flop_per_s": self.flops, "bytes_per_s": self.bandwidth,
            "matmul": self.matmul_desc, "copy": self.copy_desc}


def _copy(x):
  return x * 1 + 0   # one read, one write; XLA cannot alias it to the input


def measure_peak(platform: str, repeats: int = 5) -> Peak:
  if platform == "cpu":
    n, dtype, copy_bytes = 2048, jnp.float32, 64 << 20
  else:
    n, dtype, copy_bytes = 8192, jnp.bfloat16, 1 << 30
  a = jnp.ones((n, n), dtype)
  mm = measure(lambda x, y: jnp.dot(x, y), (a, a), repeats=repeats,
               keep_output=False)
  del a
  buf = jnp.ones((copy_bytes // 4,), jnp.float32)
  cp = measure(_copy, (buf,), repeats=repeats, keep_output=False)
  del buf
  return Peak(2.0 * n ** 3 / mm.median, 2.0 * copy_bytes / cp.median,
              f"{jnp.dtype(dtype).name} matmul {n}^3",
              f"copy {copy_bytes >> 20} MiB")
