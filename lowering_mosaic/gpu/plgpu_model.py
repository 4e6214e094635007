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
import warnings

from dsl.core import config
from lowering_mosaic.gpu.plgpu_skeleton import (Choice, Event, Skeleton,
                                                skeleton)
from lowering_mosaic.verification.promela.dump import (maybe_dump_text,
                                                      write_model)
from lowering_mosaic.verification.promela.spin import require_spin, run_spin
from lowering_mosaic.verification.promela.spin_report import Report, TrailStep

MARK = "@@plgpu"      # the header line that says a model is one of these


def _fail(code: str, ev: Event, arg: int) -> str:
  return (f"printf(\"@@E {code} {ev.id} {arg}\\n\"); assert(no_race)")


def _check(cond: str, code: str, ev: Event, arg: int) -> str:
  return f"if :: {cond} -> skip :: else -> {_fail(code, ev, arg)} fi"


def _complete(b: int, n: int) -> str:
  return (f"if :: pend[{b}] == 0 && tx[{b}] == 0 -> done[{b}]++; "
          f"pend[{b}] = {n} :: else -> skip fi")


def _arrive(sk: Skeleton, ev: Event) -> str:
  b = ev.barrier
  return (f"if :: pend[{b}] > 0 -> pend[{b}]-- :: else -> "
          f"{_fail('over', ev, b)} fi; {_complete(b, sk.num_arrivals(b))}")


def _reads(ev: Event) -> list[str]:
  return [s for c in ev.cells for s in (
      _check(f"land[{c}] == 0", "landing_read", ev, c),
      _check(f"filled[{c}]", "empty_read", ev, c))]


def _writes(ev: Event) -> list[str]:
  return [s for c in ev.cells for s in (
      _check(f"land[{c}] == 0", "landing_write", ev, c),
      _check(f"rd[{c}] == 0", "reader_write", ev, c))]


def _load(sk, ev, pairs):
  return [*_writes(ev), f"tx[{ev.barrier}]++", _arrive(sk, ev),
          *[f"land[{c}]++" for c in ev.cells],
          f"fly[{pairs[(ev.cells, ev.barrier)]}]++"]


_STEPS = {
    "load": _load,
    "store": lambda sk, ev, _: [*_reads(ev), *[f"rd[{c}]++" for c in ev.cells]],
    "mma": lambda sk, ev, _: [*_reads(ev), *[f"rd[{c}]++" for c in ev.cells]],
    "read": lambda sk, ev, _: _reads(ev),
    "write": lambda sk, ev, _: [*_writes(ev),
                                *[f"filled[{c}] = 1" for c in ev.cells]],
    "retire": lambda sk, ev, _: [f"rd[{c}]--" for c in ev.cells],
    "arrive": lambda sk, ev, _: [_arrive(sk, ev)],
    "unwaited": lambda sk, ev, _: [_fail("unwaited", ev, 0)],
}


def _statement(sk: Skeleton, ev: Event, pairs: dict) -> str:
  if ev.kind == "wait":
    b = ev.barrier
    return (f"printf(\"@@W {ev.id}\\n\");\n  atomic {{ done[{b}] > seen[{b}] "
            f"-> {_check(f'done[{b}] == seen[{b}] + 1', 'parity', ev, b)}; "
            f"seen[{b}]++; printf(\"@@P {ev.id}\\n\") }}")
  body = "; ".join([f"printf(\"@@S {ev.id}\\n\")",
                    *_STEPS[ev.kind](sk, ev, pairs)])
  return f"atomic {{ {body} }}"


def _program(sk: Skeleton, nodes: list, pairs: dict, indent: str) -> str:
  out = []
  for node in nodes:
    if isinstance(node, Choice):
      arms = "".join(
          f"{indent}:: true ->\n{_program(sk, arm, pairs, indent + '   ')}"
          if arm else f"{indent}:: true -> skip\n" for arm in node.branches)
      out.append(f"{indent}if   /* a condition on data at {node.line} */\n"
                 f"{arms}{indent}fi;\n")
    else:
      text = _statement(sk, node, pairs).replace("\n", "\n" + indent)
      out.append(f"{indent}{text};\n")
  return "".join(out) or f"{indent}skip;\n"


def _pairs(sk: Skeleton) -> dict:
  """(cells, barrier) of every TMA copy into SMEM -> its index."""
  pairs: dict = {}
  for ev in sk.events:
    if ev.kind == "load":
      pairs.setdefault((ev.cells, ev.barrier), len(pairs))
  return pairs


def _engine(sk: Skeleton, pairs: dict) -> str:
  if not pairs:
    return ""
  arms = []
  for (cells, b), p in pairs.items():
    lands = "; ".join(f"land[{c}]--; filled[{c}] = 1" for c in cells)
    arms.append(f"  :: atomic {{ fly[{p}] > 0 -> fly[{p}]--; {lands}; "
                f"tx[{b}]--; printf(\"@@L {p}\\n\"); "
                f"{_complete(b, sk.num_arrivals(b))} }}\n")
  return ("/* The TMA engine: lands any copy in flight, in any order. */\n"
          "active proctype tma() {\nend:\n  do\n" + "".join(arms)
          + "  od\n}\n\n")


def _header(sk: Skeleton, pairs: dict) -> str:
  name = re.sub(r"\W", "_", sk.kernel) or "kernel"
  lines = [f"/* The mbarrier protocol of the plgpu kernel {sk.kernel}:",
           f" * @@model kernel={name} devices=1 par=1",
           f" * {MARK} warpgroups={len(sk.programs)}"]
  lines += [f" * loop at {line}: {' or '.join(map(str, n))} steps"
            for line, n in sk.loops.items()]
  lines += [f" * @@wg {w} {sk.wg_name(w)}" for w in range(len(sk.programs))]
  lines += [f" * @@ev {e.id} {e.wg} {e.line or '-'} | {e.what}"
            for e in sk.events]
  lines += [f" * @@cell {c} {sk.cell_name(c)}" for c in range(sk.num_cells)]
  lines += [f" * @@bar {b} {sk.num_arrivals(b)} {sk.barrier_name(b)}"
            for b in range(sk.num_barriers)]
  lines += [f" * @@pair {p} {b} {sk.cells_name(cells)}"
            for (cells, b), p in pairs.items()]
  lines += [f" * note: {n}" for n in sk.notes]
  return "\n".join(lines).replace("*/", "* /") + "\n */\n"


def to_promela(sk: Skeleton) -> str:
  """The Promela model of the skeleton `sk` (plgpu_skeleton.skeleton)."""
  for b in range(sk.num_barriers):
    if not 1 <= sk.num_arrivals(b) <= 255:
      raise ValueError(f"kernel {sk.kernel}: {sk.barrier_name(b)} expects "
                       f"{sk.num_arrivals(b)} arrivals; the model counts "
                       "up to 255")
  pairs = _pairs(sk)
  nb, nc = max(sk.num_barriers, 1), max(sk.num_cells, 1)
  state = (f"bool no_race = false;   /* asserted where a check fails */\n"
           f"byte done[{nb}]; byte pend[{nb}]; byte tx[{nb}];\n"
           f"byte land[{nc}]; byte rd[{nc}]; bool filled[{nc}];\n"
           f"byte fly[{max(len(pairs), 1)}];\n\n")
  procs = "".join(
      f"proctype wg{w}() {{\n  byte seen[{nb}];\n"
      f"{_program(sk, prog, pairs, '  ')}}}\n\n"
      for w, prog in enumerate(sk.programs))
  init = ("init {\n  atomic {\n"
          + "".join(f"    pend[{b}] = {sk.num_arrivals(b)};\n"
                    for b in range(sk.num_barriers))
          + "".join(f"    run wg{w}();\n" for w in range(len(sk.programs)))
          + "  }\n}\n")
  return _header(sk, pairs) + state + _engine(sk, pairs) + procs + init


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


def is_plgpu_kernel(spec) -> bool:
  """Whether `spec` is a `plgpu.kernel`'s (its compiler params carry a
  Mesh)."""
  return getattr(spec.compiler_params, "mesh", None) is not None


def kernel_model(spec) -> str:
  """The Promela model of the `plgpu.kernel` of `spec` (a KernelSpec)."""
  return to_promela(skeleton(spec))


def verify_kernel(spec, **spin_args) -> Report:
  """SPIN's verdict on the protocol of the `plgpu.kernel` of `spec`; the
  model is written to `jax_pallas_dump_promela_to` when set."""
  text = kernel_model(spec)
  maybe_dump_text(text, spec.name)
  return verify_model(text, **spin_args)


def maybe_dump(spec) -> str | None:
  """Writes the model of a `plgpu.kernel` to `jax_pallas_dump_promela_to`
  when that option is set (the mosaic_gpu backend calls it on each kernel
  it lowers); returns the path. A kernel the model cannot follow gives a
  warning, never a failed lowering."""
  directory = config.dump_promela_to()
  if not directory or not is_plgpu_kernel(spec):
    return None
  try:
    text = kernel_model(spec)
  except Exception as e:  # noqa: BLE001 - a dump must not break lowering
    warnings.warn(f"jax_pallas_dump_promela_to: no Promela model for kernel "
                  f"{spec.name}: {e}", RuntimeWarning, stacklevel=2)
    return None
  return write_model(text, spec.name, directory)


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
