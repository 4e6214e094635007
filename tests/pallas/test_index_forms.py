"""Gathers and scatters of values in kernels (dsl/core/index_forms.py).

A kernel's own `x.at[idx].add(u)`, `x.at[:, idx].set(u)` and point
gathers/scatters (`x[rows[:, None], cols[None, :]]`, the form a discharged
ref read with arrays of indices takes) run on the compiled lowerings'
backends as they do on `interpret` and in Pallas's interpret mode, and so
do the gradients of kernels that read a ref with arrays of indices (whose
transpose scatters).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import dsl as pl
from dsl import triton as plgpu
from dsl.core import backends
from dsl.core.normalize import missing as normalize_missing, normalize_closed
from tests.pallas.testing import (assert_all_equal, run_backends, run_on,
                                  uniform_arrays)

BACKENDS = ("interpret", "triton_interpret")
f32 = jnp.float32


def _value_kernel(fn):
  """A kernel storing `fn` of its inputs' values into its output."""
  def kernel(*refs):
    *ins, o_ref = refs
    o_ref[...] = fn(*[r[...] for r in ins])
  return kernel


def _check_on(backends_, fn, out_shape, *args):
  want = fn(*args)
  results = run_backends(backends_, _value_kernel(fn),
                         jax.ShapeDtypeStruct(out_shape, want.dtype), *args)
  assert_all_equal(results, want)


def _check(fn, out_shape, *args):
  _check_on(BACKENDS, fn, out_shape, *args)


_X = jnp.arange(10, dtype=f32) * 3 + 1
_IDX = jnp.array([3, 0, 3, 9, 5, 3], jnp.int32)     # repeats 3


def test_scatter_add_at_indices_from_data():
  u = jnp.arange(6, dtype=f32) + 0.5
  _check(lambda x, i, u: x.at[i].add(u), (10,), _X, _IDX, u)


def test_scatter_set_along_columns_from_data():
  x = jnp.arange(40, dtype=f32).reshape(4, 10)
  idx = jnp.array([7, 2, 9], jnp.int32)
  u = -jnp.arange(12, dtype=f32).reshape(4, 3)
  _check(lambda x, i, u: x.at[:, i].set(u), (4, 10), x, idx, u)


def test_scatter_set_keeps_the_last_of_repeated_indices():
  _check(lambda x, i: x.at[i].set(jnp.arange(6, dtype=f32) + 100),
         (10,), _X, _IDX)


@pytest.mark.parametrize("name,index", [
    ("clamped shift", lambda n: jnp.clip(lax.iota(jnp.int32, n) - 2, 0, 9)),
    ("stride 2, some dropped", lambda n: 2 * lax.iota(jnp.int32, n)),
    ("reversed", lambda n: 9 - lax.iota(jnp.int32, n)),
])
@pytest.mark.parametrize("op", ["add", "set"])
def test_scatter_at_indices_known_at_trace_time(name, index, op):
  u = jnp.arange(16, dtype=f32) + 0.25
  fn = lambda x, u: getattr(x.at[index(16)], op)(u, mode="drop")
  _check(fn, (10,), _X, u)


def _rows_cols(x, rows):
  n, m = x.shape[1:]
  return (rows[:, None, None], jnp.arange(n)[None, :, None],
          jnp.arange(m)[None, None, :])


def test_point_gather_and_scatter_add_of_a_value():
  """x[rows[:, None, None], arange, arange]: every dim indexed by an array,
  as the discharge of `x_ref[rows, :, :]` reads it."""
  x = jnp.arange(8 * 4 * 16, dtype=f32).reshape(8, 4, 16)
  rows = jnp.array([5, 1, 5], jnp.int32)
  _check(lambda x, r: x[_rows_cols(x, r)], (3, 4, 16), x, rows)
  u = jnp.ones((3, 4, 16), f32)
  _check(lambda x, r, u: x.at[_rows_cols(x, r)].add(u), (8, 4, 16), x, rows,
         u)


def test_normalized_forms_hold_no_scatter():
  """After normalization: no scatter; gathers along one axis only; static
  indices without the onehot compare of every target with every index (a
  value of shape (targets, indices))."""
  def static(x, u):
    return x.at[jnp.clip(lax.iota(jnp.int32, 16) - 2, 0, 9)].add(u)

  def dynamic(x, i, u):
    return x.at[i].add(u)

  u = jnp.ones((16,), f32)
  for fn, args, onehot in [(static, (_X, u), None),
                           (dynamic, (_X, _IDX, u[:6]), (10, 6))]:
    closed = normalize_closed(jax.make_jaxpr(fn)(*args))
    prims = {e.primitive for e in closed.jaxpr.eqns}
    assert lax.scatter_add_p not in prims and lax.scatter_p not in prims
    shapes = [v.aval.shape for e in closed.jaxpr.eqns for v in e.outvars]
    if onehot is None:
      assert not any(len(s) == 2 and s[1] != 1 for s in shapes), shapes
    else:
      assert onehot in shapes, shapes


def test_point_scatter_over_two_indexed_dims_is_refused_by_triton():
  """A scatter whose indices move along two dims has no rewrite: the
  Triton backend says it does not lower it, naming the kernel."""
  x = jnp.zeros((4, 4), f32)
  rows, cols = jnp.array([1, 2], jnp.int32), jnp.array([0, 3], jnp.int32)
  fn = lambda x, r, c: x.at[r[:, None], c[None, :]].add(1.0)
  with pytest.raises(Exception, match="scatter.*Triton|Triton.*scatter"):
    run_on("triton_interpret", _value_kernel(fn),
           jax.ShapeDtypeStruct((4, 4), f32), x, rows, cols)


# -- gradients of kernels reading refs with arrays of indices ---------------

def _masked_row(x_ref, o_ref):
  """A row read as Pallas's softmax reads it: lanes past the row masked."""
  cols = jnp.arange(16)
  row = plgpu.load(x_ref.at[cols], mask=cols < 10, other=0.0)
  plgpu.store(o_ref.at[cols], jnp.sin(row) * row, mask=cols < 10)


def _pages(x_ref, t_ref, o_ref):
  """Rows picked by a table, as Pallas's paged attention reads pages."""
  o_ref[...] = jnp.tanh(x_ref[t_ref[...], :]) * 2.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_grads_through_indexed_ref_reads(backend):
  x = uniform_arrays((10,), seed=3)[0]
  masked = lambda x: pl.pallas_call(
      _masked_row, jax.ShapeDtypeStruct((10,), f32), backend=backend)(x)
  g = jax.jit(jax.grad(lambda x: jnp.sum(masked(x) * jnp.cos(x))))(x)
  want = jax.grad(lambda x: jnp.sum(jnp.sin(x) * x * jnp.cos(x)))(x)
  np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)

  pages = uniform_arrays((8, 16), seed=4)[0]
  table = jnp.array([6, 1, 6, 3], jnp.int32)       # page 6 twice
  paged = lambda p: pl.pallas_call(
      _pages, jax.ShapeDtypeStruct((4, 16), f32), backend=backend)(p, table)
  ct = uniform_arrays((4, 16), seed=5)[0]
  got = jax.jit(lambda p: jax.vjp(paged, p)[1](ct)[0])(pages)
  want = jax.vjp(lambda p: jnp.tanh(p[table]) * 2.0, pages)[1](ct)[0]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# -- on Mosaic, which has no gather rule ------------------------------------

_ROWS = jnp.array([3, 0, 1, 1, 7, 1, 1, 1], jnp.int32)
_BLOCK = jnp.arange(8 * 128, dtype=f32).reshape(8, 128)


def _scatter_set(x_ref, i_ref, u_ref, o_ref):
  o_ref[...] = x_ref[...].at[i_ref[...]].set(u_ref[...])


def _row_gather(x_ref, r_ref, c_ref, o_ref):
  o_ref[...] = x_ref[...][r_ref[...][:, None], c_ref[...][None, :]]


def test_scatter_add_runs_on_mosaic_without_a_gather():
  """Mosaic has no gather rule: a scatter-add gets the onehot form, which
  needs none, and agrees with jax.numpy and Pallas."""
  closed = normalize_closed(
      jax.make_jaxpr(lambda x, i, u: x.at[i].add(u))(_BLOCK, _ROWS, _BLOCK),
      missing=normalize_missing(backends.rule_table("mosaic_interpret")))
  prims = {e.primitive for e in closed.jaxpr.eqns}
  assert not prims & {lax.gather_p, lax.scatter_add_p}, prims
  _check_on(("mosaic_interpret",), lambda x, i, u: x.at[i].add(u),
            (8, 128), _BLOCK, _ROWS, -_BLOCK)


@pytest.mark.parametrize("kernel,primitive,args", [
    (_scatter_set, "scatter", (_BLOCK, _ROWS, _BLOCK)),
    (_row_gather, "gather", (_BLOCK, _ROWS, jnp.arange(128, dtype=jnp.int32))),
])
def test_mosaic_refuses_a_scatter_or_gather_by_its_own_name(kernel, primitive,
                                                            args):
  """A scatter (or a gather) whose index form would need a gather is left
  as the user wrote it: Mosaic refuses it naming the kernel, that
  primitive and the user's line."""
  with pytest.raises(pl.KernelError) as info:
    run_on("mosaic_interpret", kernel, jax.ShapeDtypeStruct((8, 128), f32),
           *args)
  msg = str(info.value)
  assert f"primitive '{primitive}' is not supported" in msg, msg
  assert f"kernel '{kernel.__name__}'" in msg, msg
  line = kernel.__code__.co_firstlineno + 1
  assert f"{__file__}:{line}" in msg, msg
