"""`python -m benchmarks.gpu_check` (`make gpu-check`): the one GPU check.

Runs the phases of `phases.PHASES` (each a process with its own time budget),
writes one record per run into benchmarks/results/, prints the rows more
than 10% slower than the last record of the same device kind, refreshes
the shipped GPU defaults from the run's winners (on by default), and ends
with a summary table. Exit status: 0 when every phase ran and passed, 1
when a phase failed or ran out of time, 2 on bad arguments or no GPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import time

from benchmarks.gpu_check import phases, record, refresh, summary

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m benchmarks.gpu_check", description=__doc__.split(
          "\n\n")[0].split(": ", 1)[-1])
  p.add_argument("--plan", action="store_true", help="print the phases, "
                 "their commands and budgets, then exit (no GPU needed)")
  p.add_argument("--only", help="comma-separated phases to run "
                 f"({', '.join(phases.NAMES)})")
  p.add_argument("--skip", help="comma-separated phases to leave out")
  p.add_argument("--update-defaults", action=argparse.BooleanOptionalAction,
                 default=True, help="refresh dsl/tools/data/gpu_configs.json and "
                 "gpu_backends.json from this run's winners (default: on)")
  p.add_argument("--results", default=record.RESULTS, metavar="DIR",
                 help="where records go (default benchmarks/results)")
  p.add_argument("--out", default=None, metavar="DIR", help="the phases' "
                 "raw outputs and logs (default out/gpu_check/<time>)")
  p.add_argument("--replay", metavar="RECORD", help="no run: compare this "
                 "record with the one before it and (with --update-defaults)"
                 " refresh the tables from it; no GPU needed")
  return p


def _names(text):
  return [t.strip() for t in text.split(",") if t.strip()] if text else None


def _git(*args) -> str:
  try:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=30).stdout.strip()
  except (OSError, subprocess.TimeoutExpired):
    return ""


def environment() -> dict:
  """Device, versions and commit: the record's head."""
  import jax  # noqa: PLC0415 - imported only when a check runs
  from benchmarks import platform_info  # noqa: PLC0415 - imports jax
  d = jax.devices()[0]
  cc = getattr(d, "compute_capability", None)
  versions = {p: platform_info.version(p) for p in (
      "jax", "jaxlib", "triton", "jax-cuda12-plugin", "jax-cuda13-plugin")}
  versions["python"] = sys.version.split()[0]
  return {
      "device_kind": d.device_kind if d.platform != "cpu" else "cpu",
      "device": {"platform": jax.default_backend(), "device_kind":
                 d.device_kind, "compute_capability": str(cc) if cc else None,
                 "device_count": jax.device_count()},
      "versions": versions,
      "commit": {"sha": _git("rev-parse", "HEAD"), "branch": _git(
          "rev-parse", "--abbrev-ref", "HEAD"),
          "dirty": bool(_git("status", "--porcelain", "--untracked-files=no"))},
  }


def no_gpu_message(platform: str) -> str:
  return (f"gpu_check: no GPU: JAX runs on the {platform}. This check "
          "measures the GPU backends and needs an NVIDIA GPU with JAX's CUDA "
          "plugin: on such a machine `make run` or `bash scripts/setup.sh` "
          "installs it (see README, 'On a GPU'). `--plan` shows what it "
          "would run.")


def run_phase(phase: phases.Phase, out_dir: str) -> dict:
  """Runs one phase in its own process group, stopped at its budget."""
  log = os.path.join(out_dir, f"{phase.name}.log")
  cmd = phase.command(out_dir)
  start = time.monotonic()
  with open(log, "w") as f:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=phase.environment(out_dir),
                            stdout=f, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
      rc = proc.wait(timeout=phase.budget_s)
      status = "ok" if rc == 0 else "failed"
    except subprocess.TimeoutExpired:
      try:
        os.killpg(proc.pid, 9)     # the phase and what it started
      except ProcessLookupError:   # it ended in between
        pass
      proc.wait()
      rc, status = None, "timeout"
  with open(log, errors="replace") as f:
    tail = f.read()[-2000:]
  return {"status": status, "returncode": rc, "budget_s": phase.budget_s,
          "wall_s": round(time.monotonic() - start, 1), "log": log,
          "command": shlex.join(["python"] + cmd[1:]), "tail": tail}


def collect(phase: phases.Phase, result: dict, out_dir: str, rec: dict) -> None:
  """Adds a finished phase's rows (or test counts) to the record."""
  path = os.path.join(out_dir, phase.output) if phase.output else None
  if path is None or not os.path.exists(path):
    result.setdefault("note", "no output")
    return
  try:
    if phase.name == "tests":
      rec["tests"] = record.tests_of_junit(path)
      return
    rows, about = record.rows_of(phase.name, path)
  except Exception as e:  # noqa: BLE001 - a malformed output is a finding
    result["note"] = f"unreadable output: {type(e).__name__}: {e}"
    return
  rec["rows"].extend(rows)
  result["rows"] = len(rows)
  result.update(about)


def run(args) -> int:
  chosen = phases.select(_names(args.only), _names(args.skip))
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  out_dir = os.path.abspath(args.out or os.path.join(ROOT, "out", "gpu_check",
                                                     stamp))
  if args.plan:
    print(phases.describe(chosen, out_dir))
    return 0
  if args.replay:
    return replay(args)
  import jax  # noqa: PLC0415 - not needed for --plan
  if jax.default_backend() != "gpu":
    print(no_gpu_message(jax.default_backend()), file=sys.stderr)
    return 2
  os.makedirs(out_dir, exist_ok=True)
  rec = {"format": record.FORMAT, "kind": "dsl gpu check",
         "date": datetime.datetime.now().isoformat(timespec="seconds"),
         "command": "python -m benchmarks.gpu_check " + shlex.join(
             args.argv), "phases": {}, "rows": [], **environment()}
  print(f"gpu_check: {rec['device_kind']}, commit "
        f"{rec['commit']['sha'][:10]}; outputs in {out_dir}", flush=True)
  for phase in chosen:
    print(f"gpu_check: {phase.name} (budget {phase.budget_s} s) ...",
          flush=True)
    result = run_phase(phase, out_dir)
    collect(phase, result, out_dir, rec)
    rec["phases"][phase.name] = result
    print(f"gpu_check: {phase.name}: {result['status']} in "
          f"{result['wall_s']} s", flush=True)
  return finish(args, rec)


def finish(args, rec: dict) -> int:
  previous = record.last_record(rec["device_kind"], args.results,
                                before=rec["date"])
  slower = record.compare(rec, previous)
  changes = []
  if args.update_defaults:
    changes = refresh.refresh(rec)
  rec["refreshed"] = changes
  path = record.write(rec, args.results) if not args.replay else args.replay
  print(summary.render(rec, previous, slower, changes, path,
                       args.update_defaults))
  bad = [n for n, p in rec["phases"].items() if p["status"] != "ok"]
  return 1 if bad else 0


def replay(args) -> int:
  try:
    with open(args.replay) as f:
      rec = json.load(f)
  except (OSError, ValueError) as e:
    print(f"gpu_check: error: --replay {args.replay}: {e}", file=sys.stderr)
    return 2
  if not isinstance(rec, dict) or rec.get("format") != record.FORMAT:
    print(f"gpu_check: {args.replay} is not a format-{record.FORMAT} gpu "
          "check record", file=sys.stderr)
    return 2
  return finish(args, rec)


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = build_parser()
  try:
    args = parser.parse_args(argv)
    args.argv = argv
    return run(args)
  except phases.PlanError as e:
    print(f"gpu_check: error: {e}", file=sys.stderr)
    return 2
  except SystemExit as e:          # argparse: usage errors exit 2
    return int(e.code or 0)
