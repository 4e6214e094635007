"""Golden corpus: the TPU's random numbers (see mosaic_corpus.py):
`prng_seed`, `prng_random_bits` and the `stateful_*` samplers, whose
jax.random conversions must lower to Pallas's operations."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from tests.pallas.mosaic_corpus import case, f32, sds


def _smem(pl, pltpu):
  return pl.BlockSpec(memory_space=pltpu.SMEM)


@case
def prng_bits_per_grid_step(pl, pltpu):
  def bits_kernel(seed_ref, o_ref):
    pltpu.prng_seed(seed_ref[0], pl.program_id(0))
    o_ref[0] = pltpu.prng_random_bits((8, 128))
    o_ref[1] = pltpu.prng_random_bits((8, 128))
  f = pl.pallas_call(
      bits_kernel, sds((2, 16, 128), jnp.int32), grid=(2,),
      in_specs=[_smem(pl, pltpu)],
      out_specs=pl.BlockSpec((2, 8, 128), lambda i: (0, i, 0)))
  return f, (jnp.array([7], jnp.int32),)


@case
def prng_uniform_and_bits(pl, pltpu):
  def uniform_kernel(lim_ref, u_ref, v_ref, b_ref):
    pltpu.prng_seed(3)
    u_ref[...] = pltpu.stateful_uniform((8, 128))
    v_ref[...] = pltpu.stateful_uniform((16, 128), minval=-2.0,
                                        maxval=lim_ref[0])
    b_ref[...] = lax.bitcast_convert_type(pltpu.stateful_bits((8, 128)),
                                          jnp.int32)
  f = pl.pallas_call(
      uniform_kernel, (sds((8, 128)), sds((16, 128)),
                       sds((8, 128), jnp.int32)),
      in_specs=[_smem(pl, pltpu)])
  return f, (jnp.array([5.0], jnp.float32),)


@case
def prng_normal_and_bernoulli(pl, pltpu):
  def sample_kernel(seed_ref, n_ref, b_ref, d_ref):
    pltpu.prng_seed(seed_ref[0], seed_ref[1])
    n_ref[...] = pltpu.stateful_normal((8, 128)) * 0.5 + 1.0
    b_ref[...] = pltpu.stateful_bernoulli(0.25, (8, 128)).astype(jnp.int32)
    keep = pltpu.stateful_bernoulli(seed_ref[2].astype(jnp.float32) / 10,
                                    (8, 128))
    d_ref[...] = jnp.where(keep, n_ref[...] * 2.0, 0.0)
  f = pl.pallas_call(
      sample_kernel, (sds((8, 128)), sds((8, 128), jnp.int32),
                      sds((8, 128))),
      in_specs=[_smem(pl, pltpu)])
  return f, (jnp.array([1, 2, 9], jnp.int32),)


@case
def prng_draws_in_a_loop(pl, pltpu):
  def loop_kernel(o_ref):
    pltpu.prng_seed(11)

    def body(i, carry):
      o_ref[pl.ds(i * 8, 8), :] = pltpu.stateful_uniform((8, 128))
      return carry
    lax.fori_loop(0, 4, body, None)
  f = pl.pallas_call(loop_kernel, sds((32, 128)))
  return f, ()


@case
def erf_inv_values(pl, pltpu):
  def erf_inv_kernel(x_ref, o_ref):
    o_ref[...] = lax.erf_inv(x_ref[...])
  f = pl.pallas_call(erf_inv_kernel, sds((8, 128)))
  return f, (f32(8, 128) * 0.5,)


@case
def prng_bernoulli_high_resolution(pl, pltpu):
  def high_kernel(o_ref):
    pltpu.prng_seed(5)
    o_ref[...] = pltpu.stateful_bernoulli(0.1, (8, 128),
                                          mode="high").astype(jnp.int32)
  f = pl.pallas_call(high_kernel, sds((8, 128), jnp.int32))
  return f, ()


@case
def threefry_hash(pl, pltpu):
  # tpu.random.threefry's kernel: the hash of counts under a key from SMEM
  from jax.extend.random import threefry2x32_p

  def threefry_kernel(key_ref, hi_ref, lo_ref, o_ref, p_ref):
    k1 = jnp.reshape(key_ref[0, 0], (1, 1))
    k2 = jnp.reshape(key_ref[0, 1], (1, 1))
    o1, o2 = threefry2x32_p.bind(k1, k2, hi_ref[...], lo_ref[...])
    o_ref[...] = o1 ^ o2
    p_ref[...] = o1
  f = pl.pallas_call(
      threefry_kernel, (sds((8, 128), jnp.uint32), sds((8, 128), jnp.uint32)),
      in_specs=[_smem(pl, pltpu), pl.BlockSpec(memory_space=pltpu.VMEM),
                pl.BlockSpec(memory_space=pltpu.VMEM)])
  counts = jnp.arange(8 * 128, dtype=jnp.uint32).reshape(8, 128)
  return f, (jnp.array([[3, 7]], jnp.uint32), counts // 7, counts)
