"""Values of the generated kernel: tensors and scalars named in the source.

Triton needs power-of-two tensor shapes. A value keeps the *logical* shape
the kernel jaxpr gives it; its tensor in the generated source has the
*padded* shape, each dim rounded up to a power of two. Lanes beyond the
logical extent hold unspecified values: every operation that could let them
leak (reductions, dots, gathers, stores) masks them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from lowering_triton import triton_dtypes as dtypes


def pow2(n: int) -> int:
  n = int(n)
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


def padded(shape) -> tuple[int, ...]:
  return tuple(pow2(d) for d in shape)


# Triton's limit on the elements of one tensor.
MAX_NUMEL = 1 << 20


@dataclasses.dataclass(frozen=True)
class TVal:
  """A tensor (or scalar, shape ()) value in the generated source."""
  expr: str                       # a name, or an expression for literals
  shape: tuple[int, ...]          # logical shape
  dtype: np.dtype
  literal: Any = None             # the Python scalar when a known constant
  bool_source: "TVal | None" = None   # set when this int came from a bool

  @property
  def padded_shape(self) -> tuple[int, ...]:
    return padded(self.shape)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def is_literal(self) -> bool:
    return self.literal is not None

  def __str__(self):
    return self.expr


def py_literal(value, dtype) -> str:
  """Python source for a scalar constant."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return "True" if bool(value) else "False"
  if dtypes.is_float(dtype):
    v = float(value)
    if math.isnan(v):
      return "float('nan')"
    if math.isinf(v):
      return "float('inf')" if v > 0 else "float('-inf')"
    return repr(v)
  return str(int(value))


def literal_value(value, dtype) -> TVal:
  """A scalar constant. Its `expr` is a typed Triton tensor expression."""
  dtype = np.dtype(dtype)
  v = np.asarray(value).astype(dtype).item() if dtype.name != "bfloat16" else (
      float(np.asarray(value).astype(dtype)))
  if dtypes.is_float(dtype):
    v = float(v)
  elif dtype == np.bool_:
    v = bool(v)
  else:
    v = int(v)
  return TVal(full_expr((), v, dtype), (), dtype, literal=v)


def full_expr(shape, value, dtype) -> str:
  """`tl.full` of a constant, typed exactly as `dtype` (padded shape)."""
  dtype = np.dtype(dtype)
  shape = tuple(padded(shape))
  lit = py_literal(value, dtype)
  if dtypes.is_low_float(dtype):
    # The interpreter cannot build low-precision constants directly.
    return f"tl.full({shape}, {lit}, tl.float32).to({dtypes.tl_type(dtype)})"
  if dtype == np.bool_:
    return f"tl.full({shape}, {lit}, tl.int1)"
  return f"tl.full({shape}, {lit}, {dtypes.tl_type(dtype)})"


def numel(shape) -> int:
  return int(np.prod(padded(shape), dtype=np.int64)) if shape else 1
