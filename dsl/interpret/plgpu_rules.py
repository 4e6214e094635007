"""The warpgroup interpreter's rules for the `plgpu` primitives (the
interpret backend's meaning of them; the primitives are defined in
dsl/mosaic_gpu/).

- A TMA copy completes when it is issued: `copy_gmem_to_smem` writes `dst`
  and makes its arrival on its barrier at once; `copy_smem_to_gmem` writes
  GMEM at once (with `reduction_op`, combined with what is there). So
  `wait_smem_to_gmem`, `commit_smem` and `commit_smem_to_gmem_group` have
  nothing left to wait for.
- An mbarrier counts arrivals: its phase completes after `num_arrivals` of
  them. Each warpgroup counts the phases it has waited for; `barrier_wait`
  pauses the warpgroup until the barrier has completed one more phase than
  that. A barrier two phases past a warpgroup's count when it waits is a
  `KernelRaceError`: the hardware tracks phases by parity, so that wait
  would wait for the wrong phase.
- Along cluster axes (dsl/interpret/cluster.py): a copy with
  `collective_axes` is split among the `n` blocks of its group, each
  block's share worth 1/n of an arrival. Multicast (no `leader_tracked`):
  the k-th block's copy writes part k of `src` (along its first dim that
  `n` divides) into `dst` of every block of the group and gives each of
  their barriers its share, so a block's barrier completes once every
  block has issued its copy. `CopyPartition.PARTITIONED(axis)`: the k-th
  block loads part k of `src` along `axis` into its own `dst`;
  `REPLICATED`: all of `src`; either way only the leader's barrier gets the
  shares (another block that reads the data waits on a cluster barrier).
  `barrier_arrive` on a `ClusterBarrier` arrives on the barrier of every
  block of its group (the leader's only, with `leader_tracked`).
- `wgmma(acc, a, b)` adds `a @ b` (in float32, or `acc`'s dtype) to `acc`
  when it is issued; `wgmma_wait` has nothing left to wait for.
- `set_max_registers` changes no value.
- `try_cluster_cancel` never claims a block (each block runs its own grid
  index, as in Pallas's GPU interpret mode): it only arrives on its
  barrier, and `query_cluster_cancel` answers "not claimed".
- The tcgen05 primitives and what stays in flight after them:
  dsl/interpret/tensor_core.py; `warp_map`: dsl/interpret/warpgroups.py.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np

from dsl.core.errors import BackendError, KernelRaceError
from dsl.core.operand_layout import unpack
from dsl.interpret import cluster
from dsl.interpret.thread_eval import (TABLE, Blocked, read, running, view,
                                      where, write)
from dsl.mosaic_gpu import compute, primitives as prims, scheduling
from dsl.mosaic_gpu.memory import CopyPartition


class BarrierState:
  """One mbarrier: arrivals in its current phase, phases completed, and
  its `BarrierSpace` (a ClusterBarrier's names its cluster axes)."""
  __slots__ = ("num_arrivals", "arrivals", "completed", "space")

  def __init__(self, num_arrivals: int, space=None):
    self.num_arrivals = num_arrivals
    self.arrivals = 0
    self.completed = 0
    self.space = space

  def arrive(self, amount=1) -> None:
    thread = getattr(running, "thread", None)
    if thread is not None and thread.machine.memory.races is not None:
      thread.machine.memory.races.release(thread, self)
    self.arrivals += amount
    if self.arrivals == self.num_arrivals:
      self.arrivals = 0
      self.completed += 1


def barrier_states(cell, transforms) -> list[BarrierState]:
  """The mbarriers a (transformed) barrier ref selects."""
  ids = np.asarray(view(cell, transforms, cell.label)).reshape(-1)
  return [cell.barriers[int(i)] for i in ids]


def enabled(parts) -> bool:
  pred = parts["predicate"]
  return not pred or bool(np.asarray(pred[0]))


@TABLE.register(prims.copy_gmem_to_smem_p)
def _copy_gmem_to_smem(thread, eqn, invals):
  a = unpack(invals, eqn.params["layout"])
  if not enabled(a):
    return []
  src = read(a["src"], a["src_t"], a["src"].label)
  axes = eqn.params["collective_axes"]
  if not axes:
    _land(thread, eqn, a, a["dst"], src, [a["barrier"]], 1)
    return []
  blocks = thread.machine.cluster.group(thread, axes, eqn)
  n, i = len(blocks), blocks.index(thread.block)
  how = eqn.params["leader_tracked"]
  if how is None:        # multicast: part i of src to every block
    axis = _split_axis(thread, eqn, src.shape, n, None)
    for dst, bar in zip(cluster.peers(thread, a["dst"], blocks),
                        cluster.peers(thread, a["barrier"], blocks)):
      part = read(dst, a["dst_t"], dst.label)
      _part(part, axis, n, i)[...] = _part(src, axis, n, i)
      _land(thread, eqn, a, dst, part, [bar], n)
    return []
  if isinstance(how, CopyPartition.PARTITIONED):
    src = _part(src, _split_axis(thread, eqn, src.shape, n, how.axis), n, i)
  # partitioned or replicated: into this block, tracked by the leader
  _land(thread, eqn, a, a["dst"], src,
        cluster.peers(thread, a["barrier"], blocks[:1]), n)
  return []


def _land(thread, eqn, a, dst, value, barriers, parts: int) -> None:
  """Writes `value` where the copy's `dst_t` select in `dst`; each of
  `barriers` gets 1/`parts` of an arrival (the copy's share of a
  collective copy's bytes)."""
  thread.machine.tensor_core.check(thread, eqn, dst, a["dst_t"],
                                   writes=True)
  write(dst, a["dst_t"], value, dst.label)
  for bar in barriers:
    for b in barrier_states(bar, a["barrier_t"]):
      b.arrive(Fraction(1, parts) if parts > 1 else 1)


def _split_axis(thread, eqn, shape, n: int, axis: int | None) -> int:
  """The dim of a collective copy's src its `n` blocks split (`axis`, or
  the first one `n` divides)."""
  dims = [axis] if axis is not None else range(len(shape))
  for d in dims:
    if 0 <= d < len(shape) and shape[d] % n == 0:
      return d
  raise BackendError(thread.kernel, f"a collective copy of a {shape} src "
                     f"among {n} blocks: " + (
                         f"dim {axis} does not split in {n}" if axis is not
                         None else f"no dim splits in {n}"), where(eqn),
                     operand="src")


def _part(x: np.ndarray, axis: int, n: int, i: int) -> np.ndarray:
  """Part `i` of `n` of `x` along `axis` (a view)."""
  size = x.shape[axis] // n
  return x[(slice(None),) * axis + (slice(i * size, (i + 1) * size),)]


# reduction name -> how it combines (TMA reductions, multimem loads)
REDUCTIONS = {"add": np.add, "max": np.maximum, "min": np.minimum,
               "and": np.bitwise_and, "or": np.bitwise_or,
               "xor": np.bitwise_xor}


@TABLE.register(prims.copy_smem_to_gmem_p)
def _copy_smem_to_gmem(thread, eqn, invals):
  a = unpack(invals, eqn.params["layout"])
  if not enabled(a):
    return []
  data = read(a["src"], a["src_t"], a["src"].label)
  op = eqn.params["reduction_op"]
  if op is not None:
    combine = REDUCTIONS[str(getattr(op, "value", op)).lower()]
    data = combine(read(a["dst"], a["dst_t"], a["dst"].label), data)
  write(a["dst"], a["dst_t"], data, a["dst"].label)
  return []


@TABLE.register(prims.barrier_arrive_p, scheduling.try_cluster_cancel_p)
def _barrier_arrive(thread, eqn, invals):
  a = unpack(invals, eqn.params["layout"])
  cell = a["barrier"]
  space = cell.barriers[0].space if cell.barriers else None
  cells = [cell]
  if space is not None and space.collective_axes:
    blocks = thread.machine.cluster.group(thread, space.collective_axes, eqn)
    cells = cluster.peers(thread, cell, blocks[:1] if space.leader_tracked
                          else blocks)
  for c in cells:
    for b in barrier_states(c, a["barrier_t"]):
      b.arrive()
  return []


@TABLE.register(prims.barrier_wait_p)
def _barrier_wait(thread, eqn, invals):
  a = unpack(invals, eqn.params["layout"])
  (b,) = barrier_states(a["barrier"], a["barrier_t"])
  seen = thread.waits.get(b, 0)
  if b.completed <= seen:
    yield Blocked(lambda: b.completed > seen,
                  f"waits on {a['barrier'].label} (phase {seen})", eqn)
  if b.completed > seen + 1:
    raise KernelRaceError(
        thread.kernel, f"{thread.name} waits for phase {seen} of "
        f"{a['barrier'].label}, but the barrier has completed "
        f"{b.completed} phases: on the hardware (which tracks phases by "
        "parity) this wait would wait for the wrong phase; wait for every "
        "phase, or give the barrier more arrivals", where(eqn))
  thread.waits[b] = seen + 1
  if thread.machine.memory.races is not None:
    thread.machine.memory.races.acquire(thread, b)
  thread.machine.tensor_core.observe(b, seen, thread.block)
  return []


@TABLE.register(compute.wgmma_p)
def _wgmma(thread, eqn, invals):
  a = unpack(invals, eqn.params["layout"])
  acc = a["acc"]
  lhs = (read(a["a"], a["a_t"], a["a"].label) if eqn.params["a_is_ref"]
         else np.asarray(a["a"]))
  rhs = read(a["b"], a["b_t"], a["b"].label)
  old = read(acc, a["acc_t"], acc.label)
  prod = np.matmul(lhs.astype(np.float32), rhs.astype(np.float32))
  write(acc, a["acc_t"], (old.astype(np.float32) + prod).astype(old.dtype),
        acc.label)
  return []


@TABLE.register(scheduling.query_cluster_cancel_p)
def _query_cluster_cancel(thread, eqn, invals):
  return [*(np.int32(0) for _ in eqn.params["grid_names"]), np.bool_(False)]


@TABLE.register(prims.wait_smem_to_gmem_p, prims.commit_group_p,
                prims.commit_smem_p, compute.wgmma_wait_p,
                compute.set_max_registers_p)
def _nothing_in_flight(thread, eqn, invals):
  return []
