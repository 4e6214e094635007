"""Recipes the lowerings share (dsl/core/rule_helpers.py), and the rules built on
them on every CPU backend."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl.core.rule_helpers import power_by_squaring
from tests.pallas.testing import CPU_BACKENDS


def test_power_by_squaring_counts_multiplications():
  calls = []

  def mul(a, b):
    calls.append("mul")
    return a * b

  def square(b):
    calls.append("square")
    return b * b
  assert power_by_squaring(3, 13, mul, square) == 3 ** 13
  assert calls.count("square") == 3 and calls.count("mul") == 2
  assert all(power_by_squaring(2, n, lambda a, b: a * b) == 2 ** n
             for n in range(1, 70))
  with pytest.raises(ValueError):
    power_by_squaring(2, 0, lambda a, b: a * b)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("y", [0, 1, 2, 5, 7, -3])
def test_integer_pow(backend, y):
  x = jnp.linspace(0.5, 1.5, 8 * 128, dtype=jnp.float32).reshape(8, 128)

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] ** y
  got = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                       backend=backend)(x)
  np.testing.assert_allclose(got, x ** y, rtol=1e-5)
