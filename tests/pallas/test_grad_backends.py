"""jvp and grad of kernels on every CPU backend.

The derived kernels (jvp, linear, transposed) hold primitives that JAX's own
transformations introduce (`empty2`, `one_minus_square`, calls, `select_n`
with several cases); `dsl.core.normalize` rewrites them before the Triton and
Mosaic lowerings, so `check_grads` holds on each backend. Shapes are
TPU-legal (8 x 128 blocks) so that `mosaic_interpret` runs them too.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from dsl.core.jax_internals import ClosedJaxpr, core as jax_core
from jax.test_util import check_grads

import dsl as pl
from dsl.core.normalize import DECOMPOSITIONS, normalize_closed
from tests.pallas.testing import CPU_BACKENDS, matmul_call
from tests.pallas.testing import check_values_and_grads as _check


def matmul(x, y, backend):
  """x @ y in (8, 128) x (128, 128) blocks, accumulated in the output."""
  return matmul_call(pl, None, x.shape[0], x.shape[1], y.shape[1],
                     (8, 128, 128), dtype=x.dtype, backend=backend)(x, y)


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
          if isinstance(s, ClosedJaxpr):
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


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fori_loop_over_rows_grads(backend):
  """The transposed loop slices carried values at the loop index; Mosaic
  gets those slices as loads and stores of a VMEM buffer."""
  (x,) = _data((8, 128))
  f = functools.partial(row_loop, backend=backend)
  np.testing.assert_allclose(f(x), jnp.tanh(x) * 2, rtol=1e-6)
  check_grads(f, (x,), order=1, modes=("fwd", "rev"), atol=2e-2, rtol=2e-2)
  got = jax.grad(lambda a: jnp.sum(f(a) ** 2))(x)
  want = jax.grad(lambda a: jnp.sum((jnp.tanh(a) * 2) ** 2))(x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _slices(a, i):
  row = lax.dynamic_slice(a, (i, 3), (1, 128))
  return lax.dynamic_update_slice(a, row * 2, (i + 1, 0))


def _slices_kernel(i_ref, x_ref, o_ref):
  o_ref[...] = _slices(x_ref[...], i_ref[0])


def test_values_in_memory_rewrites_dynamic_slices_for_mosaic():
  (x,) = _data((8, 128))
  jaxpr = jax.make_jaxpr(_slices)(x, 2)
  names = lambda j: {e.primitive.name for e in j.jaxpr.eqns}
  assert {"dynamic_slice", "dynamic_update_slice"} <= names(
      normalize_closed(jaxpr))
  mosaic = normalize_closed(jaxpr, values_in_memory=True)
  assert not {"dynamic_slice", "dynamic_update_slice"} & names(mosaic)
  assert "run_scoped" in names(mosaic)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_dynamic_slices_of_values_in_a_kernel(backend):
  (x,) = _data((8, 128))
  for i in (0, 3, 7, 9, -4):       # starts clamp as dynamic_slice clamps them
    idx = jnp.array([i], jnp.int32)
    got = pl.pallas_call(
        _slices_kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
        grid_spec=pl.tpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,),
            in_specs=[pl.BlockSpec((8, 128), lambda g, n: (0, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda g, n: (0, 0))),
        backend=backend)(idx, x)
    np.testing.assert_array_equal(got, _slices(x, i))


def _dynamic_while_kernel(n_ref, x_ref, o_ref):
  def body(c):
    i, acc = c
    return i + 1, acc * jnp.sin(x_ref[...])
  _, acc = lax.while_loop(lambda c: c[0] < n_ref[0], body,  # the loop line
                          (0, jnp.ones_like(x_ref[...])))
  o_ref[...] = acc


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_grad_of_dynamic_while_loop(backend):
  """A while_loop whose trip count is read from scalar prefetch: reverse
  mode recomputes the carry of each iteration (no hand-written backward)."""
  (x,) = _data((8, 128))
  n = jnp.array([3], jnp.int32)

  def f(a):
    return pl.pallas_call(
        _dynamic_while_kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
        grid_spec=pl.tpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,),
            in_specs=[pl.BlockSpec((8, 128), lambda i, n: (0, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i, n: (0, 0))),
        backend=backend)(n, a)
  _check(f, lambda a: jnp.sin(a) ** 3, (x,))


def _fori_rows_kernel(n_ref, x_ref, w_ref, o_ref):
  o_ref[...] = jnp.zeros_like(o_ref)

  def body(i, carry):      # a fori_loop with a traced bound: a while_loop
    row = x_ref[pl.ds(i, 1), :] * carry
    o_ref[pl.ds(i, 1), :] = jnp.tanh(row)
    return carry * w_ref[...]
  lax.fori_loop(0, n_ref[0], body, jnp.ones((1, 128), jnp.float32))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_grad_of_fori_loop_with_traced_bound(backend):
  """Rows past the traced bound are not written (zeros); the weight and the
  carry flow through the loop's iterations."""
  x, w = _data((8, 128), (1, 128))
  n = jnp.array([5], jnp.int32)

  def f(x, w):
    return pl.pallas_call(
        _fori_rows_kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
        grid_spec=pl.tpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,),
            in_specs=[pl.BlockSpec((8, 128), lambda i, n: (0, 0)),
                      pl.BlockSpec((1, 128), lambda i, n: (0, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i, n: (0, 0))),
        backend=backend)(n, x, w)

  def want(x, w):
    powers = w ** jnp.arange(8, dtype=jnp.float32)[:, None]
    return jnp.where(jnp.arange(8)[:, None] < 5, jnp.tanh(x * powers), 0.)
  _check(f, want, (x, w))


# ------------------------------------------- strided slices and interior pads

_PADS = [((1, 2, 1), (0, 0, 0)), ((0, -2, 2), (2, 1, 1)),
         ((-2, -1, 0), (1, -3, 2)), ((0, 0, 0), (0, -1, 1))]
_STRIDED = [((0, 0), (6, 5), (2, 1)), ((1, 1), (6, 4), (2, 2)),
            ((1, 0), (5, 5), (3, 1))]


def _value_op_call(fn, shape, backend):
  def kernel(x_ref, o_ref):
    o_ref[...] = fn(x_ref[...])
  return pl.pallas_call(kernel, jax.ShapeDtypeStruct(shape, jnp.float32),
                        backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_interior_pads_and_strided_slices_of_values(backend):
  """What the transpose of a strided read leaves in a derived kernel (an
  interior pad, negative edges too) and a strided slice of a value: a
  gather on Triton, strided ref writes and reads of a buffer on Mosaic."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 5)), jnp.float32)
  for cfg in _PADS:
    want = lax.pad(x, jnp.float32(7), cfg)
    got = _value_op_call(lambda v: lax.pad(v, jnp.float32(7), cfg),
                         want.shape, backend)(x)
    np.testing.assert_array_equal(got, want, err_msg=str(cfg))
  for start, limit, strides in _STRIDED:
    want = lax.slice(x, start, limit, strides)
    got = _value_op_call(lambda v: lax.slice(v, start, limit, strides),
                         want.shape, backend)(x)
    np.testing.assert_array_equal(got, want, err_msg=str(strides))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("op", [lax.cumsum, lax.cummax, lax.cummin,
                                lax.cumprod])
def test_cumulative_ops_and_their_jvp(op, backend):
  """Cumulative ops (a shift-and-combine scan on Mosaic) forward, reverse,
  and their jvp, along both axes."""
  x = jnp.asarray(np.random.default_rng(1).uniform(0.5, 1.5, (8, 128)),
                  jnp.float32)
  t = jnp.cos(x)
  for axis, reverse in [(0, False), (1, True)]:
    fn = functools.partial(op, axis=axis, reverse=reverse)
    f = _value_op_call(fn, x.shape, backend)
    # The reference jitted: eager, its jvp compiles each op of the scan.
    want, want_dot = _jitted_jvp(op, axis, reverse)(x, t)
    np.testing.assert_allclose(f(x), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jax.jvp(f, (x,), (t,))[1], want_dot,
                               rtol=1e-4, atol=1e-4)


@functools.lru_cache(maxsize=None)
def _jitted_jvp(op, axis, reverse):
  """(op(x), its jvp along t) as one jitted reference, one per op and
  direction in the process."""
  fn = functools.partial(op, axis=axis, reverse=reverse)
  return jax.jit(lambda x, t: jax.jvp(fn, (x,), (t,)))
