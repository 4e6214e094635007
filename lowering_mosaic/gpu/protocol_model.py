"""The warp-specialized ring's mbarrier protocol as a Promela model, and SPIN
runs on it.

The model is written from the schedule the lowering emits (`GpuPlan.
schedule`: the producer's and the consumers' `Role`s, the ring depth, the
number of consumers) and from the plan's blocks (how many TMA copies fill a
slot), one Promela statement per op of each role (the `_OPS` table), so a
change to the protocol changes both the module (specialized.py) and the
model. Its processes: the producer warpgroup, one process per consumer
warpgroup, and the TMA engine, which lands the copies in flight in any
order. Data are abstracted to what a slot holds: the step whose blocks it
has, the copies still landing into it, its readers, and how many consumers
released it.

The mbarriers are modelled as the hardware keeps them: a phase bit, the
arrivals still pending in the current phase, the transaction count (here:
TMA copies still to land); a phase completes when both reach zero, and
`try_wait.parity(p)` passes once the current phase's parity differs from p.

Checked, for every interleaving:
  - a consumer computes on a slot only once all of its step's copies have
    landed, and on the blocks of its own step (not stale nor future ones);
  - the producer refills a slot only after every consumer released it and
    no consumer still reads it (no slot overwritten early);
  - no mbarrier gets more arrivals than its phase expects;
  - no deadlock: every warpgroup reaches the end (SPIN's invalid end
    states).
A violation prints `@@GPU <what>` and fails `assert(no_race)` (or
`valid_model`), so `run_spin` reports a race; `verify` words it.

The loop runs `steps` sequential steps: the kernel's own count, bounded by
`2 * depth + 2` (the protocol repeats with period `2 * depth` steps: slot
s % depth in phase parity (s // depth) % 2, so a longer loop visits no new
state of the ring).
"""
from __future__ import annotations

import dataclasses
import re
import subprocess
import tempfile

from lowering_mosaic.gpu.schedule import AFTER_FIRST, BEFORE_LAST, Op, Role, \
    Schedule
from lowering_mosaic.verification.promela import run_spin
from lowering_mosaic.verification.promela.spin_report import Report
from lowering_mosaic.verification.promela.spin import require_spin


@dataclasses.dataclass(frozen=True)
class Ring:
  """What the model needs of a kernel's plan."""
  kernel: str
  schedule: Schedule
  ring_copies: int            # TMA copies that fill one slot
  fixed_copies: int           # TMA copies of the blocks loaded once
  steps: int                  # sequential steps modelled

  @classmethod
  def of(cls, plan, kernel: str = "kernel", steps: int | None = None):
    sched = plan.schedule
    if not sched.warp_specialized:
      raise ValueError(f"kernel {kernel!r} is not warp-specialized "
                       f"({sched.describe()}): no ring to model")
    ins = [b for b in plan.blocks if not b.is_output and not b.in_gmem]
    count = lambda bs: sum(b.transfers for b in bs)
    bound = 2 * sched.depth + 2
    return cls(kernel, sched, count([b for b in ins if b.moves]),
               count([b for b in ins if not b.moves]),
               steps or min(sched.steps, bound))


# ------------------------------------------------------------ the ops

def _check(cond: str, what: str) -> str:
  """A Promela check: `what` (printed) and a failed assertion if not
  `cond`."""
  return (f"if :: {cond} -> skip :: else -> printf(\"@@GPU {what}\\n\"); "
          "assert(no_race) fi")


def _slot(op: Op) -> str:
  return "0" if op.barrier in ("fixed", "schedule") else "k"


def _parity(op: Op) -> str:
  return {"phase": "((s / DEPTH) % 2)", "flipped": "(1 - (s / DEPTH) % 2)",
          "first": "0", "own": "(c % 2)", "other": "(1 - c % 2)"}[op.parity]


def _wait(r: Ring, op: Op, who: str) -> str:
  """The wait, between lines that tell a replayed deadlock where each
  warpgroup stopped."""
  b = op.barrier
  return (f"printf(\"@@WAIT %d {who} waits on the {b} barrier\\n\", _pid); "
          f"({b}_phase[{_slot(op)}] != {_parity(op)}); "
          f"printf(\"@@PASS %d\\n\", _pid)")


def _arrive(r: Ring, op: Op, who: str) -> str:
  b = op.barrier
  released = {"empty": "slot_released[k]++; ",
              "schedule": "issuing[c] = false; "}.get(b, "")
  return (f"atomic {{ {released}arrive({b}_phase[{_slot(op)}], "
          f"{b}_pending[{_slot(op)}], {b}_tx[{_slot(op)}], "
          f"{b.upper()}_COUNT) }}")


def _expect_tx(r: Ring, op: Op, who: str) -> str:
  b = op.barrier
  n = r.ring_copies if op.blocks == "ring" else r.fixed_copies
  return (f"atomic {{ {b}_tx[{_slot(op)}] = {b}_tx[{_slot(op)}] + {n}; "
          f"arrive({b}_phase[{_slot(op)}], {b}_pending[{_slot(op)}], "
          f"{b}_tx[{_slot(op)}], {b.upper()}_COUNT) }}")


def _copy(r: Ring, op: Op, who: str) -> str:
  if op.blocks == "fixed":
    return f"atomic {{ fixed_landing = {r.fixed_copies} }}"
  return ("atomic {\n      "
          + _check("slot_readers[k] == 0", "the producer refills a slot a "
                   "consumer is reading") + ";\n      "
          + _check("slot_step[k] < 0 || slot_released[k] == NCONS",
                   "the producer refills a slot before every consumer "
                   "released it") + ";\n"
          f"      slot_step[k] = s; slot_released[k] = 0; "
          f"slot_landing[k] = {r.ring_copies}\n    }}")


def _compute(r: Ring, op: Op, who: str) -> str:
  fixed = ("\n      " + _check("fixed_landing == 0 && fixed_loaded",
                                 f"{who} reads the blocks loaded once before "
                                 "they landed") + ";"
           if r.fixed_copies else "")
  return ("atomic {\n      "
          + _check("slot_landing[k] == 0 && slot_step[k] == s",
                   f"{who} computes on a slot before the copies of its "
                   "step landed") + ";"
          f"{fixed}\n"
          "      slot_readers[k]++\n    }")


# The body's end, after the turn ops inside it.
_BODY_RAN = ("atomic { slot_readers[k]-- }", "the body ran")
# A consumer issues a wgmma: never while the other one issues (it has not
# yet handed the tensor core over by arriving on the schedule barrier).
_ISSUE = ("atomic {\n      " + _check(
    "!issuing[1 - c]", "both consumers issue WGMMAs at once") + ";\n"
    "      issuing[c] = true\n    }", "a wgmma issued")


def _store(r: Ring, op: Op, who: str) -> str:
  return "skip   /* output stores: the warpgroup's own buffers */"


_OPS = {"wait": _wait, "arrive": _arrive, "expect_tx": _expect_tx,
        "copy": _copy, "compute": _compute, "store": _store}


def _statement(r: Ring, op: Op, who: str) -> str:
  """`op` in Promela; an op for one consumer only under an `if`."""
  text = _OPS[op.kind](r, op, who)
  if op.only is None:
    return text
  return f"if :: c == {op.only} -> {text} :: else -> skip fi"


def _lines(r: Ring, ops, who: str, indent: str) -> str:
  """The statements of `ops`; the ops `at` points of the body between the
  compute op's start and the body's end, beside the wgmma they follow
  (AFTER_FIRST) or precede (BEFORE_LAST)."""
  out, reading, issued = [], False, False
  for op in ops:
    if reading and not op.at:
      out.append(_BODY_RAN)
      reading = False
    if op.at == AFTER_FIRST and not issued:
      out.append(_ISSUE)
    issued = op.at == AFTER_FIRST
    out.append((_statement(r, op, who), str(op)))
    if op.at == BEFORE_LAST and op.kind == "wait":
      out.append(_ISSUE)
    reading = reading or op.kind == "compute"
  if reading:
    out.append(_BODY_RAN)
  return "".join(f"{indent}{text};   /* {what} */\n" for text, what in out)


def _proctype(r: Ring, role: Role, name: str, who: str, arg: str = "") -> str:
  lines = lambda ops, indent: _lines(r, ops, who, indent)
  body = lines(role.before, "  ")
  if role.loop:
    body += ("  s = 0;\n  do\n  :: s < STEPS ->\n    k = s % DEPTH;\n"
             + lines(role.loop, "    ") + "    s++\n  :: else -> break\n  od;\n")
  body += lines(role.after, "  ")
  return (f"proctype {name}({arg}) {{\n  short s; byte k;\n{body}"
          "  atomic { finished++ }\n}\n")


_PRELUDE = """
bool no_race = false;       /* asserted where a check fails */
bool valid_model = false;

byte full_phase[DEPTH]; byte full_pending[DEPTH]; byte full_tx[DEPTH];
byte empty_phase[DEPTH]; byte empty_pending[DEPTH]; byte empty_tx[DEPTH];
byte fixed_phase[1]; byte fixed_pending[1]; byte fixed_tx[1];
short slot_step[DEPTH];     /* the step whose blocks the slot holds (-1) */
byte slot_landing[DEPTH];   /* its TMA copies still in flight */
byte slot_readers[DEPTH];   /* consumers computing on it */
byte slot_released[DEPTH];  /* consumers that released its blocks */
byte fixed_landing; bool fixed_loaded;
byte finished;

/* One arrival; the phase completes when no arrival nor byte is pending. */
inline arrive(phase, pending, tx, count) {
  if
  :: pending > 0 -> pending--
  :: else -> printf("@@GPU an mbarrier got more arrivals than its phase expects\\n"); assert(valid_model)
  fi;
  if
  :: pending == 0 && tx == 0 -> phase = 1 - phase; pending = count
  :: else -> skip
  fi
}

/* A TMA copy lands: its bytes complete on the barrier. */
inline land(phase, pending, tx, count) {
  tx--;
  if
  :: pending == 0 && tx == 0 -> phase = 1 - phase; pending = count
  :: else -> skip
  fi
}
"""


_TURNS = """
/* The consumers' turns at the tensor core: the schedule barrier (one
   arrival per consumer), and who issues WGMMAs until its next arrival. */
byte schedule_phase[1]; byte schedule_pending[1]; byte schedule_tx[1];
bool issuing[NCONS];
"""


def _engine(r: Ring) -> str:
  arms = "".join(
      f"  :: atomic {{ slot_landing[{k}] > 0 -> slot_landing[{k}]--; "
      f"land(full_phase[{k}], full_pending[{k}], full_tx[{k}], FULL_COUNT) }}\n"
      for k in range(r.schedule.depth))
  if r.fixed_copies:
    arms += ("  :: atomic { fixed_landing > 0 -> fixed_landing--; "
             "fixed_loaded = (fixed_landing == 0); land(fixed_phase[0], "
             "fixed_pending[0], fixed_tx[0], FIXED_COUNT) }\n")
  return ("/* The TMA engine: lands any copy in flight, in any order. */\n"
          "active proctype tma() {\nend:\n  do\n" + arms + "  od\n}\n")


def _name(kernel: str) -> str:
  return re.sub(r"\W", "_", kernel)


def to_promela(r: Ring) -> str:
  """The Promela model of `r`'s ring protocol."""
  sched = r.schedule
  head = (f"/* The mbarrier protocol of a warp-specialized Mosaic GPU "
          f"kernel:\n * @@model kernel={_name(r.kernel)} devices=1 par=1\n"
          f" * {sched.describe()}; {r.steps} steps, {r.ring_copies} TMA "
          f"copies per slot, {r.fixed_copies} loaded once.\n */\n"
          f"#define DEPTH {sched.depth}\n#define STEPS {r.steps}\n"
          f"#define NCONS {sched.consumers}\n#define FULL_COUNT 1\n"
          f"#define EMPTY_COUNT {sched.consumers}\n#define FIXED_COUNT 1\n"
          + (f"#define SCHEDULE_COUNT {sched.consumers}\n"
             if sched.turns else ""))
  init = ("init {\n  byte i;\n  for (i : 0 .. DEPTH - 1) {\n"
          "    full_pending[i] = FULL_COUNT; empty_pending[i] = EMPTY_COUNT;"
          "\n    slot_step[i] = -1\n  }\n  fixed_pending[0] = FIXED_COUNT;\n"
          + ("  schedule_pending[0] = SCHEDULE_COUNT;\n" if sched.turns
             else "")
          + "  atomic {\n    run producer();\n"
          + "".join(f"    run consumer({c});\n"
                    for c in range(sched.consumers))
          + "  }\n}\n")
  return (head + _PRELUDE + (_TURNS if sched.turns else "") + "\n"
          + _engine(r) + "\n"
          + _proctype(r, sched.producer, "producer", "the producer") + "\n"
          + _proctype(r, sched.consumer, "consumer", "a consumer",
                      "byte c") + "\n" + init)


def _explain(workdir: str, name: str) -> str:
  """What the counterexample SPIN saved shows: the failed check (its
  `@@GPU` line), or the waits the warpgroups are stuck in."""
  spin, _ = require_spin()
  r = subprocess.run([spin, "-t", f"{name}.pml"], cwd=workdir,
                     capture_output=True, text=True, timeout=120)
  lines = [l.strip() for l in r.stdout.splitlines()]
  found = [l.split("@@GPU", 1)[1].strip() for l in lines if "@@GPU" in l]
  if found:
    return found[-1]
  waiting = {}
  for l in lines:
    parts = l.split(None, 2)
    if len(parts) >= 2 and parts[0] in ("@@WAIT", "@@PASS"):
      waiting[parts[1]] = parts[2] if parts[0] == "@@WAIT" else None
  stuck = sorted(w for w in waiting.values() if w)
  return ("deadlock: " + "; ".join(stuck) + " forever") if stuck else ""


def verify(r: Ring, **spin_args) -> Report:
  """SPIN's verdict on `r`'s protocol: kind "ok", "race" (with the check
  that failed in `message`), "deadlock" (`blocked` processes), "error"."""
  with tempfile.TemporaryDirectory(prefix="mgpu-ring-") as d:
    rep = run_spin(to_promela(r), workdir=d, name="ring", **spin_args)
    if not rep.ok and rep.kind != "bound":
      why = _explain(d, "ring")
      if why:
        rep.message = f"kernel {r.kernel}: {why}"
    rep.model_path = None
  return rep


def seeded(r: Ring, role: str, kind: str, barrier: str) -> Ring:
  """`r` with one op removed from a role (a bug seeded to show SPIN
  catches it): e.g. ("consumer", "wait", "full")."""
  sched = r.schedule
  changed = getattr(sched, role).without(kind, barrier)
  return dataclasses.replace(
      r, schedule=dataclasses.replace(sched, **{role: changed}))


__all__ = ["Ring", "seeded", "to_promela", "verify"]
