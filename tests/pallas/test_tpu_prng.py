"""pltpu.prng_seed / prng_random_bits / stateful_* on the host backends
(`interpret`, and `mosaic_interpret`, which runs the tpu dialect's seed and
random-bits ops): deterministic per seed, new numbers per draw (also inside
loops and branches) and per grid step, the distributions the samplers
promise with jax.random's conversions, the same bits on both host
backends, and the dtypes Pallas gives. The Mosaic modules themselves are
compared with Pallas's in test_mosaic_golden.py (mosaic_corpus_prng.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as jpltpu
import jax.extend.random as jex_random

import dsl
from dsl import tpu as pltpu
from dsl.tpu import prng_state as host_prng

HOST = ["interpret", "mosaic_interpret"]


def _bits_kernel(seed_ref, o_ref):
  pltpu.prng_seed(seed_ref[0], dsl.program_id(0))
  o_ref[0] = pltpu.prng_random_bits((8, 128))
  o_ref[1] = pltpu.prng_random_bits((8, 128))


def _bits(seed, backend="interpret"):
  return dsl.pallas_call(
      _bits_kernel, jax.ShapeDtypeStruct((2, 2, 8, 128), jnp.int32), grid=(2,),
      in_specs=[dsl.BlockSpec(memory_space=pltpu.SMEM)],
      out_specs=dsl.BlockSpec((None, 2, 8, 128), lambda i: (i, 0, 0, 0)),
      backend=backend)(jnp.array([seed], jnp.int32))


def test_bits_dtype_like_pallas():
  theirs = jax.eval_shape(lambda: jpltpu.prng_random_bits((8, 128)))
  out = _bits(0)
  assert out.dtype == theirs.dtype == jnp.int32
  assert out.shape == (2, 2) + theirs.shape


@pytest.mark.parametrize("backend", HOST)
def test_same_seed_same_bits_other_seed_other_bits(backend):
  a, b, c = _bits(1, backend), _bits(1, backend), _bits(2, backend)
  np.testing.assert_array_equal(a, b)
  assert (a != c).mean() > 0.99


@pytest.mark.parametrize("backend", HOST)
def test_draws_and_grid_steps_differ(backend):
  out = np.asarray(_bits(3, backend))
  assert (out[0, 0] != out[0, 1]).mean() > 0.99   # two draws
  assert (out[0, 0] != out[1, 0]).mean() > 0.99   # seeded by program_id
  # the bits look uniform: each of the 32 bits is set about half the time
  words = out.view(np.uint32).ravel()
  ones = np.array([((words >> k) & 1).mean() for k in range(32)])
  assert np.all(np.abs(ones - 0.5) < 0.05), ones


def test_both_host_backends_draw_the_same_bits():
  np.testing.assert_array_equal(_bits(5, "interpret"),
                                _bits(5, "mosaic_interpret"))


def test_generator_is_threefry():
  rng = np.random.default_rng(0)
  key = rng.integers(0, 2**32, 2, dtype=np.uint32)
  x = rng.integers(0, 2**32, 64, dtype=np.uint32)
  theirs = np.asarray(jex_random.threefry_2x32(jnp.asarray(key),
                                               jnp.asarray(x)))
  for xp in (np, jnp):
    o0, o1 = host_prng.threefry2x32(xp.asarray(key[:1]), xp.asarray(key[1:]),
                                    xp.asarray(x[:32]), xp.asarray(x[32:]))
    np.testing.assert_array_equal(np.concatenate([o0, o1]), theirs)


@pytest.mark.parametrize("backend", HOST)
def test_draws_in_a_loop_differ_per_iteration(backend):
  def kernel(o_ref):
    pltpu.prng_seed(7)

    def body(i, carry):
      o_ref[dsl.ds(i * 8, 8), :] = pltpu.stateful_uniform((8, 128))
      return carry
    lax.fori_loop(0, 4, body, None)

  out = np.asarray(dsl.pallas_call(
      kernel, jax.ShapeDtypeStruct((32, 128), jnp.float32),
      backend=backend)()).reshape(4, -1)
  assert len({tuple(r) for r in out.round(6)}) == 4
  assert out.min() >= 0 and out.max() < 1


@pytest.mark.parametrize("backend", HOST)
def test_draws_in_while_loops_and_branches(backend):
  def kernel(n_ref, o_ref):
    pltpu.prng_seed(9)

    @dsl.when(n_ref[0] > 0)
    def _():
      o_ref[0] = pltpu.prng_random_bits((8, 128))

    def body(k):
      o_ref[k] = pltpu.prng_random_bits((8, 128))
      return k + 1
    lax.while_loop(lambda k: k < n_ref[0], body, 1)

  out = np.asarray(dsl.pallas_call(
      kernel, jax.ShapeDtypeStruct((3, 8, 128), jnp.int32),
      in_specs=[dsl.BlockSpec(memory_space=pltpu.SMEM)],
      backend=backend)(jnp.array([3], jnp.int32)))
  rows = {tuple(r) for r in out.reshape(3, -1)}
  assert len(rows) == 3
  again = dsl.pallas_call(
      kernel, jax.ShapeDtypeStruct((3, 8, 128), jnp.int32),
      in_specs=[dsl.BlockSpec(memory_space=pltpu.SMEM)],
      backend="interpret")(jnp.array([3], jnp.int32))
  np.testing.assert_array_equal(out, again)


@pytest.mark.parametrize("backend", HOST)
def test_samplers(backend):
  def kernel(u_ref, n_ref, b_ref, h_ref):
    pltpu.prng_seed(11)
    u_ref[...] = pltpu.stateful_uniform((64, 128), minval=2.0, maxval=4.0)
    n_ref[...] = pltpu.stateful_normal((64, 128))
    b_ref[...] = pltpu.stateful_bernoulli(0.25, (64, 128)).astype(jnp.int32)
    h_ref[...] = pltpu.stateful_bernoulli(0.1, (64, 128),
                                          mode="high").astype(jnp.int32)

  shapes = (jax.ShapeDtypeStruct((64, 128), jnp.float32),
            jax.ShapeDtypeStruct((64, 128), jnp.float32),
            jax.ShapeDtypeStruct((64, 128), jnp.int32),
            jax.ShapeDtypeStruct((64, 128), jnp.int32))
  u, n, b, h = map(np.asarray,
                   dsl.pallas_call(kernel, shapes, backend=backend)())
  assert u.min() >= 2 and u.max() < 4 and abs(u.mean() - 3) < 0.05
  assert abs(n.mean()) < 0.05 and abs(n.std() - 1) < 0.05
  assert np.all(np.isfinite(n))
  assert abs(b.mean() - 0.25) < 0.03
  assert abs(h.mean() - 0.1) < 0.02


def _words_impl(words):
  """A jax.random key implementation whose draws are `words`: jax.random's
  samplers on it show how they turn those words into numbers."""
  return jex_random.define_prng_impl(
      key_shape=(1,), seed=lambda s: jnp.zeros((1,), jnp.uint32),
      split=lambda k, shape: jnp.zeros((*shape, 1), jnp.uint32),
      fold_in=lambda k, d: k,
      random_bits=lambda k, width, shape: jnp.asarray(words).reshape(shape),
      name="fixed_words")


@pytest.mark.parametrize("backend", HOST)
def test_samplers_convert_words_like_jax_random(backend):
  def kernel(w_ref, u_ref, n_ref, b_ref):
    for ref in (w_ref, u_ref, n_ref, b_ref):
      pltpu.prng_seed(4)            # every sampler sees the same words
      if ref is w_ref:
        w_ref[...] = pltpu.stateful_bits((8, 128))
      elif ref is u_ref:
        u_ref[...] = pltpu.stateful_uniform((8, 128), minval=-1.0, maxval=3.0)
      elif ref is n_ref:
        n_ref[...] = pltpu.stateful_normal((8, 128))
      else:
        b_ref[...] = pltpu.stateful_bernoulli(0.3, (8, 128)).astype(jnp.int32)

  shapes = (jax.ShapeDtypeStruct((8, 128), jnp.uint32),
            jax.ShapeDtypeStruct((8, 128), jnp.float32),
            jax.ShapeDtypeStruct((8, 128), jnp.float32),
            jax.ShapeDtypeStruct((8, 128), jnp.int32))
  w, u, n, b = dsl.pallas_call(kernel, shapes, backend=backend)()
  key = jax.random.key(0, impl=_words_impl(w))
  np.testing.assert_array_equal(
      u, jax.random.uniform(key, (8, 128), minval=-1.0, maxval=3.0))
  np.testing.assert_allclose(n, jax.random.normal(key, (8, 128)),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(b, jax.random.bernoulli(key, 0.3, (8, 128)))


def test_gradient_through_a_dropout_kernel():
  def dropout(x_ref, o_ref):
    pltpu.prng_seed(3, dsl.program_id(0))
    keep = pltpu.stateful_bernoulli(0.5, (8, 128))
    o_ref[...] = jnp.where(keep, x_ref[...] * 2.0, 0.0)

  def f(x):
    spec = dsl.BlockSpec((8, 128), lambda i: (i, 0))
    return dsl.pallas_call(dropout, jax.ShapeDtypeStruct(x.shape, x.dtype),
                           grid=(2,), in_specs=[spec], out_specs=spec,
                           interpret=True)(x)

  x = jnp.ones((16, 128))
  y = f(x)
  g = jax.grad(lambda x: jnp.sum(f(x)))(x)
  np.testing.assert_array_equal(g, jnp.where(y != 0, 2.0, 0.0))
  assert 0.4 < float((y != 0).mean()) < 0.6


def _prefetch_seeded_dropout(seed_ref, x_ref, o_ref):
  pltpu.prng_seed(seed_ref[0], dsl.program_id(0))
  keep = pltpu.stateful_bernoulli(0.5, (8, 128))
  o_ref[...] = jnp.where(keep, x_ref[...] * 2.0, 0.0)


@pytest.mark.parametrize("backend", HOST)
@pytest.mark.parametrize("seed", [3, 12345])
def test_gradient_of_a_kernel_seeded_from_scalar_prefetch(backend, seed):
  def f(x, s):
    spec = dsl.BlockSpec((8, 128), lambda i, s_ref: (i, 0))
    return dsl.pallas_call(
        _prefetch_seeded_dropout, jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(2,), in_specs=[spec],
            out_specs=spec), backend=backend)(s, x)

  x = jnp.linspace(1.0, 2.0, 16 * 128).reshape(16, 128)
  s = jnp.array([seed], jnp.int32)
  y = f(x, s)
  g = jax.grad(lambda x: jnp.sum(f(x, s) ** 2))(x)
  np.testing.assert_allclose(g, jnp.where(y != 0, 8.0 * x, 0.0), rtol=1e-6)
  assert 0.4 < float((y != 0).mean()) < 0.6
  _, tangent = jax.jvp(lambda x: f(x, s), (x,), (jnp.ones_like(x),))
  np.testing.assert_array_equal(tangent, jnp.where(y != 0, 2.0, 0.0))


def test_kernels_without_random_numbers_are_unchanged():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1
  out = dsl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                        interpret=True)(jnp.zeros(8))
  np.testing.assert_array_equal(out, np.ones(8))


def test_prng_outside_a_kernel_is_an_error():
  with pytest.raises(dsl.KernelError, match="inside a kernel body"):
    pltpu.prng_seed(0)
  with pytest.raises(dsl.KernelError, match="inside a kernel body"):
    pltpu.stateful_uniform((8, 128))


@pytest.mark.parametrize("draw, says", [
    (lambda: pltpu.prng_seed(1.5), "seed 0 must be an integer scalar"),
    (lambda: pltpu.stateful_uniform((8, 128), jnp.bfloat16), "float32"),
    (lambda: pltpu.stateful_bits((8, 128), jnp.uint8), "uint32"),
])
def test_bad_arguments_name_the_problem(draw, says):
  def kernel(o_ref):
    draw()
  with pytest.raises(dsl.KernelError, match=says):
    dsl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                    interpret=True)()


def test_mosaic_interpret_rejects_a_draw_before_the_seed():
  def kernel(o_ref):
    o_ref[...] = pltpu.prng_random_bits((8, 128))
  with pytest.raises(Exception, match="before prng_seed"):
    jax.block_until_ready(dsl.pallas_call(
        kernel, jax.ShapeDtypeStruct((8, 128), jnp.int32),
        backend="mosaic_interpret")())


def test_mosaic_rejects_a_draw_of_rank_one():
  def kernel(o_ref):
    pltpu.prng_seed(0)
    o_ref[...] = pltpu.prng_random_bits((128,))
  with pytest.raises(dsl.BackendError, match="rank 2 or more"):
    dsl.pallas_call(kernel, jax.ShapeDtypeStruct((128,), jnp.int32),
                    backend="mosaic_interpret")()


def test_triton_rejects_random_numbers_clearly():
  with pytest.raises(dsl.BackendError, match="prng_seed.*not supported"):
    _bits(0, backend="triton_interpret")


def test_threefry2x32_over_a_vectorized_grid_on_interpret():
  """JAX's threefry2x32 primitive in a kernel whose grid the interpret
  backend vectorizes: per-point counts (batched), a count block that is the
  same at every point (`zeros_like`, not batched) and (1, 1) keys, as
  Pallas's TPU threefry kernel passes them."""
  def kernel(key_ref, o_ref):
    i, j = dsl.program_id(0), dsl.program_id(1)
    lo = (lax.broadcasted_iota(jnp.uint32, (8, 128), 1)
          + (i * 2 + j).astype(jnp.uint32) * 1024)
    hi = jnp.zeros_like(lo)
    k1 = jnp.reshape(key_ref[0, 0], (1, 1))
    k2 = jnp.reshape(key_ref[0, 1], (1, 1))
    a, b = jex_random.threefry2x32_p.bind(k1, k2, hi, lo)
    o_ref[...] = a ^ b

  key = jnp.array([[3, 7]], jnp.uint32)
  out = dsl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((16, 256), jnp.uint32),
      grid=(2, 2), in_specs=[dsl.BlockSpec(memory_space=pltpu.SMEM)],
      out_specs=dsl.BlockSpec((8, 128), lambda i, j: (i, j)),
      backend="interpret")(key)
  lo = (jnp.arange(128, dtype=jnp.uint32)[None, None, :]
        + jnp.arange(4, dtype=jnp.uint32)[:, None, None] * 1024)
  lo = jnp.broadcast_to(lo, (4, 8, 128))
  a, b = jex_random.threefry_2x32(key[0], jnp.stack([jnp.zeros_like(lo), lo]))
  want = (a ^ b).reshape(2, 2, 8, 128).transpose(0, 2, 1, 3).reshape(16, 256)
  np.testing.assert_array_equal(out, want)
