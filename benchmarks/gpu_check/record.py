"""One GPU check run as a record: the device, versions, commit, each phase's
outcome and every row its benchmarks printed, in one JSON file per run
under `benchmarks/results/`; and the comparison with the last record of the
same device kind.

A row is `{"id", "phase", "kernel", "impl", "backend", "size", "dtype",
"config", "time_s", "value", "unit", "ok", "note"}`: `id` names the same
measurement across runs (phase, benchmark, implementation and config);
`time_s` is seconds per call (None where the benchmark gives a rate only,
then `value`/`unit` carry it).
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
import xml.etree.ElementTree as ET

FORMAT = 1
SLOWER = 1.10            # a row this much slower than last time is flagged
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "results")


def _num(x):
  return None if x is None or (isinstance(x, float) and not math.isfinite(x)) \
      else float(x)


def _row(phase, name, impl, *, time_s=None, value=None, unit="", ok=True,
         note="", **fields) -> dict:
  row = {"id": f"{phase}|{name}|{impl}", "phase": phase, "impl": impl,
         "time_s": _num(time_s), "value": _num(value), "unit": unit,
         "ok": bool(ok), "note": note or ""}
  row.update(fields)
  return row


# ------------------------------------------------------------ phase outputs

def rows_of_triton(data: list) -> list[dict]:
  """benchmarks/gpu_triton.py --json: one row per benchmark x impl x
  config."""
  out = []
  for r in data:
    name = f"{r['bench']}" + (f" {r['config']}" if r.get("config") else "")
    t = _num(r.get("ms"))
    out.append(_row("triton", name, r["impl"], time_s=t and t / 1e3,
                    value=r.get("value"), unit=r.get("unit", ""),
                    ok=t is not None, note=r.get("note", ""),
                    kernel=r.get("kernel"), size=r.get("size"),
                    dtype=r.get("dtype"), config=r.get("cfg")))
  return out


def rows_of_attention(data: dict) -> list[dict]:
  """python -m benchmarks.gpu_attention --json: attention (ours, Pallas,
  cuDNN) and row kernels, plus the copy it measured."""
  out = [_row("attention", "copy 1 GiB", "xla", value=data.get("copy_GBps"),
              unit="GB/s")]
  for r in data.get("attention", []):
    name = f"flash_attention {r['mode']} seq={r['seq']}"
    for impl, key, note in (("ours", "ours_ms", "error"),
                            ("ours mosaic_gpu", "mosaic_gpu_ours_ms",
                             "mosaic_gpu_error"),
                            ("pallas", "pallas_ms", "pallas_note"),
                            ("cudnn", "cudnn_ms", "cudnn_note")):
      if key not in r:
        continue
      t = _num(r.get(key))
      out.append(_row("attention", name, impl, time_s=t and t / 1e3,
                      ok=t is not None, note=r.get(note) or "",
                      kernel="kernels.flash_attention", dtype="bfloat16"))
  for r in data.get("rowwise", []):
    shape = "x".join(str(d) for d in r["shape"])
    t = _num(r.get("ms"))
    out.append(_row("attention", f"{r['kernel']} {shape}", "ours",
                    time_s=t and t / 1e3, value=r.get("GB/s"), unit="GB/s",
                    ok=t is not None, note=r.get("error") or "",
                    kernel=f"kernels.{r['kernel']}", size=shape,
                    dtype="bfloat16"))
  return out


def rows_of_cli(phase: str, data: dict) -> list[dict]:
  """python -m benchmarks --json: dsl's row and each peer's."""
  out = []
  for r in data.get("rows", []):
    name = f"{r['kernel']} {r['size']} {r['dtype']} {r['backend']}"
    common = dict(kernel=r["kernel"], backend=r["backend"], size=r["size"],
                  dtype=r["dtype"])
    cell = r["dsl"]
    row = _row(phase, name, "dsl", time_s=cell.get("median_s"),
               value=r.get("throughput"), unit=r.get("throughput_unit", ""),
               ok=r.get("check") == "ok", note=cell.get("note") or "",
               config=r.get("shown_config", r.get("config")),
               config_source=r.get("config_source"), check=r.get("check"),
               **common)
    if r.get("autotune"):
      row["tuning"] = r["autotune"]
    out.append(row)
    for peer, pc in r.get("peers", {}).items():
      out.append(_row(phase, name, peer, time_s=pc.get("median_s"),
                      ok=pc.get("median_s") is not None,
                      note=pc.get("note") or "", **common))
  return out


def tests_of_junit(path: str) -> dict:
  """Counts and failing test ids from pytest's --junitxml."""
  root = ET.parse(path).getroot()
  suites = [root] if root.tag == "testsuite" else list(root)
  counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
  failed = []
  for s in suites:
    for k in counts:
      counts[k] += int(s.get(k, 0))
    for case in s.iter("testcase"):
      if case.find("failure") is not None or case.find("error") is not None:
        failed.append(f"{case.get('classname')}::{case.get('name')}")
  counts["passed"] = (counts["tests"] - counts["failures"] - counts["errors"]
                      - counts["skipped"])
  counts["failed"] = failed
  return counts


def rows_of(phase: str, path: str) -> tuple[list[dict], dict]:
  """A phase's rows and what else it says about the run (the benchmark
  CLI's measured peak and notes on it)."""
  with open(path) as f:
    data = json.load(f)
  if phase == "triton":
    return rows_of_triton(data), {}
  if phase == "attention":
    return rows_of_attention(data), {}
  meta = data.get("meta", {})
  return rows_of_cli(phase, data), {"peak": meta.get("peak"),
                                    "peak_notes": meta.get("peak_notes", [])}


# ------------------------------------------------------------ files

def slug(text: str) -> str:
  return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def path_for(record: dict, results: str = RESULTS) -> str:
  stamp = record["date"].replace(":", "").replace("-", "").replace("T", "-")
  return os.path.join(results, f"{stamp}-{slug(record['device_kind'])}.json")


def write(record: dict, results: str = RESULTS) -> str:
  os.makedirs(results, exist_ok=True)
  path = path_for(record, results)
  with open(path, "w") as f:
    json.dump(record, f, indent=1, sort_keys=True)
    f.write("\n")
  return path


def last_record(device_kind: str, results: str = RESULTS,
                before: str | None = None) -> dict | None:
  """The latest record of `device_kind` (dated before `before`, if given)."""
  found = []
  for path in glob.glob(os.path.join(results, "*.json")):
    try:
      with open(path) as f:
        rec = json.load(f)
    except (OSError, ValueError):
      continue
    if (isinstance(rec, dict) and rec.get("format") == FORMAT
        and rec.get("device_kind") == device_kind
        and (before is None or rec.get("date", "") < before)):
      found.append(rec)
  return max(found, key=lambda r: r["date"]) if found else None


# ------------------------------------------------------------ comparison

def slowdown(new: dict, old: dict) -> float | None:
  """How many times slower `new` ran than `old` (> 1: slower): by time per
  call, else by rate; None when they cannot be compared."""
  if not (new.get("ok") and old.get("ok")):
    return None
  if new.get("time_s") and old.get("time_s"):
    return new["time_s"] / old["time_s"]
  if new.get("value") and old.get("value") and new.get("unit") == \
      old.get("unit"):
    return old["value"] / new["value"]
  return None


def compare(record: dict, previous: dict | None, threshold: float = SLOWER
            ) -> list[dict]:
  """Rows more than `threshold` times slower than in `previous`, slowest
  first: `{"id", "now", "before", "slowdown", "impl"}`."""
  if previous is None:
    return []
  old = {r["id"]: r for r in previous.get("rows", [])}
  out = []
  for r in record.get("rows", []):
    o = old.get(r["id"])
    s = o and slowdown(r, o)
    if s is not None and s > threshold:
      out.append({"id": r["id"], "impl": r["impl"], "slowdown": s,
                  "now": r.get("time_s") or r.get("value"),
                  "before": o.get("time_s") or o.get("value"),
                  "unit": "s" if r.get("time_s") else r.get("unit", "")})
  return sorted(out, key=lambda d: -d["slowdown"])
