"""Triton-flavoured kernel API (mirrors the names of Pallas's GPU module)."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from dsl.core.compiler_params import CompilerParams as BaseCompilerParams
from dsl.core.primitives import max_contiguous, multiple_of
from dsl.core.ref_ops import (atomic_add, atomic_and, atomic_cas, atomic_max,
                              atomic_min, atomic_or, atomic_xchg, atomic_xor,
                              load, store)


@dataclasses.dataclass(frozen=True)
class CompilerParams(BaseCompilerParams):
  """Triton launch parameters."""
  num_warps: int | None = None
  num_stages: int | None = None
  num_ctas: int = 1
  enable_fp_fusion: bool = True


def dot(a, b, trans_a: bool = False, trans_b: bool = False,
        allow_tf32: bool | None = None, precision=None):
  """Matrix product of two blocks, accumulated in f32 (i32 for ints)."""
  if trans_a:
    a = a.T
  if trans_b:
    b = b.T
  acc = jnp.int32 if jnp.issubdtype(a.dtype, jnp.integer) else jnp.float32
  if precision is None and allow_tf32 is False:
    precision = lax.Precision.HIGHEST
  return jnp.dot(a, b, precision=precision, preferred_element_type=acc)


def approx_tanh(x):
  """tanh(x); exact here (Pallas uses the GPU's approximate instruction)."""
  return jnp.tanh(x)


__all__ = ["approx_tanh", "CompilerParams", "load", "store", "dot", "max_contiguous",
           "multiple_of", "atomic_add", "atomic_max", "atomic_min",
           "atomic_and", "atomic_or", "atomic_xor", "atomic_xchg",
           "atomic_cas"]
