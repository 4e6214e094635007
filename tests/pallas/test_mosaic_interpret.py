"""The core DSL's kernels, fitted to TPU tiling, under `mosaic_interpret`:
each runs as a Mosaic MLIR module in our interpreter and matches jax.numpy."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl import tpu as pltpu
from dsl import triton as plt

MI = "mosaic_interpret"


def _close(a, b, tol=1e-5):
  np.testing.assert_allclose(np.asarray(a, np.float32),
                             np.asarray(b, np.float32), rtol=tol, atol=tol)


def add_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = x_ref[...] + y_ref[...]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
@pytest.mark.parametrize("n", [256, 1000])
def test_add_partial_edge_blocks(n, dtype):
  rows = 16 if dtype == jnp.bfloat16 else 8
  x = jnp.arange(2 * rows * n).reshape(2 * rows, n).astype(dtype)
  y = (2 * x).astype(dtype)
  f = pl.pallas_call(
      add_kernel, jax.ShapeDtypeStruct(x.shape, dtype),
      grid=(2, pl.cdiv(n, 256)),
      in_specs=[pl.BlockSpec((rows, 256), lambda i, j: (i, j))] * 2,
      out_specs=pl.BlockSpec((rows, 256), lambda i, j: (i, j)), backend=MI)
  _close(jax.jit(f)(x, y), x + y)


def matmul_kernel(x_ref, y_ref, o_ref):
  @pl.when(pl.program_id(2) == 0)
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)
  o_ref[...] += jnp.dot(x_ref[...], y_ref[...],
                        preferred_element_type=jnp.float32).astype(o_ref.dtype)


def matmul(x, y, bm=128, bn=128, bk=128, backend=MI):
  m, k = x.shape
  n = y.shape[1]
  return pl.pallas_call(
      matmul_kernel, jax.ShapeDtypeStruct((m, n), jnp.float32),
      grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), pl.cdiv(k, bk)),
      in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      backend=backend)(x, y)


@pytest.mark.parametrize("shape", [(256, 256, 256), (64, 384, 128)])
def test_matmul_revisits_output_block(shape):
  m, k, n = shape
  x = jax.random.normal(jax.random.key(0), (m, k))
  y = jax.random.normal(jax.random.key(1), (k, n))
  _close(jax.jit(functools.partial(matmul, bm=64))(x, y), x @ y, 1e-3)


def test_bf16_matmul_f32_accumulate():
  x = jax.random.normal(jax.random.key(0), (128, 256)).astype(jnp.bfloat16)
  y = jax.random.normal(jax.random.key(1), (256, 128)).astype(jnp.bfloat16)
  want = jnp.dot(x, y, preferred_element_type=jnp.float32)
  _close(matmul(x, y), want, 1e-2)


def test_column_sums_revisit_with_outer_sequential_dim():
  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += jnp.sum(x_ref[...], axis=0)
  x = jax.random.normal(jax.random.key(2), (64, 384))
  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((384,), jnp.float32), grid=(4, 3),
      in_specs=[pl.BlockSpec((16, 128), lambda i, j: (i, j))],
      out_specs=pl.BlockSpec((128,), lambda i, j: (j,)), backend=MI)(x)
  _close(out, x.sum(0), 1e-4)


def test_squeezed_dims_and_2d_grid():
  def kernel(x_ref, o_ref):
    assert x_ref.shape == (128,)
    o_ref[...] = x_ref[...] * (pl.program_id(0) + 10 * pl.program_id(1))
  x = jnp.ones((4, 3, 128))
  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((4, 3, 128), jnp.float32), grid=(4, 3),
      in_specs=[pl.BlockSpec((None, pl.Squeezed, 128), lambda i, j: (i, j, 0))],
      out_specs=pl.BlockSpec((None, None, 128), lambda i, j: (i, j, 0)),
      backend=MI)(x)
  want = (jnp.arange(4)[:, None, None] + 10 * jnp.arange(3)[None, :, None]) * x
  _close(out, want)


def test_transposed_and_reversed_index_maps():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...].T
  x = jnp.arange(256 * 384, dtype=jnp.float32).reshape(256, 384)
  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((384, 256), jnp.float32), grid=(3, 2),
      in_specs=[pl.BlockSpec((128, 128), lambda i, j: (j, i))],
      out_specs=pl.BlockSpec((128, 128), lambda i, j: (i, j)), backend=MI)(x)
  _close(out, x.T)

  def rev(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2
  y = jnp.arange(8 * 512.).reshape(8, 512)
  out = pl.pallas_call(
      rev, jax.ShapeDtypeStruct((8, 512), jnp.float32), grid=(4,),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 3 - i))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (0, i)), backend=MI)(y)
  _close(out, 2 * y.reshape(8, 4, 128)[:, ::-1].reshape(8, 512))


def test_no_specs_whole_array_and_multiple_outputs():
  def kernel(x_ref, s_ref, m_ref):
    s_ref[...] = jnp.sum(x_ref[...], keepdims=True)
    m_ref[...] = jnp.max(x_ref[...], axis=1)
  x = jax.random.normal(jax.random.key(3), (8, 128))
  s, m = pl.pallas_call(kernel, (jax.ShapeDtypeStruct((1, 1), jnp.float32),
                                 jax.ShapeDtypeStruct((8,), jnp.float32)),
                        backend=MI)(x)
  _close(s, x.sum(keepdims=True), 1e-4)
  _close(m, x.max(1))


def test_scalars_in_smem():
  def kernel(x_ref, o_ref):
    o_ref[0] = x_ref[0] * 3 + 1
    o_ref[1] = x_ref[1] // 2
  smem = pl.BlockSpec(memory_space=pltpu.SMEM)
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((2,), jnp.int32),
                       in_specs=[smem], out_specs=smem, backend=MI)(
                           jnp.array([5, 9], jnp.int32))
  np.testing.assert_array_equal(out, [16, 4])


def test_pytree_operands_and_out_shape():
  def kernel(d, o):
    o["s"][...] = d["a"][...] + d["b"][...]
  a, b = jnp.arange(8 * 128.).reshape(8, 128), jnp.ones((8, 128))
  out = pl.pallas_call(
      kernel, {"s": jax.ShapeDtypeStruct((8, 128), jnp.float32)},
      backend=MI)({"a": a, "b": b})
  _close(out["s"], a + b)


def test_fori_loop_ds_and_at_views():
  def kernel(x_ref, o_ref):
    def body(k, carry):
      o_ref[pl.ds(k * 8, 8)] = x_ref.at[pl.ds(k * 8, 8)][...] * k + carry
      return carry + 1.0
    jax.lax.fori_loop(0, 4, body, 0.0)
  x = jnp.ones((32, 128))
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((32, 128), jnp.float32),
                       backend=MI)(x)
  want = jnp.repeat(jnp.arange(4.) * 2, 8)[:, None] * x
  _close(out, want)


def test_loop_cond_while_and_casts():
  def kernel(x_ref, o_ref):
    @pl.loop(0, 3)
    def _(i):
      o_ref[i] = jax.lax.cond(i % 2 == 0, lambda: x_ref[i] * 2.0,
                              lambda: x_ref[i].astype(jnp.bfloat16).astype(
                                  jnp.float32))
    n = jax.lax.while_loop(lambda c: c < 10, lambda c: c + 3, 0)
    o_ref[3] = jnp.full((128,), n, jnp.float32)
  x = jnp.arange(4 * 128.).reshape(4, 128) / 7
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((4, 128), jnp.float32),
                       backend=MI)(x)
  want = jnp.stack([x[0] * 2, x[1].astype(jnp.bfloat16).astype(jnp.float32),
                    x[2] * 2, jnp.full((128,), 12.)])
  _close(out, want)


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
  x = jax.random.normal(jax.random.key(4), (16, 1024))
  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32), grid=(2, 8),
      in_specs=[pl.BlockSpec((8, 128), lambda i, k: (i, k))],
      out_specs=pl.BlockSpec((8, 128), lambda i, k: (i, 0)),
      scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)], backend=MI)(x)
  _close(out, x.reshape(16, 8, 128).sum(1), 1e-4)


def test_input_output_aliases_keep_unwritten_blocks():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 0 - 1
  x = jnp.arange(32 * 128.).reshape(32, 128)
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((32, 128), jnp.float32),
                       grid=(1,),
                       in_specs=[pl.BlockSpec((8, 128), lambda i: (1, 0))],
                       out_specs=pl.BlockSpec((8, 128), lambda i: (1, 0)),
                       input_output_aliases={0: 0}, backend=MI)(x)
  _close(out, x.at[8:16].set(-1))


def test_masked_load_store():
  def kernel(x_ref, o_ref):
    offs = jax.lax.broadcasted_iota(jnp.int32, (8, 128), 1)
    x = plt.load(x_ref, mask=offs < 100, other=-1.0)
    o_ref[...] = jnp.zeros_like(o_ref)
    plt.store(o_ref, x * 2, mask=offs % 2 == 0)
  x = jnp.arange(8 * 128.).reshape(8, 128)
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                       backend=MI)(x)
  offs = np.arange(128)[None]
  want = np.where(offs % 2 == 0, np.where(offs < 100, np.asarray(x), -1) * 2, 0)
  _close(out, want)


def test_run_scoped_scratch():
  def kernel(x_ref, o_ref):
    def body(tmp_ref):
      tmp_ref[...] = x_ref[...] * 2
      o_ref[...] = tmp_ref[...] + 1
    pl.run_scoped(body, pltpu.VMEM((8, 128), jnp.float32))
  x = jnp.arange(8 * 128.).reshape(8, 128)
  _close(pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                        backend=MI)(x), x * 2 + 1)


def test_dot_einsum_iota_reductions():
  def kernel(a_ref, b_ref, o_ref, i_ref):
    a, b = a_ref[...], b_ref[...]
    c = jnp.einsum("ik,kj->ij", a, b, preferred_element_type=jnp.float32)
    c = c + jax.lax.dot_general(a, b.T, (((1,), (1,)), ((), ())))
    o_ref[...] = c.reshape(8, 16, 128).sum(axis=1)
    i_ref[...] = jax.lax.broadcasted_iota(jnp.int32, (8, 128), 1) + jnp.argmax(
        a[:8], axis=1)[:, None].astype(jnp.int32)
  a = jax.random.normal(jax.random.key(5), (128, 128))
  b = jax.random.normal(jax.random.key(6), (128, 128))
  o, i = pl.pallas_call(kernel, (jax.ShapeDtypeStruct((8, 128), jnp.float32),
                                 jax.ShapeDtypeStruct((8, 128), jnp.int32)),
                        backend=MI)(a, b)
  c = 2 * (a @ b)
  _close(o, c.reshape(8, 16, 128).sum(1), 1e-3)
  np.testing.assert_array_equal(
      i, np.arange(128)[None, :] + np.argmax(a[:8], 1)[:, None])


def test_elementwise_math_and_comparisons():
  def kernel(x_ref, o_ref):
    x = x_ref[...]
    y = jnp.exp(x) - jnp.log(jnp.abs(x) + 1) + jnp.tanh(x) * jax.nn.sigmoid(x)
    y = y + jnp.where(x > 0, jnp.sqrt(jnp.abs(x)), -x) + jnp.maximum(x, 0.5)
    y = y + jax.lax.rsqrt(jnp.abs(x) + 1) + jnp.sin(x) ** 2 + jnp.floor(x)
    o_ref[...] = y
  x = jax.random.normal(jax.random.key(7), (8, 128))
  want = (jnp.exp(x) - jnp.log(jnp.abs(x) + 1) + jnp.tanh(x) *
          jax.nn.sigmoid(x) + jnp.where(x > 0, jnp.sqrt(jnp.abs(x)), -x) +
          jnp.maximum(x, 0.5) + jax.lax.rsqrt(jnp.abs(x) + 1) +
          jnp.sin(x) ** 2 + jnp.floor(x))
  _close(pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                        backend=MI)(x), want, 1e-4)


def test_integer_ops():
  def kernel(x_ref, o_ref):
    x = x_ref[...]
    o_ref[...] = ((x * 3) // 2 + (x % 5) - (x >> 1) + (x << 2) ^ (x & 6)) | 1
  x = jax.random.randint(jax.random.key(8), (8, 128), -100, 100, jnp.int32)
  want = ((x * 3) // 2 + (x % 5) - (x >> 1) + (x << 2) ^ (x & 6)) | 1
  np.testing.assert_array_equal(
      pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.int32),
                     backend=MI)(x), want)


def test_scalar_prefetch_index_map():
  def kernel(idx_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] + idx_ref[pl.program_id(0)].astype(jnp.float32)
  idx = jnp.array([2, 0, 1], jnp.int32)
  x = jnp.arange(24 * 128.).reshape(24, 128)
  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((24, 128), jnp.float32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(3,),
          in_specs=[pl.BlockSpec((8, 128), lambda i, idx: (idx[i], 0))],
          out_specs=pl.BlockSpec((8, 128), lambda i, idx: (i, 0))),
      backend=MI)(idx, x)
  want = x.reshape(3, 8, 128)[idx] + idx[:, None, None]
  _close(out, want.reshape(24, 128))


def test_kernel_decorator_in_jit_and_grad():
  @pl.kernel(out_shape=lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
             grid=lambda x: (x.shape[0] // 8,),
             in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
             out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), backend=MI)
  def double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  f = jax.jit(lambda x: jnp.sum(double(x)))
  for n in (8, 24):
    x = jnp.arange(n * 128, dtype=jnp.float32).reshape(n, 128)
    _close(f(x), 2 * x.sum())


def test_debug_print(capfd):
  def kernel(x_ref, o_ref):
    pl.debug_print("pid={} v={}", pl.program_id(0), x_ref[0, 0])
    o_ref[...] = x_ref[...]
  pl.pallas_call(kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32),
                 grid=(2,), in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                 out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                 backend=MI)(jnp.arange(16 * 128.).reshape(16, 128))
  jax.effects_barrier()
  out = capfd.readouterr().out
  assert "pid=0 v=0.0" in out and "pid=1 v=1024.0" in out


def test_roll_repeat_bitcast_match_interpret_backend():
  def kernel(x_ref, s_ref, r_ref, p_ref, b_ref):
    x = x_ref[...]
    r_ref[...] = pltpu.roll(x, 3, 1) + pltpu.roll(x, s_ref[0], 0)
    p_ref[...] = pltpu.repeat(x, 2, 1)
    b_ref[...] = pltpu.bitcast(x, jnp.int32)
  x = jax.random.normal(jax.random.key(9), (8, 128))
  shift = jnp.array([5], jnp.int32)
  outs = (jax.ShapeDtypeStruct((8, 128), jnp.float32),
          jax.ShapeDtypeStruct((8, 256), jnp.float32),
          jax.ShapeDtypeStruct((8, 128), jnp.int32))
  specs = [pl.BlockSpec(), pl.BlockSpec(memory_space=pltpu.SMEM)]
  got = pl.pallas_call(kernel, outs, in_specs=specs, backend=MI)(x, shift)
  ref = pl.pallas_call(kernel, outs, in_specs=specs,
                       backend="interpret")(x, shift)
  _close(got[0], jnp.roll(x, 3, 1) + jnp.roll(x, 5, 0))
  _close(got[1], jnp.tile(x, (1, 2)))
  np.testing.assert_array_equal(got[2], jax.lax.bitcast_convert_type(
      x, jnp.int32))
  for g, r in zip(got, ref):
    np.testing.assert_array_equal(g, r)


def test_bitcast_between_widths_round_trips():
  def kernel(x_ref, o_ref, back_ref):
    y = pltpu.bitcast(x_ref[...], jnp.bfloat16)
    o_ref[...] = y
    back_ref[...] = pltpu.bitcast(y, jnp.int32)
  x = jax.random.randint(jax.random.key(10), (8, 128), 0, 1 << 30, jnp.int32)
  outs = (jax.ShapeDtypeStruct((16, 128), jnp.bfloat16),
          jax.ShapeDtypeStruct((8, 128), jnp.int32))
  got = pl.pallas_call(kernel, outs, backend=MI)(x)
  ref = pl.pallas_call(kernel, outs, backend="interpret")(x)
  np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint16),
                                np.asarray(ref[0]).view(np.uint16))
  np.testing.assert_array_equal(got[1], x)


def test_grad_and_vmap_through_mosaic_interpret():
  @pl.kernel(out_shape=lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
             grid=lambda x: (x.shape[0] // 8,),
             in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
             out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), backend=MI)
  def square(x_ref, o_ref):
    o_ref[...] = x_ref[...] * x_ref[...]

  x = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128) / 100
  _close(jax.grad(lambda x: jnp.sum(square(x)))(x), 2 * x, 1e-5)
  xs = jnp.stack([x, x + 1])
  _close(jax.vmap(square)(xs), xs ** 2, 1e-5)
  ys = jax.random.normal(jax.random.key(11), (2, 128, 128))
  _close(jax.vmap(functools.partial(matmul, bm=64))(ys, ys),
         jnp.einsum("bij,bjk->bik", ys, ys), 1e-3)


def test_element_block_dims_with_padding():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
  x = jnp.arange(8 * 896, dtype=jnp.float32).reshape(8, 896)
  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((8, 512), jnp.float32), grid=(4,),
      in_specs=[pl.BlockSpec((8, pl.Element(128)), lambda i: (0, i * 128 + 3))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (0, i)), backend=MI)(x)
  np.testing.assert_array_equal(out, x[:, 3:515])
  # offsets index the padded array; the padding itself reads poison (NaN)
  padded = [pl.BlockSpec((8, pl.Element(128, (5, 0))), lambda i: (0, i * 128))]
  got = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((8, 512), jnp.float32), grid=(4,),
      in_specs=padded, out_specs=pl.BlockSpec((8, 128), lambda i: (0, i)),
      backend=MI)(x)
  np.testing.assert_array_equal(got[:, 5:], x[:, :507])
  assert np.isnan(got[:, :5]).all()


def test_out_of_bounds_access_is_reported_with_its_line():
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[...] = x_ref[pl.ds(i * 8, 8)]        # i = 1 reads rows 8:16 of 8
  f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                     grid=(2,), in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 0))],
                     out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
                     backend=MI)
  from lowering_mosaic import interpreter
  with pytest.raises(Exception, match="out-of-bounds load"):
    jax.block_until_ready(f(jnp.ones((8, 128))))
  err = interpreter.last_failure()
  assert "rows 8:16" in open(__file__).read().splitlines()[
      int(err.lines[0].rsplit(":", 1)[1]) - 1]


def test_roll_and_bitcast_agree_with_pallas_tpu():
  jpl = pytest.importorskip("jax.experimental.pallas")
  jtpu = pytest.importorskip("jax.experimental.pallas.tpu")

  def body(mod_tpu):
    def kernel(x_ref, r_ref, b_ref):
      r_ref[...] = mod_tpu.roll(x_ref[...], 3, 1)
      b_ref[...] = mod_tpu.bitcast(x_ref[...], jnp.bfloat16)
    return kernel
  x = jax.random.randint(jax.random.key(0), (8, 128), 0, 1 << 30, jnp.int32)
  outs = (jax.ShapeDtypeStruct((8, 128), jnp.int32),
          jax.ShapeDtypeStruct((16, 128), jnp.bfloat16))
  theirs = jpl.pallas_call(body(jtpu), outs, interpret=True)(x)
  ours = pl.pallas_call(body(pltpu), outs, backend=MI)(x)
  for a, b in zip(ours, theirs):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16),
                                  np.asarray(b).view(np.uint16))
