"""One model of a ref access, and the one answer to "may it leave its ref?".

An access is a ref's shape and, per dim of the ref, the window an indexer
puts there (`DimWindow`: a slice `start + stride * k, k < size`, an integer
index, or an array of indices), plus the mask that guards its lanes. It is
built once from the indexer (`RefAccess.of`), whatever the index values are:
Python or NumPy integers and tracers at trace time, `jax.extend` atoms in a
jaxpr, the values of a backend's generated code; the caller says how to read
a value known at trace time (`static`). The range analysis
(`dsl.core.ranges`) attaches what it proves (`RefAccess.proving`: per dim,
whether the lower and upper bound stay inside the ref).

`RefAccess.exits()` is the one decision: on which side of which dim the
access may leave its ref (`Exit`). An exit is `static` when the window's
place is known at trace time: then it surely leaves (the trace-time check
refuses it; derived kernels keep such windows, and the interpret backend
reads poison there). A window placed at run time may leave on each side the
analysis does not prove inside. Who asks:

- `dsl.core.refs.check_static_indices`: a static exit is an error when the
  kernel is traced;
- `dsl.core.windows` (the interpret backend's discharge of ref reads and
  writes): a dim with an exit reads poison and writes nothing outside;
- `dsl.transforms.window_checks` (run-time asserts on the interpret
  backend): a run-time exit gets a check;
- `lowering_triton.kernel_refs.apply_indexer` and `lowering_triton.rules.state`:
  a run-time exit gets a mask (and a `tl.device_assert` with run-time
  asserts on), unless the range analysis proves that side inside;
- `lowering_mosaic.unchecked_windows` (the Mosaic TPU and GPU lowerings):
  with run-time asserts on, a run-time exit not proven inside is refused
  on the hardware, which checks no window.

`compose` is the one composition of a view (its visible `Axis`es and the
ones an integer index fixed) with an indexer's windows, generic over the
value of a start (`StartAlgebra`): the range analysis's windows, the
Triton lowering's `MemRef` and the Mosaic lowerings' views compose
through it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
from dsl.core.jax_internals import core, state_indexing as indexing

SLICE, INDEX, INDICES = "slice", "index", "indices"
BELOW, ABOVE = 0, 1                 # the sides of a dim

Static = Callable[[Any], "int | None"]


def static_int(x) -> int | None:
  """`x` as a Python int when it is known at trace time (an integer, a
  concrete array or a literal), else None."""
  if isinstance(x, bool):
    return None
  if isinstance(x, (int, np.integer)):
    return int(x)
  if isinstance(x, core.Literal):
    return static_int(x.val)
  try:
    return int(core.concrete_or_error(None, x))
  except Exception:  # noqa: BLE001 - a traced (or non-integer) value
    return None


def shape_of(x) -> tuple:
  """The shape of an index value (an array, tracer, atom or backend value
  with a `shape`); () for a scalar."""
  shape = getattr(x, "shape", None)
  if shape is None:
    shape = getattr(getattr(x, "aval", None), "shape", ())
  return tuple(shape)


@dataclasses.dataclass(frozen=True)
class DimWindow:
  """The window an indexer puts on one dim of a ref: coordinates
  `start + stride * k` for `k < size` (SLICE), the one coordinate `start`
  (INDEX: the dim is squeezed), or the coordinates an array of indices
  holds (INDICES: `size` of them). `static_start` is the start when it is
  known at trace time (an INDEX counted from the end when negative, as
  numpy counts it); None when it is computed at run time. `size` is None
  for a slice of run-time size."""
  kind: str
  start: Any
  size: int | None
  stride: int = 1
  static_start: int | None = None

  @property
  def squeezed(self) -> bool:
    return self.kind != SLICE

  @property
  def last(self) -> int | None:
    """The last coordinate, when the window's place and size are static."""
    if self.static_start is None or self.size is None:
      return None
    return self.static_start + (max(self.size, 1) - 1) * self.stride

  @classmethod
  def of(cls, idx, n, static: Static = static_int) -> "DimWindow":
    """The window of one entry of an indexer (a `pl.ds` Slice, a Python
    slice, an integer index or an array of indices) on a dim of `n`."""
    if isinstance(idx, indexing.Slice):
      size = static(idx.size) if not isinstance(idx.size, int) else idx.size
      stride = int(idx.stride) if idx.stride is not None else 1
      return cls(SLICE, idx.start, size, stride, static(idx.start))
    if isinstance(idx, slice):
      return _python_slice(idx, n, static)
    if shape_of(idx):
      return cls(INDICES, idx, math.prod(shape_of(idx)))
    at = static(idx)
    if at is not None and isinstance(n, int) and -n <= at < 0:
      at += n
    return cls(INDEX, idx, 1, 1, at)

  def sides(self, n: int) -> tuple[bool, bool]:
    """(may go below 0, may reach n or past it) without any proof."""
    if self.kind == INDICES or self.static_start is None or self.size is None:
      return True, True
    if self.size <= 0:            # an empty window: only its start counts
      return self.static_start < 0, self.static_start > n
    return self.static_start < 0, self.last >= n


def slice_entry(start, size, stride: int = 1):
  """The indexer entry of the slice window `start + stride * k`, `k <
  size` (what `pl.ds(start, size, stride)` writes), for code that builds
  an indexer."""
  return indexing.Slice(start, size, stride)


def _python_slice(idx: slice, n, static: Static) -> DimWindow:
  """A Python slice `a:b:c` on a dim of `n`; None bounds are the dim's
  ends, negative ones count from the end (a run-time bound: unknown)."""
  step = 1 if idx.step is None else static(idx.step)
  start = 0 if idx.start is None else static(idx.start)
  stop = n if idx.stop is None else static(idx.stop)
  if step is None or step <= 0 or start is None or stop is None or \
      not isinstance(n, int):
    return DimWindow(SLICE, idx.start, None, step or 1)
  start, stop = (start + n if start < 0 else start,
                 stop + n if stop < 0 else stop)
  size = max(0, -(-(stop - start) // step))
  return DimWindow(SLICE, start, size, step, start)


# ------------------------------------------------------------------ views

class StartAlgebra(NamedTuple):
  """How a reader adds and scales the starts of its windows: intervals for
  the range analysis, symbolic sources for the Triton lowering, MLIR values
  or ints for the Mosaic lowerings."""
  add: Callable[[Any, Any], Any]
  scale: Callable[[Any, int], Any]

  @classmethod
  def folding(cls, add, scale) -> "StartAlgebra":
    """The algebra of a backend's values that folds what is known at trace
    time (ints: sums, adding 0, scaling by 1 or 0) and leaves the rest to
    `add(a, b)` and `scale(a, k)`, which build the backend's value."""
    def add_folded(a, b):
      if isinstance(a, int) and isinstance(b, int):
        return a + b
      if isinstance(a, int) and a == 0:
        return b
      if isinstance(b, int) and b == 0:
        return a
      return add(a, b)

    def scale_folded(a, k: int):
      if isinstance(a, int):
        return a * k
      if k == 1:
        return a
      if k == 0:
        return 0
      return scale(a, k)
    return cls(add_folded, scale_folded)


INTS = StartAlgebra(lambda a, b: a + b, lambda a, k: a * k)


@dataclasses.dataclass(frozen=True)
class Axis:
  """A dim of a view of an array: array dim `dim`, coordinates `start +
  step * k` for `k < size`. A dim an integer index fixed is an axis of
  one element (`start`: its coordinate) the view no longer shows. Readers
  may subclass it with fields of their own; composition keeps them."""
  dim: int
  start: Any
  step: int = 1
  size: int | None = None


def compose(axes: Sequence[Axis], fixed: Sequence[Axis],
            dims: Sequence[DimWindow], algebra: StartAlgebra,
            start_of: Callable[[DimWindow, Axis], Any],
            indices: Callable[[DimWindow, Axis], Axis] | None = None
            ) -> tuple[tuple[Axis, ...], tuple[Axis, ...]]:
  """The one composition of a view with an indexer: the (visible axes,
  fixed axes) of `view[indexer]`, where the view shows `axes` (and has
  fixed `fixed`) and `dims` are the indexer's windows, one per visible
  axis. A slice narrows its axis (a strided slice of a strided slice
  multiplies the strides), an integer index fixes it; `start_of(w, axis)`
  is a window's start as a value of `algebra`; `indices(w, axis)` is the
  axis an array of indices makes (the reader's own; None: not taken)."""
  if len(dims) != len(axes):
    raise ValueError(f"{len(dims)} indices for a view of rank {len(axes)}")
  shown, fixed = [], list(fixed)
  for ax, w in zip(axes, dims):
    if w.kind == INDICES:
      if indices is None:
        raise ValueError("an array of indices on a view that takes none")
      shown.append(indices(w, ax))
      continue
    at = algebra.add(ax.start, algebra.scale(start_of(w, ax), ax.step))
    if w.kind == SLICE:
      shown.append(dataclasses.replace(ax, start=at, step=ax.step * w.stride,
                                       size=w.size))
    else:
      fixed.append(dataclasses.replace(ax, start=at, size=1))
  return tuple(shown), tuple(fixed)


class Exit(NamedTuple):
  """A side of a dim where an access may leave its ref."""
  dim: int
  side: int                         # BELOW or ABOVE
  static: bool                      # the window's place is static: it
  # surely leaves there


@dataclasses.dataclass(frozen=True)
class RefAccess:
  """An access of a ref of `shape`: per dim, its window; `mask`, the mask
  of a masked load or store (None: every lane); `proven`, per dim, whether
  the range analysis proves the (lower, upper) bound inside the ref."""
  shape: tuple
  dims: tuple[DimWindow, ...]
  mask: Any = None
  proven: tuple[tuple[bool, bool], ...] = ()

  @classmethod
  def of(cls, indexer, shape: Sequence | None = None, *,
         static: Static = static_int, mask=None) -> "RefAccess":
    """The access `ref[indexer]` of a ref of `shape` (default: the
    indexer's own); `indexer` is an `NDIndexer` or a tuple of entries,
    one per dim."""
    indices = (indexer.indices if isinstance(indexer, indexing.NDIndexer)
               else tuple(indexer))
    if shape is None:
      shape = indexer.shape
    shape = tuple(int(n) if isinstance(n, (int, np.integer)) else None
                  for n in shape)
    dims = tuple(DimWindow.of(i, n, static) for i, n in zip(indices, shape))
    return cls(shape[:len(dims)], dims, mask)

  @classmethod
  def at_run_time(cls, shape: Sequence, dims) -> "RefAccess":
    """An access of a ref of `shape` placed at run time on `dims` and
    covering the others whole: what a lowering that has composed a view's
    indexers knows of it, before the range analysis's proofs."""
    shape = tuple(int(n) for n in shape)
    return cls(shape, tuple(
        DimWindow(SLICE, None, n) if d in dims else
        DimWindow(SLICE, 0, n, 1, 0) for d, n in enumerate(shape)))

  def proving(self, proven: Callable[[int], tuple[bool, bool]]
              ) -> "RefAccess":
    """The access with the range analysis's proofs: `proven(dim)` says
    whether the (lower, upper) bound of `dim` stays inside the ref."""
    return dataclasses.replace(
        self, proven=tuple(tuple(proven(d)) for d in range(len(self.dims))))

  def exits(self) -> tuple[Exit, ...]:
    """Where the access may leave its ref: the one decision."""
    out = []
    for d, (w, n) in enumerate(zip(self.dims, self.shape)):
      if n is None:                 # a dim of run-time size: not bounded
        continue
      static = w.kind != INDICES and w.static_start is not None
      proven = self.proven[d] if self.proven and not static else (False,
                                                                   False)
      for side, may in enumerate(w.sides(n)):
        if may and not proven[side]:
          out.append(Exit(d, side, static))
    return tuple(out)

  def may_leave(self) -> bool:
    return bool(self.exits())

  def leaving_dims(self, *, static: bool | None = None) -> set[int]:
    """The dims with an exit (only static ones, or only run-time ones,
    when `static` says)."""
    return {e.dim for e in self.exits()
            if static is None or e.static == static}
