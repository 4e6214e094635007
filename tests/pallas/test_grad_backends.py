"""jvp and grad of kernels on every CPU backend.

The derived kernels (jvp, linear, transposed) hold primitives that JAX's own
transformations introduce (`empty2`, `one_minus_square`, calls, `select_n`
with several cases); `dsl.normalize` rewrites them before the Triton and
Mosaic lowerings, so `check_grads` holds on each backend. Shapes are
TPU-legal (8 x 128 blocks) so that `mosaic_interpret` runs them too.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src import core as jax_core
from jax.test_util import check_grads

import dsl as pl
from dsl.normalize import DECOMPOSITIONS, normalize_closed
from tests.pallas.testing import CPU_BACKENDS


def _matmul_kernel(x_ref, y_ref, o_ref):
  @pl.when(pl.program_id(2) == 0)
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)
  o_ref[...] += jnp.dot(x_ref[...], y_ref[...])


def matmul(x, y, backend):
  return pl.pallas_call(
      _matmul_kernel, backend=backend,
      out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), x.dtype),
      grid=(2, 1, 2),
      in_specs=[pl.BlockSpec((8, 128), lambda i, j, k: (i, k)),
                pl.BlockSpec((128, 128), lambda i, j, k: (k, j))],
      out_specs=pl.BlockSpec((8, 128), lambda i, j, k: (i, j)))(x, y)


@jax.custom_jvp
def _soft(x):
  return jnp.log1p(jnp.exp(x))


_soft.defjvp(lambda p, t: (_soft(p[0]), t[0] / (1 + jnp.exp(-p[0]))))


@jax.jit
def _inner(x):
  return jnp.sin(x) * x


def _elementwise_kernel(x_ref, o_ref):
  x = x_ref[...]
  which = jnp.clip((x * 3).astype(jnp.int32), 0, 2)
  picked = lax.select_n(which, x, x * x, jnp.cos(x))
  o_ref[...] = jnp.tanh(x) + _soft(x) + _inner(x) + picked


def elementwise(x, backend):
  return pl.pallas_call(
      _elementwise_kernel, backend=backend,
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)))(x)


def _reference_elementwise(x):
  which = jnp.clip((x * 3).astype(jnp.int32), 0, 2)
  picked = lax.select_n(which, x, x * x, jnp.cos(x))
  return jnp.tanh(x) + _soft(x) + _inner(x) + picked


def _data(*shapes):
  rng = np.random.default_rng(0)
  return [jnp.asarray(rng.uniform(0.05, 0.95, s), jnp.float32) for s in shapes]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_matmul_accumulator_grads(backend):
  x, y = _data((16, 256), (256, 128))
  f = functools.partial(matmul, backend=backend)
  np.testing.assert_allclose(f(x, y), x @ y, rtol=1e-5, atol=1e-4)
  check_grads(f, (x, y), order=1, modes=("fwd", "rev"), atol=2e-2, rtol=2e-2)
  gx, gy = jax.grad(lambda a, b: jnp.sum(f(a, b) ** 2), (0, 1))(x, y)
  wx, wy = jax.grad(lambda a, b: jnp.sum((a @ b) ** 2), (0, 1))(x, y)
  np.testing.assert_allclose(gx, wx, rtol=1e-4, atol=1e-3)
  np.testing.assert_allclose(gy, wy, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_transformation_primitives_grads(backend):
  (x,) = _data((16, 128))
  f = functools.partial(elementwise, backend=backend)
  np.testing.assert_allclose(f(x), _reference_elementwise(x), rtol=1e-5,
                             atol=1e-5)
  check_grads(f, (x,), order=1, modes=("fwd", "rev"), atol=2e-2, rtol=2e-2)
  got = jax.grad(lambda a: jnp.sum(f(a)))(x)
  want = jax.grad(lambda a: jnp.sum(_reference_elementwise(a)))(x)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_normalize_removes_transformation_primitives_and_keeps_lines():
  (x,) = _data((8, 128))
  jaxpr = jax.make_jaxpr(
      lambda a, t: jax.jvp(_reference_elementwise, (a,), (t,)))(x, x)
  out = normalize_closed(jaxpr)

  def prims(j):
    for e in j.eqns:
      yield e
      for v in e.params.values():
        for s in (v if isinstance(v, tuple) else (v,)):
          if isinstance(s, jax_core.ClosedJaxpr):
            yield from prims(s.jaxpr)
  before = {e.primitive.name for e in prims(jaxpr.jaxpr)}
  after = list(prims(out.jaxpr))
  assert {"one_minus_square", "custom_jvp_call", "jit"} <= before
  names = {e.primitive.name for e in after}
  assert not names & {p.name for p in DECOMPOSITIONS if p is not lax.select_n_p}
  assert not names & {"custom_jvp_call", "jit", "eval_jaxpr"}
  assert all(len(e.invars) <= 3 for e in after if e.primitive is lax.select_n_p)
  assert any("test_grad_backends.py" in str(e.source_info.traceback)
             for e in after if e.source_info.traceback is not None)
  for got, want in zip(jax_core.jaxpr_as_fun(out)(x, x),
                       jax_core.jaxpr_as_fun(jaxpr)(x, x)):
    np.testing.assert_allclose(got, want, rtol=1e-6)


def _row_loop_kernel(x_ref, o_ref):
  def body(i, carry):
    o_ref[pl.ds(i, 1), :] = jnp.tanh(x_ref[pl.ds(i, 1), :]) * 2
    return carry
  lax.fori_loop(0, x_ref.shape[0], body, 0)


def row_loop(x, backend):
  return pl.pallas_call(_row_loop_kernel, backend=backend,
                        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


@pytest.mark.parametrize("backend", ("interpret", "triton_interpret"))
def test_fori_loop_over_rows_grads(backend):
  (x,) = _data((8, 128))
  f = functools.partial(row_loop, backend=backend)
  np.testing.assert_allclose(f(x), jnp.tanh(x) * 2, rtol=1e-6)
  check_grads(f, (x,), order=1, modes=("fwd", "rev"), atol=2e-2, rtol=2e-2)


def test_fori_loop_reverse_mode_on_mosaic_says_why():
  (x,) = _data((8, 128))
  f = functools.partial(row_loop, backend="mosaic_interpret")
  np.testing.assert_allclose(f(x), jnp.tanh(x) * 2, rtol=1e-6)
  with pytest.raises(pl.BackendError,
                     match=r"_row_loop_kernel_transpose.*dynamic_slice.*"
                           r"test_grad_backends.py:\d+"):
    jax.grad(lambda a: jnp.sum(f(a)))(x)
