"""The warpgroup interpreter's Blackwell tensor core: the rules of the
tcgen05 primitives (dsl/mosaic_gpu/tensor_memory.py) and what is in
flight between them.

Values: `plgpu.TMEM` allocations are arrays of their block, like SMEM.
`tcgen05_mma(acc, a, b)` computes `a @ b` in `acc`'s dtype and adds it to
`acc` (or overwrites it, `accumulate` False) when it is issued; its
barrier, and the barrier of a `tcgen05_commit_arrive`, get their arrival
then too. `async_load_tmem` reads, and `async_store_tmem` writes, at once.
Plain reads and writes of refs (`x[...]`, `x[...] = v`) are checked
against what is in flight too (dsl/interpret/thread_eval.py).

What stays in flight (so that a missing wait is a `KernelRaceError`, as
the hardware's asynchrony would make it a wrong answer):

- an MMA or a tensor-core copy, for the threads of a block, until some
  warpgroup or warp of that block waits for a barrier phase that its
  completion arrives on (the barrier it names, or that of a later
  `tcgen05_commit_arrive` of the same thread): until then it may still
  read its operands and write its accumulator, so a TMA copy or store into
  those operands, or a TMEM load or store of the accumulator, races with
  it. A collective one (`collective_axis=`) reads and writes both blocks
  of its pair (dsl/interpret/cluster.py) and stays in flight for each
  until that block observes its completion (and for any other block, a
  multicast copy's, until every block it works on has);
- a TMEM load, until its thread calls `wait_load_tmem`: an MMA or store
  that overwrites what it read races with it;
- a TMEM store, until its thread calls `commit_tmem`: a load or MMA that
  reads what it wrote races with it.

Retiring an operation at the first wait of a block that observes it, not
per thread, misses a thread that reads after another thread's wait without
itself being ordered after it; it never reports a correctly ordered
kernel.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from dsl.core.errors import KernelRaceError
from dsl.core.operand_layout import unpack
from dsl.interpret import cluster
from dsl.interpret.plgpu_rules import barrier_states, enabled
from dsl.interpret.thread_eval import TABLE, Cell, read, where, write
from dsl.mosaic_gpu import tensor_memory as tm


def region(cell: Cell, transforms) -> np.ndarray:
  """The elements of `cell` that `transforms` select, as a mask."""
  mask = np.zeros(cell.array.shape, np.bool_)
  write(Cell(mask, cell.label), transforms, True, cell.label)
  return mask


@dataclasses.dataclass(eq=False)
class Access:
  """A read or write in flight: of `mask` in `cell`, by `thread`'s `what`
  at `eqn`."""
  cell: Cell
  mask: np.ndarray
  thread: object
  what: str
  eqn: object

  def overlaps(self, cell: Cell, mask: np.ndarray) -> bool:
    return self.cell is cell and bool((self.mask & mask).any())


@dataclasses.dataclass(eq=False)
class TensorOp:
  """An MMA or tensor-core copy in flight: what it reads and writes, the
  (barrier, phase)s whose wait observes its completion, the blocks it
  works on that have not observed it yet and those that have."""
  reads: list
  writes: list
  blocks: set
  observers: set = dataclasses.field(default_factory=set)
  observed: set = dataclasses.field(default_factory=set)


class TensorCore:
  """What is in flight in one launch (see the module docstring)."""

  def __init__(self):
    self.ops: list[TensorOp] = []
    self.loads: list[Access] = []      # TMEM loads not waited for
    self.stores: list[Access] = []     # TMEM stores not committed

  def issue(self, thread, eqn, what, reads, writes, blocks=None) -> None:
    """`thread` issues an operation on the cells of `blocks` (its own)."""
    acc = lambda cell, t: Access(cell, region(cell, t), thread, what, eqn)
    self.ops.append(TensorOp([acc(*r) for r in reads],
                             [acc(*w) for w in writes],
                             set(blocks or [thread.block])))

  def commit(self, thread, barriers) -> None:
    """Arrives on `barriers` once `thread`'s operations so far complete."""
    for b in barriers:
      for op in self.ops:
        if any(a.thread is thread for a in op.writes):
          op.observers.add((b, b.completed))
      b.arrive()

  def observe(self, barrier, phase: int, block) -> None:
    """A thread of `block` waited for `phase` of `barrier`."""
    for op in self.ops:
      if (barrier, phase) in op.observers:
        op.blocks.discard(block)
        op.observed.add(block)
    if self.ops:
      self.ops = [op for op in self.ops if op.blocks]

  def check(self, thread, eqn, cell, transforms, *, reads=False,
            writes=False, tensor_core=False) -> None:
    """Raises a `KernelRaceError` if `thread`'s access at `eqn` meets one
    in flight (the tensor core's own operations run in order)."""
    if not (self.ops or self.loads or self.stores):
      return
    verb = "writes" if writes else "reads"
    conflicts = [(a, "reads") for a in self.stores] if reads else []
    if writes:
      conflicts += [(a, "writes") for a in self.loads]
    if not tensor_core:
      for op in self.ops:
        if thread.block in op.observed:
          continue
        conflicts += [(a, verb) for a in op.writes]
        conflicts += [(a, "writes") for a in op.reads] if writes else []
    conflicts = [(a, how) for a, how in conflicts if a.cell is cell]
    mask = region(cell, transforms) if conflicts else None
    for other, how in conflicts:
      if other.overlaps(cell, mask):
        raise _race(thread, eqn, cell, other, how)

  def track(self, pending: list, thread, eqn, cell, transforms, what,
            **access) -> None:
    """Checks a TMEM load or store (`access`: reads= or writes=), then
    keeps it in `pending` until its thread waits for it."""
    self.check(thread, eqn, cell, transforms, **access)
    pending.append(Access(cell, region(cell, transforms), thread, what, eqn))

  def retire(self, pending: list, thread) -> list:
    return [a for a in pending if a.thread is not thread]


def _race(thread, eqn, cell, other: Access, verb: str) -> KernelRaceError:
  fix = {"async_load_tmem": "call wait_load_tmem() after the load",
         "async_store_tmem": "call commit_tmem() after the store"}.get(
             other.what, "wait on the barrier its completion arrives on "
             "(its barrier or a tcgen05_commit_arrive's) first")
  if other.thread.block != thread.block:
    fix = ("the blocks of a cluster must order the two (a ClusterBarrier "
           "the issuer waits on before it issues, or a wait on the barrier "
           "its completion arrives on)")
  return KernelRaceError(
      thread.kernel, f"{thread.name} {verb} {cell.label} while the "
      f"{other.what} of {other.thread.name} at {where(other.eqn)} is still "
      f"in flight on it: {fix}", where(eqn))


def tensor_core(thread) -> TensorCore:
  return thread.machine.tensor_core


def _blocks(thread, eqn) -> list:
  """The blocks a tcgen05 operation reaches: the pair along its
  `collective_axis` (leader first), or `thread`'s own block."""
  axis = eqn.params["collective_axis"]
  if axis is None:
    return [thread.block]
  return thread.machine.cluster.pair(thread, axis, eqn)


@TABLE.register(tm.tcgen05_mma_p)
def _tcgen05_mma(thread, eqn, invals):
  """`acc (+)= a @ b`; collective: each block of the pair holds its rows
  of `acc` and `a` and its columns of `b` (the leader's first), and its
  `acc` gets its rows of `a` times all of `b`."""
  a = unpack(invals, eqn.params["layout"])
  tc = tensor_core(thread)
  blocks = _blocks(thread, eqn)
  accs, lhss, rhss = (cluster.peers(thread, a[name], blocks)
                      for name in ("acc", "a", "b"))
  acc_t, a_t, b_t = a["acc_t"], a["a_t"], a["b_t"]
  for acc, lhs in zip(accs, lhss):
    tc.check(thread, eqn, acc, acc_t, reads=True, writes=True,
             tensor_core=True)
    tc.check(thread, eqn, lhs, a_t, reads=True, tensor_core=True)
  rhs = np.concatenate([read(b, b_t, b.label) for b in rhss], axis=1)
  for acc, lhs in zip(accs, lhss):
    out = np.matmul(read(lhs, a_t, lhs.label), rhs, dtype=acc.array.dtype)
    if bool(np.asarray(a["accumulate"])):
      out = read(acc, acc_t, acc.label) + out
    write(acc, acc_t, out, acc.label)
  tc.issue(thread, eqn, "tcgen05_mma",
           [*((x, a_t) for x in lhss), *((x, b_t) for x in rhss)],
           [(x, acc_t) for x in accs], blocks)
  if a["barrier"]:
    _commit(thread, eqn, a["barrier"], a["barrier_t"], blocks)
  return []


def _commit(thread, eqn, barrier, transforms, blocks) -> None:
  """Arrives on `barrier` in each of `blocks` once `thread`'s tensor core
  operations so far complete."""
  tensor_core(thread).commit(thread, [
      b for cell in cluster.peers(thread, barrier, blocks)
      for b in barrier_states(cell, transforms)])


@TABLE.register(tm.async_copy_smem_to_tmem_p)
def _copy_smem_to_tmem(thread, eqn, invals):
  a = unpack(invals, eqn.params["layout"])
  tc = tensor_core(thread)
  blocks = _blocks(thread, eqn)
  for src, dst in zip(cluster.peers(thread, a["src"], blocks),
                      cluster.peers(thread, a["dst"], blocks)):
    tc.check(thread, eqn, dst, a["dst_t"], writes=True, tensor_core=True)
    write(dst, a["dst_t"], read(src, a["src_t"], src.label), dst.label)
    tc.issue(thread, eqn, "async_copy_smem_to_tmem", [(src, a["src_t"])],
             [(dst, a["dst_t"])], blocks)
  return []


@TABLE.register(tm.tcgen05_commit_arrive_p)
def _commit_arrive(thread, eqn, invals):
  a = unpack(invals, eqn.params["layout"])
  if enabled(a):
    blocks = ([thread.block] if eqn.params["collective_axis"] is None else
              thread.machine.cluster.group(
                  thread, (eqn.params["collective_axis"],), eqn))
    _commit(thread, eqn, a["barrier"], a["barrier_t"], blocks)
  return []


@TABLE.register(tm.async_load_tmem_p)
def _async_load_tmem(thread, eqn, invals):
  a = unpack(invals, eqn.params["layout"])
  tc = tensor_core(thread)
  tc.track(tc.loads, thread, eqn, a["src"], a["src_t"], "async_load_tmem",
           reads=True)
  return read(a["src"], a["src_t"], a["src"].label)


@TABLE.register(tm.async_store_tmem_p)
def _async_store_tmem(thread, eqn, invals):
  a = unpack(invals, eqn.params["layout"])
  tc = tensor_core(thread)
  tc.track(tc.stores, thread, eqn, a["ref"], a["ref_t"], "async_store_tmem",
           writes=True)
  write(a["ref"], a["ref_t"], np.asarray(a["value"]), a["ref"].label)
  return []


@TABLE.register(tm.wait_load_tmem_p)
def _wait_load_tmem(thread, eqn, invals):
  tc = tensor_core(thread)
  tc.loads = tc.retire(tc.loads, thread)
  return []


@TABLE.register(tm.commit_tmem_p)
def _commit_tmem(thread, eqn, invals):
  tc = tensor_core(thread)
  tc.stores = tc.retire(tc.stores, thread)
  return []
