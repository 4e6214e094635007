"""pltpu.prng_seed / prng_random_bits / stateful_* on the host backends:
deterministic per seed, new numbers per draw (also inside loops), the
distributions the samplers promise, and the dtypes Pallas gives."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as jpltpu

import dsl
from dsl import tpu as pltpu


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


def test_same_seed_same_bits_other_seed_other_bits():
  a, b, c = _bits(1), _bits(1), _bits(2)
  np.testing.assert_array_equal(a, b)
  assert (a != c).mean() > 0.99


def test_draws_and_grid_steps_differ():
  out = np.asarray(_bits(3))
  assert (out[0, 0] != out[0, 1]).mean() > 0.99   # two draws
  assert (out[0, 0] != out[1, 0]).mean() > 0.99   # seeded by program_id
  # the bits look uniform: each of the 32 bits is set about half the time
  words = out.view(np.uint32).ravel()
  ones = np.array([((words >> k) & 1).mean() for k in range(32)])
  assert np.all(np.abs(ones - 0.5) < 0.05), ones


def test_draws_in_a_loop_differ_per_iteration():
  def kernel(o_ref):
    pltpu.prng_seed(7)
    def body(i, carry):
      o_ref[pl_ds(i)] = pltpu.stateful_uniform((1, 128))
      return carry
    jax.lax.fori_loop(0, 8, body, 0)

  def pl_ds(i):
    return (dsl.ds(i, 1), slice(None))

  out = np.asarray(dsl.pallas_call(
      kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32), interpret=True)())
  assert len({tuple(r) for r in out.round(6)}) == 8
  assert out.min() >= 0 and out.max() < 1


def test_samplers(backend="interpret"):
  def kernel(u_ref, n_ref, b_ref):
    pltpu.prng_seed(11)
    u_ref[...] = pltpu.stateful_uniform((64, 128), minval=2.0, maxval=4.0)
    n_ref[...] = pltpu.stateful_normal((64, 128))
    b_ref[...] = pltpu.stateful_bernoulli(0.25, (64, 128)).astype(jnp.int32)

  shapes = (jax.ShapeDtypeStruct((64, 128), jnp.float32),
            jax.ShapeDtypeStruct((64, 128), jnp.float32),
            jax.ShapeDtypeStruct((64, 128), jnp.int32))
  u, n, b = dsl.pallas_call(kernel, shapes, backend=backend)()
  u, n, b = map(np.asarray, (u, n, b))
  assert u.min() >= 2 and u.max() < 4 and abs(u.mean() - 3) < 0.05
  assert abs(n.mean()) < 0.05 and abs(n.std() - 1) < 0.05
  assert abs(b.mean() - 0.25) < 0.03


def test_kernels_without_random_numbers_are_unchanged():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1
  out = dsl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                        interpret=True)(jnp.zeros(8))
  np.testing.assert_array_equal(out, np.ones(8))


def test_prng_outside_a_kernel_is_an_error():
  with pytest.raises(dsl.KernelError, match="inside a kernel body"):
    pltpu.prng_seed(0)


@pytest.mark.parametrize("backend", ["triton_interpret", "mosaic_interpret"])
def test_compiled_backends_reject_random_numbers_clearly(backend):
  with pytest.raises(dsl.BackendError, match="not supported"):
    _bits(0, backend=backend)
