"""Reshapes and broadcasts of scalars (reductions, single elements) inside
kernels, and their jvp: Triton has no reshape of a scalar, so the Triton
lowering broadcasts a scalar to its one-element shape and reduces a
one-element tensor to a scalar. Each kernel runs on every CPU backend and
compiles ahead of time for sm_90, against jnp and Pallas in interpret
mode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl

import dsl
from lowering_triton import aot
from tests.pallas.testing import CPU_BACKENDS, array, assert_close


def minus_max_reshaped(x_ref, o_ref):
  v = x_ref[...]
  o_ref[...] = v - jnp.reshape(v.max(axis=(0, 1)), (1, 1))


def minus_max(x_ref, o_ref):
  v = x_ref[...]
  o_ref[...] = v - v.max()


def element_and_sums(x_ref, o_ref):
  v = x_ref[...]
  corner = jnp.reshape(v[:1, :1], ())          # one element -> a scalar
  total = jnp.expand_dims(jnp.sum(v, axis=(0, 1)), (0, 1))
  o_ref[...] = v * corner + total + jnp.broadcast_to(v.min(), v.shape)


def int_reductions(x_ref, o_ref):
  v = x_ref[...]
  top = jnp.reshape(jnp.max(v), (1, 1))
  o_ref[...] = (v - top) + jnp.reshape(jnp.squeeze(v[:1, 2:3]), (1, 1))


def reference(kernel, x):
  out = np.zeros(x.shape, x.dtype)

  class Ref:
    def __init__(self, a):
      self.a = a
    def __getitem__(self, idx):
      return jnp.asarray(self.a[idx])
    def __setitem__(self, idx, v):
      out[idx] = np.asarray(v)
  kernel(Ref(np.asarray(x)), Ref(out))
  return out


KERNELS = [minus_max_reshaped, minus_max, element_and_sums]


def _call(pl, kernel, x, **kw):
  return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        **kw)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
@pytest.mark.parametrize("shape", [(8, 128), (16, 128)])
def test_scalar_reshapes_and_their_jvp(backend, kernel, shape):
  # Multiples of 1/8: sums and products are exact in any order.
  x = jnp.round(array((kernel.__name__, shape), shape, jnp.float32) * 8) / 8
  t = jnp.round(array((kernel.__name__, shape, "t"), shape, jnp.float32) * 8) / 8
  f = _call(dsl, kernel, x, backend=backend)
  theirs = _call(jpl, kernel, x, interpret=True)
  assert_close(jax.jit(f)(x), reference(kernel, x))
  assert_close(f(x), theirs(x))
  got = jax.jit(lambda x, t: jax.jvp(f, (x,), (t,)))(x, t)
  want = jax.jvp(theirs, (x,), (t,))
  assert_close(got[0], want[0])
  assert_close(got[1], want[1])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bfloat16])
def test_scalar_reshapes_of_other_dtypes(backend, dtype):
  x = array(("ints", dtype), (8, 128), dtype)
  got = _call(dsl, int_reductions, x, backend=backend)(x)
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(reference(int_reductions, x),
                                           np.float32))


@pytest.mark.parametrize("kernel", KERNELS + [int_reductions],
                         ids=lambda k: k.__name__)
def test_scalar_reshapes_compile_for_the_gpu(kernel):
  x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
  f = _call(dsl, kernel, x, backend="triton")
  kernels = aot.compile_aot(lambda x, t: jax.jvp(f, (x,), (t,)), x, x)
  # Triton's compiler fails on a reshape of a scalar ("'dtype' object has
  # no attribute 'numel'").
  assert kernels and all(k.cubin for k in kernels)
