"""Reverse mode under a TPU's output semantics (dsl/transforms/revisits.py):
input cotangents revisited non-consecutively are summed from per-point
contributions, consecutive ones accumulated in place."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl.core.blockspec import Element
from dsl.transforms import revisits
from tests.pallas.testing import CPU_BACKENDS, matmul_call
from tests.pallas.testing import check_values_and_grads as _check
from tests.pallas.testing import uniform_arrays as _data


def _mapping(f, *args):
  """The BlockMappings of the (only) pallas_call in `f`'s jaxpr."""
  jaxpr = jax.make_jaxpr(f)(*args)
  eqn = next(e for e in jaxpr.eqns if e.primitive.name == "pallas_call")
  return eqn.params["spec"].grid_mapping


def _matmul(backend, bm=8, bk=128, bn=128):
  def f(x, y):
    return matmul_call(pl, None, x.shape[0], x.shape[1], y.shape[1],
                       (bm, bk, bn), backend=backend)(x, y)
  return f


def test_matmul_cotangent_blocks_come_back_non_consecutively():
  x = jnp.ones((16, 256), jnp.float32)
  y = jnp.ones((256, 256), jnp.float32)
  gm = _mapping(_matmul("interpret"), x, y)
  dx, dy = gm.in_mappings
  # Transposed grid: dim 2 (the reduction) sequential and reversed.
  assert not revisits.revisits_consecutively(dx, gm.grid, {2})
  assert not revisits.revisits_consecutively(dy, gm.grid, {2})
  assert revisits.revisits_consecutively(gm.out_mappings[0], gm.grid, {2})


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape", [(16, 256, 256), (8, 384, 128)])
def test_matmul_grads_sum_every_contribution(backend, shape):
  m, k, n = shape
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
  ct = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  f = _matmul(backend)
  _, vjp = jax.vjp(f, x, y)
  dx, dy = vjp(ct)
  want_dx, want_dy = jax.vjp(lambda a, b: a @ b, x, y)[1](ct)
  np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-3)
  np.testing.assert_allclose(dy, want_dy, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("backend", ["interpret", "triton_interpret"])
def test_overlapping_element_windows_sum_their_cotangents(backend):
  """Windows of 16 rows at offsets 8*i overlap: each row's cotangent is
  the sum over the windows that read it."""
  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.sin(x_ref[0:8, :]) + x_ref[8:16, :] * 2.0

  def f(x):
    return pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((24, 128), jnp.float32), grid=(3,),
        in_specs=[pl.BlockSpec((Element(16), 128), lambda i: (i * 8, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
        backend=backend)(x)

  def want(x):
    return jnp.sin(x[0:24]) + 2.0 * x[8:32]

  x = jnp.asarray(np.random.default_rng(1).standard_normal((32, 128)),
                  jnp.float32)
  ct = jnp.ones((24, 128), jnp.float32)
  np.testing.assert_allclose(f(x), want(x), rtol=1e-5, atol=1e-5)
  got = jax.vjp(f, x)[1](ct)[0]
  ref = jax.vjp(want, x)[1](ct)[0]
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_scatter_contributions_adds_overlaps_and_drops_the_edge():
  def f(x):
    return pl.pallas_call(
        lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
        jax.ShapeDtypeStruct((20, 128), jnp.float32), grid=(3,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
        backend="interpret")(x)
  gm = _mapping(f, jnp.zeros((20, 128), jnp.float32))
  bm = gm.in_mappings[0]
  contribs = jnp.ones((3, 8, 128), jnp.float32)
  out = revisits.scatter_contributions(contribs, bm, gm.grid, ())
  assert out.shape == (20, 128)
  np.testing.assert_array_equal(out, np.ones((20, 128), np.float32))


def _lanes_kernel(x_ref, o_ref, m_ref):
  @pl.when(pl.program_id(1) == 0)
  def _():
    m_ref[...] = jnp.zeros_like(m_ref)
    o_ref[...] = jnp.zeros_like(o_ref)
  x = x_ref[...]
  rows = jax.lax.broadcast_in_dim(jnp.sum(jnp.sin(x), axis=1), m_ref.shape,
                                  (0,))
  m_prev = m_ref[...]
  m_ref[...] = m_prev + rows
  o_ref[...] = o_ref[...] + m_prev * x


# A GPU reads a revisited block back from memory, where the lanes past the
# array do not exist: this kernel needs a TPU's resident blocks.
@pytest.mark.parametrize("backend", ["interpret", "mosaic_interpret"])
def test_block_lanes_past_the_array_carry_between_visits(backend):
  """m's (8, 128) block covers an (8, 1) array: its lanes past the array
  hold the row sums the kernel broadcast there at the previous visit (a TPU
  keeps the block in VMEM), and o is computed from them. Reverse mode keeps
  those lanes (and their cotangents) from visit to visit, and zeros only
  what enters from outside."""
  (x,) = _data((8, 384))

  def f(x):
    return pl.pallas_call(
        _lanes_kernel, (jax.ShapeDtypeStruct((8, 128), jnp.float32),
                        jax.ShapeDtypeStruct((8, 1), jnp.float32)),
        grid=(1, 3), in_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, j))],
        out_specs=[pl.BlockSpec((8, 128), lambda i, j: (i, 0))] * 2,
        backend=backend)(x)

  def want(x):
    m, o = jnp.zeros((8, 1)), jnp.zeros((8, 128))
    for j in range(3):
      xj = x[:, j * 128:(j + 1) * 128]
      o = o + m * xj
      m = m + jnp.sum(jnp.sin(xj), axis=1, keepdims=True)
    return o, m
  _check(f, want, (x,))
