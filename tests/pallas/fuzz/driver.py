"""Runs many cases in worker processes, so that a backend that kills the
process (a segfault, heap corruption, an abort) or hangs is recorded as a
crash of that case on that backend and the run goes on.

A worker (`python -m tests.pallas.fuzz --worker`) reads its job from stdin
as JSON and writes one `@@FUZZ {json}` line before each backend run and one
per finished case; anything else it prints is ignored. When it dies, the
driver records a crash for the backend it had started, and starts a new
worker on the rest of the batch.
"""
from __future__ import annotations

import collections
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time

from tests.pallas.fuzz.runner import COUNTED, ORACLE, CaseResult, run_case
from tests.pallas.testing import CPU_BACKENDS

MARK = "@@FUZZ "
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def _emit(obj) -> None:
  sys.stdout.write(MARK + json.dumps(obj) + "\n")
  sys.stdout.flush()


def _started(cid: str, backend: str) -> None:
  _emit(dict(event="start", case=cid, backend=backend))
  # a test of the driver kills one run, as a segfault would (no core file)
  if os.environ.get("DSL_FUZZ_ABORT") == f"{cid}:{backend}":
    os.kill(os.getpid(), signal.SIGKILL)


def worker_main() -> None:
  """The worker's loop: cases from the job on stdin, events on stdout."""
  from tests.pallas.fuzz.families import generate_case
  job = json.loads(sys.stdin.read())
  crashed = job.get("crashed", {})
  for seed, index in job["cases"]:
    cid = f"{seed}:{index}"
    try:
      case = generate_case(seed, index)
    except Exception as exc:  # a generator bug: reported, not fatal
      _emit(dict(event="result", result=CaseResult(
          cid, "?", [], {}, f"generator: {type(exc).__name__}: {exc}"
      ).to_json()))
      continue
    res = run_case(case, job["backends"], job["skip_known"],
                   on_start=lambda b: _started(cid, b),
                   crashed=crashed.get(cid))
    _emit(dict(event="result", result=res.to_json()))


def _tail(path: str, n: int = 3) -> str:
  try:
    with open(path, errors="replace") as f:
      lines = [l.strip() for l in f.read().splitlines() if l.strip()]
  except OSError:
    return ""
  return " | ".join(lines[-n:])[-400:]


def _run_worker(cases, job, timeout: float, results: list, current: list):
  """One worker process over `cases`; returns its exit code (None when
  killed for silence longer than `timeout`)."""
  with tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False) as err:
    errpath = err.name
  with open(errpath, "w") as err:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.pallas.fuzz", "--worker"], cwd=ROOT,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
  proc.stdin.write(json.dumps(dict(job, cases=cases)))
  proc.stdin.close()
  sel = selectors.DefaultSelector()
  sel.register(proc.stdout, selectors.EVENT_READ)
  rc = None
  while True:
    if not sel.select(timeout):
      proc.kill()
      proc.wait()
      break
    line = proc.stdout.readline()
    if not line:
      rc = proc.wait()
      break
    if not line.startswith(MARK):
      continue
    msg = json.loads(line[len(MARK):])
    if msg["event"] == "start":
      current[:] = [msg["case"], msg["backend"]]
    else:
      results.append(CaseResult.from_json(msg["result"]))
      current[:] = []
  proc.stdout.close()
  job["stderr_tail"] = _tail(errpath)
  os.unlink(errpath)
  return rc


def run_batch(ids, backends=CPU_BACKENDS, skip_known=True, timeout=300.0,
              progress=None) -> list[CaseResult]:
  """Runs the cases `ids` ((seed, index) pairs) in worker processes."""
  todo = [tuple(i) for i in ids]
  results: list[CaseResult] = []
  crashed: dict[str, dict[str, str]] = {}
  while todo:
    job = dict(backends=list(backends), skip_known=skip_known,
               crashed=crashed)
    got, current = [], []
    rc = _run_worker([list(t) for t in todo], job, timeout, got, current)
    results.extend(got)
    if progress:
      for r in got:
        progress(r)
    done = {r.case_id for r in got}
    todo = [t for t in todo if f"{t[0]}:{t[1]}" not in done]
    if not todo:
      break
    why = ("no output for %ds (killed)" % timeout if rc is None else
           f"process died (exit code {rc})")
    why += (": " + job["stderr_tail"]) if job.get("stderr_tail") else ""
    head = f"{todo[0][0]}:{todo[0][1]}"
    if current and current[0] == head:
      crashed.setdefault(head, {})[current[1]] = why
    else:   # died outside a backend run: give up on this case
      r = CaseResult(head, "?", [], {}, f"worker: {why}")
      results.append(r)
      if progress:
        progress(r)
      todo = todo[1:]
  return results


def run_in_process(ids, backends=CPU_BACKENDS, skip_known=True):
  """The same without workers (a dying backend ends the caller too)."""
  from tests.pallas.fuzz.families import generate_case
  return [run_case(generate_case(s, i), backends, skip_known) for s, i in ids]


# ---- the summary

FAILING = ("disagree", "crash")


def counts(results) -> dict[str, collections.Counter]:
  table = collections.defaultdict(collections.Counter)
  for r in results:
    for b, o in r.outcomes.items():
      table[b][o.status] += 1
  return table


def failures(results) -> list[tuple[str, str, str, str]]:
  """(case id, backend, status, detail) of every disagreement and crash."""
  out = []
  for r in results:
    if r.error:
      out.append((r.case_id, "-", "error", r.error))
    for b, o in r.outcomes.items():
      if o.status in FAILING and b != ORACLE:
        out.append((r.case_id, b, o.status, o.detail))
  return out


def oracle_reports(results) -> list[tuple[str, str, str]]:
  """Cases where Pallas itself differs from the reference or fails."""
  return [(r.case_id, o.status, o.detail) for r in results
          for b, o in r.outcomes.items()
          if b == ORACLE and o.status not in ("agree", "skipped")]


def summary(results, elapsed: float | None = None) -> str:
  table = counts(results)
  rows = [f"{len(results)} cases" + (f" in {elapsed:.0f}s" if elapsed else "")]
  table.pop("reference", None)
  width = max(len(b) for b in table) if table else 10
  rows.append(" " * (width + 2) + "".join(f"{s:>10}" for s in COUNTED))
  secs = collections.Counter()
  for r in results:
    for b, o in r.outcomes.items():
      secs[b] += o.seconds
  rows[-1] += f"{'seconds':>10}"
  for b in [ORACLE] + list(CPU_BACKENDS):
    if b in table:
      rows.append(f"{b:<{width + 2}}" + "".join(
          f"{table[b][s]:>10}" for s in COUNTED) + f"{secs[b]:>10.0f}")
  rows.append(f"reference: {secs['reference']:.0f}s")
  skips = collections.Counter(o.detail for r in results
                              for o in r.outcomes.values()
                              if o.status == "skipped")
  if skips:
    rows.append("skipped (KNOWN_FAILURES):")
    rows += [f"  {n:4d}  {why}" for why, n in skips.most_common()]
  fails = failures(results)
  if fails:
    rows.append("failures (rerun one with --case SEED:INDEX):")
    rows += [f"  {cid:>10} {b:<17} {s:<8} {d}" for cid, b, s, d in fails]
  orc = oracle_reports(results)
  if orc:
    rows.append("Pallas differs from the reference or fails (a generator "
                "bug or a Pallas quirk; not counted against our backends):")
    rows += [f"  {cid:>10} {s:<8} {d}" for cid, s, d in orc]
  return "\n".join(rows)
