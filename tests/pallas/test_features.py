"""Features of the core DSL, each kernel on every CPU backend against a plain
jax.numpy reference.

Shapes fit TPU tiling (the last two dims of a block are multiples of
(8, 128) for 32-bit types and (16, 128) for 16-bit ones, or the array's
dims), so `mosaic_interpret` runs the same kernels as `interpret` and
`triton_interpret`. A feature that one backend family lacks (Triton's
atomics, reversing inside a block) runs on the backends that have it.
Backend-specific checks live in the backend's own file:
test_triton_features.py (ahead-of-time compilation), test_mosaic_interpret.py
(TPU operations, the Mosaic interpreter's reports).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl import triton as plt
from dsl import tpu as pltpu
from tests.pallas.testing import CPU_BACKENDS, array, assert_close

on_cpu_backends = pytest.mark.parametrize("backend", CPU_BACKENDS)
# Triton's atomics and lax.rev: the Mosaic (TPU) lowering has neither.
on_triton_style_backends = pytest.mark.parametrize(
    "backend", ("interpret", "triton_interpret"))


def add_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = x_ref[...] + y_ref[...]


def blocked_add(x, y, backend):
  """x + y in blocks of 128 (1-D) or (16, 256) (2-D) elements."""
  if x.ndim == 1:
    spec = pl.BlockSpec((128,), lambda i: (i,))
    grid = (pl.cdiv(x.shape[0], 128),)
  else:
    spec = pl.BlockSpec((16, 256), lambda i, j: (i, j))
    grid = (pl.cdiv(x.shape[0], 16), pl.cdiv(x.shape[1], 256))
  return pl.pallas_call(add_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=grid, in_specs=[spec] * 2, out_specs=spec,
                        backend=backend)(x, y)


@on_cpu_backends
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
@pytest.mark.parametrize("shape", [(128,), (1000,), (4096,), (32, 256),
                                   (32, 1000)])
def test_add_partial_edge_blocks(shape, dtype, backend):
  x = jnp.arange(np.prod(shape)).reshape(shape).astype(dtype)
  y = (2 * x).astype(dtype)
  assert_close(jax.jit(blocked_add, static_argnums=2)(x, y, backend), x + y)


def matmul_kernel(x_ref, y_ref, o_ref, *, k):
  @pl.when(pl.program_id(2) == 0)
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)
  x, y = x_ref[...], y_ref[...]
  bk = x.shape[1]
  if k % bk:   # the last K block reads past the array: poison, so mask it
    kk = pl.program_id(2) * bk + jnp.arange(bk)
    x = jnp.where(kk[None, :] < k, x, jnp.zeros_like(x))
    y = jnp.where(kk[:, None] < k, y, jnp.zeros_like(y))
  o_ref[...] += jnp.dot(x, y,
                        preferred_element_type=jnp.float32).astype(o_ref.dtype)


def matmul(x, y, backend, bm=64, bn=128, bk=128, semantics=None):
  m, k = x.shape
  n = y.shape[1]
  params = semantics and pltpu.CompilerParams(dimension_semantics=semantics)
  return pl.pallas_call(
      functools.partial(matmul_kernel, k=k),
      jax.ShapeDtypeStruct((m, n), jnp.float32),
      grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), pl.cdiv(k, bk)),
      in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
      compiler_params=params, backend=backend)(x, y)


@on_cpu_backends
@pytest.mark.parametrize("shape,dtype,semantics", [
    ((256, 256, 256), jnp.float32, ("parallel", "parallel", "arbitrary")),
    ((64, 384, 128), jnp.float32, None),
    # Partial blocks along m and n; k stays whole blocks, since the padding
    # of a partial k block is not zeros on hardware.
    ((200, 256, 136), jnp.float32, None),
    ((128, 256, 128), jnp.bfloat16, ("parallel", "parallel", "arbitrary")),
])
def test_matmul_revisits_output_block(shape, dtype, semantics, backend):
  m, k, n = shape
  x = jax.random.normal(jax.random.key(0), (m, k)).astype(dtype)
  y = jax.random.normal(jax.random.key(1), (k, n)).astype(dtype)
  got = jax.jit(lambda x, y: matmul(x, y, backend, semantics=semantics))(x, y)
  assert_close(got, jnp.dot(x, y, preferred_element_type=jnp.float32),
               tol=1e-4 if dtype == jnp.float32 else 1e-2)


@on_cpu_backends
def test_column_sums_revisit_with_outer_sequential_dim(backend):
  # grid (rows, cols): the output block depends only on cols; rows revisit.
  # The host backends accumulate over the revisits; a TPU never reads an
  # output block back, so the Mosaic backends refuse the kernel.
  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += jnp.sum(x_ref[...], axis=0)
  x = jax.random.normal(jax.random.key(2), (64, 384))
  call = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((384,), jnp.float32), grid=(4, 3),
      in_specs=[pl.BlockSpec((16, 128), lambda i, j: (i, j))],
      out_specs=pl.BlockSpec((128,), lambda i, j: (j,)), backend=backend)
  if backend.startswith("mosaic"):
    with pytest.raises(pl.KernelError, match=r"out_specs\[0\]: its index "
                       r"map ignores grid dim 0 \(size 4\) but depends on "
                       r"grid dim 1 .*visited again at grid point \(1, 0\)"
                       r".*innermost, or accumulate in scratch.*test_features"):
      call(x)
    return
  assert_close(call(x), x.sum(0), tol=1e-4)


@on_cpu_backends
def test_column_sums_with_inner_reduction_dim(backend):
  # The same sums with the grid dim the output ignores innermost: every
  # output block is visited over consecutive steps, on every backend.
  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += jnp.sum(x_ref[...], axis=0)
  x = jax.random.normal(jax.random.key(2), (64, 384))
  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((384,), jnp.float32), grid=(3, 4),
      in_specs=[pl.BlockSpec((16, 128), lambda j, i: (i, j))],
      out_specs=pl.BlockSpec((128,), lambda j, i: (j,)), backend=backend)(x)
  assert_close(out, x.sum(0), tol=1e-4)


@on_cpu_backends
def test_squeezed_dims_and_2d_grid(backend):
  def kernel(x_ref, o_ref):
    assert x_ref.shape == (128,)
    o_ref[...] = x_ref[...] * (pl.program_id(0) + 10 * pl.program_id(1))
  x = jnp.ones((4, 3, 128))
  call = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((4, 3, 128), jnp.float32), grid=(4, 3),
      in_specs=[pl.BlockSpec((None, pl.Squeezed, 128), lambda i, j: (i, j, 0))],
      out_specs=pl.BlockSpec((None, None, 128), lambda i, j: (i, j, 0)),
      backend=backend)
  if backend in ("mosaic", "mosaic_interpret"):
    # A TPU block may not squeeze its second-minor dim (as in Pallas); a
    # GPU block may ("mosaic_gpu": TMA copies a box of any rank).
    with pytest.raises(pl.KernelError, match="second-minor dim is squeezed"):
      call(x)
    return
  want = (jnp.arange(4)[:, None, None] + 10 * jnp.arange(3)[None, :, None]) * x
  assert_close(call(x), want)


@on_cpu_backends
def test_squeezed_leading_dims_and_2d_grid(backend):
  def kernel(x_ref, o_ref):
    assert x_ref.shape == (8, 128)
    o_ref[...] = x_ref[...] * (pl.program_id(0) + 10 * pl.program_id(1))
  x = jnp.ones((4, 3, 8, 128))
  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct(x.shape, jnp.float32), grid=(4, 3),
      in_specs=[pl.BlockSpec((None, pl.Squeezed, 8, 128),
                             lambda i, j: (i, j, 0, 0))],
      out_specs=pl.BlockSpec((None, None, 8, 128), lambda i, j: (i, j, 0, 0)),
      backend=backend)(x)
  want = (jnp.arange(4)[:, None, None, None]
          + 10 * jnp.arange(3)[None, :, None, None]) * x
  assert_close(out, want)


@on_cpu_backends
def test_transposed_index_map_gathers(backend):
  # out block (i, j) reads x block (j, i): not a one-to-one view.
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...].T
  x = jnp.arange(256 * 384, dtype=jnp.float32).reshape(256, 384)
  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((384, 256), jnp.float32), grid=(3, 2),
      in_specs=[pl.BlockSpec((128, 128), lambda i, j: (j, i))],
      out_specs=pl.BlockSpec((128, 128), lambda i, j: (i, j)),
      backend=backend)(x)
  assert_close(out, x.T)


def reversed_blocks(kernel, x, backend):
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((8, 512), jnp.float32), grid=(4,),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 3 - i))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (0, i)), backend=backend)(x)


@on_cpu_backends
def test_reversed_index_map(backend):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2
  x = jnp.arange(8 * 512.).reshape(8, 512)
  assert_close(reversed_blocks(kernel, x, backend),
               2 * x.reshape(8, 4, 128)[:, ::-1].reshape(8, 512))


@on_triton_style_backends
def test_reversed_index_map_and_reversed_block(backend):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...][:, ::-1]
  x = jnp.arange(8 * 512.).reshape(8, 512)
  assert_close(reversed_blocks(kernel, x, backend), x[:, ::-1])


@on_cpu_backends
def test_no_specs_whole_array_and_multiple_outputs(backend):
  def kernel(x_ref, s_ref, m_ref):
    s_ref[...] = jnp.sum(x_ref[...], keepdims=True)
    m_ref[...] = jnp.max(x_ref[...], axis=1)
  x = jax.random.normal(jax.random.key(3), (8, 128))
  s, m = pl.pallas_call(kernel, (jax.ShapeDtypeStruct((1, 1), jnp.float32),
                                 jax.ShapeDtypeStruct((8,), jnp.float32)),
                        backend=backend)(x)
  assert_close(s, x.sum(keepdims=True), tol=1e-4)
  assert_close(m, x.max(1))


@on_cpu_backends
def test_scalars_in_smem(backend):
  def kernel(x_ref, o_ref):
    o_ref[0] = x_ref[0] * 3 + 1
    o_ref[1] = x_ref[1] // 2
  smem = pl.BlockSpec(memory_space=pltpu.SMEM)
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((2,), jnp.int32),
                       in_specs=[smem], out_specs=smem, backend=backend)(
                           jnp.array([5, 9], jnp.int32))
  np.testing.assert_array_equal(out, [16, 4])


# Mosaic keeps scalars in SMEM only: a 0-d block without a memory space is
# an error there (test_mosaic_lowering.py).
@pytest.mark.parametrize("backend,memory_space", [
    *((b, pltpu.SMEM) for b in CPU_BACKENDS),
    ("interpret", None), ("triton_interpret", None)])
def test_zero_d_refs_and_int_dtypes(backend, memory_space):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 3 + 1
  specs = {}
  if memory_space is not None:
    spec = pl.BlockSpec(memory_space=memory_space)
    specs = dict(in_specs=[spec], out_specs=spec)
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((), jnp.int32),
                       backend=backend, **specs)(jnp.int32(5))
  assert out.shape == () and int(out) == 16


@on_cpu_backends
def test_pytree_operands_and_out_shape(backend):
  def kernel(d, o):
    o["s"][...] = d["a"][...] + d["b"][...]
  a, b = jnp.arange(8 * 128.).reshape(8, 128), jnp.ones((8, 128))
  out = pl.pallas_call(
      kernel, {"s": jax.ShapeDtypeStruct((8, 128), jnp.float32)},
      backend=backend)({"a": a, "b": b})
  assert_close(out["s"], a + b)


@on_cpu_backends
def test_fori_loop_ds_and_at_views(backend):
  def kernel(x_ref, o_ref):
    def body(k, carry):
      o_ref[pl.ds(k * 8, 8)] = x_ref.at[pl.ds(k * 8, 8)][...] * k + carry
      return carry + 1.0
    jax.lax.fori_loop(0, 4, body, 0.0)
  x = jnp.ones((32, 128))
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((32, 128), jnp.float32),
                       backend=backend)(x)
  assert_close(out, jnp.repeat(jnp.arange(4.) * 2, 8)[:, None] * x)


@on_cpu_backends
def test_loop_cond_while_and_casts(backend):
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
                       backend=backend)(x)
  want = jnp.stack([x[0] * 2, x[1].astype(jnp.bfloat16).astype(jnp.float32),
                    x[2] * 2, jnp.full((128,), 12.)])
  assert_close(out, want)


@on_cpu_backends
def test_scratch_accumulator_persists_over_sequential_steps(backend):
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
      scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)], backend=backend)(x)
  assert_close(out, x.reshape(16, 8, 128).sum(1), tol=1e-4)


@on_cpu_backends
def test_input_output_aliases(backend):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1
  x = jnp.arange(8 * 128.).reshape(8, 128)
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                       input_output_aliases={0: 0}, backend=backend)(x)
  assert_close(out, x + 1)


@on_cpu_backends
def test_aliased_output_keeps_unwritten_blocks(backend):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 0 - 1
  x = jnp.arange(32 * 128.).reshape(32, 128)
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((32, 128), jnp.float32),
                       grid=(1,),
                       in_specs=[pl.BlockSpec((8, 128), lambda i: (1, 0))],
                       out_specs=pl.BlockSpec((8, 128), lambda i: (1, 0)),
                       input_output_aliases={0: 0}, backend=backend)(x)
  assert_close(out, x.at[8:16].set(-1))


@on_cpu_backends
def test_masked_load_store(backend):
  def kernel(x_ref, o_ref):
    offs = jax.lax.broadcasted_iota(jnp.int32, (8, 128), 1)
    x = plt.load(x_ref.at[pl.ds(0, 8)], mask=offs < 100, other=-1.0)
    o_ref[...] = jnp.zeros_like(o_ref)
    plt.store(o_ref.at[pl.ds(0, 8)], x * 2, mask=offs % 2 == 0)
  x = jnp.arange(8 * 128.).reshape(8, 128)
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                       backend=backend)(x)
  offs = np.arange(128)[None]
  want = np.where(offs % 2 == 0, np.where(offs < 100, np.asarray(x), -1) * 2, 0)
  assert_close(out, want)


@on_triton_style_backends
def test_atomic_histogram_across_grid(backend):
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
                       out_specs=pl.BlockSpec((4,), lambda i: (0,)),
                       backend=backend)(x)
  np.testing.assert_array_equal(out, np.bincount(np.asarray(x), minlength=4))


@on_triton_style_backends
def test_atomics_return_old_values(backend):
  def kernel(o_ref, old_ref):
    o_ref[...] = jnp.array([1, 5, 7, 8], jnp.int32)
    old_ref[0] = plt.atomic_max(o_ref, 1, jnp.int32(9))
    old_ref[1] = plt.atomic_min(o_ref, 2, jnp.int32(3))
    old_ref[2] = plt.atomic_xchg(o_ref, 3, jnp.int32(0))
    old_ref[3] = plt.atomic_cas(o_ref.at[0], jnp.int32(1), jnp.int32(4))
  o, old = pl.pallas_call(kernel, (jax.ShapeDtypeStruct((4,), jnp.int32),) * 2,
                          backend=backend)()
  np.testing.assert_array_equal(o, [4, 9, 3, 0])
  np.testing.assert_array_equal(old, [5, 7, 8, 1])


@on_cpu_backends
def test_run_scoped_scratch(backend):
  def kernel(x_ref, o_ref):
    def body(tmp_ref):
      tmp_ref[...] = x_ref[...] * 2
      o_ref[...] = tmp_ref[...] + 1
    pl.run_scoped(body, pltpu.VMEM((8, 128), jnp.float32))
  x = jnp.arange(8 * 128.).reshape(8, 128)
  assert_close(pl.pallas_call(kernel,
                              jax.ShapeDtypeStruct((8, 128), jnp.float32),
                              backend=backend)(x), x * 2 + 1)


@on_cpu_backends
def test_dot_einsum_iota_reshape_reductions(backend):
  def kernel(a_ref, b_ref, o_ref, i_ref):
    a, b = a_ref[...], b_ref[...]
    c = jnp.einsum("ik,kj->ij", a, b, preferred_element_type=jnp.float32)
    c = c + plt.dot(a, b)
    c = c + jax.lax.dot_general(a, b.T, (((1,), (1,)), ((), ())))
    o_ref[...] = c.reshape(8, 2, 128).sum(axis=1)
    i_ref[...] = jax.lax.broadcasted_iota(jnp.int32, (8, 128), 1) + jnp.argmax(
        a[:8], axis=1)[:, None].astype(jnp.int32)
  # 16 rows: the smallest dot Triton takes (a 128-row f32 dot takes seconds
  # to compile ahead of time).
  a = jax.random.normal(jax.random.key(5), (16, 128))
  b = jax.random.normal(jax.random.key(6), (128, 128))
  o, i = pl.pallas_call(kernel, (jax.ShapeDtypeStruct((8, 128), jnp.float32),
                                 jax.ShapeDtypeStruct((8, 128), jnp.int32)),
                        backend=backend)(a, b)
  c = 3 * (a @ b)
  assert_close(o, c.reshape(8, 2, 128).sum(1), tol=1e-3)
  np.testing.assert_array_equal(
      i, np.arange(128)[None, :] + np.argmax(a[:8], 1)[:, None])


@on_cpu_backends
def test_elementwise_math_and_comparisons(backend):
  def math(x):
    y = jnp.exp(x) - jnp.log(jnp.abs(x) + 1) + jnp.tanh(x) * jax.nn.sigmoid(x)
    y = y + jnp.where(x > 0, jnp.sqrt(jnp.abs(x)), -x) + jnp.maximum(x, 0.5)
    return y + jax.lax.rsqrt(jnp.abs(x) + 1) + jnp.sin(x) ** 2 + jnp.floor(x)

  def kernel(x_ref, o_ref):
    o_ref[...] = math(x_ref[...])
  x = jax.random.normal(jax.random.key(7), (8, 128))
  assert_close(pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128),
                                                           jnp.float32),
                              backend=backend)(x), math(x), tol=1e-4)


@on_cpu_backends
def test_integer_ops(backend):
  def ops(x):
    return ((x * 3) // 2 + (x % 5) - (x >> 1) + (x << 2) ^ (x & 6)) | 1

  def kernel(x_ref, o_ref):
    o_ref[...] = ops(x_ref[...])
  x = array(8, (8, 128), jnp.int32, -100, 100)
  np.testing.assert_array_equal(
      pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.int32),
                     backend=backend)(x), ops(x))


@on_cpu_backends
def test_element_block_dims_with_padding(backend):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
  x = jnp.arange(8 * 896, dtype=jnp.float32).reshape(8, 896)

  def copy(in_spec, backend):
    return pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((8, 512), jnp.float32), grid=(4,),
        in_specs=[in_spec], out_specs=pl.BlockSpec((8, 128), lambda i: (0, i)),
        backend=backend)(x)
  out = copy(pl.BlockSpec((8, pl.Element(128)), lambda i: (0, i * 128 + 3)),
             backend)
  np.testing.assert_array_equal(out, x[:, 3:515])
  # offsets index the padded array; what the padding reads is poison
  # (test_triton_ops.py and test_mosaic_interpret.py check it)
  padded = pl.BlockSpec((8, pl.Element(128, (5, 0))), lambda i: (0, i * 128))
  np.testing.assert_array_equal(copy(padded, backend)[:, 5:], x[:, :507])


@on_cpu_backends
def test_scalar_prefetch_index_map(backend):
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
      backend=backend)(idx, x)
  want = x.reshape(3, 8, 128)[idx] + idx[:, None, None]
  assert_close(out, want.reshape(24, 128))


def double_kernel(backend):
  @pl.kernel(out_shape=lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
             grid=lambda x: (pl.cdiv(x.shape[0], 8),),
             in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
             out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
             backend=backend)
  def double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2
  return double


@on_cpu_backends
def test_kernel_decorator_in_jit_and_make_jaxpr(backend):
  double = double_kernel(backend)
  f = jax.jit(lambda x: jnp.sum(double(x)))
  for n in (8, 20, 64):
    x = jnp.arange(n * 128, dtype=jnp.float32).reshape(n, 128)
    assert_close(f(x), 2 * x.sum())
  jaxpr = jax.make_jaxpr(double)(jnp.ones((16, 128)))
  assert [e.primitive.name for e in jaxpr.eqns] == ["pallas_call"]
  assert "kernel double" in str(jaxpr)


@on_cpu_backends
def test_grad_and_vmap(backend):
  @pl.kernel(out_shape=lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
             grid=lambda x: (x.shape[0] // 8,),
             in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
             out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
             backend=backend)
  def square(x_ref, o_ref):
    o_ref[...] = x_ref[...] * x_ref[...]

  x = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128) / 100
  assert_close(jax.grad(lambda x: jnp.sum(square(x)))(x), 2 * x)
  xs = jnp.stack([x, x + 1])
  assert_close(jax.vmap(square)(xs), xs ** 2)
  ys = jax.random.normal(jax.random.key(11), (2, 128, 128))
  tol = 1e-3
  if backend == "mosaic_gpu":    # wgmma has no float32 precision: bf16 in
    ys, tol = ys.astype(jnp.bfloat16), 2e-2
  want = jnp.einsum("bij,bjk->bik", ys.astype(jnp.float32),
                    ys.astype(jnp.float32))
  assert_close(jax.vmap(lambda a, b: matmul(a, b, backend))(ys, ys), want,
               tol=tol)


# tl.device_print (triton_interpret) prints in Triton's own format; it is
# checked in test_triton_source.py.
@pytest.mark.parametrize("backend", ("interpret", "mosaic_interpret"))
def test_debug_print(capfd, backend):
  def kernel(x_ref, o_ref):
    pl.debug_print("pid={} v={}", pl.program_id(0), x_ref[0, 0])
    o_ref[...] = x_ref[...]
  pl.pallas_call(kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32),
                 grid=(2,), in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                 out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                 backend=backend)(jnp.arange(16 * 128.).reshape(16, 128))
  jax.effects_barrier()
  out = capfd.readouterr().out
  assert "pid=0 v=0.0" in out and "pid=1 v=1024.0" in out


@on_cpu_backends
def test_multiple_of_and_max_contiguous_are_identity(backend):
  def kernel(x_ref, o_ref):
    i = pl.multiple_of(pl.program_id(0) * 8, 8)
    o_ref[...] = plt.max_contiguous(x_ref[...], 8) + i
  out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32),
                       grid=(2,),
                       in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                       out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                       backend=backend)(jnp.zeros((16, 128)))
  assert_close(out, jnp.repeat(jnp.array([0., 8.]), 8)[:, None] *
               jnp.ones((16, 128)))
