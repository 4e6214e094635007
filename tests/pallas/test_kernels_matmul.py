"""kernels.matmul (fused bias + activation): values, gradients, backends."""
import importlib
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, strategies as st

import kernels
from tests.pallas.testing import (KERNEL_GRAD_SETTINGS, KERNEL_SETTINGS,
                                  OTHER_CPU_BACKENDS, array, assert_close,
                                  assert_tree_close, automatic_vjp_or_xfail,
                                  kernel_dtypes, run_or_skip, vjp_with)

matmul_mod = importlib.import_module("kernels.matmul")

ACTS = [None, "relu", "gelu", "silu", "tanh"]
BLOCKS = [None, (8, 8, 8), (16, 8, 16)]


def _inputs(m, k, n, dtype, bias, seed=0):
  ks = [(seed, i) for i in range(4)]
  x = array(ks[0], (m, k), dtype)
  y = array(ks[1], (k, n), dtype, scale=1.0 / k ** 0.5)
  b = array(ks[2], (n,), dtype) if bias else None
  ct = array(ks[3], (m, n), dtype)
  return x, y, b, ct


@KERNEL_SETTINGS
@given(m=st.integers(1, 40), k=st.integers(1, 40), n=st.integers(1, 40),
       dtype=kernel_dtypes, bias=st.booleans(),
       activation=st.sampled_from(ACTS), blocks=st.sampled_from(BLOCKS))
def test_forward_matches_reference(m, k, n, dtype, bias, activation, blocks):
  x, y, b, _ = _inputs(m, k, n, dtype, bias, m + k + n)
  f = jax.jit(lambda x, y, b: kernels.matmul(
      x, y, bias=b, activation=activation, backend="interpret",
      block_sizes=blocks))
  want = jax.jit(lambda x, y, b: matmul_mod.reference(
      x, y, bias=b, activation=activation))(x, y, b)
  assert_close(f(x, y, b), want, dtype, tol={jnp.float32: 2e-5})


@KERNEL_GRAD_SETTINGS
@given(m=st.integers(1, 30), k=st.integers(1, 30), n=st.integers(1, 30),
       bias=st.booleans(), activation=st.sampled_from(ACTS),
       blocks=st.sampled_from(BLOCKS))
def test_gradients_match_reference(m, k, n, bias, activation, blocks):
  x, y, b, ct = _inputs(m, k, n, jnp.float32, bias, m * k + n)
  args = (x, y, b)
  got = jax.jit(lambda *a: vjp_with(
      lambda x, y, b: kernels.matmul(x, y, bias=b, activation=activation,
                                     block_sizes=blocks), a, ct))(*args)
  want = jax.jit(lambda *a: vjp_with(lambda x, y, b: matmul_mod.reference(
      x, y, bias=b, activation=activation), a, ct))(*args)
  assert_tree_close(got, want, tol=1e-4)


def test_bf16_gradients_and_leading_dims():
  x, y, b, _ = _inputs(24, 20, 12, jnp.bfloat16, True, 1)
  x = x.reshape(2, 12, 20)
  ct = array(9, (2, 12, 12), jnp.bfloat16)
  got = vjp_with(lambda x, y, b: kernels.matmul(
      x, y, bias=b, activation="gelu", block_sizes=(8, 8, 8)), (x, y, b), ct)
  want = vjp_with(lambda x, y, b: matmul_mod.reference(
      x, y, bias=b, activation="gelu"), (x, y, b), ct)
  assert_tree_close(got, want, jnp.bfloat16, tol=5e-2)


def test_callable_activation_and_partial_k_block():
  x, y, b, ct = _inputs(20, 37, 9, jnp.float32, True, 2)
  act = lambda z: z * jax.nn.sigmoid(2.0 * z)
  got = kernels.matmul(x, y, bias=b, activation=act, block_sizes=(8, 8, 16))
  assert_close(got, act(x @ y + b), tol=2e-5)


def test_hand_written_backward_matches_automatic():
  x, y, b, ct = _inputs(20, 24, 16, jnp.float32, True, 3)
  raw = lambda x, y, b: matmul_mod.matmul_2d(
      x, y, b, activation="gelu", blocks=(8, 8, 8))
  auto = automatic_vjp_or_xfail(raw, (x, y, b), ct)
  hand = vjp_with(lambda x, y, b: kernels.matmul(
      x, y, bias=b, activation="gelu", block_sizes=(8, 8, 8)), (x, y, b), ct)
  assert_tree_close(hand, auto, tol=1e-4)


@pytest.mark.parametrize("backend", ["interpret", "triton", "triton_interpret",
                                     "mosaic", "mosaic_interpret"])
def test_block_sizes_per_backend_fit_the_array(backend):
  for m, n, k in [(1, 1, 1), (5, 300, 7), (1000, 1000, 1000), (4096, 96, 8192)]:
    bm, bn, bk = matmul_mod.block_sizes(m, n, k, backend)
    assert 1 <= bm <= m and 1 <= bn <= n and 1 <= bk <= k
    if backend.startswith("triton"):
      assert all(b & (b - 1) == 0 for b in (bm, bn, bk))
  # the CPU interpreter prefers whole, exactly dividing blocks
  assert matmul_mod.block_sizes(512, 384, 1000, "interpret") == (512, 384,
                                                                     1000)


@pytest.mark.parametrize("backend", OTHER_CPU_BACKENDS)
def test_other_cpu_backends(backend):
  x, y, b, _ = _inputs(32, 128, 128, jnp.float32, True, 4)
  got = run_or_skip(lambda x, y, b: kernels.matmul(
      x, y, bias=b, activation="relu", backend=backend), x, y, b)
  assert_close(got, matmul_mod.reference(x, y, bias=b, activation="relu"),
               tol=2e-5)
  # partial blocks in every dim, and the backward products
  x, y, b, ct = _inputs(40, 136, 72, jnp.float32, True, 5)
  fn = lambda x, y, b: kernels.matmul(x, y, bias=b, activation="gelu",
                                      backend=backend)
  got = run_or_skip(lambda *a: vjp_with(fn, a, ct), x, y, b)
  want = vjp_with(lambda x, y, b: matmul_mod.reference(
      x, y, bias=b, activation="gelu"), (x, y, b), ct)
  assert_tree_close(got, want, tol=1e-4)
