"""`python -m benchmarks --suite pallas-ops`: Pallas's own kernel library on
dsl's `interpret` backend beside Pallas's interpret mode.

Each op of `jax.experimental.pallas.ops` runs at the shapes of its cheap
case in benchmarks/pallas_library/cases.py (the ones
tests/pallas/test_pallas_ops.py checks): from its import-swapped copy on dsl's `interpret` backend, and, as
the peer, from Pallas's own source in Pallas's interpret mode (TPU ops under
`force_tpu_interpret_mode`, GPU ops with `interpret=True`). Both are
compiled ahead of time as functions of the case's arrays and take their
samples in alternating rounds (`dsl.tools.timing.run_interleaved`); `vs
Pallas` is dsl's time / Pallas's (lower is better). `check` compares the
two outputs at the case's tolerance. An op that fails on dsl, or whose peer
cannot run, says why in its row.

    python -m benchmarks --suite pallas-ops [--kernels tpu.matmul,gpu.softmax]
        [--repeats 5] [--stat min] [--json out.json]

`--json benchmarks/results/pallas-ops-cpu.json` rewrites the record that
docs/pallas-compat.md's table takes its `vs Pallas` column from.
"""
from __future__ import annotations

import dataclasses
import datetime
import json

import jax

from benchmarks import platform_info, report, sharding_runs
from benchmarks.usage_errors import UsageError
from benchmarks.pallas_library import cases, swap
from dsl.tools import timing

BACKEND = "interpret"


@dataclasses.dataclass
class Row:
  op: str
  dsl_s: float | None = None
  pallas_s: float | None = None
  dsl_note: str = ""          # why dsl has no time
  pallas_note: str = ""       # why the peer has no time
  check: str = "-"

  @property
  def ratio(self) -> float | None:
    if self.dsl_s is None or self.pallas_s is None:
      return None
    return self.dsl_s / self.pallas_s

  def as_dict(self) -> dict:
    return dict(dataclasses.asdict(self), ratio=self.ratio)


def _first_line(e: Exception) -> str:
  text = str(e).splitlines()[0] if str(e) else ""
  return f"{type(e).__name__}: {text}"[:160]


def _prepared(fn, args, context, *, trust_first, slow_s):
  with context:
    return timing.prepare(fn, args, slow_s=slow_s, trust_first=trust_first)


def measure(op: str, *, repeats: int, warmup: int, stat: str,
            slow_s: float, skip_slow_peers: bool) -> Row:
  """Times op `op` (a key of `cases.CASES`) on dsl's interpret
  backend and in Pallas's interpret mode."""
  row = Row(op)
  case = cases.make_case(op)
  ours = swap.swapped(cases.module_of(op))
  theirs = swap.original(cases.module_of(op))
  prepared = {}
  try:
    prepared["dsl"] = _prepared(
        lambda *a: case.run(ours, False, *a), case.args,
        cases.dsl_context(op, BACKEND), trust_first=False, slow_s=slow_s)
  except Exception as e:  # noqa: BLE001 -- the row says what failed
    row.dsl_note = f"error: {_first_line(e)}"
    return row
  if skip_slow_peers:
    row.pallas_note = "skipped: --skip-slow-peers"
  else:
    try:
      prepared["pallas"] = _prepared(
          lambda *a: case.run(theirs, True, *a), case.args,
          cases.pallas_context(op), trust_first=True, slow_s=slow_s)
    except Exception as e:  # noqa: BLE001
      why = cases.no_pallas(op)
      row.pallas_note = (f"n/a: {why}" if why is not None
                         else f"error: {_first_line(e)}")
  stats = timing.run_interleaved(prepared, case.args, warmup=warmup,
                                 repeats=repeats)
  row.dsl_s = stats["dsl"].value(stat)
  if "pallas" in stats:
    row.pallas_s = stats["pallas"].value(stat)
    row.check = _check(op, case, stats["dsl"].output, stats["pallas"].output)
  return row


def _check(op, case, ours, theirs) -> str:
  why = cases.no_pallas(op)
  if why is not None:
    return "n/a"
  try:
    cases.close(ours, theirs, case.tol, op)
  except AssertionError:
    return "MISMATCH"
  return "ok"


def _time(s: float | None, note: str) -> str:
  if s is None:
    return note or "-"
  return report.fmt_time(s)


def render(rows, meta) -> str:
  head = (f"{'op':<28} {'dsl interpret':>14} {'Pallas interpret':>17} "
          f"{'vs Pallas':>10}  check")
  lines = [f"Pallas's kernel library on dsl  {meta['date']}  "
           f"{meta['device']}  jax {meta['jax']}  repeats {meta['repeats']}, "
           f"{meta['stat']}", "", head, "-" * len(head)]
  notes = []
  for r in rows:
    cells = []
    for s, note in ((r.dsl_s, r.dsl_note), (r.pallas_s, r.pallas_note)):
      if s is None and note:
        notes.append(note)
        cells.append(f"[{len(notes)}]")
      else:
        cells.append(_time(s, note))
    ratio = "-" if r.ratio is None else report.fmt_ratio(r.ratio)
    lines.append(f"{r.op:<28} {cells[0]:>14} {cells[1]:>17} {ratio:>10}  "
                 f"{r.check}")
  lines += [""] + [f"[{k}] {n}" for k, n in enumerate(notes, 1)]
  lines.append("vs Pallas: dsl's time / Pallas's time (lower is better); "
               f"command: {meta['command']}")
  return "\n".join(lines)


def selected_ops(text: str | None) -> list[str]:
  """The ops `--kernels` names; by default every op but the `*_mgpu` ones
  (they run on the warpgroup interpreter, several not yet: name them to
  time those that do)."""
  ops = list(cases.CASES)
  if text is None:
    return [op for op in ops if not swap.is_mgpu(op)]
  chosen = [t.strip() for t in text.split(",")]
  unknown = [t for t in chosen if t not in ops]
  if unknown:
    raise UsageError(f"--kernels with --suite pallas-ops: unknown op(s) "
                     f"{', '.join(unknown)} (the ops: {', '.join(ops)})")
  return chosen


def _device() -> str:
  d = platform_info.describe()
  cores = f" ({d['cpu_count']} CPU cores)" if d["platform"] == "cpu" else ""
  return d["device_kind"] + cores


def run(args) -> int:
  sharding_runs.ensure_host_devices()     # tpu.all_gather runs on 4 of them
  ops = selected_ops(args.kernels)
  repeats = args.repeats or 5
  rows = [measure(op, repeats=repeats, warmup=args.warmup, stat=args.stat,
                  slow_s=args.single_run_after,
                  skip_slow_peers=args.skip_slow_peers) for op in ops]
  meta = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
          "device": _device(),
          "jax": jax.__version__, "repeats": repeats, "stat": args.stat,
          "command": "python -m benchmarks " + " ".join(args.argv)}
  print(render(rows, meta))
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump({"meta": meta, "rows": [r.as_dict() for r in rows]}, f,
                indent=1)
  bad = [r for r in rows if r.check == "MISMATCH"
         or r.dsl_note.startswith("error")]
  return 1 if bad else 0


def ratios(path: str) -> dict[str, float | None]:
  """op -> dsl / Pallas time, from a `--json` record of this suite."""
  with open(path, encoding="utf-8") as f:
    record = json.load(f)
  return {r["op"]: r["ratio"] for r in record["rows"]}

