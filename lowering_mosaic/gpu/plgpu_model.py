"""The mbarrier protocol of an explicit `plgpu.kernel` as a Promela model,
and SPIN runs on it.

The model is written from the kernel's synchronization skeleton
(plgpu_skeleton.py: per warpgroup, its TMA copies, SMEM reads and writes,
WGMMAs, barrier arrivals and waits, loops unrolled at the traced sizes).
Processes: one per warpgroup of a block, and the TMA engine, which lands
the copies in flight in any order, at any later point.

State: per mbarrier the phases it completed (`done`), the arrivals its
current phase still expects (`pend`) and the TMA copies still to land on
it (`tx`): a phase completes when both reach zero. Each warpgroup counts
the phases it waited for (`seen`): `barrier_wait` passes once the barrier
completed one more. Per SMEM cell (plgpu_skeleton.py): the TMA copies
landing into it (`land`), the asynchronous reads of it in flight (WGMMAs,
SMEM -> GMEM copies: `rd`), whether anything was ever written to it
(`filled`).

Checked on every interleaving (a failed check prints `@@E code event arg`
and asserts `no_race`; SPIN's invalid end states are deadlocks):
  - a warpgroup reads a cell (a load, a WGMMA operand, a TMA store's
    source) while a TMA copy into it is still landing, or before anything
    was written to it;
  - a cell is overwritten (a TMA copy into it, a store) while a copy into
    it is landing or a WGMMA / TMA store still reads it (not released);
  - an mbarrier gets more arrivals than its phase expects;
  - a warpgroup waits on an mbarrier that completed two phases since its
    last wait (the hardware tracks phases by parity: it would wait for the
    wrong one);
  - a warpgroup ends with SMEM -> GMEM copies not waited for;
  - deadlock: a warpgroup waits forever.

The model's header carries the tables (`@@ev`, `@@cell`, `@@bar`,
`@@pair`) that turn a trail back into warpgroups, barriers, buffers and
kernel lines, so a dumped model verifies on its own (`explain`).
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile

from lowering_mosaic.gpu.plgpu_promela import (MARK, is_plgpu_kernel,
                                               kernel_model, maybe_dump,
                                               to_promela)
from lowering_mosaic.gpu.plgpu_skeleton import Choice, Event, Skeleton
from lowering_mosaic.verification.promela.dump import maybe_dump_text
from lowering_mosaic.verification.promela.spin import require_spin, run_spin
from lowering_mosaic.verification.promela.spin_report import Report, TrailStep


# ------------------------------------------------------------ the answer

@dataclasses.dataclass
class _Tables:
  """The header's tables, read back from a model's text."""
  wgs: dict
  events: dict         # id -> (wg, line, what)
  cells: dict
  bars: dict           # id -> (arrivals, name)
  pairs: dict          # id -> (barrier, cells' name)

  @classmethod
  def parse(cls, text: str) -> "_Tables":
    t = cls({}, {}, {}, {}, {})
    for line in text.splitlines():
      m = re.match(r"\s*\* @@(wg|ev|cell|bar|pair) (\d+) (.*)", line)
      if not m:
        continue
      kind, k, rest = m.group(1), int(m.group(2)), m.group(3)
      if kind == "ev":
        wg, src, what = re.match(r"(\d+) (\S+) \| (.*)", rest).groups()
        t.events[k] = (int(wg), None if src == "-" else src, what)
      elif kind in ("bar", "pair"):
        first, name = rest.split(" ", 1)
        getattr(t, kind + "s")[k] = (int(first), name)
      else:
        getattr(t, kind + "s" if kind != "cell" else "cells")[k] = rest
    return t

  def event(self, k: int):
    wg, line, what = self.events[k]
    return self.wgs.get(wg, f"warpgroup {wg}"), line, what


_MESSAGES = {
    "landing_read": "{who} {what} at {line} while a TMA copy into {cell} is "
                    "still landing",
    "empty_read": "{who} {what} at {line} before any copy into {cell} landed",
    "landing_write": "{who} {what} at {line} while a TMA copy into {cell} is "
                     "still landing",
    "reader_write": "{who} {what} at {line} while a WGMMA or a TMA store "
                    "still reads {cell} (not released)",
    "over": "{bar} gets more arrivals than its phase expects "
            "(num_arrivals={arrivals}): {who} {what} at {line}",
    "parity": "{who} {what} at {line} for a phase the barrier has gone "
              "past: it completed two phases since this warpgroup's last "
              "wait on it (the hardware tracks phases by parity and would "
              "wait for the wrong one)",
    "unwaited": "{who} {what} (at {line})",
}


def _race(t: _Tables, code: str, k: int, arg: int) -> tuple[str, str]:
  who, line, what = t.event(k)
  bar = t.bars.get(arg, (0, "?"))
  text = _MESSAGES[code].format(who=who, line=line, what=what,
                                cell=t.cells.get(arg, "?"), bar=bar[1],
                                arrivals=bar[0])
  return f"race: {text}", line


def _step(t: _Tables, tag: str, k: int) -> TrailStep | None:
  if tag in ("S", "W"):
    who, line, what = t.event(k)
    return TrailStep(who, line, what)
  if tag == "L":
    b, cells = t.pairs[k]
    return TrailStep("TMA engine", None, f"lands a copy into {cells} "
                     f"(its bytes complete on {t.bars[b][1]})")
  return None


def explain(text: str, workdir: str, name: str, rep: Report) -> None:
  """Fills `rep`'s message, trail and blocked waits from the trail SPIN
  saved for the model `text` (workdir/name.pml)."""
  t = _Tables.parse(text)
  spin, _ = require_spin()
  out = subprocess.run([spin, "-t", f"{name}.pml"], cwd=workdir,
                       capture_output=True, text=True, timeout=120).stdout
  waiting, trail = {}, []
  for tag, k, *rest in re.findall(r"@@([SWPLE]) (\w+) ?(\d*) ?(\d*)", out):
    if tag == "E":
      rep.message, rep.error_line = _race(t, k, int(rest[0]), int(rest[1]))
      break
    k = int(k)
    if tag in ("W", "P"):
      waiting[t.events[k][0]] = k if tag == "W" else None
    step = _step(t, tag, k)
    if step is not None:
      trail.append(step)
  rep.trail = trail
  if rep.kind == "deadlock":
    stuck = [t.event(k) for k in waiting.values() if k is not None]
    rep.blocked = [TrailStep(who, line, f"blocked: {what}")
                   for who, line, what in stuck]
    rep.message = "deadlock: " + "; ".join(
        f"{who} {what} at {line} forever" for who, line, what in stuck)
    rep.error_line = stuck[0][1] if stuck else None
  if rep.message:
    rep.message = f"kernel {rep.kernel}: {rep.message}"


def is_plgpu_model(text: str) -> bool:
  return MARK in text.split("*/", 1)[0]


def verify_model(text: str, *, max_depth: int = 200_000,
                 timeout_s: float = 60.0, memory_mb: int = 512,
                 keep_dir: str | None = None, name: str = "plgpu") -> Report:
  """SPIN's verdict on a model written by `to_promela`: kind "ok", "race",
  "deadlock", "bound" or "error", the message naming warpgroups, barriers,
  buffers and kernel lines, and the trail that leads there."""
  with tempfile.TemporaryDirectory(prefix="plgpu-") as tmp:
    d = keep_dir or tmp
    os.makedirs(d, exist_ok=True)
    rep = run_spin(text, workdir=d, name=name, max_depth=max_depth,
                   timeout_s=timeout_s, memory_mb=memory_mb)
    if rep.kind in ("race", "deadlock"):
      explain(text, d, name, rep)
    rep.notes = [line.split("note: ", 1)[1] for line in
                 text.split("*/", 1)[0].splitlines() if " * note: " in line]
    if not keep_dir:
      rep.model_path = None
  return rep


def verify(sk: Skeleton, **spin_args) -> Report:
  """SPIN's verdict on the protocol of the skeleton `sk`."""
  return verify_model(to_promela(sk), **spin_args)


def verify_kernel(spec, **spin_args) -> Report:
  """SPIN's verdict on the protocol of the `plgpu.kernel` of `spec`; the
  model is written to `jax_pallas_dump_promela_to` when set."""
  text = kernel_model(spec)
  maybe_dump_text(text, spec.name)
  return verify_model(text, **spin_args)


def without(sk: Skeleton, wg: int, kind: str, barrier: str) -> Skeleton:
  """`sk` with warpgroup `wg`'s `kind` events ("wait", "arrive", "load")
  on the mbarriers named `barrier` (`loaded` or `loaded[1]`) removed: a
  bug seeded to show that SPIN catches it."""
  def keep(node):
    return not (isinstance(node, Event) and node.kind == kind
                and node.barrier is not None
                and re.fullmatch(rf"{re.escape(barrier)}(\[.*\])?",
                                 sk.barrier_name(node.barrier)))

  def strip(nodes):
    return [Choice([strip(a) for a in n.branches], n.line)
            if isinstance(n, Choice) else n for n in nodes if keep(n)]
  programs = list(sk.programs)
  programs[wg] = strip(programs[wg])
  return dataclasses.replace(sk, programs=programs)


__all__ = ["MARK", "explain", "is_plgpu_kernel", "is_plgpu_model",
           "kernel_model", "maybe_dump", "to_promela", "verify",
           "verify_kernel", "verify_model", "without"]
