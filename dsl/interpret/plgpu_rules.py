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

import numpy as np

from dsl.core.errors import BackendError, KernelRaceError
from dsl.core.operand_layout import unpack
from dsl.interpret.thread_eval import (TABLE, Blocked, read, running, view,
                                      where, write)
from dsl.mosaic_gpu import compute, primitives as prims, scheduling
from dsl.mosaic_gpu.memory import CopyPartition


class BarrierState:
  """One mbarrier: arrivals in its current phase, phases completed."""
  __slots__ = ("num_arrivals", "arrivals", "completed")

  def __init__(self, num_arrivals: int):
    self.num_arrivals = num_arrivals
    self.arrivals = 0
    self.completed = 0

  def arrive(self) -> None:
    thread = getattr(running, "thread", None)
    if thread is not None and thread.machine.memory.races is not None:
      thread.machine.memory.races.release(thread, self)
    self.arrivals += 1
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
  if isinstance(eqn.params["leader_tracked"], CopyPartition.PARTITIONED):
    raise BackendError(thread.kernel, "a collective copy partitioned among "
                       "a cluster's blocks (leader_tracked=CopyPartition."
                       "PARTITIONED) does not run on the interpret backend "
                       "yet: its blocks run apart", where(eqn),
                       operand="leader_tracked")
  if enabled(a):
    thread.machine.tensor_core.check(thread, eqn, a["dst"], a["dst_t"],
                                     writes=True)
    write(a["dst"], a["dst_t"], read(a["src"], a["src_t"], a["src"].label),
          a["dst"].label)
    for b in barrier_states(a["barrier"], a["barrier_t"]):
      b.arrive()
  return []


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
  for b in barrier_states(a["barrier"], a["barrier_t"]):
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
  thread.machine.tensor_core.observe(b, seen)
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
