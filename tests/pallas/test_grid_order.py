"""The CPU backends run a grid in the order a TPU runs it: scratch carries
from one grid point to the next in row-major order, unless the kernel
provably starts it afresh (the accumulator reset at `program_id(k) == 0`),
so interpret's vectorization over grid points never changes a result."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl import tpu as pltpu
from dsl.core.grid_plan import make_plan
from dsl.core.inspection import kernel_specs

M = K = N = 256
B = 128


def _matmul(reset):
  def kernel(x_ref, y_ref, o_ref, acc_ref):
    i, j, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(reset(i, j, k))
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...],
                            preferred_element_type=jnp.float32)
    o_ref[...] = acc_ref[...].astype(o_ref.dtype)
  return kernel


RIGHT = lambda i, j, k: k == 0                                  # noqa: E731
WRONG = lambda i, j, k: (i == 0) & (j == 0) & (k == 0)          # noqa: E731


def _call(kernel, backend, x, y, **kw):
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32),
      grid=(M // B, N // B, K // B),
      in_specs=[pl.BlockSpec((B, B), lambda i, j, k: (i, k)),
                pl.BlockSpec((B, B), lambda i, j, k: (k, j))],
      out_specs=pl.BlockSpec((B, B), lambda i, j, k: (i, j)),
      scratch_shapes=[pltpu.VMEM((B, B), jnp.float32)], backend=backend,
      **kw)(x, y)


def _inputs(seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return (jax.random.normal(k1, (M, K), jnp.float32),
          jax.random.normal(k2, (K, N), jnp.float32))


def _tpu_order(x, y):
  """What a TPU computes for the WRONG kernel: the accumulator carries from
  each (i, j) to the next in row-major order."""
  out = np.zeros((M, N), np.float32)
  acc = np.zeros((B, B), np.float32)
  xs, ys = np.asarray(x), np.asarray(y)
  for i in range(M // B):
    for j in range(N // B):
      for k in range(K // B):
        acc = acc + xs[i*B:(i+1)*B, k*B:(k+1)*B] @ ys[k*B:(k+1)*B, j*B:(j+1)*B]
        out[i*B:(i+1)*B, j*B:(j+1)*B] = acc
  return out


@pytest.mark.parametrize("backend", ["interpret", "mosaic_interpret"])
def test_a_carried_accumulator_follows_the_tpu_order(backend):
  x, y = _inputs()
  got = _call(_matmul(WRONG), backend, x, y)
  np.testing.assert_allclose(got, _tpu_order(x, y), rtol=1e-4, atol=1e-3)
  assert not np.allclose(got, x @ y, atol=1e-2)


def test_interpret_and_mosaic_interpret_agree_on_carried_scratch():
  for seed, reset in enumerate([RIGHT, WRONG, lambda i, j, k: j + k == 0,
                                lambda i, j, k: i == 0]):
    x, y = _inputs(seed)
    a = _call(_matmul(reset), "interpret", x, y)
    b = _call(_matmul(reset), "mosaic_interpret", x, y)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)


def test_a_reset_accumulator_stays_vectorized():
  x, y = _inputs()
  np.testing.assert_allclose(_call(_matmul(RIGHT), "interpret", x, y),
                             x @ y, rtol=1e-4, atol=1e-3)
  assert [p.parallel for p in _plans(_matmul(RIGHT), x, y)] == [(0, 1)]
  assert [p.parallel for p in _plans(_matmul(WRONG), x, y)] == [()]


def _plans(kernel, x, y):
  jaxpr = jax.make_jaxpr(lambda a, b: _call(kernel, "interpret", a, b))(x, y)
  return [make_plan(s.grid_mapping, s.compiler_params, s.jaxpr)
          for s, _ in kernel_specs(jaxpr.jaxpr)]
