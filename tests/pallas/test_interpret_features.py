"""Features of the core DSL, each against a plain jax.numpy reference."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl import triton as plt
from dsl import tpu as pltpu


def _close(a, b, tol=1e-5):
  np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                             rtol=tol, atol=tol)


def add_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = x_ref[...] + y_ref[...]


def blocked_add(x, y, block=128):
  return pl.pallas_call(
      add_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(pl.cdiv(x.shape[0], block),),
      in_specs=[pl.BlockSpec((block,), lambda i: (i,))] * 2,
      out_specs=pl.BlockSpec((block,), lambda i: (i,)))(x, y)


@pytest.mark.parametrize("n", [128, 1000, 4096])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_add_partial_edge_blocks(n, dtype):
  x = jnp.arange(n).astype(dtype)
  y = (2 * jnp.arange(n)).astype(dtype)
  _close(jax.jit(blocked_add)(x, y), x + y)


def matmul_kernel(x_ref, y_ref, o_ref, *, k):
  @pl.when(pl.program_id(2) == 0)
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)
  x, y = x_ref[...], y_ref[...]
  bk = x.shape[1]
  if k % bk:   # the last K block reads past the array: poison, so mask it
    kk = pl.program_id(2) * bk + jnp.arange(bk)
    x = jnp.where(kk[None, :] < k, x, 0.0)
    y = jnp.where(kk[:, None] < k, y, 0.0)
  o_ref[...] += jnp.dot(x, y,
                        preferred_element_type=jnp.float32).astype(o_ref.dtype)


def matmul(x, y, bm=32, bn=32, bk=32):
  m, k = x.shape
  n = y.shape[1]
  return pl.pallas_call(
      functools.partial(matmul_kernel, k=k),
      jax.ShapeDtypeStruct((m, n), jnp.float32),
      grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), pl.cdiv(k, bk)),
      in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)))(x, y)


@pytest.mark.parametrize("shape", [(64, 64, 64), (96, 64, 128), (100, 70, 50)])
def test_matmul_revisits_output_block(shape):
  m, k, n = shape
  x = jax.random.normal(jax.random.key(0), (m, k))
  y = jax.random.normal(jax.random.key(1), (k, n))
  _close(jax.jit(matmul)(x, y), x @ y, 1e-4)


def test_column_sums_revisit_with_outer_sequential_dim():
  # grid (rows, cols): the output block depends only on cols; rows revisit.
  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += jnp.sum(x_ref[...], axis=0)
  x = jax.random.normal(jax.random.key(2), (64, 48))
  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((48,), jnp.float32), grid=(4, 3),
      in_specs=[pl.BlockSpec((16, 16), lambda i, j: (i, j))],
      out_specs=pl.BlockSpec((16,), lambda i, j: (j,)))(x)
  _close(out, x.sum(0), 1e-4)


def test_squeezed_dims_and_2d_grid():
  def kernel(x_ref, o_ref):
    assert x_ref.shape == (8,)
    o_ref[...] = x_ref[...] * (pl.program_id(0) + 10 * pl.program_id(1))
  x = jnp.ones((4, 3, 8))
  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((4, 3, 8), jnp.float32), grid=(4, 3),
      in_specs=[pl.BlockSpec((None, pl.Squeezed, 8), lambda i, j: (i, j, 0))],
      out_specs=pl.BlockSpec((None, None, 8), lambda i, j: (i, j, 0)))(x)
  want = (jnp.arange(4)[:, None, None] + 10 * jnp.arange(3)[None, :, None]) * x
  _close(out, want)


def test_transposed_index_map_gathers():
  # out block (i, j) reads x block (j, i): not a one-to-one view.
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...].T
  x = jnp.arange(32 * 48, dtype=jnp.float32).reshape(32, 48)
  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((48, 32), jnp.float32), grid=(3, 2),
      in_specs=[pl.BlockSpec((16, 16), lambda i, j: (j, i))],
      out_specs=pl.BlockSpec((16, 16), lambda i, j: (i, j)))(x)
  _close(out, x.T)


def test_reversed_index_map():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...][::-1]
  x = jnp.arange(64.)
  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((64,), jnp.float32), grid=(4,),
      in_specs=[pl.BlockSpec((16,), lambda i: (3 - i,))],
      out_specs=pl.BlockSpec((16,), lambda i: (i,)))(x)
  _close(out, x[::-1])


def test_no_specs_whole_array_and_multiple_outputs():
  def kernel(x_ref, s_ref, m_ref):
    s_ref[...] = jnp.sum(x_ref[...], keepdims=True)
    m_ref[...] = jnp.max(x_ref[...], axis=1)
  x = jax.random.normal(jax.random.key(3), (8, 16))
  s, m = pl.pallas_call(kernel, (jax.ShapeDtypeStruct((1, 1), jnp.float32),
                                 jax.ShapeDtypeStruct((8,), jnp.float32)))(x)
  _close(s, x.sum(keepdims=True), 1e-4)
  _close(m, x.max(1))


def test_zero_d_refs_and_int_dtypes():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 3 + 1
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((), jnp.int32))(
      jnp.int32(5))
  assert int(out) == 16


def test_pytree_operands_and_out_shape():
  def kernel(d, o):
    o["s"][...] = d["a"][...] + d["b"][...]
  a, b = jnp.arange(8.), jnp.ones(8)
  out = pl.pallas_call(
      kernel, {"s": jax.ShapeDtypeStruct((8,), jnp.float32)})({"a": a, "b": b})
  _close(out["s"], a + b)


def test_fori_loop_ds_and_at_views():
  def kernel(x_ref, o_ref):
    def body(k, carry):
      o_ref[pl.ds(k * 4, 4)] = x_ref.at[pl.ds(k * 4, 4)][...] * k
      return carry
    jax.lax.fori_loop(0, 4, body, 0)
  x = jnp.ones(16)
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((16,), jnp.float32))(x)
  _close(out, jnp.repeat(jnp.arange(4.), 4))


def test_loop_cond_while_and_casts():
  def kernel(x_ref, o_ref):
    @pl.loop(0, 3)
    def _(i):
      o_ref[i] = jax.lax.cond(i % 2 == 0, lambda: x_ref[i] * 2.0,
                              lambda: x_ref[i].astype(jnp.bfloat16).astype(
                                  jnp.float32))
    n = jax.lax.while_loop(lambda c: c < 10, lambda c: c + 3, 0)
    o_ref[3] = jnp.float32(n)
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((4,), jnp.float32))(
      jnp.array([1., 2., 3., 4.]))
  _close(out, [2., 2., 6., 12.])


def test_scratch_accumulator_persists_over_sequential_steps():
  def kernel(x_ref, o_ref, acc_ref):
    k = pl.program_id(1)
    @pl.when(k == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += x_ref[...]
    @pl.when(k == pl.num_programs(1) - 1)
    def _():
      o_ref[...] = acc_ref[...]
  x = jax.random.normal(jax.random.key(4), (16, 64))
  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((16, 8), jnp.float32), grid=(2, 8),
      in_specs=[pl.BlockSpec((8, 8), lambda i, k: (i, k))],
      out_specs=pl.BlockSpec((8, 8), lambda i, k: (i, 0)),
      scratch_shapes=[pltpu.VMEM((8, 8), jnp.float32)])(x)
  _close(out, x.reshape(16, 8, 8).sum(1), 1e-4)


def test_input_output_aliases():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1
  x = jnp.arange(8.)
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                       input_output_aliases={0: 0})(x)
  _close(out, x + 1)


def test_aliased_output_keeps_unwritten_blocks():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 0 - 1
  x = jnp.arange(32.)
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((32,), jnp.float32),
                       grid=(1,),
                       in_specs=[pl.BlockSpec((8,), lambda i: (1,))],
                       out_specs=pl.BlockSpec((8,), lambda i: (1,)),
                       input_output_aliases={0: 0})(x)
  _close(out, x.at[8:16].set(-1))


def test_masked_load_store():
  def kernel(x_ref, o_ref):
    offs = jnp.arange(16)
    mask = offs < 10
    x = plt.load(x_ref.at[pl.ds(0, 16)], mask=mask, other=-1.0)
    plt.store(o_ref.at[pl.ds(0, 16)], x * 2, mask=offs % 2 == 0)
  x = jnp.arange(16.)
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((16,), jnp.float32),
                       input_output_aliases={})(x)
  offs = np.arange(16)
  want = np.where(offs % 2 == 0, np.where(offs < 10, np.arange(16.), -1) * 2, 0)
  _close(out, want)


def test_atomic_histogram_across_grid():
  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    for j in range(4):
      v = x_ref[j]
      plt.atomic_add(o_ref, v, jnp.int32(1))
  x = jnp.array([0, 1, 1, 3, 2, 2, 2, 0], jnp.int32)
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((4,), jnp.int32), grid=(2,),
                       in_specs=[pl.BlockSpec((4,), lambda i: (i,))],
                       out_specs=pl.BlockSpec((4,), lambda i: (0,)))(x)
  np.testing.assert_array_equal(out, np.bincount(np.asarray(x), minlength=4))


def test_atomics_return_old_values():
  def kernel(o_ref, old_ref):
    o_ref[...] = jnp.array([1, 5, 7, 8], jnp.int32)
    old_ref[0] = plt.atomic_max(o_ref, 1, jnp.int32(9))
    old_ref[1] = plt.atomic_min(o_ref, 2, jnp.int32(3))
    old_ref[2] = plt.atomic_xchg(o_ref, 3, jnp.int32(0))
    old_ref[3] = plt.atomic_cas(o_ref.at[0], jnp.int32(1), jnp.int32(4))
  o, old = pl.pallas_call(kernel, (jax.ShapeDtypeStruct((4,), jnp.int32),) * 2)()
  np.testing.assert_array_equal(o, [4, 9, 3, 0])
  np.testing.assert_array_equal(old, [5, 7, 8, 1])


def test_run_scoped_scratch():
  def kernel(x_ref, o_ref):
    def body(tmp_ref):
      tmp_ref[...] = x_ref[...] * 2
      o_ref[...] = tmp_ref[...] + 1
    pl.run_scoped(body, pltpu.VMEM((8,), jnp.float32))
  x = jnp.arange(8.)
  _close(pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32))(x),
         x * 2 + 1)


def test_dot_einsum_iota_reshape_reductions():
  def kernel(a_ref, b_ref, o_ref, i_ref):
    a, b = a_ref[...], b_ref[...]
    c = jnp.einsum("ik,kj->ij", a, b, preferred_element_type=jnp.float32)
    c = c + plt.dot(a, b)
    o_ref[...] = c.reshape(4, 64).sum(axis=0).reshape(8, 8)
    i_ref[...] = jax.lax.broadcasted_iota(jnp.int32, (8, 8), 1) + jnp.argmax(
        a[:8], axis=1)[:, None].astype(jnp.int32)
  a = jax.random.normal(jax.random.key(5), (16, 16))
  b = jax.random.normal(jax.random.key(6), (16, 16))
  o, i = pl.pallas_call(kernel, (jax.ShapeDtypeStruct((8, 8), jnp.float32),
                                 jax.ShapeDtypeStruct((8, 8), jnp.int32)))(a, b)
  c = 2 * (a @ b)
  _close(o, c.reshape(4, 64).sum(0).reshape(8, 8), 1e-3)
  np.testing.assert_array_equal(i, np.arange(8)[None, :] + np.argmax(a[:8], 1)[:, None])


def test_element_block_dims():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
  x = jnp.arange(40.)
  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((32,), jnp.float32), grid=(4,),
      in_specs=[pl.BlockSpec((pl.Element(8),), lambda i: (i * 8 + 3,))],
      out_specs=pl.BlockSpec((8,), lambda i: (i,)))(x)
  _close(out, x[3:35])


def test_scalar_prefetch_index_map():
  def kernel(idx_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] + idx_ref[pl.program_id(0)]
  idx = jnp.array([2, 0, 1], jnp.int32)
  x = jnp.arange(24.).reshape(3, 8)
  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((3, 8), jnp.float32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(3,),
          in_specs=[pl.BlockSpec((1, 8), lambda i, idx: (idx[i], 0))],
          out_specs=pl.BlockSpec((1, 8), lambda i, idx: (i, 0))))(idx, x)
  _close(out, x[idx] + idx[:, None])


def test_kernel_decorator_in_jit_and_make_jaxpr():
  @pl.kernel(out_shape=lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
             grid=lambda x: (pl.cdiv(x.shape[0], 8),),
             in_specs=[pl.BlockSpec((8,), lambda i: (i,))],
             out_specs=pl.BlockSpec((8,), lambda i: (i,)))
  def double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  f = jax.jit(lambda x: jnp.sum(double(x)))
  for n in (8, 20, 64):
    x = jnp.arange(n, dtype=jnp.float32)
    _close(f(x), 2 * x.sum())
  jaxpr = jax.make_jaxpr(double)(jnp.ones(16))
  assert [e.primitive.name for e in jaxpr.eqns] == ["pallas_call"]
  assert "kernel double" in str(jaxpr)


def test_debug_print(capfd):
  def kernel(x_ref, o_ref):
    pl.debug_print("pid={} v={}", pl.program_id(0), x_ref[0])
    o_ref[...] = x_ref[...]
  pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32), grid=(2,),
                 in_specs=[pl.BlockSpec((4,), lambda i: (i,))],
                 out_specs=pl.BlockSpec((4,), lambda i: (i,)))(jnp.arange(8.))
  jax.effects_barrier()
  out = capfd.readouterr().out
  assert "pid=0 v=0.0" in out and "pid=1 v=4.0" in out


def test_multiple_of_and_max_contiguous_are_identity():
  def kernel(x_ref, o_ref):
    i = pl.multiple_of(pl.program_id(0) * 8, 8)
    o_ref[...] = plt.max_contiguous(x_ref[...], 8) + i
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((16,), jnp.float32),
                       grid=(2,), in_specs=[pl.BlockSpec((8,), lambda i: (i,))],
                       out_specs=pl.BlockSpec((8,), lambda i: (i,)))(jnp.zeros(16))
  _close(out, jnp.repeat(jnp.array([0., 8.]), 8))
