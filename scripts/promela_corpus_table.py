#!/usr/bin/env python
"""Runs the verification corpus (benchmarks/promela_corpus.py) and
prints the table of docs/verification.md: per kernel, the kind SPIN
reported, the states it explored and the time it took.

    .venv/bin/python scripts/promela_corpus_table.py            # markdown table
    .venv/bin/python scripts/promela_corpus_table.py --json     # one JSON per line
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
flag = "--xla_force_host_platform_device_count"
if flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {flag}=8"
                             ).strip()


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--json", action="store_true")
  ap.add_argument("-k", default="", help="only cases whose name contains this")
  a = ap.parse_args(argv)

  import lowering_mosaic.verify as verify
  from benchmarks.promela_corpus import CORPUS

  rows = []
  for case in CORPUS:
    if a.k and a.k not in case.name:
      continue
    f, args = case.build()
    t0 = time.perf_counter()
    rep = verify(f, *args, timeout_s=300)
    wall = time.perf_counter() - t0
    row = dict(case=case.name, devices=case.devices, bug=case.bug,
               expected=case.expected, kind=rep.kind,
               caught=rep.kind == case.expected, states=rep.states,
               transitions=rep.transitions, depth=rep.depth,
               search_s=round(rep.search_s, 3), spin_s=round(rep.time_s, 3),
               wall_s=round(wall, 3), line=rep.error_line)
    rows.append(row)
    if a.json:
      print(json.dumps(row), flush=True)

  if not a.json:
    print("| kernel | devices | expected | reported | states | transitions "
          "| depth | search (s) | SPIN total (s) |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
      mark = "" if r["caught"] else " **MISSED**"
      print(f"| {r['case']} | {r['devices']} | {r['expected']} | "
            f"{r['kind']}{mark} | {r['states']} | {r['transitions']} | "
            f"{r['depth']} | {r['search_s']:.2f} | {r['spin_s']:.2f} |")
    good = [r for r in rows if r["expected"] == "ok"]
    bad = [r for r in rows if r["expected"] != "ok"]
    print()
    print(f"correct kernels verified ok: {sum(r['caught'] for r in good)}/"
          f"{len(good)}; broken variants caught with the right kind: "
          f"{sum(r['caught'] for r in bad)}/{len(bad)}; SPIN time in all: "
          f"{sum(r['spin_s'] for r in rows):.1f} s")
  return 0 if all(r["caught"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
