"""python -m tests.pallas.fuzz --seed S --n N   (see docs/fuzzing.md)"""
from __future__ import annotations

import argparse
import json
import sys
import time


def _parse_case(text: str) -> tuple[int, int]:
  seed, _, index = text.partition(":")
  return int(seed), int(index)


def _show_case(cid, backends, skip_known, verbose) -> int:
  from tests.pallas.fuzz.families import generate_case
  from tests.pallas.fuzz.runner import ORACLE, run_backend, run_case
  case = generate_case(*cid)
  print(case.describe())
  if verbose:
    for b in (ORACLE,) + tuple(backends):
      try:
        run_backend(case, b)
      except Exception:
        import traceback
        print(f"--- {b} raised:")
        traceback.print_exc()
  res = run_case(case, backends, skip_known)
  if res.error:
    print("error:", res.error)
  for b, o in res.outcomes.items():
    print(f"{b:<18} {o.status:<10} {o.detail}")
  bad = [o for b, o in res.outcomes.items()
         if b != ORACLE and o.status in ("disagree", "crash")]
  return 1 if bad or res.error else 0


def main(argv=None) -> int:
  from tests.pallas.fuzz import driver
  from tests.pallas.testing import CPU_BACKENDS
  ap = argparse.ArgumentParser(
      prog="python -m tests.pallas.fuzz",
      description="Differential fuzzer: random kernels on every CPU backend, "
                  "Pallas's interpret mode and a numpy reference.")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--n", type=int, default=100, help="number of cases")
  ap.add_argument("--start", type=int, default=0, help="first case index")
  ap.add_argument("--case", help="run one case, SEED:INDEX, in this process "
                  "and print it")
  ap.add_argument("--backends", default=",".join(CPU_BACKENDS),
                  help="comma-separated dsl backends (default: all CPU ones)")
  ap.add_argument("--all", action="store_true",
                  help="also run the KNOWN_FAILURES combinations")
  ap.add_argument("--batch", type=int, default=100,
                  help="cases per worker process")
  ap.add_argument("--timeout", type=float, default=300,
                  help="seconds of silence before a worker is killed")
  ap.add_argument("--json", help="write every case's outcomes to this file")
  ap.add_argument("--verbose", action="store_true",
                  help="with --case: print the tracebacks of failures")
  ap.add_argument("--minimize", metavar="BACKEND",
                  help="with --case: shrink the case while BACKEND still "
                  "fails on it, and print the smallest one")
  ap.add_argument("--quiet", action="store_true", help="no progress dots")
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    driver.worker_main()
    return 0
  backends = tuple(b for b in args.backends.split(",") if b)
  if args.case and args.minimize:
    from tests.pallas.fuzz.families import generate_case
    from tests.pallas.fuzz.minimize import minimize
    try:
      small = minimize(generate_case(*_parse_case(args.case)), args.minimize)
    except ValueError as exc:
      print(exc)
      return 1
    print(small.describe())
    return 0
  if args.case:
    return _show_case(_parse_case(args.case), backends, not args.all,
                      args.verbose)
  ids = [(args.seed, i) for i in range(args.start, args.start + args.n)]
  results, t0 = [], time.time()

  def progress(r):
    if not args.quiet:
      bad = r.error or any(o.status in driver.FAILING
                           for b, o in r.outcomes.items() if b != "pallas")
      sys.stderr.write("F" if bad else ".")
      sys.stderr.flush()

  for k in range(0, len(ids), args.batch):
    results += driver.run_batch(ids[k:k + args.batch], backends, not args.all,
                                args.timeout, progress)
  if not args.quiet:
    sys.stderr.write("\n")
  print(driver.summary(results, time.time() - t0))
  if args.json:
    with open(args.json, "w") as f:
      json.dump([r.to_json() for r in results], f, indent=1)
  return 1 if driver.failures(results) else 0


if __name__ == "__main__":
  sys.exit(main())
