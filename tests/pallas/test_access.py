"""The access model (dsl/core/access.py): its one decision, where an access
may leave its ref, against a brute-force reference for windows placed at
trace time, for windows placed at run time with and without the range
analysis's proofs, and as the backends that ask it act on it."""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax.experimental import pallas as jpl
from jax import lax

import dsl as pl
from dsl.core import bounded_discharge, ranges
from dsl.core.access import (ABOVE, BELOW, INDEX, INDICES, SLICE, Exit,
                             RefAccess)
from dsl.core.jax_internals import (core, state_discharge, state_indexing,
                                    state_primitives)
from dsl.core.errors import KernelCheckError
from dsl.transforms.window_checks import window_check_eqn
from lowering_triton import aot
from tests.pallas.testing import assert_close, hypothesis_settings

SETTINGS = hypothesis_settings(60)


def _brute_force(entry, n: int) -> set[int]:
  """The sides of a dim of `n` that a static window leaves, from its
  coordinates listed one by one."""
  if isinstance(entry, slice):       # as written: a negative bound counts
    # from the end once
    start = entry.start + n if entry.start is not None and \
        entry.start < 0 else (entry.start or 0)
    stop = n if entry.stop is None else (
        entry.stop + n if entry.stop < 0 else entry.stop)
    coords = list(range(start, stop, entry.step or 1))
    if not coords:                # empty: only its start counts
      return ({BELOW} if start < 0 else set()) | (
          {ABOVE} if start > n else set())
  elif isinstance(entry, state_indexing.Slice):
    coords = [entry.start + entry.stride * k for k in range(entry.size)]
    if not coords:
      return ({BELOW} if entry.start < 0 else set()) | (
          {ABOVE} if entry.start > n else set())
  else:
    coords = [entry + n if -n <= entry < 0 else entry]
  return ({BELOW} if min(coords) < 0 else set()) | (
      {ABOVE} if max(coords) >= n else set())


_ENTRIES = st.one_of(
    st.builds(lambda s, k, st_: pl.ds(s, k, stride=st_),
              st.integers(-6, 20), st.integers(0, 9), st.integers(1, 4)),
    st.builds(slice, st.one_of(st.none(), st.integers(-20, 20)),
              st.one_of(st.none(), st.integers(-20, 20)),
              st.one_of(st.none(), st.integers(1, 3))),
    st.integers(-20, 20))


@SETTINGS
@given(st.lists(st.tuples(_ENTRIES, st.integers(1, 12)), min_size=1,
                max_size=3))
def test_static_windows_leave_where_their_coordinates_do(dims):
  entries, shape = zip(*dims)
  exits = RefAccess.of(entries, shape).exits()
  expected = {(d, side) for d, (e, n) in enumerate(dims)
              for side in _brute_force(e, n)}
  assert {(e.dim, e.side) for e in exits} == expected
  assert all(e.static for e in exits)


def test_windows_placed_at_run_time_may_leave_on_both_sides():
  seen = {}

  def f(i, idx):
    seen["slice"] = RefAccess.of((pl.ds(i, 4), 3), (16, 8)).exits()
    seen["index"] = RefAccess.of((i, slice(None)), (16, 8)).exits()
    seen["indices"] = RefAccess.of((idx, pl.ds(2, 4)), (16, 8))
    return i
  jax.make_jaxpr(f)(jnp.int32(0), jnp.arange(3, dtype=jnp.int32))
  assert seen["slice"] == (Exit(0, BELOW, False), Exit(0, ABOVE, False))
  assert seen["index"] == (Exit(0, BELOW, False), Exit(0, ABOVE, False))
  indices = seen["indices"]
  assert [w.kind for w in indices.dims] == [INDICES, SLICE]
  assert indices.dims[0].size == 3 and indices.leaving_dims() == {0}


@pytest.mark.parametrize("lower,upper", list(itertools.product(
    [False, True], repeat=2)))
def test_proofs_remove_the_sides_they_prove(lower, upper):
  access = RefAccess.at_run_time((16, 8), {1}).proving(
      lambda d: (lower, upper) if d == 1 else (False, False))
  assert {(e.dim, e.side) for e in access.exits()} == (
      ({(1, BELOW)} if not lower else set())
      | ({(1, ABOVE)} if not upper else set()))


def test_proofs_do_not_hide_a_static_window_outside():
  access = RefAccess.of((pl.ds(12, 8),), (16,)).proving(
      lambda d: (True, True))
  assert access.exits() == (Exit(0, ABOVE, True),)


def test_a_negative_static_index_counts_from_the_end():
  access = RefAccess.of((-1, -16, -17), (16, 16, 16))
  assert [w.kind for w in access.dims] == [INDEX] * 3
  assert [w.static_start for w in access.dims] == [15, 0, -17]
  assert access.exits() == (Exit(2, BELOW, True),)


# ------------------------------------------------------ the range analysis

def _spec(kernel, *args, **kw):
  def f(*xs):
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((16, 8), jnp.float32),
                          backend="triton", **kw)(*xs)
  (spec,) = aot.kernel_specs(f, *args)
  return spec


def _loaded(spec):
  return [a for _, a in ranges.analyze_kernel(spec).items()
          if a.origin == "in_specs[1]"]


def _of_kernel(i_ref, x_ref, o_ref):
  def body(k, c):                               # proven: k * 4 + 4 <= 16
    o_ref[pl.ds(k * 4, 4), :] = x_ref[pl.ds(k * 4, 4), :]
    return c
  lax.fori_loop(0, 4, body, 0)
  o_ref[pl.ds(0, 4), :] += x_ref[pl.ds(i_ref[0], 4), :]   # read from data


I = jax.ShapeDtypeStruct((1,), jnp.int32)
X = jax.ShapeDtypeStruct((16, 8), jnp.float32)


def test_the_analysis_proves_what_the_model_then_drops():
  spec = _spec(_of_kernel, I, X)
  proven, data = _loaded(spec)
  loop = RefAccess.at_run_time((16, 8), {0})
  assert loop.proving(proven.inside_ref).exits() == ()
  assert loop.proving(data.inside_ref).exits() == loop.exits()


def test_a_mask_bounds_the_lanes_the_analysis_proves():
  def kernel(i_ref, x_ref, o_ref, masked: bool):
    rows = i_ref[0] + jnp.arange(16)
    ok = (rows >= 0) & (rows < 16)
    o_ref[...] = pl.load(x_ref, (rows,), mask=ok if masked else None,
                         other=0.0 if masked else None)

  def proofs(masked):
    def f(i, x):
      return pl.pallas_call(functools.partial(kernel, masked=masked),
                            jax.ShapeDtypeStruct((16,), jnp.float32),
                            backend="triton")(i, x)
    (spec,) = aot.kernel_specs(f, I, jax.ShapeDtypeStruct((16,), jnp.float32))
    (load,) = _loaded(spec)
    return RefAccess.at_run_time((16,), {0}).proving(load.inside_ref).exits()
  assert proofs(masked=True) == ()
  assert len(proofs(masked=False)) == 2


# ------------------------------------------------------ who acts on it

def _count(jaxpr, prim) -> int:
  return sum(e.primitive is prim for e in _eqns(jaxpr))


def _eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for v in eqn.params.values():
      for j in (v if isinstance(v, tuple) else (v,)):
        inner = getattr(j, "jaxpr", j)
        if isinstance(inner, core.Jaxpr):
          yield from _eqns(inner)


def test_run_time_checks_skip_windows_the_analysis_proves():
  spec = _spec(_of_kernel, I, X)
  proofs = ranges.analyze_kernel(spec)
  eqns = list(_eqns(spec.jaxpr.jaxpr))
  # the loop's load and store, and the load placed by data
  assert sum(window_check_eqn(e, None) is not None for e in eqns) == 3
  # ... of which the analysis proves the loop's
  assert sum(window_check_eqn(e, None, proofs) is not None
             for e in eqns) == 1


@pytest.mark.parametrize("start,fails", [(0, False), (12, False),
                                         (13, True)])
def test_checked_kernel_fails_only_where_a_window_leaves(runtime_asserts,
                                                         start, fails):
  x = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8)
  call = pl.pallas_call(_of_kernel, jax.ShapeDtypeStruct((16, 8),
                                                         jnp.float32),
                        backend="interpret")
  i = jnp.array([start], jnp.int32)
  if fails:
    with pytest.raises(KernelCheckError, match="outside"):
      call(i, x)
  else:
    expected = x.at[:4].add(x[start:start + 4])
    assert_close(call(i, x), expected)


def test_only_windows_that_may_leave_and_strided_writes_become_twins():
  def kernel(i_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...]
    o_ref[pl.ds(0, 4), :] = x_ref[pl.ds(i_ref[0], 4), :]
    o_ref[pl.ds(1, 4, stride=2), :] = x_ref[pl.ds(0, 4, stride=3), :]
  spec = _spec(kernel, I, X)
  bounded = bounded_discharge.bound_windows(spec.jaxpr.jaxpr)
  assert _count(bounded, bounded_discharge.bounded_get_p) == 1
  # i_ref[0], x_ref[...], the strided read
  assert _count(bounded, state_primitives.get_p) == 3
  assert _count(bounded, state_primitives.swap_p) == 2
  assert _count(bounded, bounded_discharge.bounded_swap_p) == 1


def test_jax_discharge_rules_stay_jaxs():
  rules = [state_discharge._discharge_rules[p] for p in (
      state_primitives.get_p, state_primitives.swap_p,
      state_primitives.addupdate_p)]
  assert all(r.__module__.startswith("jax.") for r in rules)


def _shifted(i_ref, x_ref, o_ref):
  o_ref[...] = x_ref[pl.ds(i_ref[0], 8), :] * 2.0


@pytest.mark.parametrize("start", [0, 5, 8])
def test_inside_windows_agree_with_pallas_and_numpy(start):
  x = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8)
  i = jnp.array([start], jnp.int32)
  out = jax.ShapeDtypeStruct((8, 8), jnp.float32)
  ours = pl.pallas_call(_shifted, out, backend="interpret")(i, x)
  theirs = jpl.pallas_call(_shifted_pallas, out, interpret=True)(i, x)
  assert_close(ours, x[start:start + 8] * 2.0)
  assert_close(theirs, x[start:start + 8] * 2.0)


def _shifted_pallas(i_ref, x_ref, o_ref):
  o_ref[...] = x_ref[jpl.ds(i_ref[0], 8), :] * 2.0


def test_leaving_windows_read_poison_here_and_stay_jaxs_in_pallas():
  """The same window past the end: dsl's lanes outside read poison (NaN),
  while Pallas's interpreter, in the same process, keeps JAX's clamp."""
  x = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8)
  i = jnp.array([12], jnp.int32)
  out = jax.ShapeDtypeStruct((8, 8), jnp.float32)
  ours = np.asarray(pl.pallas_call(_shifted, out, backend="interpret")(i, x))
  theirs = jpl.pallas_call(_shifted_pallas, out, interpret=True)(i, x)
  assert_close(ours[:4], x[12:16] * 2.0)
  assert np.isnan(ours[4:]).all()
  assert_close(theirs, x[8:16] * 2.0)


def test_accesses_of_refs_the_discharge_keeps_stay_jaxs():
  def kernel(i_ref, x_ref, o_ref):
    j = i_ref[pl.ds(i_ref[0], 1)][0]              # a window of a kept ref
    o_ref[pl.ds(0, 4), :] = x_ref[pl.ds(j, 4), :]
  spec = _spec(kernel, I, X)
  out = bounded_discharge.discharge(spec.jaxpr, [False, True, True])
  assert _count(out.jaxpr, state_primitives.get_p) == 2
  assert not any(e.primitive in (bounded_discharge.bounded_get_p,
                                 bounded_discharge.bounded_swap_p)
                 for e in _eqns(out.jaxpr))
  f = core.jaxpr_as_fun(out)
  x = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8)
  o = jnp.zeros((16, 8), jnp.float32)
  for start, rows in ((0, 0), (13, 13)):
    i = jax.new_ref(jnp.array([start], jnp.int32))
    _, new_o = f(i, x, o)
    got = np.asarray(new_o[:4])
    inside = min(4, 16 - rows)
    assert_close(got[:inside], x[rows:rows + inside])
    assert np.isnan(got[inside:]).all()
