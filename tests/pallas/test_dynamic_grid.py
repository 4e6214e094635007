"""Grids whose size is a traced value (dsl.core.dynamic_grid).

`grid=(2, n)` with `n` an int32 scalar traced under `jax.jit`: one compiled
function runs every `n`, on the host backends that take traced grid sizes
(the interpret backend and the Mosaic interpreter), compared with a
jax.numpy reference and with Pallas's interpret mode; the Mosaic module is
Pallas's. Triton and Mosaic GPU refuse such kernels, naming the dim; so do
reverse mode and the interpret backend's run-time checks.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import checkify
from jax.experimental import pallas as jpl

import dsl as pl
from dsl import tpu as pltpu
from dsl.errors import (KernelCheckError, KernelError, KernelTypeError,
                        raising_kernel_errors)
from tests.pallas import mosaic_golden as golden

HOST_BACKENDS = ("interpret", "mosaic_interpret")
X = jax.random.normal(jax.random.key(0), (64, 256), jnp.float32)
THREE = jnp.int32(3)      # a concrete size: static


def _mean_kernel(P):
  """The mean of the row blocks a grid of (2, n) visits, per column block:
  the output block is revisited along the traced dim and accumulated."""
  def kernel(x_ref, o_ref):
    i, n = P.program_id(1), P.num_programs(1)

    @P.when(i == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += x_ref[...]

    @P.when(i == n - 1)
    def _():
      o_ref[...] = o_ref[...] / jnp.asarray(n, jnp.float32)
  return kernel


def _mean(P, x, n, **kw):
  return P.pallas_call(
      _mean_kernel(P), out_shape=jax.ShapeDtypeStruct((8, 256), x.dtype),
      grid=(2, n), in_specs=[P.BlockSpec((8, 128), lambda j, i: (i, j))],
      out_specs=P.BlockSpec((8, 128), lambda j, i: (0, j)), **kw)(x)


def _reference(x, n):
  return x[:8 * n].reshape(n, 8, x.shape[1]).mean(axis=0)


def _close(got, want):
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_one_compiled_kernel_runs_every_traced_size(backend):
  traces = []

  @jax.jit
  def ours(x, n):
    traces.append(n)
    return _mean(pl, x, n, backend=backend)
  sizes = (1, 3, 8)
  got = [ours(X, jnp.int32(n)) for n in sizes]
  assert len(traces) == 1
  theirs = jax.jit(lambda x, n: _mean(jpl, x, n, interpret=True))
  for n, g in zip(sizes, got):
    _close(g, _reference(X, n))
    _close(g, theirs(X, jnp.int32(n)))


def _ids_kernel(o_ref):
  """`pl.num_programs` of the traced dim inside `pl.when` and as a loop
  bound (Pallas's interpret mode has no rule for it there)."""
  i = pl.program_id(0)

  @pl.when(i == pl.num_programs(0) - 1)
  def _():
    o_ref[...] = jnp.full(o_ref.shape, 100, jnp.int32) + pl.num_programs(0)

  @pl.when(i < pl.num_programs(0) - 1)
  def _():
    steps = lax.fori_loop(0, pl.num_programs(0), lambda k, c: c + 1,
                          jnp.int32(0))
    o_ref[...] = jnp.full(o_ref.shape, 10, jnp.int32) * steps + i


def _ids(n, backend):
  return pl.pallas_call(
      _ids_kernel, out_shape=jax.ShapeDtypeStruct((64, 128), jnp.int32),
      grid=(n,), out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
      backend=backend)()


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_num_programs_of_a_traced_dim_inside_control_flow(backend):
  f = jax.jit(lambda n: _ids(n, backend))
  for n in (1, 5):
    got = np.asarray(f(jnp.int32(n)))[:8 * n].reshape(n, 8, 128)
    want = [100 + n if i == n - 1 else 10 * n + i for i in range(n)]
    np.testing.assert_array_equal(got[:, 0, 0], want)
    assert (got == got[:, :1, :1]).all()


def _seeded_kernel(o_ref):
  pltpu.prng_seed(pl.program_id(0))
  bits = pltpu.prng_random_bits(o_ref.shape)
  o_ref[...] = (bits & 0) + pl.num_programs(0) * 100 + pl.program_id(0)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_num_programs_in_a_kernel_that_draws_random_numbers(backend):
  """(The interpret backend runs such a body inside a scoped buffer that
  holds the random state.)"""
  f = jax.jit(lambda n: pl.pallas_call(
      _seeded_kernel, out_shape=jax.ShapeDtypeStruct((32, 128), jnp.int32),
      grid=(n,), out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
      backend=backend)())
  np.testing.assert_array_equal(np.asarray(f(jnp.int32(3)))[:24:8, 0],
                                [300, 301, 302])


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_a_traced_size_of_zero_runs_no_step(backend):
  out = jax.jit(lambda x, n: _mean(pl, x, n, backend=backend))(
      X, jnp.int32(0))
  assert np.isnan(np.asarray(out)).all()   # never written: poison


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_vmap_over_operands_and_over_sizes(backend):
  xs = jnp.stack([X, 2 * X + 1])
  over_x = jax.jit(lambda xs, n: jax.vmap(
      lambda x: _mean(pl, x, n, backend=backend))(xs))
  got = over_x(xs, jnp.int32(3))
  _close(got, jnp.stack([_reference(x, 3) for x in xs]))
  over_n = jax.jit(jax.vmap(lambda n: _mean(pl, X, n, backend=backend)))
  got = over_n(jnp.array([2, 5], jnp.int32))
  _close(got, jnp.stack([_reference(X, 2), _reference(X, 5)]))


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_jvp(backend):
  t = jnp.cos(X)

  @jax.jit
  def f(x, t, n):
    return jax.jvp(lambda y: _mean(pl, y, n, backend=backend), (x,), (t,))
  primal, tangent = f(X, t, jnp.int32(3))
  _close(primal, _reference(X, 3))
  _close(tangent, _reference(t, 3))


def test_reverse_mode_is_a_clear_error():
  loss = lambda x, n: jnp.sum(_mean(pl, x, n, backend="interpret") ** 2)
  with pytest.raises(KernelError, match="reverse mode .* grid dim 1 has a "
                     "traced size.*jax.custom_vjp"):
    jax.jit(jax.grad(loss))(X, jnp.int32(3))


@pytest.mark.parametrize("backend,owner", [
    ("triton_interpret", "the Triton backend"),
    ("mosaic_gpu", "the Mosaic GPU backend")])
def test_backends_with_static_launch_grids_refuse_naming_the_dim(backend,
                                                                 owner):
  f = jax.jit(lambda x, n: _mean(pl, x, n, backend=backend))
  with pytest.raises(KernelError, match=f"kernel 'kernel', grid: grid dim 1 "
                     f"has a traced size; {owner} needs static grid sizes"):
    f(X, jnp.int32(3))


def _checked_kernel(x_ref, o_ref):
  pl.debug_check(x_ref[0, 0] < 1e3, "x too large")
  o_ref[...] = x_ref[...]


def _checked(x, n, backend):
  return pl.pallas_call(
      _checked_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(n,), in_specs=[pl.BlockSpec((8, 256), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((8, 256), lambda i: (i, 0)), backend=backend)(x)


def test_run_time_checks_need_the_mosaic_interpreter():
  with pl.config.enable_runtime_assert_option(True):
    with pytest.raises(KernelError, match="grid dim 0 has a traced size, "
                       "and the interpret backend checks"):
      jax.jit(lambda x, n: _checked(x, n, "interpret"))(X, jnp.int32(2))
    f = raising_kernel_errors(
        jax.jit(lambda x, n: _checked(x, n, "mosaic_interpret")))
    _close(f(X, jnp.int32(8)), X)
    with pytest.raises(KernelCheckError, match="x too large"):
      f(X.at[16, 0].set(1e4), jnp.int32(8))
  checked = checkify.checkify(lambda x, n: _checked(x, n, "mosaic_interpret"))
  with pytest.raises(KernelError, match="checkify.checkify needs a static"):
    jax.jit(checked)(X, jnp.int32(2))


def _pallas_call_eqn(f, *args):
  jaxpr = jax.make_jaxpr(f)(*args)
  eqns = [e for e in jaxpr.jaxpr.eqns if e.primitive is pl.pallas_call_p]
  if not eqns:
    (inner,) = [e for e in jaxpr.jaxpr.eqns if "jaxpr" in e.params]
    eqns = [e for e in inner.params["jaxpr"].jaxpr.eqns
            if e.primitive is pl.pallas_call_p]
  return eqns[0]


def test_traced_sizes_lead_the_operands_and_concrete_ones_stay_static():
  traced = _pallas_call_eqn(lambda x, n: _mean(pl, x, n), X, jnp.int32(3))
  gm = traced.params["spec"].grid_mapping
  assert repr(gm.grid) == "(2, dynamic)" and gm.dynamic_dims == (1,)
  assert traced.invars[0].aval.shape == () and len(traced.invars) == 2
  assert traced.invars[0].aval.dtype == jnp.int32
  concrete = _pallas_call_eqn(lambda x: _mean(pl, x, THREE), X)
  assert concrete.params["spec"].grid_mapping.grid == (2, 3)
  assert len(concrete.invars) == 1


def test_grid_entries_that_cannot_be_sizes_are_errors():
  with pytest.raises(KernelTypeError, match=r"grid\[1\] must be a positive "
                     "integer or a traced integer scalar, got a traced"):
    jax.jit(lambda x, n: _mean(pl, x, n))(X, jnp.float32(3))

  def named(x, n):
    return pl.pallas_call(
        lambda x_ref, o_ref: None, out_shape=x, grid=(("i", n),))(x)
  with pytest.raises(KernelError, match="named grid axis needs a static"):
    jax.jit(named)(X, jnp.int32(3))


def test_mosaic_module_is_pallas_module():
  """iteration_bounds marks the traced dim dynamic, the custom call takes
  its size as the leading operand and `pl.num_programs` reads it with
  `tpu.iteration_bound`, as Pallas lowers it."""
  n = jnp.int32(3)
  ours = golden.lower_tpu(lambda x, n: _mean(pl, x, n, backend="mosaic"),
                          X, n)
  theirs = golden.lower_tpu(lambda x, n: _mean(jpl, x, n), X, n)
  assert len(ours) == len(theirs) == 1
  assert ours[0].module == theirs[0].module, golden.diff(ours[0].module,
                                                         theirs[0].module)
  assert ours[0].attrs == theirs[0].attrs
  assert ours[0].config == theirs[0].config
  assert "iteration_bounds = array<i64: 2, -9223372036854775808>" in (
      ours[0].module)
  assert "tpu.iteration_bound 1" in ours[0].module
