"""The DMA schedule of `emit_pipeline` for operands in HBM.

Each operand in HBM (a "stream") gets a VMEM buffer of `n` slots for its
block and `n` DMA semaphores, in one `run_scoped` around the pipeline's loop
(`n` = 2, or 1 for `pl.Buffered(1)` and `no_pipelining=True`). The loop
carries the grid indices (stepped by increments and selects) and each
stream's slot. At step `s` of the row-major grid, with `b(s)` a stream's
block indices there:

inputs, double buffered: before the loop, block `b(0)` is fetched into slot
  0. At step `s`, the next block `b(s+1)` is fetched into the other slot when
  it differs from `b(s)` (every stream's fetch is started before any wait);
  then the fetch of `b(s)` is waited for when `b(s)` differs from `b(s-1)`
  (or at step 0); the slot moves on when the block changes. A block that
  stays the same between steps is not fetched again.
inputs, one buffer: `b(s)` is fetched and waited for at step `s` when it
  differs from `b(s-1)` (or at step 0).
outputs: after the body, the block is written back when `b(s+1)` differs
  from `b(s)` or at the last step: an accumulator revisited on consecutive
  steps is written once, when the pipeline leaves it. Double buffered, the
  write-back of `b(s-1)` is waited for after the body of step `s` (which
  wrote the other slot) and the last write-back after the loop; with one
  buffer each write-back is waited for at once.

An output block is never copied in: it starts with what the buffer holds
(uninitialized on a TPU), so a body initializes its accumulator, e.g. under
`pl.when(pl.program_id(2) == 0)`, as with Pallas. The regions carry
Pallas's named scopes (`ep_copy_in`, `ep_wait_in`, `ep_run_kernel`, ...:
`tpu.trace_start`/`trace_stop` for the profiler) unless
`trace_scopes=False`.

Blocks need not tile the array: along a dim whose block does not divide
the array dim, the last block is a partial edge block, and its DMAs copy
only the in-bounds part (a window of static size, `array dim % block dim`,
rounded up to whole tiles on a TPU) between HBM and the leading part of the slot, in a branch taken when the
block index is the last one (see `_BlockCopy`). The rest of an input slot
is unspecified, as in Pallas (poison on the host backends); only the
in-bounds part of an output block is written back.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsl.core.backends import traced_backend
from dsl.core.blockspec import BlockSpec, Blocked, Element, squeezed
from dsl.core.errors import KernelError, user_frame
from dsl.core.memory import MemorySpace
from dsl.core.poison import poison_full
from dsl.core.primitives import run_scoped, when
from dsl.core.refs import ds, past_bounds
from dsl.core.semaphores import SemaphoreType
from dsl.tpu.pipeline_blocks import (block_indices, block_view, block_window,
                                     kernel_name, run_body)
from dsl.tpu.primitives import make_async_copy


# ------------------------------------------------------------ bool helpers
# Block indices are Python ints where an index map returns constants: these
# keep such predicates Python bools, so no branch is emitted for them.

def _logic(a, b, absorbing: bool, op):
  """`op(a, b)` for logical or (absorbing True) / and (absorbing False),
  kept a Python bool where an operand decides it."""
  if a is absorbing or b is absorbing:
    return absorbing
  if a is (not absorbing):
    return b
  if b is (not absorbing):
    return a
  return op(a, b)


def _or(a, b):
  return _logic(a, b, True, jnp.logical_or)


def _and(a, b):
  return _logic(a, b, False, jnp.logical_and)


def _not(a):
  return (not a) if isinstance(a, bool) else jnp.logical_not(a)


def _differ(xs, ys):
  out = False
  for x, y in zip(xs, ys):
    if isinstance(x, int) and isinstance(y, int):
      out = _or(out, x != y)
    else:
      out = _or(out, jnp.asarray(x) != jnp.asarray(y))
  return out


def _branch(pred, if_true, if_false):
  """`if_true()` where `pred` holds, else `if_false()` (chosen at trace
  time for a Python bool)."""
  if isinstance(pred, (bool, np.bool_)):
    (if_true if pred else if_false)()
  else:
    lax.cond(pred, lambda: (if_true(), None)[1],
             lambda: (if_false(), None)[1])


def _flip(pred, slot):
  if pred is False:
    return slot
  if pred is True:
    return 1 - slot
  return lax.select(pred, 1 - slot, slot)


# ------------------------------------------------------------ streams

def _block_dim(d) -> int | None:
  """The buffer extent of a block dim (None: squeezed)."""
  if d is None or d is squeezed:
    return None
  if isinstance(d, Element):
    return d.block_size
  return d.block_size if isinstance(d, Blocked) else d


@dataclasses.dataclass(eq=False)
class _Stream:
  """One operand copied block by block between HBM and a VMEM buffer."""
  ref: Any
  spec: BlockSpec
  label: str
  is_output: bool
  nbuf: int
  buf: Any = None       # VMEM ref of shape (nbuf, *block)
  sem: Any = None       # DMA semaphores (nbuf,)

  def __post_init__(self):
    # a TPU's DMAs copy whole tiles (see `_edge_dims`)
    target = traced_backend()
    self.whole_tiles = target.code == "mosaic" and not target.on_host
    self.edges = _edge_dims(self.spec, tuple(self.ref.shape), self.ref.dtype,
                            self.whole_tiles)

  @property
  def block_shape(self) -> tuple[int, ...]:
    dims = (_block_dim(d) for d in self.spec.block_shape)
    return tuple(d for d in dims if d is not None)

  def scratch_types(self):
    return (MemorySpace.VMEM((self.nbuf, *self.block_shape), self.ref.dtype),
            SemaphoreType.DMA((self.nbuf,)))

  def block(self, indices) -> tuple:
    return block_indices(self.spec, self.label, indices)

  def _copy(self, blk, slot, inward: bool):
    return _BlockCopy(self, blk, slot, inward)

  def descriptor(self, blk, slot, inward: bool, partial: dict):
    """The DMA of block `blk` to or from `slot`; `partial` maps an edge dim
    to the extent of the block there (the in-bounds part, copied into the
    leading part of the slot)."""
    window = list(block_window(self.spec, blk))
    inner = [slot]
    for dim, d in enumerate(self.spec.block_shape):
      size = _block_dim(d)
      if size is None:
        continue
      if dim in partial:     # the last block: its start is static
        window[dim] = ds(self.ref.shape[dim] // size * size, partial[dim])
      inner.append(ds(0, partial.get(dim, size)))
    # on a TPU, an edge window may reach into the array's tile padding
    hbm = (past_bounds(self.ref, tuple(window))
           if partial and self.whole_tiles else self.ref.at[tuple(window)])
    vmem = self.buf.at[tuple(inner)] if partial else self.buf.at[slot]
    src, dst = (hbm, vmem) if inward else (vmem, hbm)
    return make_async_copy(src, dst, self.sem.at[slot])

  def poison(self, slot):
    """Fills `slot` with poison (before an edge block lands in its leading
    part: the rest then reads poison on the host backends)."""
    view = self.buf.at[slot]
    view[...] = poison_full(view.shape, self.ref.dtype)

  def copy_in(self, blk, slot):
    return self._copy(blk, slot, inward=True)

  def copy_out(self, blk, slot):
    return self._copy(blk, slot, inward=False)


def _check_stream(ref, spec: BlockSpec, label: str) -> None:
  """Refuses block shapes that do not fit `ref`'s rank or are not sizes."""
  where = spec.where or user_frame()
  shape = tuple(ref.shape)
  if len(spec.block_shape) != len(shape):
    raise KernelError(kernel_name(), f"block shape {tuple(spec.block_shape)} "
                      f"has rank {len(spec.block_shape)} but the operand has "
                      f"shape {shape}", where, operand=label)
  for dim, d in enumerate(spec.block_shape):
    size = _block_dim(d)
    if size is None or isinstance(d, Element):
      continue
    if not isinstance(size, int) or size <= 0:
      raise KernelError(kernel_name(), f"block dim {dim} must be a positive "
                        f"integer, None or Element, got {d!r}", where,
                        operand=label)


def _edge_dims(spec: BlockSpec, shape, dtype, whole_tiles: bool) -> tuple:
  """(dim, block size, index of the partial block, the extent its DMAs
  copy) of each blocked dim whose block does not divide the array dim. The
  extent is the in-bounds part, or with `whole_tiles` (a TPU, whose DMAs
  move whole tiles of the two minor dims; an array in HBM is stored padded
  to tiles) that part rounded up to tiles, at most the block."""
  out = []
  tiles = _tiles(len(shape), dtype)
  for dim, (d, n) in enumerate(zip(spec.block_shape, shape)):
    size = _block_dim(d)
    if size is None or isinstance(d, Element) or n % size == 0:
      continue
    extent = n % size
    if whole_tiles and tiles[dim] > 1:
      extent = min(-(-extent // tiles[dim]) * tiles[dim], size)
    out.append((dim, size, n // size, extent))
  return tuple(out)


def _tiles(rank: int, dtype) -> tuple[int, ...]:
  """The TPU's tile of each dim of an array (1: untiled): (8, 128) for
  32-bit types on the two minor dims, more rows for narrower types."""
  packing = max(1, 4 // jnp.dtype(dtype).itemsize)
  if rank == 1:
    return (128 * packing,)
  return (1,) * (rank - 2) + (8 * packing, 128)


class _BlockCopy:
  """The DMA of one block between HBM and a VMEM slot. A block on the edge
  of its array (the last one along a dim that blocks do not tile) copies
  only its in-bounds part (rounded up to whole tiles on a TPU), a window of
  static size, into the leading part of the slot. Which window is chosen
  at run time, by one if/else per edge dim on whether the block index is
  the last one; `wait` takes the same branches, so each wait names the DMA
  that was started, of the same size."""

  def __init__(self, stream: _Stream, blk, slot, inward: bool):
    self.stream, self.blk, self.slot, self.inward = stream, blk, slot, inward

  def _each(self, fn, k: int = 0, partial=None):
    """`fn(descriptor, partial)` in the branch of this block's edges."""
    partial = partial or {}
    edges = self.stream.edges
    if k == len(edges):
      fn(self.stream.descriptor(self.blk, self.slot, self.inward, partial),
         partial)
      return
    dim, _, last, extent = edges[k]
    i = self.blk[dim]
    is_last = (i == last) if isinstance(i, int) else jnp.asarray(i) == last
    _branch(is_last, lambda: self._each(fn, k + 1, {**partial, dim: extent}),
            lambda: self._each(fn, k + 1, partial))

  def start(self):
    poison = self.inward and _poisons_edges()

    def go(copy, partial):
      if partial and poison:
        self.stream.poison(self.slot)
      copy.start()
    self._each(go)
    return self

  def wait(self):
    self._each(lambda copy, partial: copy.wait())


def _poisons_edges() -> bool:
  """Whether the part of an edge block's slot past the array is filled with
  poison: on the host backends, where memory is otherwise zeros or stale."""
  target = traced_backend()
  return target.on_host and target.copies_hbm_blocks


def _buffer_count(spec: BlockSpec, buffered: bool) -> int:
  mode = spec.pipeline_mode
  if not buffered or (mode is not None and mode.buffer_count == 1):
    return 1
  return 2


# ------------------------------------------------------------ the schedule

def _sync_copy(copy):
  copy.start()
  copy.wait()


def _inputs_before_body(ins, slots, at, scope):
  """The input streams' fetches (all started before any is waited for);
  returns their slots for the next step."""
  new = []
  for s, slot in zip(ins, slots):
    fetch_next = False
    if s.nbuf == 2:
      fetch_next = _and(_not(at["last"]), _differ(at["next"][s], at["cur"][s]))
      with scope("ep_copy_in"):
        when(fetch_next)(lambda s=s, slot=slot: s.copy_in(
            at["next"][s], 1 - slot).start())
    new.append(_flip(fetch_next, slot))
  for s, slot in zip(ins, slots):
    arrive = _or(at["first"], _differ(at["cur"][s], at["prev"][s]))
    with scope("ep_wait_in"):
      if s.nbuf == 1:
        when(arrive)(lambda s=s: _sync_copy(s.copy_in(at["cur"][s], 0)))
      else:
        when(arrive)(lambda s=s, slot=slot: s.copy_in(
            at["cur"][s], slot).wait())
  return new


def _outputs_after_body(outs, slots, at, scope):
  """The output streams' write-backs: a block is written back when the
  pipeline leaves it, and (double buffered) the previous block's write-back
  is waited for once the body has written the other slot. Returns their
  slots for the next step."""
  new = []
  for s, slot in zip(outs, slots):
    leave = _or(at["last"], _differ(at["next"][s], at["cur"][s]))
    with scope("ep_copy_out"):
      if s.nbuf == 1:
        when(leave)(lambda s=s: _sync_copy(s.copy_out(at["cur"][s], 0)))
        new.append(slot)
        continue
      when(leave)(lambda s=s, slot=slot: s.copy_out(
          at["cur"][s], slot).start())
    new.append(_flip(leave, slot))
  for s, slot in zip(outs, slots):
    if s.nbuf == 2:
      with scope("ep_wait_out"):
        changed = _and(_not(at["first"]), _differ(at["cur"][s], at["prev"][s]))
        when(changed)(lambda s=s, slot=slot: s.copy_out(
            at["prev"][s], 1 - slot).wait())
  return new


class _Blocks(dict):
  """Block indices of each stream at one grid point, computed on demand."""

  def __init__(self, indices):
    super().__init__()
    self.indices = indices

  def __missing__(self, stream):
    self[stream] = stream.block(self.indices)
    return self[stream]


def _scopes(enabled: bool):
  return jax.named_scope if enabled else (lambda name: contextlib.nullcontext())


@dataclasses.dataclass(frozen=True)
class _Body:
  """The user's body and what it takes besides the streamed blocks."""
  fn: Any
  grid: tuple
  n_refs: int
  view: Any              # view(k, indices): operand k's block, not streamed
  scratches: tuple
  prologue: Any
  scope: Any             # scope(name): a named scope, or none

  def run(self, indices, streamed: dict):
    """The body at grid point `indices`; `streamed[k]`: operand k's slot."""
    blocks = [streamed[k] if k in streamed else self.view(k, indices)
              for k in range(self.n_refs)]
    with self.scope("ep_run_kernel"):
      run_body(self.fn, self.grid, indices, blocks, self.scratches,
               self.prologue)


def _schedule(body: _Body, streams: dict):
  """The pipeline's loop (under `pl.when(size > 0)` for a traced grid,
  which may be empty)."""
  grid = body.grid
  total = math.prod(grid) if grid else 1
  if not isinstance(total, int):
    when(total > 0)(lambda: _loop(body, streams, total))
  else:
    _loop(body, streams, total)


def _loop(body: _Body, streams: dict, total):
  grid, scope = body.grid, body.scope
  ins = [s for s in streams.values() if not s.is_output]
  outs = [s for s in streams.values() if s.is_output]
  with scope("ep_initialize_0"):
    for s in ins:
      if s.nbuf == 2:
        s.copy_in(s.block((0,) * len(grid)), 0).start()

  def step(n, carry):
    cur, in_slots, out_slots = carry
    cur = tuple(0 if _is_one(g) else i for i, g in zip(cur, grid))
    nxt = _next_indices(cur, grid)
    at = dict(cur=_Blocks(cur), prev=_Blocks(_prev_indices(cur, grid)),
              next=_Blocks(nxt), first=n == 0, last=n == total - 1)
    next_in = _inputs_before_body(ins, in_slots, at, scope)
    slot_of = dict(zip(ins, in_slots))
    slot_of.update(zip(outs, out_slots))
    body.run(cur, {k: s.buf.at[slot_of[s]] for k, s in streams.items()})
    next_out = _outputs_after_body(outs, out_slots, at, scope)
    return _int32s(nxt), tuple(next_in), tuple(next_out)

  zeros = lambda xs: tuple(jnp.int32(0) for _ in xs)
  _, _, out_slots = lax.fori_loop(0, total, step,
                                  (zeros(grid), zeros(ins), zeros(outs)))
  # the last write-back of each double-buffered output (from the slot
  # before the last flip)
  last = tuple(g - 1 for g in grid)
  with scope("ep_finalize"):
    for s, slot in zip(outs, out_slots):
      if s.nbuf == 2:
        s.copy_out(s.block(last), 1 - slot).wait()


def _is_one(g) -> bool:
  """A grid dim of static size 1 (its index is the constant 0)."""
  return isinstance(g, int) and g == 1


def _int32s(xs):
  return tuple(jnp.asarray(x, jnp.int32) for x in xs)


def _next_indices(indices, grid):
  """The row-major successor of `indices` (wrapping to all zeros), by
  increments and selects: no division in the loop."""
  out, carry = [], True
  for i, g in reversed(list(zip(indices, grid))):
    if _is_one(g):
      out.append(0)
      continue
    inc = i + 1 if carry is True else lax.select(carry, i + 1, i)
    wrap = inc == g
    out.append(lax.select(wrap, jnp.zeros_like(inc), inc))
    carry = wrap
  return tuple(reversed(out))


def _prev_indices(indices, grid):
  """The row-major predecessor of `indices` (wrapping to the last point)."""
  out, borrow = [], True
  for i, g in reversed(list(zip(indices, grid))):
    if _is_one(g):
      out.append(0)
      continue
    dec = i - 1 if borrow is True else lax.select(borrow, i - 1, i)
    wrap = dec < 0
    out.append(lax.select(wrap, jnp.full_like(dec, g - 1), dec))
    borrow = wrap
  return tuple(reversed(out))


def run_copied(body, grid, refs, specs, labels, copied, n_in, scratches, *,
               buffered: bool = True, trace_scopes: bool = True,
               prologue=None):
  """Runs the pipeline with the `copied` operands streamed through VMEM
  buffers; the others are passed as views."""
  streams = {}
  for k, (ref, spec, label, c) in enumerate(zip(refs, specs, labels, copied)):
    if c:
      _check_stream(ref, spec, label)
      streams[k] = _Stream(ref, spec, label, k >= n_in,
                           _buffer_count(spec, buffered))

  def view(k, indices):
    return block_view(refs[k], specs[k], labels[k], indices)

  body = _Body(body, tuple(grid), len(refs), view, scratches, prologue,
               _scopes(trace_scopes))

  def with_buffers(bufs, sems):
    for s, b, m in zip(streams.values(), bufs, sems):
      s.buf, s.sem = b, m
    _schedule(body, streams)

  types = [s.scratch_types() for s in streams.values()]
  run_scoped(with_buffers, [t[0] for t in types], [t[1] for t in types])
