"""Refs of the generated kernel.

A `MemRef` is a window of an array in global memory: the operand's pointer
plus, per array dim, either a fixed coordinate or a visible axis
(`start + step * k` for `k < size`). BlockSpecs produce one per operand and
grid step; `NDIndexer`s (`x_ref[pl.ds(i, 8), 0]`) narrow it without emitting
code; loads and stores turn it into pointer arithmetic with strides and a
mask for padded lanes, partial edge blocks and blocks whose index, read from
data, lies outside the array (so no access leaves the operand's buffer).

A `ValueRef` is a ref kept in registers: a variable holding the whole
(padded) tensor, reassigned on every write. Scratch buffers and
`run_scoped` allocations are `ValueRef`s.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Union

import numpy as np
from dsl.core import access
from dsl.core.access import ABOVE, BELOW, RefAccess
from dsl.core.jax_internals import state_indexing as indexing

from lowering_triton.codegen import paren
from lowering_triton.values import TVal, pow2

Sym = Union[int, str]   # a static int, or the source of an int32 scalar


# Starts of windows as source text, folded where they are ints.
SYMS = access.StartAlgebra.folding(lambda a, b: f"{a} + {paren(b)}",
                                   lambda a, k: f"{paren(a)} * {k}")
sym_add, sym_mul = SYMS.add, SYMS.scale


def as_sym(x) -> Sym:
  """A Slice start or integer index (int or TVal) as a Sym."""
  if isinstance(x, (int, np.integer)):
    return int(x)
  if isinstance(x, TVal):
    if x.literal is not None:
      return int(x.literal)
    return x.expr
  raise TypeError(f"unsupported index {x!r}")


def index_sym(idx, size: int) -> Sym:
  """An integer index into an axis of `size` elements as a Sym; a static
  negative index counts from the end, as in numpy."""
  sym = as_sym(idx)
  if isinstance(sym, int) and sym < 0:
    return sym + int(size)
  return sym


@dataclasses.dataclass(frozen=True)
class Axis(access.Axis):
  """A visible axis of a ref (the access model's `Axis`, whose `start` is a
  Sym): array coordinate `start + step * k`, k < size;
  with `lanes` (the source of an int32 array of indices, of shape
  `lanes_shape`), `start + step * lanes[k...]` instead: its dims are dims of
  the result, unless it `rides` on the axis before it (several arrays of
  indices, broadcast to one shape, index several array dims at once). A
  `start` computed at run time is known to be a multiple of `align` (0: it
  is 0)."""
  lanes: str | None = None
  align: int = 1
  wrap: int | None = None        # negative `lanes` count from the end of
  # an axis of `wrap` elements (None: proven not negative)
  clamp_to: int | None = None    # a read through `lanes`: clamp them to
  # [0, clamp_to) as JAX clamps a gather's indices (checked, not masked;
  # None: not a read, or proven inside)
  lanes_shape: tuple[int, ...] = ()
  rides: bool = False

  @property
  def out_shape(self) -> tuple[int, ...]:
    """The dims this axis gives the result."""
    if self.rides:
      return ()
    return self.lanes_shape if self.lanes is not None else (self.size,)


@dataclasses.dataclass(frozen=True)
class MemRef:
  base: str                      # stem for generated names, e.g. "x"
  ptr: str                       # the kernel parameter, e.g. "x_ptr"
  dtype: np.dtype
  array_shape: tuple[int, ...]
  strides: tuple[int, ...]
  fixed: tuple[Axis, ...]        # the array dims an index fixed (size 1)
  axes: tuple[Axis, ...]
  check_upper: tuple[bool, ...]  # per array dim: mask coordinates >= size
  check_lower: tuple[bool, ...]  # per array dim: mask coordinates < 0
  wide: bool = False             # offsets need int64
  origin: str = ""               # "in_specs[0]" etc., for messages
  valid: tuple[str, ...] = ()    # scalar conditions for the whole window
  # (a block index read from data lies inside the array)
  dynamic: tuple[int, ...] = ()  # array dims an indexer put a coordinate
  # computed at run time on (the access model's run-time exits,
  # dsl.core.access): bounded to the array (masked), and checked with
  # jax_pallas_enable_runtime_assert on, where not proven inside
  limits: tuple[tuple[int, Sym, Sym, bool], ...] = ()  # (array dim, lo,
  # hi, whole): the ref's extent on a dim a run-time coordinate was put on
  # (the block, or a window of it when not `whole`): lanes outside [lo, hi)
  # read poison and write nothing
  block: tuple[Sym, ...] = ()    # the block index, for messages
  narrowed: tuple[int, ...] = ()  # array dims a window narrowed the block on
  exits: tuple[tuple[int, int], ...] | None = None  # (array dim, side:
  # BELOW / ABOVE) where the access may leave the array, once the range
  # analysis's proofs are attached (`with_proofs`; None: all sides of the
  # `dynamic` dims)
  block_exits: tuple[tuple[int, int], ...] | None = None  # the same for
  # the operand's block
  gathered: tuple[int, ...] = ()  # array dims read through an array of
  # indices into an axis placed at trace time: clamped (or proven) inside
  # that axis, so no mask keeps them inside the array

  def inside_masks(self, dim: int) -> tuple[bool, bool]:
    """(upper, lower): whether a coordinate on array dim `dim` needs a mask
    that keeps it inside the array beyond the block's own masks: computed
    at run time and not proven inside."""
    if dim not in self.dynamic or dim in self.gathered:
      return False, False
    return (not self.check_upper[dim] and self._exits(dim, ABOVE),
            not self.check_lower[dim] and self._exits(dim, BELOW))

  def _exits(self, dim: int, side: int, block: bool = False) -> bool:
    exits = self.block_exits if block else self.exits
    return exits is None or (dim, side) in exits

  def limit_bounds(self, dim: int) -> list[tuple[str, Sym]]:
    """The bounds ("lo" / "hi", value) that keep a coordinate on `dim`
    inside the ref's extent (see `limits`), but those the range analysis
    proves (inside the block, for a limit that is the whole block)."""
    out = []
    for d, lo, hi, whole in self.limits:
      if d != dim or dim in self.gathered:
        continue
      if lo != 0 and not (whole and not self._exits(dim, BELOW, True)):
        out.append(("lo", lo))
      if hi != self.array_shape[dim] and not (
          whole and not self._exits(dim, ABOVE, True)):
        out.append(("hi", hi))
    return out

  @property
  def unproven(self) -> tuple[int, ...]:
    """The array dims with a run-time coordinate not proven inside (a
    clamped one counts: with run-time checks on, it is checked)."""
    clamped = {a.dim for a in self.axes if a.clamp_to is not None}
    return tuple(d for d in self.dynamic
                 if any(self.inside_masks(d)) or self.limit_bounds(d)
                 or d in clamped)

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(n for a in self.axes for n in a.out_shape)

  @property
  def padded_shape(self) -> tuple[int, ...]:
    return tuple(pow2(n) for n in self.shape)


@dataclasses.dataclass
class ValueRef:
  """A ref held in a variable of the generated source."""
  var: str
  shape: tuple[int, ...]
  dtype: np.dtype
  origin: str = ""


def row_major_strides(shape) -> tuple[int, ...]:
  strides, acc = [], 1
  for d in reversed(shape):
    strides.append(acc)
    acc *= int(d)
  return tuple(reversed(strides))


class UnsupportedIndex(Exception):
  pass


def _start_align(ax: Axis) -> int:
  return ax.start if isinstance(ax.start, int) else ax.align




def _start_sym(w: access.DimWindow, ax: Axis) -> Sym:
  if w.kind == access.INDEX:
    return index_sym(w.start, ax.size)
  return as_sym(w.start)


def apply_indexer(ref: MemRef, indexer, multiples=None,
                  gather: bool = False) -> MemRef:
  """The window `ref[indexer]` (static; emits nothing), composed by the
  access model (`dsl.core.access.compose`); `multiples[k]`: a number
  index k's start is known to be a multiple of (default 1). An array of
  indices follows JAX's indexing: negative indices count from the end,
  and for a read (`gather`) the ones outside are clamped."""
  if not isinstance(indexer, indexing.NDIndexer):
    raise UnsupportedIndex(f"ref transform {type(indexer).__name__} is not "
                           "supported by the Triton backend")
  indices = tuple(indexer.indices)
  if len(indices) != len(ref.axes):
    raise UnsupportedIndex(f"{len(indices)} indices for a ref of rank "
                           f"{len(ref.axes)}")
  acc = RefAccess.of(indexer, [ax.size for ax in ref.axes], static=_static)
  _check_array_indices(acc.dims)
  if any(ax.lanes is not None for ax in ref.axes):
    raise UnsupportedIndex("indexing a window of an array of indices again "
                           "is not supported by the Triton backend")
  lead = []                   # the array dim of the first array of indices

  def lanes_axis(w: access.DimWindow, ax: Axis) -> Axis:
    lanes = w.start.expr if w.start.dtype == np.int32 else \
        f"{paren(w.start.expr)}.to(tl.int32)"
    shape = tuple(int(n) for n in w.start.shape)
    rides = bool(lead)
    lead.append(ax.dim)
    return Axis(ax.dim, ax.start, ax.step, math.prod(shape), lanes=lanes,
                wrap=ax.size, clamp_to=ax.size if gather else None,
                lanes_shape=shape, rides=rides)
  axes, fixed = access.compose(ref.axes, ref.fixed, acc.dims, SYMS,
                               _start_sym, lanes_axis)
  return dataclasses.replace(
      _bookkeeping(ref, acc, gather),
      fixed=tuple(sorted(fixed, key=lambda f: f.dim)),
      axes=_with_alignment(ref, acc, axes, multiples or [1] * len(indices)))


def _with_alignment(ref: MemRef, acc: RefAccess, axes, multiples) -> tuple:
  """`axes` (the composed view's) with the multiple each slice's start is
  known to be (`Axis.align`)."""
  shown = iter(axes)
  out = []
  for ax, w, mult in zip(ref.axes, acc.dims, multiples):
    if w.kind == access.INDEX:
      continue
    new = next(shown)
    if w.kind == access.SLICE:
      if w.static_start is not None:
        mult = w.static_start
      new = dataclasses.replace(
          new, align=math.gcd(_start_align(ax), mult * ax.step))
    out.append(new)
  return tuple(out)


def _bookkeeping(ref: MemRef, acc: RefAccess, gather: bool) -> MemRef:
  """`ref` with the dims `acc` places at run time (`dynamic`, with the
  extents they stay in: `limits`), narrows and gathers noted."""
  gathered, dynamic = set(ref.gathered), set(ref.dynamic)
  limits, narrowed = list(ref.limits), set(ref.narrowed)
  at_run_time = acc.leaving_dims(static=False)
  for k, (ax, w) in enumerate(zip(ref.axes, acc.dims)):
    if k in at_run_time:
      dynamic.add(ax.dim)
      hi = sym_add(ax.start, ax.step * ax.size)
      if (ax.start, hi) != (0, ref.array_shape[ax.dim]):
        limits.append((ax.dim, ax.start, hi, ax.dim not in ref.narrowed))
    if w.kind == access.SLICE and (as_sym(w.start), w.size, w.stride) != (
        0, ax.size, 1):
      narrowed.add(ax.dim)
    elif w.kind == access.INDICES:
      if gather and ax.dim not in ref.dynamic:
        gathered.add(ax.dim)
      narrowed.add(ax.dim)
  return dataclasses.replace(ref, dynamic=tuple(sorted(dynamic)),
                             limits=tuple(limits),
                             narrowed=tuple(sorted(narrowed)),
                             gathered=tuple(sorted(gathered)))


def _static(x) -> int | None:
  """An index value known when the kernel is generated (for the access
  model): an int, or a TVal holding a literal."""
  if isinstance(x, TVal):
    return None if x.literal is None else int(x.literal)
  return int(x) if isinstance(x, (int, np.integer)) else None


def ref_windows(indexer, shape) -> tuple[access.DimWindow, ...]:
  """The access model's window of each entry of `indexer` on a ref of
  `shape`, its values read as the generated kernel knows them."""
  return RefAccess.of(indexer, shape, static=_static).dims


def run_time_dims(indexer, shape) -> set[int]:
  """The dims of a ref of `shape` where `indexer` may leave it at a place
  computed at run time (the access model's run-time exits)."""
  return RefAccess.of(indexer, shape, static=_static).leaving_dims(
      static=False)


def with_proofs(ref: MemRef, in_array, in_block) -> MemRef:
  """`ref` with the sides of its run-time coordinates that may still leave
  the array and the block once the range analysis's proofs are attached
  (`in_array(dim)`, `in_block(dim)`: (lower, upper) proven), as the access
  model decides them."""
  access = RefAccess.at_run_time(ref.array_shape, ref.dynamic)

  def exits(proven):
    return tuple((e.dim, e.side) for e in access.proving(proven).exits())
  return dataclasses.replace(ref, exits=exits(in_array),
                             block_exits=exits(in_block))


def without_proven_wraps(ref: MemRef, inside) -> MemRef:
  """`ref` without the wrap of negative indices and the clamp of the
  arrays of indices that `inside(dim)` ((lower, upper) proven) proves
  inside the axis they index."""
  axes = []
  for ax in ref.axes:
    if ax.lanes is not None:
      lower, upper = inside(ax.dim)
      if lower:
        ax = dataclasses.replace(ax, wrap=None)
      if lower and upper:
        ax = dataclasses.replace(ax, clamp_to=None)
    axes.append(ax)
  return dataclasses.replace(ref, axes=tuple(axes))


def _check_array_indices(dims) -> None:
  """Arrays of indices the Triton backend takes: arrays of one shape (JAX's
  indexers broadcast them to one), among integer indices next to each
  other (so that their dims stay at their place, as numpy places them)."""
  arrays = [w.start for w in dims if w.kind == access.INDICES]
  if not arrays:
    return
  shapes = {tuple(a.shape) for a in arrays}
  if len(shapes) > 1:
    raise UnsupportedIndex(f"arrays of indices of shapes {sorted(shapes)} in "
                           "one access: the Triton backend takes arrays "
                           "broadcast to one shape")
  ints = [k for k, w in enumerate(dims) if w.kind != access.SLICE]
  if ints != list(range(ints[0], ints[-1] + 1)):
    raise UnsupportedIndex("an array of indices separated from the other "
                           "integer indices by a slice moves its dims to the "
                           "front (numpy's rule), which the Triton backend "
                           "does not do; put the integer indices together")


def _axis_word(j: int, rank: int) -> str:
  if rank == 1:
    return "offs"
  if rank == 2:
    return ("rows", "cols")[j]
  return f"idx{j}"


def bcast(j: int, rank: int) -> str:
  """Indexing that places a 1-D vector on axis j of a rank-`rank` tensor."""
  return place(j, 1, rank)


def place(j: int, k: int, rank: int) -> str:
  """Indexing that places a k-D tensor on axes j..j+k-1 of a rank-`rank`
  tensor."""
  if k >= rank:
    return ""
  return "[" + ", ".join(":" if j <= i < j + k else "None"
                         for i in range(rank)) + "]"


def _bounds(coord: str, n: int, upper: bool, lower: bool) -> list[str]:
  return ([f"{coord} < {n}"] if upper else []) + (
      [f"{coord} >= 0"] if lower else [])


def _limits(coord: str, ref: MemRef, dim: int) -> list[str]:
  """`coord` inside the ref's extent on `dim` (see MemRef.limits)."""
  return [f"{coord} >= {paren(v)}" if side == "lo" else f"{coord} < {paren(v)}"
          for side, v in ref.limit_bounds(dim)]


def _emit_coordinates(ctx, ref: MemRef, j: int, ax: Axis, b: str,
                      clamped: list) -> tuple[str, str]:
  """Binds the array coordinates of axis `j` (placed in the result by `b`);
  returns their name and the lanes they add to the axis's start (their
  offset from it, in steps). A clamp's check goes to `clamped`."""
  lanes = ax.lanes or f"tl.arange(0, {pow2(ax.size)})"
  if ax.wrap is not None:
    lanes = (f"tl.where({paren(lanes)} < 0, {paren(lanes)} + {ax.wrap}, "
             f"{lanes})")
  if ax.clamp_to is not None:
    raw = ctx.bind_raw(lanes, f"{ref.base}_index")
    lanes = f"tl.minimum(tl.maximum({raw}, 0), {ax.clamp_to - 1})"
    clamped.append(f"({raw}{b} >= 0) & ({raw}{b} < {ax.clamp_to})")
    if (ax.start, ax.step) != (0, 1):
      lanes = ctx.bind_raw(lanes, f"{ref.base}_lanes")
  coord = str(sym_add(ax.start, lanes if ax.step == 1 else
                      f"{paren(lanes)} * {ax.step}"))
  if ref.wide:
    coord = f"({coord}).to(tl.int64)"
  name = ctx.bind_raw(coord, f"{ref.base}_{_axis_word(j, len(ref.axes))}")
  return name, (name if (ax.start, ax.step) == (0, 1) else lanes)


def _lane_bound(ax: Axis) -> int | None:
  """The largest lane an axis adds to its start (in steps), when it is
  known when the kernel is generated: a range's last lane, or the last
  index a gather clamps to; None for indices from data left unclamped."""
  if ax.lanes is None:
    return pow2(ax.size) - 1
  return ax.clamp_to - 1 if ax.clamp_to is not None else None


# The most bytes of a tile per thread whose offsets are summed in int32: a
# vector of 16 bytes per load or store instruction, 4 of them.
SUMMED_BYTES_PER_THREAD = 64


class _Offsets:
  """The terms of an address, in the order they are added to the pointer:
  scalars first (the block's and window's starts, fixed coordinates: one
  pointer for the whole tile), then tensor terms of coordinates not bounded
  when the kernel is generated, then the lanes' offsets.

  The lanes' offsets are summed in int32 before the one pointer addition
  (Pallas's form) where the sum provably fits (each lane's largest offset
  is known) and a thread holds at most `SUMMED_BYTES_PER_THREAD` of the
  tile: a few 32-bit offsets live in fewer registers than 64-bit partial
  pointers, but a thread holding many vectors of a tile reaches them from
  one pointer with constant displacements through separate pointer
  additions, which a sign-extended int32 sum per element hides (float32
  softmax rows of 16 x 1024 on 8 warps: 97-99 registers instead of 80)."""

  def __init__(self):
    self.scalars, self.tensors, self.lanes, self.lane_bound = [], [], [], 0

  def add_axis(self, ref: MemRef, ax: Axis, name: str, lane: str, b: str):
    stride = ref.strides[ax.dim]
    bound = _lane_bound(ax)
    if ref.wide or bound is None:
      self.tensors.append(f"{name}{b}" + (f" * {stride}" if stride != 1
                                          else ""))
      return
    self.add_scalar(sym_mul(ax.start, stride))
    m = ax.step * stride
    self.lanes.append(f"{paren(lane)}{b}" + (f" * {m}" if m != 1 else ""))
    self.lane_bound += bound * abs(m)

  def add_scalar(self, term: Sym):
    if term != 0:
      self.scalars.append(str(term))

  def pointer(self, ptr: str, bytes_per_thread: float) -> str:
    lanes = self.lanes
    if (len(lanes) > 1 and self.lane_bound < 2 ** 31
        and bytes_per_thread <= SUMMED_BYTES_PER_THREAD):
      lanes = [f"({' + '.join(lanes)})"]
    return " + ".join([ptr] + self.scalars + self.tensors + lanes)


def emit_address(ctx, ref: MemRef, extra_mask: str | None = None,
                 check: str | None = None, comment: str | None = None):
  """Emits the pointers and mask of `ref`; returns (pointer expr, mask expr).

  Coordinates computed at run time (`ref.dynamic`) are masked to the array,
  so no lane leaves the operand's buffer, unless the range analysis proved
  them inside (`ref.proven`); with `check` (the message of a failed check)
  a lane the other masks keep outside the array fails a `tl.device_assert`
  instead.
  """
  rank = len(ref.shape)
  offsets, masks, inside, clamped = _Offsets(), [], [], []
  at = 0                      # the result dims of the axis (and riders)
  for j, ax in enumerate(ref.axes):
    if not ax.rides:
      pos, k = at, len(ax.out_shape)
      at += k
      masks += [f"tl.arange(0, {pow2(n)}){bcast(pos + i, rank)} < {n}"
                for i, n in enumerate(ax.out_shape) if pow2(n) != n]
    b = place(pos, k, rank)
    name, lane = _emit_coordinates(ctx, ref, j, ax, b, clamped)
    offsets.add_axis(ref, ax, name, lane, b)
    n = ref.array_shape[ax.dim]
    masks += _bounds(f"{name}{b}", n, ref.check_upper[ax.dim],
                     ref.check_lower[ax.dim])
    inside += _bounds(f"{name}{b}", n, *ref.inside_masks(ax.dim))
    inside += _limits(f"{name}{b}", ref, ax.dim)
  for d, c in ((f.dim, f.start) for f in ref.fixed):
    if isinstance(c, int):
      offsets.add_scalar(c * ref.strides[d])
    else:
      c_expr = f"({c}).to(tl.int64)" if ref.wide else paren(c)
      offsets.add_scalar(c_expr + (f" * {ref.strides[d]}"
                                   if ref.strides[d] != 1 else ""))
      n = ref.array_shape[d]
      masks += _bounds(paren(c), n, ref.check_upper[d], ref.check_lower[d])
      inside += _bounds(paren(c), n, *ref.inside_masks(d))
      inside += _limits(paren(c), ref, d)
  threads = 32 * getattr(ctx, "host", ctx).num_warps
  ptr = offsets.pointer(ref.ptr, math.prod(ref.padded_shape)
                        * ref.dtype.itemsize / threads)
  masks.extend(ref.valid)
  if extra_mask is not None:
    masks.append(extra_mask)
  if (inside or clamped) and check is not None:
    ok = " & ".join(f"({m})" for m in inside + clamped)
    if masks:
      ok = f"~({' & '.join(f'({m})' for m in masks)}) | ({ok})"
    ctx.emit(f"tl.device_assert({ok}, {check!r})"
             + (f"  {comment}" if comment else ""))
  masks.extend(inside)
  if not masks:
    return ptr, None
  if len(masks) == 1:
    return ptr, masks[0]
  mask = " & ".join(f"({m})" for m in masks)
  return ptr, ctx.bind_raw(mask, f"{ref.base}_mask")


def has_padding_or_bounds(ref: MemRef) -> bool:
  if ref.valid or ref.unproven or ref.padded_shape != ref.shape:
    return True
  dims = [a.dim for a in ref.axes + ref.fixed]
  return any(ref.check_upper[d] or ref.check_lower[d] for d in dims)
