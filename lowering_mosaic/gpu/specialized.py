"""The warp-specialized CTA: a producer warpgroup and consumer warpgroups.

The CTA has `consumers + 1` warpgroups. The last one is the producer: it
gives registers up (`setmaxnreg.dec`) and runs its `Role` of the schedule's
protocol (schedule.py): the blocks loaded once, then, per sequential step
s, wait until ring slot s % depth is empty, arm its full barrier with the
step's bytes, and issue the step's TMA copies into it. The others are the
consumers (consumer c is warpgroup c): they take registers
(`setmaxnreg.inc`) and run theirs: wait for the slot to be full, run the
kernel body on grid point c of the CTA's `consumers` points along the
split dim, release the slot (one arrival per warpgroup on its empty
barrier), store the output blocks that move; after the loop the others.
Consumers that take turns at the tensor core share a `schedule` barrier:
the turn ops inside the body are handed to the dot rule, which emits them
around the issue of the step's first and last wgmmas (turns.py).

Each op of a role is emitted by one entry of `_EMIT` (keyed by op kind),
so the emitted module follows the protocol that protocol_model.py checks.
"""
from __future__ import annotations

import contextlib
import itertools

from dsl.core.jax_internals import arith, ir, nvvm, scf
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from lowering_mosaic.gpu import turns
from lowering_mosaic.gpu.host import decode, i32, index_cast_i32
from lowering_mosaic.gpu.schedule import AFTER_FIRST, BEFORE_LAST


# The CTA's mbarrier groups (kernel.py `_barriers`), by the names of ops.
_BARRIER_GROUPS = {"full": 0, "empty": 1, "fixed": 2, "schedule": 3}


class _Step:
  """Where a role is: the sequential step `s` (i32; None outside the
  loop), its ring slot, which warpgroup runs it, and the values of the
  refs the consumers carry in registers (`carry`, updated by compute),
  the parity of the consumer's first turn of a step (`own`, i1), and the
  turn ops the body emits (`inside`: those `at` a point of it)."""

  def __init__(self, em, consumer, s=None, carry=(), own=None):
    self.em, self.consumer, self.s = em, consumer, s
    self.carry, self.own, self.inside = list(carry), own, ()
    depth = em.plan.schedule.depth
    self.slot = arith.remui(s, i32(depth)) if s is not None else None
    self.round = (arith.divui(s, i32(depth)) if s is not None else None)

  def slot_index(self):
    return arith.index_cast(ir.IndexType.get(), self.slot)

  def parity(self, kind: str) -> ir.Value:
    i1 = ir.IntegerType.get_signless(1)
    if kind == "first":
      return arith.constant(i1, 0)
    if kind in ("own", "other"):
      return (self.own if kind == "own"
              else arith.xori(self.own, arith.constant(i1, 1)))
    bit = arith.trunci(i1, arith.andi(self.round, i32(1)))
    return arith.xori(bit, arith.constant(i1, 1)) if kind == "flipped" else bit

  def barrier(self, name: str):
    group = self.em.barriers[_BARRIER_GROUPS[name]]
    return group[self.slot] if name in ("full", "empty") else group

  def ids(self, replica):
    """Grid ids of this step (step 0 outside the loop) for `replica`."""
    em = self.em
    sizes = [em.plan.grid[d] for d in em.plan.sequential]
    seq = (decode(self.s, sizes) if self.s is not None
           else [i32(0)] * len(sizes))
    return em.ids_at(em.par, seq, replica)


def _inputs(em, which):
  """The input blocks of the ring (those that move along the sequential
  dims, however deep the ring) or the fixed ones (loaded once)."""
  ins = [b for b in em.plan.blocks if not b.in_gmem and not b.is_output]
  return [b for b in ins if b.moves == (which == "ring")]


def _copy_items(st: _Step, which: str):
  """(block, destination, grid ids) of the producer's copies: every
  replica of each block (one per consumer that needs its own; all at once
  for a stacked block)."""
  em = st.em
  slot = st.slot_index() if which == "ring" else None
  items = []
  for b in _inputs(em, which):
    if b.stacked:                 # one copy of all replicas (Emitter.copy)
      items.append((b, em.view(b, slot), st.ids(0)))
      continue
    for r in range(b.replicas):
      items.append((b, em.view(b, slot, r if b.replicas > 1 else None),
                    st.ids(r)))
  return items


def _wait(st, op):
  # The barrier ref's own wait on a given parity (`mbarrier.try_wait.parity`
  # in the module): jaxlib 0.12's dialect has no `mosaic_gpu.wait` op, and
  # this is what jaxlib 0.11 lowered that op to, so both emit the same.
  st.barrier(op.barrier).wait_parity(st.parity(op.parity))


def _arrive(st, op):
  st.barrier(op.barrier).arrive()


def _expect_tx(st, op):
  nbytes = sum(b.nbytes * b.replicas for b in _inputs(st.em, op.blocks))
  st.barrier(op.barrier).arrive_expect_tx(i32(nbytes))


def _copy(st, op):
  em = st.em
  barrier = st.barrier(op.barrier)
  for b, dest, ids in _copy_items(st, op.blocks):
    em.copy(b, dest, ids, barrier)


def _consumer_views(st):
  em = st.em
  c = arith.index_cast(ir.IndexType.get(), st.consumer)
  slot = st.slot_index() if st.s is not None else None
  out = {}
  for b in em.plan.blocks:
    if not b.in_gmem and (slot is not None or b.slots == 1):
      rep = c if b.replicas > 1 else None
      out[b] = em.view(b, slot if b.slots > 1 else None, rep)
  return out, c


@contextlib.contextmanager
def _turns_inside(st):
  """The turn ops `at` points of the body (`st.inside`), handed to the dot
  rule for the wgmmas there while the body is emitted."""
  host = st.em.host
  if st.inside:
    first, last = turns.phases(st.em.plan.body)
    points = {AFTER_FIRST: (id(first), "after"),
              BEFORE_LAST: (id(last), "before")}
    for op in st.inside:
      host.turns.setdefault(points[op.at], []).append(
          lambda op=op: _EMIT[op.kind](st, op))
  try:
    yield
  finally:
    host.turns = {}


def _compute(st, op):
  em = st.em
  views, c = _consumer_views(st)
  with _turns_inside(st):
    st.carry = em.body(st.ids(st.consumer), em.refs(views, c), st.carry)


def _store(st, op):
  em = st.em
  views, _ = _consumer_views(st)
  outs = [b for b in em.plan.blocks if b.is_output and not b.in_gmem
          and b.moves == (op.blocks == "moving")]
  if op.blocks == "staying":
    em.write_back(st.carry, views)
    ids = em.ids_at(em.par, [i32(em.plan.grid[d] - 1)
                             for d in em.plan.sequential], st.consumer)
  else:
    ids = st.ids(st.consumer)
  em.store([(b, views[b], ids) for b in outs])


_EMIT = {"wait": _wait, "arrive": _arrive, "expect_tx": _expect_tx,
         "copy": _copy, "compute": _compute, "store": _store}


def _emit_ops(st, ops):
  """Emits `ops` in order: the ops `at` a point of the body by the compute
  op before them, a run of ops for one consumer only in one `scf.if`."""
  for i, op in enumerate(ops):
    if op.kind == "compute":
      st.inside = tuple(itertools.takewhile(lambda o: o.at, ops[i + 1:]))
  ops = [op for op in ops if not op.at]
  for only, run in itertools.groupby(ops, lambda op: op.only):
    if only is None:
      for op in run:
        _EMIT[op.kind](st, op)
      continue
    mine = arith.cmpi(arith.CmpIPredicate.eq, st.consumer, i32(only))
    with ir.InsertionPoint(scf.IfOp(mine).then_block):
      for op in run:
        _EMIT[op.kind](st, op)
      scf.yield_([])


def _own_parity(role, consumer):
  """The parity of `consumer`'s first turn of a step (c & 1, as i1), once,
  before the loop; None if the role takes no turns."""
  if not any(op.parity in ("own", "other") for op in role.loop):
    return None
  return arith.trunci(ir.IntegerType.get_signless(1),
                      arith.andi(consumer, i32(1)))


def _run(em, role, consumer):
  """Emits `role`'s ops: before, in a loop over the sequential steps
  (carrying the consumers' accumulators), after."""
  _emit_ops(_Step(em, consumer), role.before)
  computes = any(op.kind == "compute" for op in role.loop)
  carry = em.initial_carry() if computes else []
  own = _own_parity(role, consumer)

  def step(s, carry):
    st = _Step(em, consumer, s, carry, own)
    _emit_ops(st, role.loop)
    return st.carry

  if role.loop:
    carry = em.steps_loop(carry, step)
  _emit_ops(_Step(em, consumer, carry=carry), role.after)


def _registers(n: int, action: str):
  nvvm.setmaxregister(n, getattr(nvvm.SetMaxRegisterAction, action))


def emit(em):
  """The CTA of a warp-specialized kernel: warpgroup `consumers` is the
  producer, the others consumers."""
  sched = em.plan.schedule
  wg = mgpu_utils.warpgroup_idx(sync=True)
  is_producer = arith.cmpi(arith.CmpIPredicate.eq, wg, i32(sched.consumers))
  which = arith.index_cast(ir.IndexType.get(),
                           arith.extui(ir.IntegerType.get_signless(32),
                                       is_producer))
  switch = scf.IndexSwitchOp([], which, [0])
  with ir.InsertionPoint(switch.case_blocks[0]):        # consumers
    _registers(sched.consumer_registers, "increase")
    _run(em, sched.consumer, wg)
    scf.yield_([])
  with ir.InsertionPoint(switch.default_block):         # the producer
    _registers(sched.producer_registers, "decrease")
    _run(em, sched.producer, None)
    scf.yield_([])
