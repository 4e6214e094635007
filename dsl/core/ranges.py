"""The range analysis of a kernel: which coordinates can leave their array.

`analyze_kernel(spec)` runs an interval analysis over the kernel jaxpr
(rules in `dsl.core.range_rules`, arithmetic in `dsl.core.intervals`): program ids lie
in 0..grid-1, index maps give the blocks' positions, loops with bounds known
at trace time give their counters' ranges, and arithmetic carries them to
every ref access. For each load, store and atomic it records, per array dim
of the accessed operand, the interval of every coordinate the access can
touch (`Access`), so a lowering can leave out the masks and checks of the
coordinates it proves inside (`Access.proven`) and keep them for the rest.

The analysis is sound, not exact: a value it cannot follow (read from
memory, a float converted to an int, arithmetic that may wrap around) is
anywhere in its dtype's range, and then nothing built from it is proven.
It is backend-neutral: backends ask it, it knows none of them.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Sequence

import numpy as np
from dsl.core.jax_internals import (ClosedJaxpr, core,
                                    state_indexing as indexing)

from dsl.core import intervals as iv
from dsl.core.access import (SLICE, Axis, DimWindow, RefAccess, StartAlgebra,
                             compose)
from dsl.core.blockspec import Element, squeezed
from dsl.core.dynamic_grid import is_dynamic
from dsl.core.errors import BackendError
from dsl.core.intervals import Interval
from dsl.core.jaxpr_walk import LoweringHost, walk_jaxpr
from dsl.core.range_rules import RANGE_RULES

MaybeInterval = Interval | None


def _add(a: MaybeInterval, b: MaybeInterval) -> MaybeInterval:
  return None if a is None or b is None else a + b


def _scale(a: MaybeInterval, k: int) -> MaybeInterval:
  return None if a is None else a.scale(k)


# ------------------------------------------------------------------ windows

def _both(f):
  return lambda a, b: (f(a[0], b[0]), f(a[1], b[1]))


# A start is a pair (coordinate in the array, the same counted from the
# first element of the operand's block); a window's start moves both.
_PAIRS = StartAlgebra(_both(_add),
                      lambda a, k: (_scale(a[0], k), _scale(a[1], k)))


def _extent(base: MaybeInterval, ax: Axis) -> MaybeInterval:
  return _add(base, Interval(0, ax.step * max(ax.size - 1, 0)))


@dataclasses.dataclass(frozen=True)
class Window:
  """Where the elements of a kernel ref lie in its operand's array: per
  array dim, a visible axis or a fixed one (a squeezed block dim or an
  integer index), the access model's `Axis` whose start is the pair
  (coordinate, coordinate counted from the block's start), None where
  unknown."""
  origin: str                    # "in_specs[0]", "scratch_shapes[1]", ...
  array_shape: tuple[int, ...]
  block_sizes: tuple[int, ...]   # per array dim (squeezed: 1)
  axes: tuple[Axis, ...]
  fixed: tuple[Axis, ...] = ()
  indexed: tuple[tuple[int, bool, bool], ...] = ()
  # (array dim, proven >= 0, proven below the size of the axis it indexes)
  # of each integer index (scalar or array) an indexer put on a dim

  @classmethod
  def whole(cls, shape, origin: str) -> "Window":
    """A ref that is its whole array (scratch, scalar prefetch)."""
    shape = tuple(int(n) for n in shape)
    zero = Interval(0, 0)
    return cls(origin, shape, shape, tuple(
        Axis(d, (zero, zero), 1, n) for d, n in enumerate(shape)))

  def index(self, indexer) -> "Window | None":
    """The window `ref[indexer]`, None when the indexer is not understood."""
    if not isinstance(indexer, indexing.NDIndexer) or \
        len(indexer.indices) != len(self.axes):
      return None
    access = RefAccess.of(indexer, [ax.size for ax in self.axes],
                          static=_static)
    indexed = list(self.indexed)
    for ax, w in zip(self.axes, access.dims):
      if w.kind == SLICE and (w.size is None or
                              _index_interval(w.start, None) is None):
        return None
      if w.kind != SLICE:
        if _index_interval(w.start, ax.size) is None:
          return None
        raw = w.start if isinstance(w.start, Interval) else \
            Interval.const(int(w.start))
        indexed.append((ax.dim, raw.lo >= 0, raw.hi <= ax.size - 1))
    axes, fixed = compose(self.axes, self.fixed, access.dims, _PAIRS,
                          _start_pair)
    return dataclasses.replace(self, axes=axes, fixed=fixed,
                               indexed=tuple(indexed))

  def extents(self) -> dict[int, tuple[MaybeInterval, MaybeInterval]]:
    """Per array dim: (coordinates, coordinates counted from the block's
    start) of every element of the window."""
    return {ax.dim: (_extent(ax.start[0], ax), _extent(ax.start[1], ax))
            for ax in self.fixed + self.axes}


def _static(x) -> int | None:
  return int(x) if isinstance(x, (int, np.integer)) else None


def _start_pair(w: DimWindow, ax: Axis) -> tuple:
  at = _index_interval(w.start, ax.size if w.kind != SLICE else None)
  return at, at


def _index_interval(idx, size: int | None) -> MaybeInterval:
  """The coordinates an index (a Slice start, or an integer index into an
  axis of `size` elements) can take. A static negative integer index counts
  from the end; a constant one computed in the kernel may be folded to one
  by a backend, so it counts both ways."""
  if isinstance(idx, (int, np.integer)):
    idx = int(idx)
    return Interval.const(idx + size if idx < 0 and size is not None else idx)
  if not isinstance(idx, Interval):
    return None
  if size is not None and idx.is_const and idx.lo < 0:
    return Interval(idx.lo, idx.lo + size)
  return idx


# ----------------------------------------------------------------- accesses

@dataclasses.dataclass(frozen=True)
class Access:
  """Every coordinate one load/store/atomic equation can touch, per array
  dim of its operand: `coords` in the array, `offsets` counted from the
  first element of the block (None: unknown)."""
  origin: str
  array_shape: tuple[int, ...]
  block_sizes: tuple[int, ...]
  coords: tuple[MaybeInterval, ...]
  offsets: tuple[MaybeInterval, ...]
  # Per array dim: whether the integer indices an indexer put there are
  # proven at or above 0 and below the size of the axis they index.
  indices: tuple[tuple[bool, bool], ...] = ()
  # The array dim of each dim of the ref its first indexer indexes (() when
  # joined over refs that differ).
  ref_dims: tuple[int, ...] = ()

  @classmethod
  def of(cls, window: Window, ref_dims: tuple[int, ...] = ()) -> "Access":
    ext = window.extents()
    rank = len(window.array_shape)
    indices = [(True, True)] * rank
    for d, lo, hi in window.indexed:
      indices[d] = (indices[d][0] and lo, indices[d][1] and hi)
    return cls(window.origin, window.array_shape, window.block_sizes,
               tuple(ext.get(d, (None, None))[0] for d in range(rank)),
               tuple(ext.get(d, (None, None))[1] for d in range(rank)),
               tuple(indices), tuple(ref_dims))

  def join(self, other: "Access") -> "Access":
    if (self.origin, self.array_shape) != (other.origin, other.array_shape):
      unknown = (None,) * len(self.array_shape)
      return dataclasses.replace(
          self, coords=unknown, offsets=unknown,
          indices=((False, False),) * len(self.array_shape), ref_dims=())
    j = lambda a, b: None if a is None or b is None else a.join(b)
    both = lambda a, b: (a[0] and b[0], a[1] and b[1])
    return dataclasses.replace(
        self, coords=tuple(map(j, self.coords, other.coords)),
        offsets=tuple(map(j, self.offsets, other.offsets)),
        indices=tuple(map(both, self.indices, other.indices)),
        ref_dims=self.ref_dims if self.ref_dims == other.ref_dims else ())

  def in_array(self, dim: int) -> tuple[bool, bool]:
    """(no coordinate below 0, none at or past the end) on `dim`."""
    return _inside(self.coords[dim], self.array_shape[dim])

  def in_block(self, dim: int) -> tuple[bool, bool]:
    """The same within the operand's block (of `block_sizes[dim]`)."""
    return _inside(self.offsets[dim], self.block_sizes[dim])

  def proven(self, dim: int) -> tuple[bool, bool]:
    """(lower, upper): whether every coordinate on `dim` is proven at or
    above 0, below the end. Inside the block counts as inside the array: a
    backend already guards the block itself (masks a partial edge block or
    one whose index, read from data, lies outside the array)."""
    a, b = self.in_array(dim), self.in_block(dim)
    return a[0] or b[0], a[1] or b[1]

  def inside_ref(self, k: int) -> tuple[bool, bool]:
    """(lower, upper) proven inside the ref on its dim `k` (a kernel ref:
    its block; a scratch or scoped buffer: all of it), for the access
    model (`dsl.core.access.RefAccess.proving`)."""
    if k >= len(self.ref_dims):
      return False, False
    return self.in_block(self.ref_dims[k])

  def index_inside(self, dim: int) -> tuple[bool, bool]:
    """(lower, upper): whether every integer index put on `dim` is proven
    at or above 0 (none counts from the end), below the size of the axis
    it indexes (none is clamped, as a gather clamps)."""
    return self.indices[dim] if self.indices else (False, False)


def _inside(coords: MaybeInterval, n: int) -> tuple[bool, bool]:
  if coords is None:
    return False, False
  return coords.lo >= 0, coords.hi <= n - 1


class KernelRanges:
  """The analysis's result: an `Access` per ref-accessing equation; the
  operands (by origin) some access reads, and those passed to a primitive
  the analysis does not know (anything may happen to them)."""

  def __init__(self):
    self._accesses: dict[int, tuple[Any, Access]] = {}
    self.read: set[str] = set()
    self.escaped: set[str] = set()

  def record(self, eqn, access: Access, reads: bool = True) -> None:
    old = self._accesses.get(id(eqn))
    self._accesses[id(eqn)] = (eqn, access if old is None
                               else old[1].join(access))
    if reads:
      self.read.add(access.origin)

  def access(self, eqn) -> Access | None:
    """The coordinates `eqn` can touch; None when it was never reached (or
    accesses a ref the analysis cannot follow)."""
    hit = self._accesses.get(id(eqn))
    return hit[1] if hit is not None and hit[0] is eqn else None

  def items(self) -> list[tuple[Any, Access]]:
    return list(self._accesses.values())


# --------------------------------------------------------------- the walk

class _Context:
  """What a rule of `RANGE_RULES` sees."""

  def __init__(self, host: "_RangeHost", eqn, used=frozenset(),
               jaxpr=None):
    self.host, self.eqn, self.primitive = host, eqn, eqn.primitive
    self.used = used            # the variables the eqn's jaxpr reads
    self.jaxpr = jaxpr          # the jaxpr the eqn belongs to

  @property
  def producers(self) -> dict:
    """The equation computing each variable of the eqn's jaxpr."""
    return self.host.producers(self.jaxpr)

  def dtype(self, k: int = 0):
    aval = self.eqn.outvars[k].aval
    return getattr(aval, "dtype", None) if not _is_ref(aval) else None

  def top(self, k: int = 0) -> MaybeInterval:
    dtype = self.dtype(k)
    return None if dtype is None else iv.dtype_range(dtype)

  def walk(self, jaxpr: core.Jaxpr, consts: Sequence, args: Sequence) -> list:
    return walk_jaxpr(self.host, jaxpr, consts, args)

  def walk_closed(self, closed, args: Sequence) -> list:
    if isinstance(closed, ClosedJaxpr):
      return self.walk(closed.jaxpr, closed.consts, args)
    return self.walk(closed, (), args)

  def access(self, ref, transforms, reads: bool = True) -> None:
    """Records the coordinates `ref[transforms...]` touches (and whether
    the access reads them)."""
    if not isinstance(ref, Window):
      return
    origin, ref_dims = ref.origin, tuple(ax.dim for ax in ref.axes)
    for t in transforms:
      ref = ref.index(t)
      if ref is None:
        self.escape([origin])
        return
    self.host.result.record(self.eqn, Access.of(ref, ref_dims), reads)

  def bind(self, inner, outer) -> None:
    """Notes that the variables `inner` of a jaxpr this eqn runs (a
    branch) hold the values of this eqn's atoms `outer` while it runs."""
    self.host.producers(self.jaxpr)
    self.host.aliases.update((i, o) for i, o in zip(inner, outer)
                             if isinstance(o, core.Var))

  def definition(self, var):
    """(the variable `var` holds the value of, across the jaxprs bound by
    `bind`; the equation computing it, None for an input)."""
    while var in self.host.aliases:
      var = self.host.aliases[var]
    self.host.producers(self.jaxpr)     # the eqn's own jaxpr, into defs
    return var, self.host.defs.get(var)

  def escape(self, args) -> None:
    """Notes the refs among `args`: something the analysis does not follow
    happens to them."""
    self.host.result.escaped.update(a.origin for a in args
                                    if isinstance(a, Window))

  def new_buffer(self, aval, origin: str) -> Window | None:
    inner = getattr(aval, "inner_aval", aval)
    shape = getattr(inner, "shape", None)
    return None if shape is None else Window.whole(shape, origin)


def _is_ref(aval) -> bool:
  return hasattr(aval, "inner_aval")


def _concrete_interval(value) -> MaybeInterval:
  try:
    arr = np.asarray(value)
  except Exception:  # noqa: BLE001 - not a concrete array: unknown
    return None
  if arr.size == 0 or not iv.is_integer(arr.dtype):
    return None
  return Interval(int(arr.min()), int(arr.max()))


class _RangeHost(LoweringHost):
  rules = RANGE_RULES

  def __init__(self, kernel: str, where: str):
    self.kernel, self.where = kernel, where
    self.result = KernelRanges()
    self._producers: dict = {}
    self.defs: dict = {}        # variable -> its equation, every jaxpr seen
    self.aliases: dict = {}     # a branch's input -> the atom bound to it

  def literal(self, atom):
    return _concrete_interval(atom.val)

  def constvar(self, var, value):
    if value is None or isinstance(value, (Interval, Window)):
      return value
    return _concrete_interval(value)

  def rule_context(self, eqn, used, position):
    return _Context(self, eqn, used, position[0])

  def producers(self, jaxpr) -> dict:
    hit = self._producers.get(id(jaxpr))
    if hit is None or hit[0] is not jaxpr:
      hit = self._producers[id(jaxpr)] = (jaxpr, {
          v: e for e in (jaxpr.eqns if jaxpr is not None else ())
          for v in e.outvars})
      self.defs.update(hit[1])
    return hit[1]

  def error(self, message, eqn=None):
    return BackendError(self.kernel, message, self.where)


# ------------------------------------------------------------- the kernel

def _grid_intervals(grid) -> list[Interval] | None:
  """The program ids of each dim: any int32 for a dynamic (traced) size."""
  if any(not is_dynamic(g) and int(g) <= 0 for g in grid):
    return None                  # the kernel never runs
  top = int(np.iinfo(np.int32).max) - 1
  return [Interval(0, top if is_dynamic(g) else int(g) - 1) for g in grid]


def _block_window(host: _RangeHost, bm, ids, prefetch) -> Window:
  """Where the block of `bm` lies, over every grid point."""
  shape = tuple(int(n) for n in bm.array_aval.shape)
  if bm.whole_array:
    return Window.whole(shape, bm.origin)
  jaxpr = bm.index_map_jaxpr
  index = walk_jaxpr(host, jaxpr.jaxpr, jaxpr.consts,
                     list(ids) + list(prefetch))
  zero = Interval(0, 0)
  axes, fixed = [], []
  for d, (dim, size) in enumerate(zip(bm.block_shape, bm.block_sizes)):
    idx = index[d] if isinstance(index[d], Interval) else None
    if isinstance(dim, Element):
      start = _add(idx, Interval.const(-dim.padding[0]))
    else:
      start = _scale(idx, int(size))
    if dim is squeezed:
      fixed.append(Axis(d, (start, zero), 1, 1))
    else:
      axes.append(Axis(d, (start, zero), 1, int(size)))
  return Window(bm.origin, shape, tuple(int(s) for s in bm.block_sizes),
                tuple(axes), tuple(fixed))


def _analyze(spec, pinned: dict[int, int] | None = None) -> KernelRanges:
  host = _RangeHost(spec.name, spec.where)
  gm = spec.grid_mapping
  ids = _grid_intervals(gm.grid)
  if ids is None:
    return host.result
  for d, v in (pinned or {}).items():
    ids[d] = Interval.const(v)
  prefetch = [Window.whole(getattr(a, "inner_aval", a).shape,
                           f"scalar prefetch {k}")
              for k, a in enumerate(gm.prefetch_avals)]
  blocks = [_block_window(host, bm, ids, prefetch)
            for bm in gm.block_mappings]
  scratch = [Window.whole(getattr(a, "inner_aval", a).shape,
                          f"scratch_shapes[{k}]")
             for k, a in enumerate(gm.scratch_avals)]
  args = ids + prefetch + blocks + scratch
  jaxpr = spec.jaxpr
  walk_jaxpr(host, jaxpr.jaxpr, jaxpr.consts, args)
  return host.result


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def analyze_kernel(spec) -> KernelRanges:
  """The coordinates every ref access of `spec` can touch (cached per
  spec)."""
  hit = _CACHE.get(spec)
  if hit is None:
    hit = _CACHE[spec] = _analyze(spec)
  return hit


def analyze_at(spec, pinned: dict[int, int]) -> KernelRanges:
  """The same as `analyze_kernel` at the grid points whose index along
  each grid dim `d` of `pinned` is `pinned[d]` (not cached)."""
  return _analyze(spec, pinned)


def analyze_jaxpr(jaxpr: ClosedJaxpr, args: Sequence) -> list:
  """The intervals of `jaxpr`'s outputs for arguments in the intervals
  `args` (None: unknown); for tests and tools."""
  host = _RangeHost("jaxpr", "<analysis>")
  return walk_jaxpr(host, jaxpr.jaxpr, jaxpr.consts, list(args))
