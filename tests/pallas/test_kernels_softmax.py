"""kernels.softmax against jax.nn.softmax: values, gradients, backends."""
import importlib
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, strategies as st

import kernels
from tests.pallas.testing import (KERNEL_GRAD_SETTINGS, KERNEL_SETTINGS,
                                  OTHER_CPU_BACKENDS, array, assert_close,
                                  automatic_vjp_or_xfail, jitted, kernel_dtypes,
                                  run_or_skip, vjp_with)

softmax_mod = importlib.import_module("kernels.softmax")

shapes = st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple)


@KERNEL_SETTINGS
@given(shape=shapes, data=st.data(), dtype=kernel_dtypes,
       block_cols=st.sampled_from([None, 8, 16]),
       block_rows=st.sampled_from([None, 8]))
def test_forward_matches_reference(shape, data, dtype, block_cols, block_rows):
  axis = data.draw(st.integers(-len(shape), len(shape) - 1), label="axis")
  x = array(shape, shape, dtype, scale=3.0)
  f = jax.jit(lambda x: kernels.softmax(x, axis, backend="interpret",
                                        block_rows=block_rows,
                                        block_cols=block_cols))
  assert_close(f(x), jitted(softmax_mod.reference, axis=axis)(x), dtype,
               tol={jnp.bfloat16: 1e-2})


@KERNEL_GRAD_SETTINGS
@given(rows=st.integers(1, 30), cols=st.integers(1, 70),
       block_cols=st.sampled_from([None, 16]))
def test_gradient_matches_reference(rows, cols, block_cols):
  x = array(rows * 100 + cols, (rows, cols), jnp.float32, scale=2.0)
  ct = array(7, (rows, cols), jnp.float32)
  got = jax.jit(lambda x: vjp_with(
      lambda x: kernels.softmax(x, block_cols=block_cols), (x,), ct))(x)
  want = jax.jit(lambda x: vjp_with(softmax_mod.reference, (x,), ct))(x)
  assert_close(got[0], want[0], tol=1e-5)


def test_online_path_masks_the_partial_last_block():
  # 100 columns in blocks of 32: four column blocks, the last one 4 wide.
  x = array(0, (24, 100), jnp.float32, scale=5.0)
  x = x.at[:, 97].set(30.0)          # the max lies in the partial block
  got = kernels.softmax(x, block_cols=32, block_rows=8)
  assert_close(got, jax.nn.softmax(x, axis=-1))
  assert_close(jnp.sum(got, axis=-1), jnp.ones(24))


def test_bf16_gradient():
  x = array(1, (16, 50), jnp.bfloat16, scale=2.0)
  ct = array(2, (16, 50), jnp.bfloat16)
  got = vjp_with(lambda x: kernels.softmax(x, block_cols=16), (x,), ct)
  want = vjp_with(softmax_mod.reference, (x,), ct)
  assert_close(got[0], want[0], jnp.bfloat16, tol=3e-2)


@pytest.mark.parametrize("block_cols", [None, 16])
def test_hand_written_backward_matches_automatic(block_cols):
  x = array(3, (12, 40), jnp.float32, scale=2.0)
  ct = array(4, (12, 40), jnp.float32)
  auto = automatic_vjp_or_xfail(
      lambda x: softmax_mod.softmax_2d(x, block_cols=block_cols), (x,), ct)
  hand = vjp_with(lambda x: kernels.softmax(x, block_cols=block_cols), (x,),
                  ct)
  assert_close(hand[0], auto[0])


def test_default_backend_and_jit_composition():
  x = array(5, (3, 5, 7), jnp.float32)
  f = jax.jit(lambda x: jnp.sum(kernels.softmax(x, axis=1) ** 2))
  assert_close(f(x), jnp.sum(jax.nn.softmax(x, axis=1) ** 2))


@pytest.mark.parametrize("backend", OTHER_CPU_BACKENDS)
def test_other_cpu_backends(backend):
  x = array(6, (16, 256), jnp.float32, scale=3.0)
  got = run_or_skip(lambda x: kernels.softmax(x, backend=backend), x)
  assert_close(got, jax.nn.softmax(x, axis=-1))
  # the online path: column blocks of 128 over rows of 300 (masked tail)
  x = array(8, (16, 300), jnp.float32, scale=3.0)
  got = run_or_skip(lambda x: kernels.softmax(x, backend=backend,
                                              block_cols=128), x)
  assert_close(got, jax.nn.softmax(x, axis=-1))
