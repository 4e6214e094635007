"""The range analysis (dsl.core.ranges, dsl.core.range_rules, dsl.core.intervals): sound
intervals (every concrete value lies inside; property tests), loops with
static and traced bounds, and the per-access coordinates of kernels."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax import lax
from dsl.core.jax_internals import core

import dsl as pl
from dsl.core import intervals as iv
from dsl.core import ranges
from dsl.core.intervals import Interval
from lowering_triton import aot
from tests.pallas.testing import hypothesis_settings

I32 = jnp.int32


def _points(*sizes, length=512):
  """Every point of the grid `sizes`, repeated to `length` entries (one
  shape for every example, so the eager evaluation compiles each primitive
  once)."""
  grids = np.meshgrid(*(np.arange(n, dtype=np.int32) for n in sizes),
                      indexing="ij")
  return [np.resize(g.ravel(), max(length, g.size)) for g in grids]


def _concrete(closed, *args):
  """Every value of `closed`'s outputs over the argument points `args`."""
  outs = jax.vmap(core.jaxpr_as_fun(closed))(*args)
  return [np.asarray(o) for o in outs]


def _assert_inside(values, interval, what=""):
  lo, hi = int(values.min()), int(values.max())
  assert interval is not None, what
  assert interval.lo <= lo and hi <= interval.hi, (
      f"{what}: values [{lo}, {hi}] escape the interval {interval}")


# ------------------------------------------------------------ intervals

@pytest.mark.parametrize("fn,name", [
    (lambda a, b: np.trunc(a / b).astype(np.int64), "div"),
    (lambda a, b: a // b, "floor_div"),
    (lambda a, b: np.fmod(a, b), "rem"),
    (lambda a, b: np.mod(a, b), "py_mod"),
])
def test_division_rules_contain_every_quotient(fn, name):
  rule = getattr(iv, name)
  r = np.random.default_rng(0)
  for _ in range(300):
    a = sorted(r.integers(-40, 40, 2))
    b = sorted(r.integers(-9, 9, 2))
    got = rule(Interval(*map(int, a)), Interval(*map(int, b)))
    if b[0] <= 0 <= b[1]:
      assert got is None            # a divisor that may be 0: unknown
      continue
    xs, ys = np.meshgrid(np.arange(a[0], a[1] + 1), np.arange(b[0], b[1] + 1))
    _assert_inside(fn(xs, ys), got, f"{name} {a} {b}")


def test_results_that_may_wrap_take_the_whole_range():
  assert iv.fit(Interval(0, 2 ** 31), np.int32) == iv.dtype_range(np.int32)
  assert iv.fit(Interval(-1, 3), np.uint32) == Interval(0, 2 ** 32 - 1)
  assert iv.fit(Interval(-5, 5), np.int8) == Interval(-5, 5)
  assert iv.dtype_range(np.float32) is None
  assert iv.compare("lt", Interval(0, 3), Interval(4, 9)) == Interval(1, 1)
  assert iv.compare("ge", Interval(0, 3), Interval(4, 9)) == Interval(0, 0)
  assert iv.compare("eq", Interval(0, 3), Interval(2, 9)) == Interval(0, 1)


# ------------------------------------------------ expressions (property)

_LEAVES = st.one_of(
    st.just(("pid",)), st.just(("i",)),
    st.tuples(st.just("c"), st.integers(-70, 300)),
    st.tuples(st.just("c"), st.sampled_from([2 ** 30, -(2 ** 30), 2 ** 31 - 1])))

_DIVISORS = st.integers(-9, 17).filter(lambda k: k != 0)


def _nodes(children):
  return st.one_of(
      st.tuples(st.sampled_from(["add", "sub", "mul", "min", "max",
                                 "fdiv_any", "and"]), children, children),
      st.tuples(st.sampled_from(["fdiv", "mod", "div", "rem", "shr"]),
                children, _DIVISORS),
      st.tuples(st.sampled_from(["neg", "abs", "mof", "u8"]), children),
      st.tuples(st.just("clip"), children, st.integers(-20, 5),
                st.integers(6, 200)),
      st.tuples(st.just("where"), children, children, children, children))


EXPRS = st.recursive(_LEAVES, _nodes, max_leaves=10)


def _build(tree, env):
  op, *args = tree
  if op in ("pid", "i"):
    return env[op]
  if op == "c":
    return I32(args[0])
  sub = lambda k: _build(args[k], env)
  if op == "add":
    return sub(0) + sub(1)
  if op == "sub":
    return sub(0) - sub(1)
  if op == "mul":
    return sub(0) * sub(1)
  if op == "min":
    return jnp.minimum(sub(0), sub(1))
  if op == "max":
    return jnp.maximum(sub(0), sub(1))
  if op == "fdiv_any":
    return jnp.floor_divide(sub(0), sub(1))
  if op == "and":
    return sub(0) & sub(1)
  if op == "fdiv":
    return sub(0) // args[1]
  if op == "mod":
    return sub(0) % args[1]
  if op == "div":
    return lax.div(sub(0), I32(args[1]))
  if op == "rem":
    return lax.rem(sub(0), I32(args[1]))
  if op == "shr":
    return lax.shift_right_arithmetic(sub(0), I32(abs(args[1]) % 8))
  if op == "neg":
    return -sub(0)
  if op == "abs":
    return jnp.abs(sub(0))
  if op == "mof":
    return pl.multiple_of(sub(0), 1)
  if op == "u8":
    return sub(0).astype(jnp.uint8).astype(I32)
  if op == "clip":
    return jnp.clip(sub(0), args[1], args[2])
  if op == "where":
    return jnp.where(sub(0) < sub(1), sub(2), sub(3))
  raise AssertionError(op)


@hypothesis_settings(80)
@given(tree=EXPRS, grid=st.integers(1, 9), trips=st.integers(1, 40))
def test_expression_values_lie_inside_their_interval(tree, grid, trips):
  fn = lambda pid, i: _build(tree, {"pid": pid, "i": i})
  closed = jax.make_jaxpr(fn)(I32(0), I32(0))
  (got,) = ranges.analyze_jaxpr(closed, [Interval(0, grid - 1),
                                         Interval(0, trips - 1)])
  (values,) = _concrete(closed, *_points(grid, trips))
  _assert_inside(values, got, str(tree))


def test_floor_divide_and_remainder_are_exact():
  fn = lambda i: (i // 3, i % 5, (i * 64 - 1) // 64, jnp.remainder(i - 7, 4))
  closed = jax.make_jaxpr(fn)(I32(0))
  got = ranges.analyze_jaxpr(closed, [Interval(0, 63)])
  assert got == [Interval(0, 21), Interval(0, 4), Interval(-1, 62),
                 Interval(0, 3)]


def test_a_call_named_like_jnp_but_computing_else_is_not_trusted():
  @jax.jit
  def floor_divide(a, b):     # not jnp's body: analysed as what it does
    return a * b
  closed = jax.make_jaxpr(lambda i: floor_divide(i, I32(4)))(I32(0))
  assert ranges.analyze_jaxpr(closed, [Interval(0, 9)]) == [Interval(0, 36)]


def test_unknown_values_and_floats():
  fn = lambda i, x: ((x * 3).astype(I32), jnp.sin(x), jnp.float32(i) * 2)
  closed = jax.make_jaxpr(fn)(I32(0), jnp.float32(0))
  got = ranges.analyze_jaxpr(closed, [Interval(0, 3), None])
  assert got == [iv.dtype_range(np.int32), None, None]


# ----------------------------------------------------------------- loops

LOOP_BODY = st.tuples(EXPRS, EXPRS)


@hypothesis_settings(12)
@given(body=LOOP_BODY, trips=st.integers(0, 12), grid=st.integers(1, 4),
       start=st.integers(-3, 3), dynamic=st.booleans())
def test_loop_carries_lie_inside_their_intervals(body, trips, grid, start,
                                                 dynamic):
  """A fori_loop (a scan for a static trip count, a while loop for a traced
  one) whose counter, a running max and min of an expression of the
  counter, and a carry updated by another expression stay inside."""
  expr, update = body

  def fn(pid, n):
    def step(i, c):
      acc, lo, hi = c
      e = _build(expr, {"pid": pid, "i": i})
      new = _build(update, {"pid": acc, "i": i})
      return new, jnp.minimum(lo, e), jnp.maximum(hi, e)
    init = (pid, I32(2 ** 31 - 1), I32(-2 ** 31))
    upper = n if dynamic else start + trips
    return lax.fori_loop(start, upper, step, init)

  closed = jax.make_jaxpr(fn)(I32(0), I32(0))
  n_iv = Interval(start, start + trips) if dynamic else Interval(0, 0)
  got = ranges.analyze_jaxpr(closed, [Interval(0, grid - 1), n_iv])
  pids, = _points(grid)
  ns = np.full_like(pids, start + trips) if dynamic else np.zeros_like(pids)
  values = _concrete(closed, pids, ns)
  for k, (v, g) in enumerate(zip(values, got)):
    _assert_inside(v, g, f"carry {k} of {body}")
  if trips and expr == ("i",):
    assert got[1] == Interval(start, start + trips - 1) or dynamic


def test_a_static_fori_loop_counter_is_exact_inside_the_body():
  def fn(x):
    return lax.fori_loop(0, 64, lambda i, c: jnp.maximum(c, i * 64), x)
  closed = jax.make_jaxpr(fn)(I32(0))
  assert ranges.analyze_jaxpr(closed, [Interval(0, 0)]) == [Interval(0, 4032)]


def test_a_loop_bounded_by_a_traced_value_keeps_its_counter_below_it():
  def fn(n, x):
    return lax.fori_loop(0, n, lambda i, c: jnp.maximum(c, i), x)
  closed = jax.make_jaxpr(fn)(I32(0), I32(0))
  assert "while" in str(closed)
  got = ranges.analyze_jaxpr(closed, [Interval(1, 9), Interval(0, 0)])
  assert got == [Interval(0, 8)]


def test_a_carry_that_keeps_growing_is_widened():
  closed = jax.make_jaxpr(lambda x: lax.fori_loop(
      0, 1000, lambda i, c: c * 2 + 1, x))(I32(0))
  assert ranges.analyze_jaxpr(closed, [Interval(0, 0)]) == [
      iv.dtype_range(np.int32)]


# --------------------------------------------------------------- kernels

def _accesses(fn, *args):
  (spec,) = aot.kernel_specs(fn, *args)
  result = ranges.analyze_kernel(spec)
  return {a.origin: a for _, a in result.items()}, result


def _k_loop(k_total, bk, trips, shift=0, multiple=False):
  def kernel(x_ref, o_ref):
    def body(i, acc):
      start = i * bk + shift
      if multiple:
        start = pl.multiple_of(start, bk)
      return acc + x_ref[:, pl.ds(start, bk)]
    o_ref[...] = lax.fori_loop(0, trips, body,
                               jnp.zeros((8, bk), jnp.float32))

  def f(x):
    return pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((16, bk), jnp.float32),
        grid=(2,), in_specs=[pl.BlockSpec((8, k_total), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, bk), lambda i: (i, 0)),
        backend="triton")(x)
  return f, jax.ShapeDtypeStruct((16, k_total), jnp.float32)


@pytest.mark.parametrize("trips,shift,lower,upper", [
    (4, 0, True, True),        # K % bk == 0: every window inside
    (5, 0, True, False),       # one step too many: past the end
    (4, 1, True, False),       # shifted by one: the last lane past the end
    (4, -1, False, True),      # the first window starts at -1
])
def test_loop_windows_proven_or_not(trips, shift, lower, upper):
  f, x = _k_loop(128, 32, trips, shift, multiple=shift == 0)
  acc, _ = _accesses(f, x)
  a = acc["in_specs[0]"]
  assert a.proven(0) == (True, True)
  assert a.proven(1) == (lower, upper)
  assert a.offsets[1] == Interval(shift, (trips - 1) * 32 + shift + 31)


def test_index_maps_place_blocks_and_whole_arrays_start_at_zero():
  def kernel(x_ref, y_ref, o_ref):
    i = pl.program_id(0)
    o_ref[...] = x_ref[...] + y_ref[pl.ds(i * 8, 8)]

  def f(x, y):
    return pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((32,), jnp.float32), grid=(4,),
        in_specs=[pl.BlockSpec((8,), lambda i: (3 - i,)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((8,), lambda i: (i,)), backend="triton")(x, y)
  x = jax.ShapeDtypeStruct((32,), jnp.float32)
  acc, _ = _accesses(f, x, x)
  assert acc["in_specs[0]"].coords == (Interval(0, 31),)
  assert acc["in_specs[1]"].coords == (Interval(0, 31),)
  assert acc["in_specs[1]"].proven(0) == (True, True)
  assert acc["out_specs[0]"].coords == (Interval(0, 31),)


def test_coordinates_read_from_data_are_not_proven():
  def kernel(s_ref, x_ref, o_ref):
    o_ref[...] = x_ref[pl.ds(s_ref[0], 8)]

  def f(s, x):
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                          backend="triton")(s, x)
  acc, _ = _accesses(f, jax.ShapeDtypeStruct((1,), jnp.int32),
                     jax.ShapeDtypeStruct((16,), jnp.float32))
  assert acc["in_specs[1]"].proven(0) == (False, False)
  assert acc["in_specs[0]"].proven(0) == (True, True)


def test_clamped_and_remainder_starts_are_proven():
  def kernel(s_ref, x_ref, o_ref):
    j = pl.program_id(0)
    a = x_ref[pl.ds(jnp.clip(s_ref[0], 0, 8), 8)]
    b = x_ref[pl.ds((j * 5) % 9, 8)]
    o_ref[...] = a + b

  def f(s, x):
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                          grid=(7,), out_specs=pl.BlockSpec((8,), lambda j: (0,)),
                          backend="triton")(s, x)
  (spec,) = aot.kernel_specs(f, jax.ShapeDtypeStruct((1,), jnp.int32),
                             jax.ShapeDtypeStruct((16,), jnp.float32))
  loads = [a for e, a in ranges.analyze_kernel(spec).items()
           if a.origin == "in_specs[1]"]
  assert [a.coords for a in loads] == [(Interval(0, 15),), (Interval(0, 15),)]
  assert all(a.proven(0) == (True, True) for a in loads)


# -------------------------------------------------- what masks say

def _mask_bound(fn, index_at, mask_at, *args):
  """The bound `dsl.core.mask_bounds` finds for output `index_at` of
  `fn(*args)` under its output `mask_at`."""
  from dsl.core import mask_bounds
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  producers = {v: e for e in jaxpr.eqns for v in e.outvars}
  return mask_bounds.bounds_under_mask(jaxpr.outvars[index_at],
                                       jaxpr.outvars[mask_at], producers)


def _on_cols(f):
  """`f(cols)` for the columns `i * 16 + arange(16)` of program `i`."""
  return lambda i: f(i * 16 + jnp.arange(16))


@pytest.mark.parametrize("name,fn,bound", [
    ("lt", _on_cols(lambda c: (c, c < 100)), Interval(-(1 << 63), 99)),
    ("flipped", _on_cols(lambda c: (c, 50 > c)), Interval(-(1 << 63), 49)),
    ("both_sides", _on_cols(lambda c: (c, (c >= 3) & (c <= 90))),
     Interval(3, 90)),
    # rows broadcast against columns, as Pallas's norms' backward does
    ("rows_of_a_tile", _on_cols(lambda c: (
        jnp.broadcast_to(c[:, None], (16, 8)),
        (c[:, None] < 40) & (jnp.arange(8)[None, :] < 5))),
     Interval(-(1 << 63), 39)),
    # the mask bounds the columns, the index runs along the rows
    ("other_axis", _on_cols(lambda c: (
        jnp.broadcast_to(c[:, None], (16, 16)),
        jnp.broadcast_to((c < 3)[None, :], (16, 16)))), None),
    ("another_value", _on_cols(lambda c: (c, c + 1 < 100)), None),
    ("or", _on_cols(lambda c: (c, (c < 100) | (c > 200))), None),
])
def test_a_mask_bounds_the_indices_it_compares_lane_for_lane(name, fn,
                                                             bound):
  assert _mask_bound(fn, 0, 1, 3) == bound


@given(st.integers(0, 12), st.integers(-40, 200), st.integers(-40, 200))
@hypothesis_settings(max_examples=40)
def test_indices_under_a_mask_lie_inside_its_bound(i, lo, hi):
  fn = _on_cols(lambda c: (c, (c >= lo) & (c < hi)))
  bound = _mask_bound(fn, 0, 1, i)
  cols, mask = fn(i)
  kept = np.asarray(cols)[np.asarray(mask)]
  if kept.size:
    assert bound.lo <= kept.min() and kept.max() <= bound.hi


# ------------------------------------------------------ relational facts

def test_min_with_a_value_plus_k_minus_that_value_is_at_most_k():
  """`min(n, s + 2) - s <= 2` whatever n is (and `max(n, s - 3) - s >=
  -3`), in a cond's branch too: so `cdiv(min(n, s + 2) - s, 2)`, the trip
  count of a loop over one split of 2 pages starting at s (Pallas's paged
  attention), is at most 1; every concrete value stays inside."""
  def fn(s, n):
    end = jnp.minimum(n, s + 2)
    trips = lax.cond(s >= end, lambda a, b: a * 0,
                     lambda a, b: pl.cdiv(b - a, 2), s, end)
    return end - s, jnp.maximum(n, s - 3) - s, trips
  closed = jax.make_jaxpr(fn)(I32(0), I32(0))
  got = ranges.analyze_jaxpr(closed, [Interval(0, 30), Interval(0, 2 ** 20)])
  assert got[0] == Interval(-30, 2) and got[1] == Interval(-3, 2 ** 20)
  assert got[2].hi == 1
  s, n = _points(31, 40)
  for values, interval in zip(_concrete(closed, s, n * 7), got):
    _assert_inside(values, interval)


def test_no_relation_between_other_values_or_across_a_wrap():
  """`min(n, t + 2) - s` (t is not s) keeps the interval of its operands;
  so does `min(n, s + 2) - s` where `s + 2` may wrap around."""
  closed = jax.make_jaxpr(
      lambda s, t, n: jnp.minimum(n, t + 2) - s)(I32(0), I32(0), I32(0))
  got = ranges.analyze_jaxpr(closed, [Interval(0, 30), Interval(0, 30),
                                      Interval(0, 100)])
  assert got == [Interval(-30, 32)]          # not 2
  closed = jax.make_jaxpr(
      lambda s, n: jnp.minimum(n, s + 2) - s)(I32(0), I32(0))
  top = 2 ** 31 - 1
  got = ranges.analyze_jaxpr(closed, [Interval(0, top), Interval(0, 100)])
  assert got == [iv.dtype_range(np.int32)]
