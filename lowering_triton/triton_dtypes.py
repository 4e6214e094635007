"""JAX dtypes as Triton types: source spellings, signatures, interpreter types."""
from __future__ import annotations

import numpy as np

from dsl.core.dtypes import (is_bool, is_float, is_int, is_unsigned)  # noqa: F401
from dsl.core.errors import BackendError

# numpy dtype name -> (Triton language attribute, signature spelling)
_TABLE = {
    "bool": ("int1", "i1"),
    "int8": ("int8", "i8"),
    "int16": ("int16", "i16"),
    "int32": ("int32", "i32"),
    "int64": ("int64", "i64"),
    "uint8": ("uint8", "u8"),
    "uint16": ("uint16", "u16"),
    "uint32": ("uint32", "u32"),
    "uint64": ("uint64", "u64"),
    "float16": ("float16", "fp16"),
    "bfloat16": ("bfloat16", "bf16"),
    "float32": ("float32", "fp32"),
    "float64": ("float64", "fp64"),
    "float8_e4m3fn": ("float8e4nv", "fp8e4nv"),
    "float8_e5m2": ("float8e5", "fp8e5"),
    "float8_e4m3fnuz": ("float8e4b8", "fp8e4b8"),
    "float8_e5m2fnuz": ("float8e5b16", "fp8e5b16"),
}

# Floating types whose arithmetic is done in float32 and rounded back, as XLA
# does on CPU (and as Triton requires for its math functions).
LOW_PRECISION_FLOATS = frozenset({
    "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz"})


def _entry(dtype, kernel: str | None = None):
  name = np.dtype(dtype).name
  if name not in _TABLE:
    raise BackendError(kernel, f"dtype {name} has no Triton equivalent")
  return _TABLE[name]


def tl_type(dtype) -> str:
  """Source spelling, e.g. `tl.float32`."""
  return "tl." + _entry(dtype)[0]


def signature(dtype) -> str:
  """Signature spelling of a scalar type, e.g. `fp32` (pointer: `*fp32`)."""
  return _entry(dtype)[1]


def from_tl(tl_dtype) -> np.dtype:
  """The JAX (numpy) dtype of a `triton.language` dtype object."""
  import jax.numpy as jnp
  import triton.language as tl
  for name, (attr, _) in _TABLE.items():
    if getattr(tl, attr) == tl_dtype:
      return np.dtype(getattr(jnp, name))
  raise ValueError(f"no JAX dtype for Triton's {tl_dtype}")


def tl_object(dtype):
  """The `triton.language` dtype object (used by the interpreter launch)."""
  import triton.language as tl
  return getattr(tl, _entry(dtype)[0])


def is_low_float(dtype) -> bool:
  return np.dtype(dtype).name in LOW_PRECISION_FLOATS


def compute_dtype(dtype):
  """The dtype arithmetic on `dtype` is carried out in."""
  return np.dtype(np.float32) if is_low_float(dtype) else np.dtype(dtype)


def min_value(dtype):
  if is_float(dtype):
    return float("-inf")
  if is_bool(dtype):
    return False
  return int(np.iinfo(np.dtype(dtype)).min)


def max_value(dtype):
  if is_float(dtype):
    return float("inf")
  if is_bool(dtype):
    return True
  return int(np.iinfo(np.dtype(dtype)).max)
