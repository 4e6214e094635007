"""kernels.layer_norm and kernels.rms_norm: values, gradients, backends."""
import importlib
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, strategies as st

import kernels
from tests.pallas.testing import (KERNEL_GRAD_SETTINGS, KERNEL_SETTINGS,
                                  OTHER_CPU_BACKENDS, array, assert_close,
                                  assert_tree_close, automatic_vjp_or_xfail,
                                  jitted, kernel_dtypes, run_or_skip, vjp_with)

layer_norm_mod = importlib.import_module("kernels.layer_norm")
rms_norm_mod = importlib.import_module("kernels.rms_norm")

lead_shapes = st.lists(st.integers(1, 9), min_size=0, max_size=2).map(tuple)


def _inputs(lead, d, dtype, seed=0):
  k = [(seed, i) for i in range(4)]
  x = array(k[0], (*lead, d), dtype, scale=2.0, shift=0.5)
  w = array(k[1], (d,), dtype, scale=0.2, shift=1.0)
  b = array(k[2], (d,), dtype, scale=0.2)
  ct = array(k[3], (*lead, d), dtype)
  return x, w, b, ct


@KERNEL_SETTINGS
@given(lead=lead_shapes, d=st.integers(1, 80), dtype=kernel_dtypes,
       block_rows=st.sampled_from([None, 1, 4]))
def test_layer_norm_forward(lead, d, dtype, block_rows):
  x, w, b, _ = _inputs(lead, d, dtype, d)
  f = jax.jit(lambda x, w, b: kernels.layer_norm(
      x, w, b, backend="interpret", block_rows=block_rows))
  assert_close(f(x, w, b), jitted(layer_norm_mod.reference)(x, w, b), dtype,
               tol={jnp.float32: 2e-5})


@KERNEL_SETTINGS
@given(lead=lead_shapes, d=st.integers(1, 80), dtype=kernel_dtypes,
       block_rows=st.sampled_from([None, 1, 4]))
def test_rms_norm_forward(lead, d, dtype, block_rows):
  x, w, _, _ = _inputs(lead, d, dtype, d)
  f = jax.jit(lambda x, w: kernels.rms_norm(x, w, backend="interpret",
                                            block_rows=block_rows))
  assert_close(f(x, w), jitted(rms_norm_mod.reference)(x, w), dtype,
               tol={jnp.float32: 2e-5})


@KERNEL_GRAD_SETTINGS
@given(rows=st.integers(1, 30), d=st.integers(2, 64),
       block_rows=st.sampled_from([None, 8]), dtype=kernel_dtypes)
def test_layer_norm_gradients(rows, d, block_rows, dtype):
  x, w, b, ct = _inputs((rows,), d, dtype, rows + d)
  got = jax.jit(lambda *a: vjp_with(
      lambda x, w, b: kernels.layer_norm(x, w, b, block_rows=block_rows),
      a, ct))(x, w, b)
  want = jax.jit(lambda *a: vjp_with(layer_norm_mod.reference, a, ct))(x, w, b)
  assert_tree_close(got, want, dtype,
                    tol={jnp.float32: 1e-4, jnp.bfloat16: 5e-2})


@KERNEL_GRAD_SETTINGS
@given(rows=st.integers(1, 30), d=st.integers(2, 64),
       block_rows=st.sampled_from([None, 8]), dtype=kernel_dtypes)
def test_rms_norm_gradients(rows, d, block_rows, dtype):
  x, w, _, ct = _inputs((rows,), d, dtype, rows + d)
  got = jax.jit(lambda *a: vjp_with(
      lambda x, w: kernels.rms_norm(x, w, block_rows=block_rows),
      a, ct))(x, w)
  want = jax.jit(lambda *a: vjp_with(rms_norm_mod.reference, a, ct))(x, w)
  assert_tree_close(got, want, dtype,
                    tol={jnp.float32: 1e-4, jnp.bfloat16: 5e-2})


def test_leading_dims_and_none_weights():
  x, w, b, ct = _inputs((2, 3), 24, jnp.float32)
  assert_close(kernels.layer_norm(x, None, None),
               layer_norm_mod.reference(x, None, None))
  assert_close(kernels.rms_norm(x, None), rms_norm_mod.reference(x, None))
  g = jax.grad(lambda x: jnp.sum(kernels.layer_norm(x, None, None) * ct))(x)
  assert_close(g, jax.grad(
      lambda x: jnp.sum(layer_norm_mod.reference(x, None, None) * ct))(x), tol=1e-4)


@pytest.mark.parametrize("block_rows", [None, 8])
def test_layer_norm_hand_written_backward_matches_automatic(block_rows):
  x, w, b, ct = _inputs((21,), 40, jnp.float32, 3)

  def raw(x, w, b):
    return layer_norm_mod.forward(x, w, b, eps=1e-5, block_rows=block_rows)[0]

  auto = automatic_vjp_or_xfail(raw, (x, w, b), ct)
  hand = vjp_with(lambda x, w, b: kernels.layer_norm(
      x, w, b, block_rows=block_rows), (x, w, b), ct)
  assert_tree_close(hand, auto, tol=1e-4)


@pytest.mark.parametrize("block_rows", [None, 8])
def test_rms_norm_hand_written_backward_matches_automatic(block_rows):
  x, w, _, ct = _inputs((21,), 40, jnp.float32, 4)

  def raw(x, w):
    return rms_norm_mod.forward(x, w, eps=1e-6, block_rows=block_rows)[0]

  auto = automatic_vjp_or_xfail(raw, (x, w), ct)
  hand = vjp_with(lambda x, w: kernels.rms_norm(x, w, block_rows=block_rows),
                  (x, w), ct)
  assert_tree_close(hand, auto, tol=1e-4)


@pytest.mark.parametrize("backend", OTHER_CPU_BACKENDS)
def test_other_cpu_backends(backend):
  x, w, b, _ = _inputs((16,), 256, jnp.float32, 5)
  got = run_or_skip(lambda x, w, b: kernels.layer_norm(
      x, w, b, backend=backend), x, w, b)
  assert_close(got, layer_norm_mod.reference(x, w, b), tol=2e-5)
  got = run_or_skip(lambda x, w: kernels.rms_norm(x, w, backend=backend), x, w)
  assert_close(got, rms_norm_mod.reference(x, w), tol=2e-5)


@pytest.mark.parametrize("backend", OTHER_CPU_BACKENDS)
def test_other_cpu_backends_backward(backend):
  x, w, b, ct = _inputs((24,), 128, jnp.float32, 6)
  got = run_or_skip(lambda *a: vjp_with(lambda x, w, b: kernels.layer_norm(
      x, w, b, backend=backend), a, ct), x, w, b)
  assert_tree_close(got, vjp_with(layer_norm_mod.reference, (x, w, b), ct), tol=1e-4)
  got = run_or_skip(lambda *a: vjp_with(lambda x, w: kernels.rms_norm(
      x, w, backend=backend), a, ct), x, w)
  assert_tree_close(got, vjp_with(rms_norm_mod.reference, (x, w), ct), tol=1e-4)


def test_vmap_of_forward_and_gradient():
  x, w, b, _ = _inputs((3, 10), 16, jnp.float32, 7)
  grad = lambda f: jax.vmap(jax.grad(lambda x: jnp.sum(f(x) ** 3)))
  ln = lambda x: kernels.layer_norm(x, w, b)
  ln_ref = lambda x: layer_norm_mod.reference(x, w, b)
  assert_close(jax.vmap(ln)(x), ln_ref(x), tol=2e-5)
  assert_close(grad(ln)(x), grad(ln_ref)(x), tol=1e-4)
  rms = lambda x: kernels.rms_norm(x, w)
  assert_close(grad(rms)(x), grad(lambda x: rms_norm_mod.reference(x, w))(x),
               tol=1e-4)
