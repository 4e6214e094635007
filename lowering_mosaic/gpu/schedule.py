"""How a kernel's CTA is organized over time: the schedule.

Two schedules:

- one warpgroup copies and computes (`warp_specialized=False`): blocks that
  stay put along the sequential grid dims are loaded once; blocks that move
  are double-buffered (`depth` 2: step s computes on slot s % 2 while TMA
  fills the other), or loaded at each step when shared memory holds only
  one slot (`depth` 1);
- warp-specialized (`warp_specialized=True`): a producer warpgroup issues the
  TMA copies of the blocks that move into a ring of `depth` slots, and
  `consumers` consumer warpgroups run the kernel body, each on its own point
  of the parallel grid dim `split_dim` (a CTA covers `consumers` blocks
  along it; blocks that do not depend on that dim are copied once and
  shared). Per slot, a `full` mbarrier (the producer's `arrive_expect_tx`
  plus the bytes TMA lands) and an `empty` mbarrier (one arrival per
  consumer warpgroup); the producer gives registers up (`setmaxnreg.dec`)
  and the consumers take them (`setmaxnreg.inc`). Two consumers whose
  step issues two tensor-core phases with work between them (attention:
  QK^T, softmax, PV) take turns at the tensor core (ping-pong): a
  `schedule` mbarrier (one arrival per consumer) and rounds on it (arrive,
  then wait) after the issue of the step's first wgmma and before the
  issue of its last; the second consumer takes one round before its loop,
  the first one after it, so one's softmax runs under the other's WGMMAs
  (on a ring of two slots or more).

The barrier protocol of each warpgroup is data (`Role`: ops before, in and
after the loop over sequential steps): the lowering emits it (specialized.py)
and the Promela model that SPIN checks is written from it (protocol_model.py),
so what is verified is what is emitted.
"""
from __future__ import annotations

import dataclasses
import math

WARPGROUP = 128                 # threads
MAX_DEPTH = 4                   # ring slots chosen automatically, at most
MAX_CONSUMERS = 3               # consumer warpgroups (4 warpgroups per CTA)
DEFAULT_CONSUMERS = 2
PRODUCER_REGISTERS = 40         # per thread, after `setmaxnreg.dec`
REGISTER_FILE = 65536           # 32-bit registers per SM (sm_90)
MAX_THREAD_REGISTERS = 256      # what `setmaxnreg` may ask for
LAUNCH_REGISTERS_GRANULE = 8    # `setmaxnreg` counts are multiples of 8
# Consumers that take turns at the tensor core: ping-pong hands the tensor
# core from one consumer to the other; with three on one barrier, two would
# issue in the same turn. The first consumer runs half a step ahead of the
# second: it waits for step s + 1's slot while the second still reads step
# s's, so turns need a ring of two slots at least (with one, SPIN finds the
# deadlock: tests/pallas/test_mosaic_gpu_protocol.py).
TURN_CONSUMERS = 2
TURN_MIN_DEPTH = 2
# Where, inside the kernel body, the ops of a turn go: after the issue of
# the step's first wgmma (before its wait), before the issue of its last.
AFTER_FIRST, BEFORE_LAST = "after_first_wgmma", "before_last_wgmma"


@dataclasses.dataclass(frozen=True)
class Op:
  """One step of a warpgroup's part in the protocol.

  kind: "wait" (on `barrier`, for the phase of parity `parity`), "arrive"
  (on `barrier`), "expect_tx" (arrive on `barrier`, expecting the bytes of
  `blocks`), "copy" (TMA of `blocks` into their buffers, completing on
  `barrier`), "compute" (the kernel body, reading `blocks`), "store" (TMA of
  the output blocks `blocks` to global memory).
  barrier: "full" / "empty" (the ring slot of the step), "fixed" (the
  blocks loaded once), "schedule" (the consumers' turns).
  parity: "phase" ((s // depth) & 1: the round of the ring), "flipped" (its
  complement: the first round passes an empty slot at once), "first" (0),
  "own" (c & 1 for consumer c: its first turn of a step), "other" (its
  complement: its second).
  blocks: "ring" (inputs that move), "fixed" (inputs loaded once),
  "moving" / "staying" (outputs stored every step / once at the end).
  at: "" (the op's own place), or a point inside the kernel body of the
  compute op before it (AFTER_FIRST, BEFORE_LAST: the dot rule emits it).
  only: the consumer that runs the op (None: every one).
  """
  kind: str
  barrier: str = ""
  parity: str = ""
  blocks: str = ""
  at: str = ""
  only: int | None = None

  def __str__(self):
    where = ((self.at,) if self.at else ()) + (
        (f"consumer {self.only}",) if self.only is not None else ())
    args = ", ".join(a for a in (self.barrier, self.parity, self.blocks)
                     + where if a)
    return f"{self.kind}({args})"


@dataclasses.dataclass(frozen=True)
class Role:
  """A warpgroup's ops: `before` the loop, `loop` (once per sequential step
  s, on ring slot s % depth), `after` it."""
  name: str
  before: tuple[Op, ...]
  loop: tuple[Op, ...]
  after: tuple[Op, ...]

  def ops(self):
    return self.before + self.loop + self.after

  def without(self, kind: str, barrier: str) -> "Role":
    """This role less its first `kind` op on `barrier` (seeding bugs)."""
    for part in ("before", "loop", "after"):
      ops = getattr(self, part)
      for i, op in enumerate(ops):
        if op.kind == kind and op.barrier == barrier:
          return dataclasses.replace(self, **{part: ops[:i] + ops[i + 1:]})
    raise ValueError(f"{self.name} has no {kind} on {barrier}")


def _turn(parity: str, at: str = "", only: int | None = None):
  """One round on the schedule barrier: arrive, then wait for the other
  consumer's arrival."""
  return (Op("arrive", "schedule", at=at, only=only),
          Op("wait", "schedule", parity, at=at, only=only))


def protocol(has_fixed: bool, turns: bool = False) -> tuple[Role, Role]:
  """The producer's and the consumers' ops of the warp-specialized ring
  (with `turns`: the consumers take turns at the tensor core)."""
  fixed_in = (Op("expect_tx", "fixed", blocks="fixed"),
              Op("copy", "fixed", blocks="fixed")) if has_fixed else ()
  producer = Role("producer", fixed_in,
                  (Op("wait", "empty", "flipped"),
                   Op("expect_tx", "full", blocks="ring"),
                   Op("copy", "full", blocks="ring")), ())
  fixed_wait = (Op("wait", "fixed", "first"),) if has_fixed else ()
  turn = _turn if turns else lambda *a, **k: ()
  consumer = Role("consumer", fixed_wait + turn("first", only=1),
                  (Op("wait", "full", "phase"),
                   Op("compute", blocks="ring"))
                  + turn("own", AFTER_FIRST) + turn("other", BEFORE_LAST)
                  + (Op("arrive", "empty"),
                     Op("store", blocks="moving")),
                  turn("first", only=0) + (Op("store", blocks="staying"),))
  return producer, consumer


@dataclasses.dataclass(frozen=True)
class Schedule:
  warp_specialized: bool
  depth: int                        # slots of each input block that moves
  consumers: int = 1                # consumer warpgroups (1 if not specialized)
  split_dim: int | None = None      # the parallel grid dim consumers share
  steps: int = 1                    # sequential steps per CTA
  producer: Role | None = None
  consumer: Role | None = None
  reason: str = ""                  # why this schedule

  @property
  def turns(self) -> bool:
    """Whether the consumers take turns at the tensor core."""
    return self.consumer is not None and any(
        op.barrier == "schedule" for op in self.consumer.ops())

  @property
  def warpgroups(self) -> int:
    return self.consumers + 1 if self.warp_specialized else 1

  @property
  def threads(self) -> int:
    return WARPGROUP * self.warpgroups

  @property
  def producer_registers(self) -> int:
    return PRODUCER_REGISTERS

  @property
  def consumer_registers(self) -> int:
    """What each consumer thread may use once the producer gave registers
    up: the register file less the producer's share, split evenly, rounded
    down to a multiple of 8, at most 256 (`setmaxnreg`'s bounds)."""
    per_wg = REGISTER_FILE // WARPGROUP - self.producer_registers
    n = min(MAX_THREAD_REGISTERS, per_wg // max(self.consumers, 1))
    return n - n % LAUNCH_REGISTERS_GRANULE

  def describe(self) -> str:
    if not self.warp_specialized:
      return (f"one warpgroup, {self.depth} slot(s) per moving block"
              + (f" ({self.reason})" if self.reason else ""))
    return (f"warp-specialized: 1 producer + {self.consumers} consumer "
            f"warpgroup(s) on grid dim {self.split_dim}, a ring of "
            f"{self.depth} slots, registers {self.producer_registers}/"
            f"{self.consumer_registers}"
            + (", turns at the tensor core" if self.turns else "")
            + (f" ({self.reason})" if self.reason else ""))


def single(depth: int, steps: int, reason: str = "") -> Schedule:
  return Schedule(False, depth, 1, None, steps, reason=reason)


def specialized(depth: int, consumers: int, split_dim: int | None,
                steps: int, has_fixed: bool, reason: str = "",
                two_phases: bool = False) -> Schedule:
  """`two_phases`: the body issues two tensor-core phases per step with
  work between them (turns.py); two consumers then take turns, on a ring
  of two slots or more."""
  producer, consumer = protocol(
      has_fixed, two_phases and consumers == TURN_CONSUMERS
      and depth >= TURN_MIN_DEPTH)
  return Schedule(True, depth, consumers, split_dim, steps, producer,
                  consumer, reason)


def ring_depth(budget: int, per_slot: int, steps: int,
               cap: int = MAX_DEPTH) -> int:
  """The deepest ring (at most `cap` and `steps` slots) whose slots of
  `per_slot` bytes fit in `budget` bytes; 0 if not even one fits."""
  if per_slot <= 0:
    return max(1, min(cap, steps))
  return max(0, min(cap, steps, budget // per_slot))


def round_up(n: int, k: int) -> int:
  return -(-n // k) * k


def total(sizes, align: int) -> int:
  return sum(round_up(n, align) for n in sizes if n)


def cta_count(grid, parallel, split_dim, consumers) -> int:
  n = math.prod(grid[d] for d in parallel)
  return n // consumers if split_dim is not None else n
