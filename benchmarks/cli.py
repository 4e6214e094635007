"""`python -m benchmarks` / `dsl-bench`: time dsl kernels beside their peers.

    python -m benchmarks --list
    python -m benchmarks --quick                      # the README's main command
    python -m benchmarks --kernels add,matmul --sizes 1M,4M --backends interpret
    python -m benchmarks --kernels matmul --sizes 512 --autotune --json out.json
    python -m benchmarks --sharding                   # 8 host devices
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time

from benchmarks.usage_errors import UsageError

DTYPES = ("float32", "bfloat16", "float16")


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
  p = _Parser(prog="dsl-bench", description=(
      "Benchmark dsl kernels against XLA, jax.experimental.pallas and (on "
      "GPUs) hand-written Triton, in the same run."))
  p.add_argument("--list", action="store_true",
                 help="list kernels, backends and peers, then exit")
  p.add_argument("--quick", action="store_true",
                 help="the quick suite (under two minutes on a 2-core CPU), "
                 "including the interpret-speed cases beside Pallas")
  p.add_argument("--sharding", action="store_true",
                 help="a kernel partitioned by a sharded jax.jit beside the "
                 "same kernel in shard_map and the replicated run, on 8 host "
                 "devices (--kernels softmax,layer_norm, --sizes, --backends "
                 "apply)")
  p.add_argument("--suite", choices=("pallas-ops",), help="run a named "
                 "suite instead of the kernels: pallas-ops times each op of "
                 "Pallas's kernel library (jax.experimental.pallas.ops, "
                 "import-swapped onto dsl) on dsl's interpret backend beside "
                 "Pallas's interpret mode (--kernels picks ops; --repeats, "
                 "--warmup, --stat, --single-run-after, --skip-slow-peers "
                 "and --json apply)")
  p.add_argument("--kernels", help="comma-separated kernel names (see --list)")
  p.add_argument("--kernel", metavar="MODULE:FUNCTION",
                 help="benchmark your own kernel function instead of the "
                 "suite (mypkg.mymod:fn or path/to/file.py:fn); with --inputs")
  p.add_argument("--inputs", metavar="SHAPES", help="with --kernel: its "
                 "argument shapes, e.g. 'f32[4096,1024],f32[1024]'")
  p.add_argument("--reference", metavar="MODULE:FUNCTION", help="with "
                 "--kernel: a plain-jnp function of the same inputs, timed "
                 "as the XLA column and used to check the outputs")
  p.add_argument("--sizes", help="comma-separated sizes, dims joined by 'x', "
                 "K/M/G suffixes: 4M, 1024, 512x256x1024, 4096x1024")
  p.add_argument("--backends", help="comma-separated dsl backends "
                 "(default: the platform's, interpret on CPU)")
  p.add_argument("--dtype", default=None, choices=DTYPES,
                 help="input dtype of the suite's kernels (default float32)")
  p.add_argument("--config", help="override kernel parameters, e.g. "
                 "block=4096 or bm=64,bn=64,bk=256,variant=loop_k")
  p.add_argument("--repeats", type=int, default=None,
                 help="timed samples per implementation (default 5; 10 with "
                 "--quick)")
  p.add_argument("--warmup", type=int, default=1,
                 help="warm-up calls before timing (default 1)")
  p.add_argument("--stat", choices=("median", "min"), default="median",
                 help="the statistic behind times and ratios (default median; "
                 "min is steadier on a noisy machine)")
  p.add_argument("--single-run-after", type=float, default=1.0,
                 metavar="SECONDS", help="a call slower than this is the only "
                 "measurement of its implementation: one run, no repeats "
                 "(Pallas interpret: its first call; others: the second; "
                 "default 1)")
  p.add_argument("--skip-slow-peers", action="store_true",
                 help="skip Pallas interpret-mode peers that would take "
                 "seconds (large grids over large operands)")
  p.add_argument("--autotune", action="store_true",
                 help="search block sizes (and num_warps/num_stages on GPU) per "
                 "kernel and size; winners are cached on disk and reused")
  p.add_argument("--retune", action="store_true",
                 help="with --autotune: search again even if cached")
  p.add_argument("--tune-repeats", type=int, default=3)
  p.add_argument("--tune-budget", type=float, default=None, metavar="SECONDS",
                 help="with --autotune: start no new candidate after this "
                 "many seconds per row (the current config is timed first)")
  p.add_argument("--peak", choices=("auto", "on", "off"), default="auto",
                 help="measure the device peak (a large matmul and a copy) for "
                 "the %%peak column; auto: on GPUs and TPUs, not on CPUs")
  p.add_argument("--json", metavar="PATH", help="write results as JSON")
  p.add_argument("--csv", metavar="PATH", help="write results as CSV")
  p.add_argument("--plot", metavar="PATH", help="write a PNG chart of ratios")
  p.add_argument("--progress", choices=("auto", "always", "never"),
                 default="auto", help="progress bar on stderr (auto: on a "
                 "terminal, once the run lasts over 2 s)")
  return p


# ------------------------------------------------------------------ listing

def list_text() -> str:
  from benchmarks import platform_info, sizes
  from benchmarks.suite import all_kernels
  plat = platform_info.platform()
  lines = ["kernels:"]
  for k in all_kernels():
    reason = k.unavailable()
    if reason:
      lines.append(f"  {k.name:<24} unavailable: {reason}")
      continue
    szs = ", ".join(sizes.label(s) for s in k.default_sizes(plat))
    lines.append(f"  {k.name:<24} {k.summary}")
    lines.append(f"  {'':<24} sizes: {k.dims_doc}; default {szs}")
  lines.append("backends (dsl):")
  for b in platform_info.DSL_BACKENDS:
    reason = platform_info.backend_unavailable(b)
    mark = "available" if reason is None else f"unavailable: {reason}"
    default = " (default)" if b == platform_info.default_backend() else ""
    lines.append(f"  {b:<24} {mark}{default}")
  lines.append("peers:")
  lines.append(f"  {'xla':<24} plain jax.numpy, always")
  for mode in ("interpret", "triton", "mosaic", "mosaic_gpu"):
    reason = platform_info.pallas_unavailable(mode)
    lines.append(f"  {'pallas ' + mode:<24} "
                 f"{'available' if reason is None else reason}")
  lines.append(f"  {'triton (hand-written)':<24} "
               f"{'GPU only' if not platform_info.has_gpu() else 'needs jax-triton'}")
  return "\n".join(lines)


# ------------------------------------------------------------------ selection

def _split(text: str, what: str) -> list[str]:
  items = [t.strip() for t in text.split(",")]
  if not text.strip() or any(not t for t in items):
    raise UsageError(f"malformed --{what} {text!r}: expected comma-separated "
                     "names")
  return items


def select_kernels(args):
  from benchmarks.suite import all_kernels
  known = {k.name: k for k in all_kernels()}
  if args.kernels is None:
    chosen = [k for k in known.values() if k.unavailable() is None]
    skipped = [k for k in known.values() if k.unavailable() is not None]
    return chosen, skipped
  out = []
  for name in _split(args.kernels, "kernels"):
    k = known.get(name)
    if k is None and f"kernels.{name}" in known and name not in known:
      k = known[f"kernels.{name}"]
    if k is None:
      raise UsageError(f"unknown kernel {name!r}; choose from "
                       f"{', '.join(known)} (see --list)")
    if k.unavailable():
      raise UsageError(f"kernel {k.name!r} is unavailable: {k.unavailable()}")
    if k not in out:
      out.append(k)
  return out, []


def select_backends(args, quick: bool) -> list[str]:
  from benchmarks import platform_info
  if args.backends is None:
    names = [platform_info.default_backend()]
    if quick and platform_info.platform() != "cpu":
      names.append("interpret")
    usable = [b for b in names if platform_info.backend_unavailable(b) is None]
    if not usable:
      raise UsageError(platform_info.backend_unavailable(names[0]))
    return usable
  names = _split(args.backends, "backends")
  for b in names:
    reason = platform_info.backend_unavailable(b)
    if reason:
      raise UsageError(reason)
  return list(dict.fromkeys(names))


def parse_config(text: str | None) -> dict:
  if not text:
    return {}
  out = {}
  for item in _split(text, "config"):
    if "=" not in item:
      raise UsageError(f"malformed --config item {item!r}: expected key=value")
    k, v = (s.strip() for s in item.split("=", 1))
    if not k or not v:
      raise UsageError(f"malformed --config item {item!r}: expected key=value")
    try:
      out[k] = int(v)
    except ValueError:
      parts = v.lower().split("x")
      if len(parts) > 1 and all(p.isdigit() for p in parts):
        out[k] = [int(p) for p in parts]     # block_sizes=128x128x256
      else:
        out[k] = v
  return out


def kernel_backends(args, bench, backends, platform: str) -> list[str]:
  """The backends of one kernel's rows: on a GPU without --backends, a
  kernel of kernels/ runs on the backend it picks itself for backend=None
  (the shipped choice for this device) instead of the platform's."""
  choice = getattr(bench, "auto_backend", None)
  if args.backends is not None or platform != "gpu" or choice is None:
    return backends
  picked = choice()
  if picked is None:
    return backends
  from benchmarks import platform_info
  default = platform_info.default_backend()
  return list(dict.fromkeys(picked.backend if b == default else b
                            for b in backends))


def _check_overrides(bench, size, backend, platform, overrides) -> None:
  allowed = set(bench.default_config(size, backend, platform))
  if bench.tunable:
    for c in bench.search_space(size, backend, platform):
      allowed |= set(c)
  unknown = sorted(set(overrides) - allowed)
  if unknown:
    raise UsageError(f"--config key(s) {', '.join(unknown)} do not "
                     f"apply to kernel '{bench.name}' (its parameters: "
                     f"{', '.join(sorted(allowed)) or 'none'})")


def build_cases(args, kernels, backends, quick):
  from benchmarks import platform_info, sizes
  from benchmarks.runner import Case
  import jax.numpy as jnp
  plat = platform_info.platform()
  user_sizes = sizes.parse_sizes(args.sizes) if args.sizes is not None else None
  overrides = parse_config(args.config)
  dtype = jnp.dtype(args.dtype)
  cases = []
  for k in kernels:
    if user_sizes is not None:
      szs = [k.normalize(s) for s in user_sizes]
    else:
      szs = k.quick_sizes(plat) if quick else k.default_sizes(plat)
    for s in szs:
      for b in kernel_backends(args, k, backends, plat):
        config, source = k.chosen_config(s, b, plat, dtype)
        if overrides:
          _check_overrides(k, s, b, plat, overrides)
          config = k.fix_config(s, {**config, **overrides}, dtype)
          source = "--config"
        cases.append(Case(k, s, b, config, source,
                          shown=k.shown_config(s, b, dtype, config)))
  return cases


# ------------------------------------------------------------------ main

def _check_output_path(path, flag):
  if path is None:
    return
  parent = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(parent):
    raise UsageError(f"{flag} {path}: directory {parent} does not exist")


def check_args(args) -> None:
  """Fills the defaults that depend on other flags and rejects bad flags,
  before anything slow is imported or run."""
  if args.repeats is None:
    args.repeats = 10 if args.quick else 5
  if args.repeats < 1:
    raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
  if args.warmup < 0:
    raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
  if args.retune and not args.autotune:
    raise UsageError("--retune needs --autotune")
  if args.tune_budget is not None and not args.autotune:
    raise UsageError("--tune-budget needs --autotune")
  if args.tune_budget is not None and args.tune_budget <= 0:
    raise UsageError(f"--tune-budget must be > 0, got {args.tune_budget}")
  check_user_args(args)
  args.dtype = args.dtype or "float32"
  for path, flag in ((args.json, "--json"), (args.csv, "--csv"),
                     (args.plot, "--plot")):
    _check_output_path(path, flag)
  if args.plot:
    try:
      import matplotlib  # noqa: F401
    except ImportError:
      raise UsageError("--plot needs matplotlib (pip install matplotlib)")


def check_user_args(args) -> None:
  """--kernel, --inputs and --reference go together, without the suite's
  selection flags."""
  if args.kernel is None:
    for flag, value in (("--inputs", args.inputs),
                        ("--reference", args.reference)):
      if value is not None:
        raise UsageError(f"{flag} needs --kernel")
    return
  if args.inputs is None:
    raise UsageError("--kernel needs --inputs, e.g. --inputs 'f32[4096,1024]'")
  for flag, value in (("--kernels", args.kernels), ("--sizes", args.sizes),
                      ("--quick", args.quick or None),
                      ("--autotune", args.autotune or None),
                      ("--dtype", args.dtype)):
    if value is not None:
      raise UsageError(f"{flag} does not apply to --kernel (its inputs' "
                       "shapes and dtypes come from --inputs; a function "
                       "decorated with dsl.autotune tunes itself)")


def user_cases(args):
  """The rows of `--kernel`: one per dsl backend."""
  from benchmarks.runner import Case
  from benchmarks.suite.user import load_user_kernel
  bench = load_user_kernel(args.kernel, args.inputs, args.reference)
  args.dtype = bench.specs[0].dtype.name
  if args.backends is not None and not bench.backend_choice():
    raise UsageError(f"--backends: {args.kernel} takes neither a 'pl' nor a "
                     "'backend' parameter, so it runs on the default backend "
                     "only (see docs/benchmarks.md)")
  backends = select_backends(args, quick=False)
  config = parse_config(args.config)
  unknown = sorted(set(config) - bench.keywords())
  if unknown and not bench.takes_any_keyword:
    raise UsageError(f"--config key(s) {', '.join(unknown)} are not keyword "
                     f"parameters of {args.kernel} (its keywords: "
                     f"{', '.join(sorted(bench.keywords())) or 'none'})")
  if not bench.backend_choice():
    backends = backends[:1]
  return [Case(bench, bench.size, b, dict(config),
               "--config" if config else "default") for b in backends]


def measure_cases(args, cases):
  """Runs the cases (each autotuned first with --autotune) and, when asked
  for, the device peak, under one progress bar. Returns the rows, the peak
  (None when not measured) and notes on it (`peak.settle`)."""
  import jax.numpy as jnp

  from benchmarks import peak as peak_mod
  from benchmarks import platform_info, runner
  from benchmarks.progress import Progress

  plat = platform_info.platform()
  want_peak = args.peak == "on" or (args.peak == "auto" and plat != "cpu")
  units = runner.plan_units(cases) + (2 if want_peak else 0)
  if args.autotune:
    units += sum(len(c.bench.search_space(c.size, c.backend, plat))
                 for c in cases if c.bench.tunable)
  progress = Progress(units, mode=args.progress)
  options = runner.Options(
      dtype=jnp.dtype(args.dtype), warmup=args.warmup, repeats=args.repeats,
      slow_s=args.single_run_after, skip_slow_peers=args.skip_slow_peers,
      autotune=args.autotune, retune=args.retune, stat=args.stat,
      tune_repeats=args.tune_repeats, tune_budget=args.tune_budget)
  rows = []
  try:
    if want_peak:
      progress.status("measuring the device peak")
      options.peak = peak_mod.measure_peak(plat, platform_info.device_kind())
      progress.advance(2)
    r = runner.Runner(options, progress)
    for case in cases:
      if args.autotune:
        case = r.tune(case)
      rows.append(r.run_case(case))
    r.finish()
    notes = []
    if options.peak:
      progress.status("checking rows against the measured copy")
      options.peak, notes = peak_mod.settle(
          rows, options.peak, lambda: peak_mod.remeasure(plat))
  finally:
    progress.close()
  return rows, options.peak, notes


def run_meta(args, peak, started: float) -> dict:
  """What the report, the JSON and the plot say about the run itself."""
  from benchmarks import platform_info
  meta = {
      "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
      "command": "python -m benchmarks " + " ".join(
          shlex.quote(a) for a in args.argv),
      "device": platform_info.describe(), "dtype": args.dtype,
      "warmup": args.warmup, "repeats": args.repeats, "quick": args.quick,
      "stat": args.stat, "wall_s": round(time.time() - started, 1),
      "peak": peak.as_dict() if peak else None,
      "autotune_cache": None, "malloc_tuned": malloc_tuned(),
  }
  if args.autotune:
    from benchmarks import autotune
    meta["autotune_cache"] = autotune.cache_path()
  return meta


def report_notes(args, meta, rows, skipped, peak_notes=()) -> list[str]:
  """The lines under the table: what did not run, rows above the measured
  peak, the configs autotuning chose, the wall time and the command."""
  from benchmarks import report
  notes = list(peak_notes)
  if skipped:
    notes.append("not run (unavailable, see --list): "
                 + ", ".join(k.name for k in skipped))
  if args.autotune:
    notes.append(f"autotune cache: {meta['autotune_cache']}")
    for row in rows:
      c = row.case
      notes.append(f"  {c.label}: {report.fmt_config(c.config)} "
                   f"({c.config_source})")
  notes += shipped_notes(args, rows)
  notes.append(f"wall time {meta['wall_s']} s; command: {meta['command']}")
  return notes


def shipped_notes(args, rows) -> list[str]:
  """Where the GPU rows' configs and the kernels' backends came from (the
  shipped defaults, dsl/tools/data/gpu_*.json)."""
  from benchmarks import report
  lines = []
  for row in rows:
    c = row.case
    if c.config_source.startswith("shipped: "):
      shown = c.config if c.shown is None else c.shown
      lines.append(f"  {c.label}: {report.fmt_config(shown)} <- "
                   f"{c.config_source[len('shipped: '):]}")
    pick = getattr(c.bench, "auto_backend", None)
    choice = pick() if pick and args.backends is None else None
    if choice is not None and choice.backend == c.backend:
      lines.append(f"  {c.label}: backend {choice.backend}, the kernel's "
                   f"choice for backend=None here ({choice.where})")
  if lines:
    lines.insert(0, "GPU defaults shipped in dsl/tools/data/gpu_configs.json and "
                 "gpu_backends.json:")
  return lines


def write_results(args, meta, rows, skipped, peak_notes=()) -> None:
  """Prints the report; writes the --json, --csv and --plot files."""
  from benchmarks import plot, report, runner
  goals = runner.goals(rows)
  print(report.render(meta, rows, goals,
                      report_notes(args, meta, rows, skipped, peak_notes)))
  if args.json:
    report.write_json(args.json, meta, rows, goals)
  if args.csv:
    report.write_csv(args.csv, rows)
  if args.plot:
    plot.plot(rows, args.plot, title=f"dsl vs peers, "
              f"{meta['device']['device_kind']}, {meta['date']}")


def run(args) -> int:
  if args.list:
    print(list_text())
    return 0
  if args.sharding:
    from benchmarks import sharding_runs
    return sharding_runs.run(args)
  if args.suite == "pallas-ops":
    from benchmarks import pallas_ops
    return pallas_ops.run(args)
  check_args(args)
  if args.kernel is not None:
    skipped, cases = [], user_cases(args)
  else:
    kernels, skipped = select_kernels(args)
    backends = select_backends(args, args.quick)
    cases = build_cases(args, kernels, backends, args.quick)
  if not cases:
    raise UsageError("nothing to run")
  started = time.time()
  rows, peak, peak_notes = measure_cases(args, cases)
  meta = run_meta(args, peak, started)
  meta["peak_notes"] = peak_notes
  write_results(args, meta, rows, skipped, peak_notes)
  bad = [row for row in rows if not row.dsl.ok or row.check == "MISMATCH"]
  return 1 if bad else 0


# glibc returns big freed blocks to the OS (and XLA's threads allocate from
# per-thread arenas), so a call's fresh 16 MiB output is often page-faulted in
# again (about 3 ms on a 2-core CPU): timings turn bimodal and ratios noisy.
# These settings keep freed blocks for reuse in one arena; glibc reads them at
# start-up, hence one re-exec. DSL_BENCH_MALLOC=0 turns it off.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30),
              "MALLOC_TRIM_THRESHOLD_": str(1 << 32),
              "MALLOC_ARENA_MAX": "1"}


def _reexec_with_stable_malloc() -> None:
  if (not sys.platform.startswith("linux")
      or os.environ.get("DSL_BENCH_MALLOC", "1") == "0"
      or all(os.environ.get(k) == v for k, v in MALLOC_ENV.items())):
    return
  env = dict(os.environ, **MALLOC_ENV)
  orig = getattr(sys, "orig_argv", None)
  if not orig:
    return
  try:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable] + list(orig[1:]), env)
  except OSError:
    return   # run without it


def malloc_tuned() -> bool:
  return all(os.environ.get(k) == v for k, v in MALLOC_ENV.items())


def main(argv=None) -> int:
  if argv is None:
    _reexec_with_stable_malloc()
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    args = build_parser().parse_args(argv)
    args.argv = argv
    return run(args)
  except UsageError as e:
    print(f"dsl-bench: error: {e}", file=sys.stderr)
    return 2
  except BrokenPipeError:   # `... | head`: the reader left; not an error
    try:
      sys.stdout = open(os.devnull, "w")
    except OSError:
      pass
    return 0
  except KeyboardInterrupt:
    print("dsl-bench: interrupted", file=sys.stderr)
    return 130
  except Exception as e:  # a bug here: say it in one line, trace on request
    if os.environ.get("DSL_BENCH_DEBUG"):
      raise
    msg = str(e).splitlines()[0] if str(e) else ""
    print(f"dsl-bench: internal error: {type(e).__name__}: {msg} "
          "(set DSL_BENCH_DEBUG=1 for the traceback)", file=sys.stderr)
    return 3
