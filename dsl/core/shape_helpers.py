"""Small integer and shape helpers with Pallas's names."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def next_power_of_2(x: int) -> int:
  """The smallest power of two >= `x` (1 for 0)."""
  if x < 0:
    raise ValueError("next_power_of_2 is defined for x >= 0 only")
  return 1 if x == 0 else 1 << (int(x) - 1).bit_length()


def align_to(a, alignment):
  """`a` rounded up to a multiple of `alignment` (ints or int arrays)."""
  return (a + alignment - 1) // alignment * alignment


def strides_from_shape(shape) -> tuple[int, ...]:
  """Row-major element strides of an array of `shape`."""
  strides, acc = [], 1
  for d in reversed(tuple(shape)):
    strides.append(acc)
    acc *= d
  return tuple(reversed(strides))


def broadcast_to(a, shape):
  """`jnp.broadcast_to` (every backend lowers the broadcast)."""
  return jnp.broadcast_to(a, tuple(shape))


def empty(shape, dtype, *, out_sharding=None):
  """An array of unspecified values (JAX's `lax.empty`)."""
  return lax.empty(shape, dtype, out_sharding=out_sharding)


def empty_like(x):
  """A pytree like `x` of arrays of unspecified values."""
  return jax.tree.map(lambda leaf: empty(leaf.shape, leaf.dtype), x)


# `in_specs=pl.no_block_spec`: the same as leaving the specs out.
no_block_spec = None
