"""Golden corpus: more block shapes, values, loops and shapes (see
mosaic_corpus.py).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from tests.pallas.mosaic_corpus import case, f32, sds


# ------------------------------------------------------------ more blocks

@case
def squeezed_3d_grid(pl, pltpu):
  def mid_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0
  spec = pl.BlockSpec((None, 8, 128), lambda i, j, k: (i, j, k))
  f = pl.pallas_call(mid_kernel, sds((3, 16, 256)), grid=(3, 2, 2),
                     in_specs=[spec], out_specs=spec,
                     compiler_params=pltpu.CompilerParams(
                         dimension_semantics=("parallel", "arbitrary",
                                              "parallel")))
  return f, (f32(3, 16, 256),)


@case
def element_with_padding(pl, pltpu):
  def pad_kernel(x_ref, o_ref):
    # rows 8.. of the last window are padding (undefined): not read
    o_ref[...] = x_ref[pl.ds(0, 8), :] * 2.0
  f = pl.pallas_call(
      pad_kernel, sds((32, 128)), grid=(4,),
      in_specs=[pl.BlockSpec((pl.Element(16, (0, 8)), pl.Element(128)),
                             lambda i: (i * 8, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)))
  return f, (f32(32, 128),)


@case
def squeezed_and_element(pl, pltpu):
  def page_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0
  f = pl.pallas_call(
      page_kernel, sds((2, 16, 128)), grid=(2, 2),
      in_specs=[pl.BlockSpec((None, pl.Element(8), pl.Element(128)),
                             lambda b, i: (b, i * 8, 0))],
      out_specs=pl.BlockSpec((None, 8, 128), lambda b, i: (b, i, 0)))
  return f, (f32(2, 16, 128),)


@case
def smem_output_and_scratch(pl, pltpu):
  def count_kernel(x_ref, o_ref, acc_ref):
    acc_ref[0] = 0
    for k in range(4):
      acc_ref[0] = acc_ref[0] + x_ref[k]
    o_ref[0] = acc_ref[0] * 2
  f = pl.pallas_call(
      count_kernel, sds((1,), jnp.int32),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)],
      out_specs=pl.BlockSpec(memory_space=pltpu.SMEM),
      scratch_shapes=[pltpu.SMEM((1,), jnp.int32)])
  return f, (jnp.arange(4, dtype=jnp.int32),)


@case
def prefetch_in_body_and_alias(pl, pltpu):
  def scatter_kernel(idx_ref, x_ref, y_ref, o_ref):
    del y_ref
    o_ref[...] = x_ref[...] * idx_ref[pl.program_id(0)].astype(jnp.float32)
  f = pl.pallas_call(
      scatter_kernel, sds((32, 128)),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(2,),
          in_specs=[pl.BlockSpec((8, 128), lambda i, idx: (i, 0)),
                    pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=pl.BlockSpec((8, 128), lambda i, idx: (idx[i], 0))),
      input_output_aliases={2: 0})
  return f, (jnp.array([1, 3], jnp.int32), f32(16, 128), f32(32, 128))


@case
def multiple_outputs_2d(pl, pltpu):
  def split_kernel(x_ref, lo_ref, hi_ref):
    x = x_ref[...]
    lo_ref[...] = jnp.minimum(x, 0.0)
    hi_ref[...] = jnp.maximum(x, 0.0)
  spec = pl.BlockSpec((16, 128), lambda i, j: (i, j))
  f = pl.pallas_call(split_kernel, (sds((32, 256)), sds((32, 256))),
                     grid=(2, 2), in_specs=[spec], out_specs=[spec, spec],
                     compiler_params=pltpu.CompilerParams(
                         dimension_semantics=("parallel", "parallel")))
  return f, (f32(32, 256),)


@case
def cost_estimate_passed(pl, pltpu):
  def exp_kernel(x_ref, o_ref):
    o_ref[...] = jnp.exp(x_ref[...])
  cost = pl.CostEstimate(flops=1024, transcendentals=1024,
                         bytes_accessed=8192)
  f = pl.pallas_call(exp_kernel, sds((8, 128)), cost_estimate=cost)
  return f, (f32(8, 128),)


# ------------------------------------------------------------ values

@case
def bf16_int8_math(pl, pltpu):
  def lowp_kernel(a_ref, b_ref, c_ref, o_ref, q_ref, h_ref):
    a = a_ref[...]
    o_ref[...] = jnp.dot(a, b_ref[...], preferred_element_type=jnp.float32)
    q_ref[...] = (c_ref[...] * 4).astype(jnp.int8)
    h_ref[...] = (a * 2).astype(jnp.float32) + c_ref[...].astype(jnp.float32)
  f = pl.pallas_call(lowp_kernel, (sds((128, 128)),
                                   sds((128, 128), jnp.int8),
                                   sds((128, 128))))
  a = jnp.ones((128, 128), jnp.bfloat16)
  return f, (a, a, jnp.ones((128, 128), jnp.int32))


@case
def float_to_int_cast(pl, pltpu):
  def quantize_kernel(x_ref, q_ref):
    q_ref[...] = jnp.clip(x_ref[...] * 4.0, -128, 127).astype(jnp.int8)
  f = pl.pallas_call(quantize_kernel, sds((32, 128), jnp.int8))
  return f, (f32(32, 128),)


@case
def int_arith_and_compare(pl, pltpu):
  def int_kernel(x_ref, o_ref):
    x = x_ref[...]
    y = jnp.where(x > 3, x * 2 - 1, x >> 1) & 0xFF
    o_ref[...] = y + lax.broadcasted_iota(jnp.int32, (8, 128), 0)
  f = pl.pallas_call(int_kernel, sds((8, 128), jnp.int32))
  return f, (jnp.ones((8, 128), jnp.int32),)


@case
def transcendental_and_reduce_min(pl, pltpu):
  def softmax_kernel(x_ref, o_ref):
    x = x_ref[...]
    m = jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x - m)
    o_ref[...] = e / jnp.sum(e, axis=-1, keepdims=True) + jnp.min(
        x, axis=-1, keepdims=True)
  f = pl.pallas_call(softmax_kernel, sds((8, 128)))
  return f, (f32(8, 128),)


@case
def pl_loop_over_ref(pl, pltpu):
  def acc_kernel(x_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)

    def body(i, c):
      o_ref[...] += x_ref[pl.ds(i * 8, 8), :]
      return c
    lax.fori_loop(0, 4, body, 0)
  f = pl.pallas_call(acc_kernel, sds((8, 128)))
  return f, (f32(32, 128),)


@case
def dynamic_while(pl, pltpu):
  def count_kernel(n_ref, x_ref, o_ref):
    def cond(c):
      return c[0] < n_ref[0]

    def body(c):
      return c[0] + 1, c[1] + x_ref[...]
    _, acc = lax.while_loop(cond, body, (jnp.int32(0),
                                         jnp.zeros((8, 128), jnp.float32)))
    o_ref[...] = acc
  f = pl.pallas_call(count_kernel, sds((8, 128)),
                     in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                               pl.BlockSpec(memory_space=pltpu.VMEM)])
  return f, (jnp.array([3], jnp.int32), f32(8, 128))


@case
def dynamic_fori_bounds(pl, pltpu):
  def span_kernel(n_ref, x_ref, o_ref):
    def body(i, acc):
      return acc + x_ref[...] * i.astype(jnp.float32)
    o_ref[...] = lax.fori_loop(1, n_ref[0], body,
                               jnp.zeros((8, 128), jnp.float32))
  f = pl.pallas_call(span_kernel, sds((8, 128)),
                     in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                               pl.BlockSpec(memory_space=pltpu.VMEM)])
  return f, (jnp.array([3], jnp.int32), f32(8, 128))


@case
def switch_three_branches(pl, pltpu):
  def switch_kernel(x_ref, o_ref):
    i = pl.program_id(0)
    o_ref[...] = lax.switch(i, [lambda x: x + 1.0, lambda x: x * 2.0,
                                lambda x: x - 3.0], x_ref[...])
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  f = pl.pallas_call(switch_kernel, sds((24, 128)), grid=(3,),
                     in_specs=[spec], out_specs=spec)
  return f, (f32(24, 128),)


@case
def transpose_and_broadcast(pl, pltpu):
  def t_kernel(x_ref, r_ref, o_ref):
    o_ref[...] = x_ref[...].T + r_ref[...]
  f = pl.pallas_call(t_kernel, sds((128, 128)))
  return f, (f32(128, 128), f32(1, 128))


@case
def tile_repeats(pl, pltpu):
  def tile_kernel(x_ref, o_ref):
    o_ref[...] = jnp.tile(x_ref[...], (2, 3))
  f = pl.pallas_call(tile_kernel, sds((16, 384)))
  return f, (f32(8, 128),)


@case
def reshaped_ref_window(pl, pltpu):
  # ragged paged attention's K/V read: a buffer of a stack, reshaped, read
  # every other row
  def reshape_kernel(x_ref, i_ref, o_ref, w_ref):
    flat = x_ref.at[i_ref[0]].reshape(32, 128)
    o_ref[...] = flat[1::2, :]
    w_ref[...] = x_ref.reshape(64, 128)[...]
  f = pl.pallas_call(
      reshape_kernel, (sds((16, 128)), sds((64, 128))),
      in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM),
                pl.BlockSpec(memory_space=pltpu.SMEM)])
  x = jnp.arange(2 * 4 * 8 * 128, dtype=jnp.float32).reshape(2, 4, 8, 128)
  return f, (x, jnp.array([1], jnp.int32))
