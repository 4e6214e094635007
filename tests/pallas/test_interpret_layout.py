"""The interpret backend carries view operands in the kernel's layout: a
step's blocks are a slice of the carried state, not a transpose of it, and
the results match jnp and Pallas's interpret mode."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl

import dsl as pl
from dsl.interpret import execute


def _matmul(pl_, x, y, b, **kw):
  def kernel(x_ref, y_ref, o_ref):
    @pl_.when(pl_.program_id(2) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += jnp.dot(x_ref[...], y_ref[...])
  m, k = x.shape
  n = y.shape[1]
  return pl_.pallas_call(
      kernel, jax.ShapeDtypeStruct((m, n), x.dtype),
      grid=(m // b, n // b, k // b),
      in_specs=[pl_.BlockSpec((b, b), lambda i, j, kk: (i, kk)),
                pl_.BlockSpec((b, b), lambda i, j, kk: (kk, j))],
      out_specs=pl_.BlockSpec((b, b), lambda i, j, kk: (i, j)), **kw)(x, y)


def _spec(f, *args):
  return jax.make_jaxpr(f)(*args).jaxpr.eqns[0].params["spec"]


def _eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (list, tuple)) else [p]):
        inner = getattr(sub, "jaxpr", None)
        if inner is not None and hasattr(inner, "eqns"):
          yield from _eqns(inner)
        elif hasattr(sub, "eqns"):
          yield from _eqns(sub)


def test_matmul_loop_body_transposes_no_carried_state():
  x = jax.random.normal(jax.random.key(0), (256, 256))
  y = jax.random.normal(jax.random.key(1), (256, 256))
  f = functools.partial(_matmul, pl, b=64, backend="interpret")
  spec = _spec(f, x, y)
  run = jax.make_jaxpr(functools.partial(execute.run, spec=spec))(x, y)
  loops = [e for e in _eqns(run.jaxpr) if e.primitive.name in ("while", "scan")]
  assert len(loops) == 1
  body = loops[0].params.get("jaxpr") or loops[0].params["body_jaxpr"]
  body = getattr(body, "jaxpr", body)
  carried = set(body.invars)
  moved = [e for e in body.eqns if e.primitive.name == "transpose"
           and e.invars[0] in carried]
  assert not moved, moved


@pytest.mark.parametrize("b", [32, 64])
def test_matmul_matches_jnp_and_pallas(b):
  x = jax.random.normal(jax.random.key(0), (128, 192))
  y = jax.random.normal(jax.random.key(1), (192, 64))
  got = _matmul(pl, x, y, b, backend="interpret")
  want = _matmul(jpl, x, y, b, interpret=True)
  np.testing.assert_allclose(got, x @ y, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _transposed_out(pl_, x, **kw):
  """Output block (j, i) of input block (i, j), summed over a sequential
  k dim that re-reads a constant block: mixes parallel, sequential and
  constant block axes in one operand."""
  def kernel(x_ref, c_ref, o_ref):
    @pl_.when(pl_.program_id(2) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += x_ref[...].T * c_ref[...]
  return pl_.pallas_call(
      kernel, jax.ShapeDtypeStruct((x.shape[1], x.shape[0]), x.dtype),
      grid=(x.shape[0] // 8, x.shape[1] // 16, 3),
      in_specs=[pl_.BlockSpec((8, 16), lambda i, j, k: (i, j)),
                pl_.BlockSpec((16, 8), lambda i, j, k: (1, 0))],
      out_specs=pl_.BlockSpec((16, 8), lambda i, j, k: (j, i)),
      **kw)(x, jnp.full((32, 8), 2.0, x.dtype))


def test_mixed_block_axes_match_pallas():
  x = jax.random.normal(jax.random.key(2), (24, 48))
  got = _transposed_out(pl, x, backend="interpret")
  want = _transposed_out(jpl, x, interpret=True)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(got, 6.0 * x.T, rtol=1e-6)


def _squeezed(pl_, x, **kw):
  """Squeezed (None) block dims with a parallel dim that is not the first
  array dim and a sequential one that walks the first."""
  def kernel(x_ref, o_ref):
    @pl_.when(pl_.program_id(1) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += x_ref[...]
  a, b, c = x.shape
  return pl_.pallas_call(
      kernel, jax.ShapeDtypeStruct((b, c), x.dtype),
      grid=(b, a),
      in_specs=[pl_.BlockSpec((None, None, c), lambda j, i: (i, j, 0))],
      out_specs=pl_.BlockSpec((None, c), lambda j, i: (j, 0)), **kw)(x)


def test_squeezed_dims_match_pallas():
  x = jax.random.normal(jax.random.key(3), (5, 6, 128))
  got = _squeezed(pl, x, backend="interpret")
  np.testing.assert_allclose(got, _squeezed(jpl, x, interpret=True),
                             rtol=1e-5)
  np.testing.assert_allclose(got, x.sum(0), rtol=1e-5, atol=1e-5)
