"""Golden corpus: refs, loops, dots and values in more forms (see
mosaic_corpus.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tests.pallas.mosaic_corpus import case, f32, sds


# ------------------------------------------------------------ more values

@case
def run_scoped_buffers(pl, pltpu):
  def scoped_kernel(x_hbm, o_ref):
    def body(buf, sem):
      c = pltpu.make_async_copy(x_hbm, buf, sem)
      c.start()
      c.wait()
      o_ref[...] = buf[...] + 1.0
    pl.run_scoped(body, pltpu.VMEM((8, 128), jnp.float32),
                  pltpu.SemaphoreType.DMA)
  f = pl.pallas_call(
      scoped_kernel, sds((8, 128)),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec(memory_space=pltpu.VMEM))
  return f, (f32(8, 128),)


@case
def strided_and_sliced_refs(pl, pltpu):
  def stride_kernel(x_ref, o_ref):
    even = x_ref[pl.ds(0, 8, stride=2), :]
    o_ref[pl.ds(0, 8), :] = even
    o_ref[pl.ds(8, 8), :] = x_ref[pl.ds(8, 8), :] * 2.0
  f = pl.pallas_call(stride_kernel, sds((16, 128)))
  return f, (f32(16, 128),)


@case
def integer_division_and_select(pl, pltpu):
  def div_kernel(x_ref, y_ref, o_ref):
    x, y = x_ref[...], y_ref[...]
    o_ref[...] = lax.div(x, y) + lax.rem(x, y) + jnp.where(x > y, x, y)
  f = pl.pallas_call(div_kernel, sds((8, 128), jnp.int32))
  x = jnp.full((8, 128), 7, jnp.int32)
  return f, (x, x - 4)


@case
def reshape_broadcast_concat(pl, pltpu):
  def shape_kernel(x_ref, v_ref, o_ref):
    x = x_ref[...]
    v = v_ref[...]                                   # (1, 128)
    y = jnp.concatenate([x[:8], x[8:] * 2.0], axis=0)
    o_ref[...] = y + jnp.broadcast_to(v, (16, 128))
  f = pl.pallas_call(shape_kernel, sds((16, 128)))
  return f, (f32(16, 128), f32(1, 128))


@case
def argmax_and_compare(pl, pltpu):
  def argmax_kernel(x_ref, o_ref):
    o_ref[...] = jnp.broadcast_to(
        jnp.argmax(x_ref[...], axis=1, keepdims=True).astype(jnp.int32),
        (8, 128))
  f = pl.pallas_call(argmax_kernel, sds((8, 128), jnp.int32))
  return f, (f32(8, 128),)


@case
def program_id_arithmetic_in_index_map(pl, pltpu):
  def shift_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + pl.program_id(1).astype(jnp.float32)
  f = pl.pallas_call(
      shift_kernel, sds((32, 256)), grid=(2, 2),
      in_specs=[pl.BlockSpec((16, 128), lambda i, j: ((i + 1) % 2, 1 - j))],
      out_specs=pl.BlockSpec((16, 128), lambda i, j: (i, j)),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary")))
  return f, (f32(32, 256),)


@case
def vmapped_kernel(pl, pltpu):
  def add_one_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  f = pl.pallas_call(add_one_kernel, sds((16, 128)), grid=(2,),
                     in_specs=[spec], out_specs=spec)
  return jax.vmap(f), (f32(3, 16, 128),)


@case
def scalar_prefetch_2d_table(pl, pltpu):
  def table_kernel(tbl_ref, x_ref, o_ref):
    i, j = pl.program_id(0), pl.program_id(1)
    o_ref[...] = x_ref[...] * tbl_ref[i, j].astype(jnp.float32)
  f = pl.pallas_call(
      table_kernel, sds((16, 256)),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(2, 2),
          in_specs=[pl.BlockSpec((8, 128),
                                 lambda i, j, t: (t[i, j] % 2, j))],
          out_specs=pl.BlockSpec((8, 128), lambda i, j, t: (i, j))))
  return f, (jnp.array([[1, 0], [0, 1]], jnp.int32), f32(16, 256))


@case
def scratch_carried_over_grid(pl, pltpu):
  def running_kernel(x_ref, o_ref, acc_ref, n_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
      n_ref[0] = 0
    acc_ref[...] += x_ref[...]
    n_ref[0] = n_ref[0] + 1
    o_ref[...] = acc_ref[...] / n_ref[0].astype(jnp.float32)
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  f = pl.pallas_call(
      running_kernel, sds((32, 128)), grid=(4,), in_specs=[spec],
      out_specs=spec,
      scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32),
                      pltpu.SMEM((1,), jnp.int32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("arbitrary",)))
  return f, (f32(32, 128),)


@case
def bitcast_values(pl, pltpu):
  def bits_kernel(x_ref, b_ref):
    b_ref[...] = pltpu.bitcast(x_ref[...], jnp.int32)
  f = pl.pallas_call(bits_kernel, sds((8, 128), jnp.int32))
  return f, (f32(8, 128),)


@case
def math_functions(pl, pltpu):
  def math_kernel(x_ref, o_ref):
    x = x_ref[...]
    o_ref[...] = (jnp.tanh(x) + jnp.log(x + 2.0) + jax.nn.sigmoid(x)
                  + lax.rsqrt(x + 1.0) + jnp.abs(x) + jnp.sqrt(x * x))
  f = pl.pallas_call(math_kernel, sds((8, 128)))
  return f, (f32(8, 128),)


@case
def cond_with_results_and_nested_loops(pl, pltpu):
  def nested_kernel(x_ref, o_ref):
    x = x_ref[...]
    y = lax.cond(pl.program_id(0) % 2 == 0, lambda v: v * 2.0,
                 lambda v: v - 1.0, x)

    def outer(i, acc):
      def inner(j, a):
        return a + (i * j).astype(jnp.float32)
      return lax.fori_loop(0, 3, inner, acc)
    o_ref[...] = lax.fori_loop(0, 2, outer, y)
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  f = pl.pallas_call(nested_kernel, sds((16, 128)), grid=(2,),
                     in_specs=[spec], out_specs=spec)
  return f, (f32(16, 128),)


@case
def masked_store(pl, pltpu):
  def mask_kernel(x_ref, o_ref):
    rows = lax.broadcasted_iota(jnp.int32, (8, 128), 0)
    o_ref[...] = jnp.zeros_like(o_ref)
    if hasattr(pltpu, "store"):        # JAX 0.11: pltpu.store(ref, val, mask=)
      pltpu.store(o_ref, x_ref[...], mask=rows < 5)
    else:
      pl.store(o_ref, (slice(None), slice(None)), x_ref[...], mask=rows < 5)
  f = pl.pallas_call(mask_kernel, sds((8, 128)))
  return f, (f32(8, 128),)


@case
def jnp_roll_and_dynamic_roll(pl, pltpu):
  def roll_kernel(x_ref, o_ref):
    x = x_ref[...]
    o_ref[...] = jnp.roll(x, 5, axis=1) + pltpu.roll(x, 1, 0)
  f = pl.pallas_call(roll_kernel, sds((8, 128)))
  return f, (f32(8, 128),)


@case
def batched_dot_3d(pl, pltpu):
  def bmm_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.einsum("bij,bjk->bik", x_ref[...], y_ref[...],
                            preferred_element_type=jnp.float32)
  f = pl.pallas_call(bmm_kernel, sds((2, 128, 128)))
  return f, (f32(2, 128, 128), f32(2, 128, 128))


@case
def dot_bf16_transposed_rhs(pl, pltpu):
  def nt_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = lax.dot_general(
        x_ref[...], y_ref[...], (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32).astype(o_ref.dtype)
  f = pl.pallas_call(nt_kernel, sds((128, 256), jnp.bfloat16))
  return f, (jnp.ones((128, 128), jnp.bfloat16),
             jnp.ones((256, 128), jnp.bfloat16))


@case
def alias_into_any_output(pl, pltpu):
  def update_kernel(x_ref, big_hbm, o_hbm, sem):
    del big_hbm
    c = pltpu.make_async_copy(x_ref, o_hbm.at[pl.ds(8, 8)], sem)
    c.start()
    c.wait()
  f = pl.pallas_call(
      update_kernel, sds((32, 128)),
      in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM),
                pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec(memory_space=pl.ANY),
      scratch_shapes=[pltpu.SemaphoreType.DMA],
      input_output_aliases={1: 0})
  return f, (f32(8, 128), f32(32, 128))


@case
def reduce_all_axes_to_smem(pl, pltpu):
  def total_kernel(x_ref, o_ref):
    o_ref[0, 0] = jnp.sum(x_ref[...])
  f = pl.pallas_call(
      total_kernel, sds((1, 1)),
      out_specs=pl.BlockSpec(memory_space=pltpu.SMEM))
  return f, (f32(8, 128),)


@case
def named_scopes(pl, pltpu):
  def scoped_names_kernel(x_ref, o_ref):
    with jax.named_scope("prologue"):
      x = x_ref[...] * 2.0
    with jax.named_scope("body"):
      with jax.named_scope("inner"):
        y = jnp.exp(x)
      o_ref[...] = y + 1.0
  f = pl.pallas_call(scoped_names_kernel, sds((8, 128)))
  return f, (f32(8, 128),)



@case
def element_mixed_with_blocked(pl, pltpu):
  def mixed_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0
  f = pl.pallas_call(
      mixed_kernel, sds((32, 256)), grid=(4, 2),
      in_specs=[pl.BlockSpec((pl.Element(8), 128), lambda i, j: (i * 8, j))],
      out_specs=pl.BlockSpec((8, 128), lambda i, j: (i, j)))
  return f, (f32(32, 256),)


@case
def dot_int8_and_bf16_tn(pl, pltpu):
  def lowp_dot_kernel(a_ref, b_ref, x_ref, y_ref, i_ref, f_ref):
    i_ref[...] = lax.dot_general(a_ref[...], b_ref[...],
                                 (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.int32)
    f_ref[...] = lax.dot_general(x_ref[...], y_ref[...],
                                 (((0,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
  f = pl.pallas_call(lowp_dot_kernel, (sds((128, 128), jnp.int32),
                                       sds((128, 128))))
  a = jnp.ones((128, 128), jnp.int8)
  x = jnp.ones((128, 128), jnp.bfloat16)
  return f, (a, a, x, x)


@case
def logic_clamp_and_select(pl, pltpu):
  def logic_kernel(x_ref, y_ref, o_ref, b_ref):
    x, y = x_ref[...], y_ref[...]
    m = (x > 0) & ~(y > 1) | (x == y)
    o_ref[...] = lax.select_n(m.astype(jnp.int32), jnp.clip(x, -1.0, 1.0),
                              jnp.maximum(x, y)) + lax.erf(x) + jnp.exp2(y)
    b_ref[...] = jnp.where(m, 1, 0).astype(jnp.int32) * jnp.minimum(
        x.astype(jnp.int32), 3)
  f = pl.pallas_call(logic_kernel, (sds((8, 128)), sds((8, 128), jnp.int32)))
  return f, (f32(8, 128), f32(8, 128))


@case
def one_d_blocks(pl, pltpu):
  def vec_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + lax.iota(jnp.int32, 1024).astype(
        jnp.float32)
  spec = pl.BlockSpec((1024,), lambda i: (i,))
  f = pl.pallas_call(vec_kernel, sds((4096,)), grid=(4,), in_specs=[spec],
                     out_specs=spec)
  return f, (f32(4096),)


@case
def scalar_math_in_smem(pl, pltpu):
  def scalar_kernel(s_ref, o_ref):
    a, b = s_ref[0], s_ref[1]
    o_ref[0] = jnp.where(a > b, a * b, a - b) + jnp.maximum(a, 2)
    o_ref[1] = lax.rem(a, 3) + (b // 2)
  f = pl.pallas_call(
      scalar_kernel, sds((2,), jnp.int32),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
      out_specs=pl.BlockSpec(memory_space=pltpu.SMEM))
  return f, (jnp.array([7, 4], jnp.int32),)


@case
def float_sign(pl, pltpu):
  def sign_kernel(x_ref, o_ref):
    o_ref[...] = jnp.sign(x_ref[...]) + jnp.sign(x_ref[...] * 0.0)
  f = pl.pallas_call(sign_kernel, sds((8, 128)))
  return f, (f32(8, 128),)


@case
def bf16_elementwise_and_reduce(pl, pltpu):
  def bf16_kernel(x_ref, o_ref, m_ref):
    x = x_ref[...]
    o_ref[...] = jnp.exp(x) + x * x
    m_ref[...] = jnp.broadcast_to(jnp.max(x, axis=1, keepdims=True), (16, 128))
  f = pl.pallas_call(bf16_kernel, (sds((16, 128), jnp.bfloat16),
                                   sds((16, 128), jnp.bfloat16)))
  return f, (jnp.ones((16, 128), jnp.bfloat16),)


@case
def dynamic_ref_slices(pl, pltpu):
  def window_kernel(s_ref, x_ref, o_ref):
    start = pl.multiple_of(s_ref[0] * 8, 8)
    o_ref[...] = x_ref[pl.ds(start, 8), :] + pltpu.roll(
        x_ref[pl.ds(0, 8), :], s_ref[1], 1)
  f = pl.pallas_call(
      window_kernel, sds((8, 128)),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                pl.BlockSpec(memory_space=pltpu.VMEM)])
  return f, (jnp.array([2, 5], jnp.int32), f32(32, 128))


@case
def unrolled_loop_and_int_reduce(pl, pltpu):
  def unroll_kernel(x_ref, o_ref):
    def body(i, acc):
      return jnp.maximum(acc, x_ref[pl.ds(i * 8, 8), :])
    acc = lax.fori_loop(0, 4, body, jnp.full((8, 128), -1, jnp.int32),
                        unroll=True)
    o_ref[...] = acc + jnp.max(acc, axis=0, keepdims=True)
  f = pl.pallas_call(unroll_kernel, sds((8, 128), jnp.int32))
  return f, (jnp.ones((32, 128), jnp.int32),)


@case
def smem_accumulate_over_grid(pl, pltpu):
  def count_kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[0] = 0.0
    o_ref[0] += jnp.sum(x_ref[...])
  f = pl.pallas_call(
      count_kernel, sds((1,)), grid=(4,),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec(memory_space=pltpu.SMEM))
  return f, (f32(32, 128),)


@case
def transpose_3d_and_swap(pl, pltpu):
  def swap_kernel(x_ref, o_ref):
    o_ref[...] = jnp.swapaxes(x_ref[...], 1, 2)
  f = pl.pallas_call(swap_kernel, sds((2, 128, 128)))
  return f, (f32(2, 128, 128),)


@case
def partially_unrolled_loop(pl, pltpu):
  def half_unroll_kernel(x_ref, o_ref):
    def body(i, acc):
      return acc + x_ref[pl.ds(i * 8, 8), :]
    o_ref[...] = lax.fori_loop(0, 4, body, jnp.zeros((8, 128), jnp.float32),
                               unroll=2)
  f = pl.pallas_call(half_unroll_kernel, sds((8, 128)))
  return f, (f32(32, 128),)


@case
def shifts_and_unsigned(pl, pltpu):
  def shift_kernel(x_ref, u_ref, o_ref, p_ref):
    x = x_ref[...]
    o_ref[...] = (x << 2) + (x >> 1) + lax.shift_right_logical(x, 3)
    u = u_ref[...]
    p_ref[...] = jnp.where(u > jnp.uint32(5), u // jnp.uint32(3),
                           u % jnp.uint32(7))
  f = pl.pallas_call(shift_kernel, (sds((8, 128), jnp.int32),
                                    sds((8, 128), jnp.uint32)))
  return f, (jnp.ones((8, 128), jnp.int32), jnp.ones((8, 128), jnp.uint32))


@case
def value_slices_and_reshape(pl, pltpu):
  def slice_kernel(x_ref, o_ref):
    x = x_ref[...]
    top, bottom = x[:8], x[8:]
    y = jnp.concatenate([bottom[:, 128:], top[:, :128]], axis=1)
    o_ref[...] = y.reshape(2, 8, 128).sum(axis=0)
  f = pl.pallas_call(slice_kernel, sds((8, 128)))
  return f, (f32(16, 256),)


@case
def nan_test_and_rounding(pl, pltpu):
  def nan_kernel(x_ref, o_ref):
    x = x_ref[...]
    o_ref[...] = (jnp.where(jnp.isnan(x), 0.0, jnp.maximum(x, 0.0))
                  + jnp.floor(x) + jnp.ceil(x) + jnp.round(x))
  f = pl.pallas_call(nan_kernel, sds((8, 128)))
  return f, (f32(8, 128),)


@case
def bool_operands(pl, pltpu):
  def mask_kernel(m_ref, x_ref, o_ref, b_ref):
    m = m_ref[...]
    o_ref[...] = jnp.where(m, x_ref[...], 0.0)
    b_ref[...] = jnp.logical_not(m)
  f = pl.pallas_call(mask_kernel, (sds((8, 128)), sds((8, 128), jnp.bool_)))
  return f, (jnp.arange(8 * 128).reshape(8, 128) % 3 == 0, f32(8, 128))



@case
def bool_squeezed_windows(pl, pltpu):
  def mask_row_kernel(m_ref, x_ref, o_ref, b_ref):
    m = m_ref[1]                    # a squeezed window of a bool block
    o_ref[...] = jnp.where(m, x_ref[...], 0.0)
    b_ref[0] = jnp.logical_not(m)
  f = pl.pallas_call(mask_row_kernel,
                     (sds((8, 128)), sds((1, 8, 128), jnp.bool_)))
  return f, (jnp.arange(2 * 8 * 128).reshape(2, 8, 128) % 3 == 0,
             f32(8, 128))

@case
def when_inside_loop(pl, pltpu):
  def loop_when_kernel(s_ref, x_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)

    def body(i, c):
      @pl.when(i % 2 == s_ref[0])
      def _():
        o_ref[...] += x_ref[pl.ds(i * 8, 8), :]
      return c
    lax.fori_loop(0, 4, body, 0)
  f = pl.pallas_call(loop_when_kernel, sds((8, 128)),
                     in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                               pl.BlockSpec(memory_space=pltpu.VMEM)])
  return f, (jnp.array([1], jnp.int32), f32(32, 128))
