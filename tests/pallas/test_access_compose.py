"""The one composition of views (`dsl.core.access.compose`): a view of a
view of a view touches the elements numpy's indexing touches, whatever the
readers' start values are (ints, the range analysis's intervals, the
Triton lowering's symbolic starts)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import dsl as pl
from dsl.core import ranges
from dsl.core.access import (INDEX, INDICES, INTS, SLICE, Axis, DimWindow,
                             RefAccess, compose)
from dsl.core.intervals import Interval
from dsl.core.jax_internals import state_indexing
from lowering_triton import kernel_refs
from lowering_triton.kernel_refs import MemRef, apply_indexer
from lowering_triton.values import TVal
from tests.pallas import testing
from tests.pallas.testing import hypothesis_settings

SETTINGS = hypothesis_settings(60)


@st.composite
def chains(draw):
  """(array shape, a chain of indexers: per indexer, per dim it shows, a
  slice (start, size, stride) inside the dim or an integer index)."""
  shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
  sizes, chain = list(shape), []
  for _ in range(draw(st.integers(1, 3))):
    if not sizes:
      break
    entries, left = [], []
    for m in sizes:
      if draw(st.booleans()) and len(sizes) > 1:
        entries.append(draw(st.integers(0, m - 1)))
        continue
      start = draw(st.integers(0, m - 1))
      stride = draw(st.integers(1, 3))
      size = draw(st.integers(1, -(-(m - start) // stride)))
      entries.append((start, size, stride))
      left.append(size)
    chain.append(tuple(entries))
    sizes = left
  return shape, chain


def _numpy_entry(e):
  if isinstance(e, tuple):
    start, size, stride = e
    return slice(start, start + (size - 1) * stride + 1, stride)
  return e


def _indexer(entries, sizes, value=lambda v: v):
  """The indexer of `entries`, its starts and indices `value(...)` (the
  values a reader holds)."""
  return state_indexing.NDIndexer(
      tuple(pl.ds(value(e[0]), e[1], e[2]) if isinstance(e, tuple)
            else value(e) for e in entries), tuple(sizes), (), validate=False)


def _compose_chain(shape, chain, algebra, start_of):
  axes, fixed = tuple(Axis(d, 0, 1, n) for d, n in enumerate(shape)), ()
  for entries in chain:
    dims = RefAccess.of(_indexer(entries, [a.size for a in axes])).dims
    axes, fixed = compose(axes, fixed, dims, algebra, start_of)
  return axes, fixed


def _elements(shape, axes, fixed):
  """The flat positions (in a row-major array of `shape`) of the view's
  elements, in the view's order."""
  strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
  out = np.zeros([a.size for a in axes], np.int64)
  for f in fixed:
    out += f.start * strides[f.dim]
  for k, a in enumerate(axes):
    lanes = a.start + a.step * np.arange(a.size)
    out += (lanes * strides[a.dim]).reshape(
        [-1 if j == k else 1 for j in range(len(axes))])
  return out


@SETTINGS
@given(chains())
def test_composed_views_touch_what_numpy_touches(case):
  shape, chain = case
  x = np.arange(math.prod(shape)).reshape(shape)
  for entries in chain:
    x = x[tuple(_numpy_entry(e) for e in entries)]
  axes, fixed = _compose_chain(shape, chain, INTS, lambda w, ax: w.start)
  np.testing.assert_array_equal(_elements(shape, axes, fixed), x)


@SETTINGS
@given(chains())
def test_the_range_analysis_bounds_the_composed_coordinates(case):
  """The range analysis's windows compose through the same function: the
  interval it gives each array dim is the numpy view's coordinates' hull."""
  shape, chain = case
  window = ranges.Window.whole(shape, "x")
  for entries in chain:
    window = window.index(_indexer(entries, [a.size for a in window.axes],
                                   Interval.const))
  coords = np.indices(shape)
  for entries in chain:
    coords = coords[(slice(None),) + tuple(_numpy_entry(e) for e in entries)]
  for d, (coord, offset) in window.extents().items():
    assert (coord.lo, coord.hi) == (coords[d].min(), coords[d].max())
    assert offset == coord          # a whole ref: its block starts at 0


def _sym_view(shape, chain):
  """A Triton MemRef of `shape` composed with `chain`, its first start `i`
  (a value computed at run time): the sources of its starts."""
  ref = MemRef("x", "x_ptr", np.dtype(np.float32), shape,
               kernel_refs.row_major_strides(shape), (),
               tuple(kernel_refs.Axis(d, "i" if d == 0 else 0, 1, n)
                     for d, n in enumerate(shape)),
               (False,) * len(shape), (False,) * len(shape))
  for entries in chain:
    ref = apply_indexer(ref, _indexer(entries, ref.shape))
  return ref


@SETTINGS
@given(chains())
def test_the_triton_lowering_composes_symbolic_starts_the_same_way(case):
  """The Triton lowering's MemRef composes through the same function: with
  `i` for 0 in its first start, its first start is the source of `i + c`
  where the int composition reads `c`."""
  shape, chain = case
  ref = _sym_view(shape, chain)
  axes, fixed = _compose_chain(shape, chain, INTS, lambda w, ax: w.start)
  assert [(a.dim, a.step, a.size) for a in ref.axes] == [
      (a.dim, a.step, a.size) for a in axes]
  mine = {a.dim: a.start for a in ref.axes + ref.fixed}
  for a in axes + fixed:
    if a.dim == 0:              # the source of `i + c`, read with i = 100
      assert isinstance(mine[0], str) and "i" in mine[0]
      assert eval(mine[0], {"i": 100}) == 100 + a.start
    else:
      assert mine[a.dim] == a.start


def test_a_strided_slice_of_a_strided_slice_multiplies_the_strides():
  axes, fixed = compose((Axis(0, 3, 2, 10),), (),
                        (DimWindow(SLICE, 1, 4, 3, 1),), INTS,
                        lambda w, ax: w.start)
  assert axes == (Axis(0, 3 + 2 * 1, 6, 4),) and fixed == ()
  axes, fixed = compose(axes, fixed, (DimWindow(INDEX, 2, 1, 1, 2),), INTS,
                        lambda w, ax: w.start)
  assert axes == () and fixed == (Axis(0, 5 + 6 * 2, 6, 1),)


def test_an_array_of_indices_is_the_readers_own_axis():
  idx = np.array([2, 0, 1])
  w = DimWindow.of(idx, 5)
  assert w.kind == INDICES
  with pytest.raises(ValueError, match="array of indices"):
    compose((Axis(0, 0, 1, 5),), (), (w,), INTS, lambda w, ax: w.start)
  axes, _ = compose((Axis(0, 4, 2, 5),), (), (w,), INTS,
                    lambda w, ax: w.start,
                    indices=lambda w, ax: Axis(ax.dim, ax.start, ax.step, 3))
  assert axes == (Axis(0, 4, 2, 3),)


def test_a_triton_gather_keeps_its_lanes():
  """An array of indices (a TVal of shape (3,)) becomes the Triton
  lowering's lanes axis through the composition's hook."""
  ref = _sym_view((6, 4), [])
  lanes = TVal("idx", (3,), np.dtype(np.int32))
  out = apply_indexer(ref, state_indexing.NDIndexer(
      (lanes, pl.ds(1, 2)), (6, 4), (3,), validate=False), gather=True)
  gathered, cols = out.axes
  assert (gathered.lanes, gathered.clamp_to, gathered.size) == ("idx", 6, 3)
  assert (cols.start, cols.size, cols.lanes) == (1, 2, None)
  assert out.gathered == (0,)


def _view_of_a_view_kernel(x_ref, o_ref):
  rows = x_ref.at[pl.ds(2, 12)]                 # rows 2..13
  o_ref[...] = rows[pl.ds(1, 4, 2), :]          # rows 3, 5, 7, 9


def _view_then_index_kernel(x_ref, o_ref):
  rows = x_ref.at[pl.ds(1, 8, 2)]               # rows 1, 3, ..., 15
  o_ref[...] = rows[3, :][None]                 # row 7


@pytest.mark.parametrize("kernel,want_rows", [
    (_view_of_a_view_kernel, [3, 5, 7, 9]),
    (_view_then_index_kernel, [7])])
def test_every_cpu_backend_reads_the_composed_view(kernel, want_rows):
  """Each backend composes `x.at[...]` views through the one composition
  (the interpreter's discharge, the Triton MemRef, the Mosaic view): every
  CPU backend and Pallas's interpret mode read numpy's rows."""
  x = np.arange(16 * 128, dtype=np.float32).reshape(16, 128)
  out = jax.ShapeDtypeStruct((len(want_rows), 128), jnp.float32)
  got = testing.run_backends(testing.CPU_BACKENDS, kernel, out, x)
  for backend, y in got.items():
    np.testing.assert_array_equal(np.asarray(y), x[want_rows],
                                  err_msg=backend)
