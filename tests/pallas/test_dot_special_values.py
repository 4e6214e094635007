"""16-bit dots accumulated in f32 whose operands hold inf, NaN, the largest
finite values (f16) and -0.0: every CPU backend gives jnp's answer (inf where jnp
has inf, NaN only where jnp has NaN). Triton pads small dots (M, N < 16)
with zero copies of the operands, whose products with inf are NaN; they
must not reach the result."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as jpl

import dsl
from lowering_triton import aot
from tests.pallas.testing import CPU_BACKENDS


def special_block(shape, dtype, seed):
  # f16's largest value squared fits f32; bf16's would overflow the f32
  # accumulator, whose sums of +inf and -inf then depend on the order.
  big = float(jnp.finfo(dtype).max) if dtype == jnp.float16 else 2.0 ** 40
  r = np.random.default_rng(seed)
  x = r.integers(-3, 4, shape).astype(np.float32)
  picks = [np.inf, -np.inf, big, -big, np.nan, -0.0]
  for p in picks:
    x[tuple(r.integers(0, n) for n in shape)] = p
  x[0, 0] = np.inf                 # row 0 holds inf and zeros
  x[0, 1:] = 0.0
  x[1, :] = big                    # a row that overflows to inf in f32 sums
  return jnp.asarray(x, dtype)


def gram_kernel(x_ref, o_ref):
  v = x_ref[...]
  o_ref[...] = lax.dot_general(v, v, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)


def matmul_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = jnp.dot(x_ref[...], y_ref[...],
                       preferred_element_type=jnp.float32)


def _same(got, want):
  got, want = np.asarray(got), np.asarray(want)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  np.testing.assert_array_equal(np.isinf(got) & (got > 0),
                                np.isinf(want) & (want > 0))
  np.testing.assert_array_equal(np.isinf(got) & (got < 0),
                                np.isinf(want) & (want < 0))
  finite = np.isfinite(want)
  np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(6, 16), (8, 128), (16, 32)])
def test_gram_with_special_values(backend, dtype, shape):
  x = special_block(shape, dtype, hash(shape) % 1000)
  out = jax.ShapeDtypeStruct((shape[0], shape[0]), jnp.float32)
  want = lax.dot_general(x, x, (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)
  try:
    got = dsl.pallas_call(gram_kernel, out, backend=backend)(x)
  except dsl.KernelError as e:      # Mosaic's tiling of 16-bit blocks
    assert backend == "mosaic_interpret", e
    return
  _same(got, want)
  _same(got, jpl.pallas_call(gram_kernel, out, interpret=True)(x))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("m,k,n", [(4, 16, 8), (8, 16, 128), (32, 64, 16)])
def test_small_matmul_with_special_values(backend, m, k, n):
  x = special_block((m, k), jnp.float16, m)
  y = special_block((n, k), jnp.float16, n).T
  out = jax.ShapeDtypeStruct((m, n), jnp.float32)
  want = jnp.dot(x, y, preferred_element_type=jnp.float32)
  try:
    got = dsl.pallas_call(matmul_kernel, out, backend=backend)(x, y)
  except dsl.KernelError as e:
    assert backend == "mosaic_interpret", e
    return
  _same(got, want)


def test_small_padded_dot_compiles_for_the_gpu():
  x = jax.ShapeDtypeStruct((6, 16), jnp.float16)
  f = dsl.pallas_call(gram_kernel, jax.ShapeDtypeStruct((6, 6), jnp.float32),
                      backend="triton")
  (k,) = aot.compile_aot(f, x)
  assert "mma" in k.ptx
