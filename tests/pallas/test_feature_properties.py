"""Property tests: blocked kernels equal their jnp references for random
shapes, dtypes, block sizes and grids (partial edge blocks included), on the
CPU backends that take any block shape (Mosaic needs TPU tiling: the
feature suite, test_features.py, runs it on TPU-legal shapes)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import dsl as pl
from tests.pallas.testing import array, assert_close, hypothesis_settings

SETTINGS = hypothesis_settings(12, derandomize=False)
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.int8]

on_any_block_shape = pytest.mark.parametrize(
    "backend", ("interpret", "triton_interpret"))


@on_any_block_shape
@SETTINGS
@given(m=st.integers(1, 70), n=st.integers(1, 70), bm=st.integers(1, 32),
       bn=st.integers(1, 32), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_blocked_elementwise_2d(m, n, bm, bn, dtype, seed, backend):
  bm, bn = min(bm, m), min(bn, n)
  x = array(seed, (m, n), dtype)
  y = array(seed + 1, (m, n), dtype)

  def kernel(x_ref, y_ref, o_ref):
    a, b = x_ref[...], y_ref[...]
    o_ref[...] = jnp.where(a > b, a * 2, b - a).astype(o_ref.dtype)

  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((m, n), dtype),
      grid=(pl.cdiv(m, bm), pl.cdiv(n, bn)),
      in_specs=[pl.BlockSpec((bm, bn), lambda i, j: (i, j))] * 2,
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      backend=backend)(x, y)
  assert_close(out, jnp.where(x > y, x * 2, y - x), dtype)


@on_any_block_shape
@SETTINGS
@given(m=st.sampled_from([16, 24, 40]), k=st.sampled_from([16, 24, 48]),
       n=st.sampled_from([16, 24]), b=st.sampled_from([8, 16]),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
       seed=st.integers(0, 2**16))
def test_blocked_matmul(m, k, n, b, dtype, seed, backend):
  x = array(seed, (m, k), dtype)
  y = array(seed + 1, (k, n), dtype)

  def kernel(x_ref, y_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    xb, yb = x_ref[...], y_ref[...]
    if k % b:   # the last K block reads past the array: poison, so mask it
      kk = pl.program_id(2) * b + jnp.arange(b)
      xb = jnp.where(kk[None, :] < k, xb, jnp.zeros_like(xb))
      yb = jnp.where(kk[:, None] < k, yb, jnp.zeros_like(yb))
    acc_ref[...] += jnp.dot(xb, yb, preferred_element_type=jnp.float32)
    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
      o_ref[...] = acc_ref[...].astype(o_ref.dtype)

  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((m, n), dtype),
      grid=(pl.cdiv(m, b), pl.cdiv(n, b), pl.cdiv(k, b)),
      in_specs=[pl.BlockSpec((b, b), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((b, b), lambda i, j, kk: (kk, j))],
      out_specs=pl.BlockSpec((b, b), lambda i, j, kk: (i, j)),
      scratch_shapes=[pl.tpu.VMEM((b, b), jnp.float32)], backend=backend)(x, y)
  want = jnp.dot(x, y, preferred_element_type=jnp.float32).astype(dtype)
  assert_close(out, want, dtype if dtype != jnp.float32 else jnp.bfloat16)


@on_any_block_shape
@SETTINGS
@given(rows=st.integers(1, 20), cols=st.integers(1, 64), br=st.integers(1, 8),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.int32]),
       seed=st.integers(0, 2**16))
def test_row_reductions(rows, cols, br, dtype, seed, backend):
  br = min(br, rows)
  x = array(seed, (rows, cols), dtype)

  def kernel(x_ref, s_ref, m_ref, a_ref):
    v = x_ref[...]
    s_ref[...] = jnp.sum(v.astype(jnp.float32), axis=1)
    m_ref[...] = jnp.max(v, axis=1)
    a_ref[...] = jnp.argmin(v, axis=1).astype(jnp.int32)

  s, mx, am = pl.pallas_call(
      kernel, (jax.ShapeDtypeStruct((rows,), jnp.float32),
               jax.ShapeDtypeStruct((rows,), dtype),
               jax.ShapeDtypeStruct((rows,), jnp.int32)),
      grid=(pl.cdiv(rows, br),),
      in_specs=[pl.BlockSpec((br, cols), lambda i: (i, 0))],
      out_specs=[pl.BlockSpec((br,), lambda i: (i,))] * 3,
      backend=backend)(x)
  assert_close(s, jnp.sum(x.astype(jnp.float32), axis=1), jnp.bfloat16)
  assert_close(mx, jnp.max(x, axis=1), dtype)
  np.testing.assert_array_equal(am, jnp.argmin(x, axis=1))


@on_any_block_shape
@SETTINGS
@given(n=st.integers(1, 200), block=st.sampled_from([8, 16, 32, 64]),
       src=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.int32, jnp.bool_]),
       dst=st.sampled_from([jnp.float32, jnp.float16, jnp.int32, jnp.int8]),
       seed=st.integers(0, 2**16))
def test_casts_with_masked_tail(n, block, src, dst, seed, backend):
  x = (array(seed, (n,), jnp.float32) * 3).astype(src)

  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    offs = i * block + jnp.arange(block)
    v = pl.load(x_ref.at[pl.ds(0, block)], mask=offs < n)
    pl.store(o_ref.at[pl.ds(0, block)], v.astype(dst), mask=offs < n)

  block = min(block, n)
  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((n,), dst), grid=(pl.cdiv(n, block),),
      in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
      out_specs=pl.BlockSpec((block,), lambda i: (i,)), backend=backend)(x)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(x.astype(dst)))
