"""Dtype predicates shared by the transformations and every lowering."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def is_float(dtype) -> bool:
  """A real floating-point dtype (f16, bf16, f32, f64, f8 variants)."""
  return jnp.issubdtype(jnp.dtype(dtype), jnp.floating)


def has_tangent(dtype) -> bool:
  """A dtype that carries tangents and cotangents (floating or complex)."""
  return jnp.issubdtype(jnp.dtype(dtype), jnp.inexact)


def is_int(dtype) -> bool:
  return jnp.issubdtype(jnp.dtype(dtype), jnp.integer)


def is_unsigned(dtype) -> bool:
  return jnp.issubdtype(jnp.dtype(dtype), jnp.unsignedinteger)


def is_bool(dtype) -> bool:
  return np.dtype(dtype) == np.bool_


def bits(dtype) -> int:
  """The width of one element in bits (1 for bool)."""
  return 1 if is_bool(dtype) else np.dtype(dtype).itemsize * 8
