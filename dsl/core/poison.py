"""Poison: what memory that nothing defined holds, as the host backends show it.

On a GPU or TPU, the part of an edge block past its array, a fresh scratch
buffer and the masked-off lanes of a load without `other` hold whatever was
in that memory. The host backends fill them with *poison* instead, a value
chosen so that a kernel that uses it gives a visibly wrong answer on the CPU
rather than the right answer by luck (zeros would make a sum over padding
correct):

- floats: NaN (it survives every arithmetic operation and reduction);
- signed integers: the dtype's minimum plus one (-2**31 + 1 for int32);
- unsigned integers: the dtype's maximum (all bits set);
- bool: True.

Integers take an odd value so that no small number of poison elements
cancels in a sum: the minimum itself is even, and in two's complement two of
them add up to 0 (`INT_MIN + INT_MIN == 0`), so a block with an even number
of padding elements would sum to the right answer; and the unsigned minimum
is 0, which hides everything. An odd value `p` gives `k * p == 0` (mod 2**bits)
only for `k` a multiple of 2**bits. The signed value is still below any
ordinary data (a `min` over padding shows it) and its negation does not wrap;
the unsigned one shows in a `max`.

Every host backend (`interpret`, `triton_interpret`, `mosaic_interpret`) and
the Mosaic interpreter's own poison (a shift or cast out of range) use
`poison_value`.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dsl.core.semaphores import is_semaphore_aval


def poison_value(dtype):
  """The poison of `dtype` as a Python scalar (see the module docstring)."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return True
  if np.issubdtype(dtype, np.integer):
    info = np.iinfo(dtype)
    return int(info.max) if info.min == 0 else int(info.min) + 1
  return float("nan")


def poison_full(shape, dtype):
  """A jax array of `shape` filled with the poison of `dtype`."""
  return jnp.full(shape, poison_value(dtype), dtype)


def fresh_buffer(aval, poison: bool, lead: tuple[int, ...] = ()):
  """The initial value of a scratch buffer or `run_scoped` allocation of ref
  aval `aval` (with `lead` extra leading dims): poison with `poison`
  (jax_pallas_poison_buffers), zeros otherwise; semaphores always start at
  zero."""
  inner = getattr(aval, "inner_aval", aval)
  if not hasattr(inner, "shape"):
    raise NotImplementedError(f"cannot allocate a buffer of {aval}")
  shape = tuple(lead) + tuple(inner.shape)
  if poison and not is_semaphore_aval(aval):
    return poison_full(shape, inner.dtype)
  return jnp.zeros(shape, inner.dtype)
