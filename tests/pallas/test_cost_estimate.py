"""`pl.estimate_cost` counts what Pallas's `estimate_cost` counts, so a kernel
that passes it to `pallas_call(cost_estimate=...)` gets the same TPU custom
call on both."""
import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as jpl

import dsl as pl

S = jax.ShapeDtypeStruct


def _attention(q, k, v):
  s = jnp.einsum("bqd,bkd->bqk", q, k) * 0.125
  return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v)


def _powers(x, y):
  z = x @ y
  return jnp.sqrt(jnp.abs(z)) ** -5 - jnp.floor(z) ** 2 + z ** 1 + z ** 0


@jax.jit
def _jitted(x):
  return jnp.tanh(x) * x


def _custom(x):
  f = jax.custom_vjp(lambda a: jnp.exp(a) + a)
  f.defvjp(lambda a: (f(a), a), lambda a, g: (g * a,))
  return f(x)


CASES = {
    "attention": (_attention, [S((2, 128, 64), jnp.bfloat16)] * 3),
    "attention_f32": (_attention, [S((1, 8, 16), jnp.float32)] * 3),
    "powers": (_powers, [S((32, 16), jnp.float32), S((16, 8), jnp.float32)]),
    "jit": (lambda x: _jitted(x) + 1, [S((4, 256), jnp.float32)]),
    "custom_vjp": (_custom, [S((8, 128), jnp.float32)]),
    "bitwise": (lambda a, b: (a & b) | ~a ^ b, [S((64,), jnp.int32)] * 2),
    "pytree": (lambda d: d["x"] * d["y"],
               [{"x": S((3, 5), jnp.float16), "y": S((3, 5), jnp.float16)}]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_estimate_matches_pallas(name):
  fn, args = CASES[name]
  got = pl.estimate_cost(fn, *args)
  want = jpl.estimate_cost(fn, *args)
  assert (got.flops, got.transcendentals, got.bytes_accessed) == (
      want.flops, want.transcendentals, want.bytes_accessed)
  assert got.flops > 0 or name == "pytree"


def test_dot_counts_two_flops_per_multiply_add():
  est = pl.estimate_cost(lambda x, y: x @ y, S((8, 4), jnp.float32),
                         S((4, 16), jnp.float32))
  assert est.flops == 2 * 8 * 4 * 16
  assert est.transcendentals == 0
  assert est.bytes_accessed == 4 * (8 * 4 + 4 * 16 + 8 * 16)


def test_arrays_and_keyword_arguments():
  x = jnp.ones((16, 128))
  est = pl.estimate_cost(lambda x, *, scale: jnp.exp(x) * scale, x, scale=2.0)
  assert est.transcendentals == 16 * 128 and est.flops == 16 * 128


def test_the_estimate_reaches_the_kernel():
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)
  est = pl.estimate_cost(jnp.exp, x)

  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.exp(x_ref[...])
  out = pl.pallas_call(kernel, out_shape=S(x.shape, x.dtype),
                       cost_estimate=est)(x)
  assert jnp.allclose(out, jnp.exp(x))
