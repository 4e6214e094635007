"""Runs the selected cases: each row is one kernel x size x dsl backend,
timed beside its peers in the same process, one after the other."""
from __future__ import annotations

import dataclasses
import gc
import json
import time
from typing import Any

import jax.numpy as jnp

from benchmarks import autotune, peers, platform_info, sizes
from benchmarks import peak as peak_mod
from benchmarks.suite import max_rel_err
from dsl.tools.timing import Stats, prepare, run_interleaved

# --skip-slow-peers: Pallas's interpret mode copies whole buffers at every grid
# point; beyond this many bytes moved (points x operand bytes) it takes seconds.
SLOW_PEER_BYTES = 8 << 30
# Always skipped beyond this (about 16 GB/s on a 2-core CPU: the 4M add moves
# 200 GB in ~12 s; 64M on a 65536-point grid would take about an hour).
TOO_SLOW_PEER_BYTES = 1 << 40


@dataclasses.dataclass
class Case:
  bench: Any
  size: tuple[int, ...]
  backend: str
  config: dict
  config_source: str = "default"
  shown: dict | None = None      # the config column, when not `config`
  tuning: dict | None = None     # autotune's candidates and their times

  @property
  def label(self) -> str:
    return f"{self.bench.name} {sizes.label(self.size)} {self.backend}"


@dataclasses.dataclass
class Cell:
  """One timed implementation: stats, or a note saying why it did not run."""
  stats: Stats | None = None
  note: str = ""            # "n/a: no GPU", "skipped: ...", "error: ..."

  @property
  def ok(self) -> bool:
    return self.stats is not None

  def as_dict(self):
    d = {"note": self.note or None}
    if self.stats is not None:
      d.update(self.stats.as_dict())
    return d


@dataclasses.dataclass
class Row:
  case: Case
  dtype: str
  dsl: Cell
  peers: dict[str, Cell]
  check: str = "n/a"           # "ok", "MISMATCH", "n/a"
  max_err: float | None = None
  throughput: float | None = None     # FLOP/s or bytes/s
  throughput_unit: str = ""           # "FLOP/s" or "B/s"
  peak_fraction: float | None = None
  autotune: dict | None = None
  stat: str = "median"                # the statistic that times and ratios use

  def ratio(self, peer: str) -> float | None:
    cell = self.peers.get(peer)
    if not (self.dsl.ok and cell and cell.ok):
      return None
    return self.dsl.stats.value(self.stat) / cell.stats.value(self.stat)

  def as_dict(self):
    c = self.case
    d = {"kernel": c.bench.name, "source": c.bench.source,
         "size": sizes.key(c.size), "size_label": sizes.label(c.size),
         "dtype": self.dtype, "backend": c.backend, "config": c.config,
         "shown_config": c.config if c.shown is None else c.shown,
         "config_source": c.config_source, "dsl": self.dsl.as_dict(),
         "peers": {}, "check": self.check, "max_rel_err": self.max_err,
         "throughput": self.throughput, "throughput_unit": self.throughput_unit,
         "peak_fraction": self.peak_fraction, "stat": self.stat}
    for name, cell in self.peers.items():
      d["peers"][name] = cell.as_dict()
      d["peers"][name]["ratio"] = self.ratio(name)
      if name == "pallas":
        d["peers"][name]["mode"] = platform_info.pallas_mode(c.backend)
    if self.autotune:
      d["autotune"] = self.autotune
    return d


@dataclasses.dataclass
class Options:
  dtype: Any = jnp.float32
  warmup: int = 1
  repeats: int = 5
  slow_s: float = 1.0
  min_sample_s: float = 0.01
  stat: str = "median"
  skip_slow_peers: bool = False
  autotune: bool = False
  retune: bool = False
  tune_repeats: int = 3
  tune_budget: float | None = None   # seconds per row's search
  peak: Any = None          # benchmarks.peak.Peak or None


def _short(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  msg = text[0] if text else ""
  msg = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
  return msg if len(msg) <= 160 else msg[:157] + "..."


def plan_units(cases) -> int:
  """Progress units: per row, one per implementation (dsl + 3 peers) made
  ready, and one for the timed rounds."""
  return 5 * len(cases)


class Runner:

  def __init__(self, options: Options, progress=None):
    self.o = options
    self.progress = progress
    self._inputs: dict = {}
    self._single_runs: dict = {}   # peer key -> Cell timed once / n/a
    self.platform = platform_info.platform()

  # -------------------------------------------------------------- helpers
  def _step(self, text):
    if self.progress:
      self.progress.status(text)

  def _done(self):
    if self.progress:
      self.progress.advance()

  def inputs(self, bench, size):
    key = (bench.name, size)
    if key not in self._inputs:
      self._inputs.clear()      # one size's inputs alive at a time
      gc.collect()
      self._inputs[key] = bench.inputs(size, self.o.dtype)
    return self._inputs[key]

  def _prepare(self, make, args, keep_output=False, trust_first=False):
    """A `timing._Prepared`, or a Cell saying why it cannot run."""
    try:
      fn = make()
    except peers.PeerUnavailable as e:
      return Cell(note=str(e))
    except Exception as e:
      return Cell(note=f"error: {_short(e)}")
    try:
      return prepare(fn, args, slow_s=self.o.slow_s,
                     min_sample_s=self.o.min_sample_s, keep_output=keep_output,
                     trust_first=trust_first)
    except Exception as e:
      return Cell(note=f"error: {_short(e)}")

  # -------------------------------------------------------------- autotune
  def tune(self, case: Case) -> Case:
    b = case.bench
    if not b.tunable:
      case.config_source = "default (not tunable)"
      return case
    skey = autotune.size_key(case.size, self.o.dtype)
    if not self.o.retune:
      hit = autotune.lookup(b.name, skey, backend=case.backend)
      if hit is not None:
        if self.progress:
          self.progress.advance(len(b.search_space(case.size, case.backend,
                                                   self.platform)))
        case.config = b.fix_config(case.size, hit, self.o.dtype)
        case.config_source = "autotune: cached"
        return case
    self._step(f"autotune {case.label}")
    # With a budget the search may stop early: the order changes daily, so
    # that repeated budgeted runs reach the whole space.
    shuffle = (None if self.o.tune_budget is None
               else int(time.time() // 86400))
    planned = autotune.candidates(b, case.size, self.o.dtype, case.backend,
                                  self.platform, case.config, shuffle)
    try:
      best, best_t, results = autotune.search(
          b, case.size, self.o.dtype, case.backend, self.platform,
          repeats=self.o.tune_repeats, progress=self.progress,
          first=case.config, budget_s=self.o.tune_budget, shuffle=shuffle)
    except Exception as e:   # keep the default config; the row says why
      case.config_source = f"default (autotune failed: {_short(e)})"
      return case
    if self.progress and len(results) < len(planned):
      self.progress.advance(len(planned) - len(results))
    autotune.store(b.name, skey, case.backend, best, median_s=best_t,
                   candidates=len(results))
    case.tuning = {"before": case.config, "before_source": case.config_source,
                   "candidates": len(planned),
                   "results": [[c, t] for c, t in results]}
    case.config = best
    case.config_source = f"autotune: best of {len(results)}" + (
        f" (of {len(planned)}, --tune-budget)" if len(results) < len(planned)
        else "")
    return case

  # -------------------------------------------------------------- one row
  def run_case(self, case: Case) -> Row:
    """Prepares dsl and every peer (compile + first call), then times those
    that are not done in interleaved rounds."""
    b, size, dtype = case.bench, case.size, self.o.dtype
    dname = jnp.dtype(dtype).name
    try:
      args = self.inputs(b, size)
    except Exception as e:   # e.g. out of memory: the row says so
      note = f"error: inputs: {_short(e)}"
      if self.progress:
        self.progress.advance(5)
      return Row(case, dname, Cell(note=note),
                 {k: Cell(note=note) for k in peers.PEERS}, check="error",
                 stat=self.o.stat)
    cfg_key = json.dumps(case.config, sort_keys=True)
    mode = platform_info.pallas_mode(case.backend)

    makers = {
        "dsl": (lambda: peers.dsl_fn(b, case.backend, size, dtype,
                                     case.config), True, None),
        "xla": (lambda: peers.xla_fn(b), True, None),
        "pallas": (lambda: peers.pallas_fn(b, mode, size, dtype, case.config),
                   False, ("pallas", mode, b.name, size, dname, cfg_key)),
        "triton": (lambda: peers.triton_fn(b, size, dtype, case.config),
                   False, ("triton", b.name, size, dname)),
    }
    titles = {"dsl": f"dsl {case.backend}", "xla": "XLA",
              "pallas": f"Pallas {mode}", "triton": "Triton"}
    prepared, cells = {}, {}
    for name, (make, keep, cache_key) in makers.items():
      self._step(f"{case.label}: {titles[name]} (compile + first call)")
      if cache_key is not None and cache_key in self._single_runs:
        cells[name] = self._single_runs[cache_key]
      elif name == "pallas" and mode == "interpret" and b.pallas_source and (
          moved := b.grid_points(size, case.config) * b.io_bytes(size, dtype)
      ) > (SLOW_PEER_BYTES if self.o.skip_slow_peers else TOO_SLOW_PEER_BYTES):
        cells[name] = Cell(note="skipped: --skip-slow-peers"
                           if moved <= TOO_SLOW_PEER_BYTES else
                           f"skipped: est. > {moved / 16e9 / 60:.0f} min")
      else:
        # Pallas's interpret mode is slow for real (whole-buffer copies per
        # grid point): its first slow call is its measurement.
        p = self._prepare(make, args, keep_output=keep,
                          trust_first=(name == "pallas" and mode == "interpret"))
        if isinstance(p, Cell):
          cells[name] = p
          if cache_key is not None:
            self._single_runs[cache_key] = p    # unavailable: say so once
        else:
          prepared[name] = p
      self._done()

    self._step(f"{case.label}: timing {', '.join(prepared)}")
    stats = run_interleaved(prepared, args, warmup=self.o.warmup,
                            repeats=self.o.repeats)
    for name, st in stats.items():
      cells[name] = Cell(st)
      key = makers[name][2]
      if key is not None and len(st.samples) == 1 and prepared[name].done:
        self._single_runs[key] = cells[name]    # slow: never run it twice
    self._done()

    row = Row(case, dname, cells["dsl"],
              {k: cells[k] for k in peers.PEERS}, autotune=case.tuning,
              stat=self.o.stat)
    self._check(row)
    self._throughput(row)
    for c in cells.values():
      if c.ok:
        c.stats.output = None
    return row

  def _check(self, row: Row):
    ref = row.peers["xla"]
    if not (row.dsl.ok and ref.ok):
      row.check = "n/a" if row.dsl.ok else "error"
      return
    err = max_rel_err(row.dsl.stats.output, ref.stats.output)
    row.max_err = err
    row.check = "ok" if err <= row.case.bench.tolerance(self.o.dtype) else \
        "MISMATCH"

  def _throughput(self, row: Row):
    if not row.dsl.ok:
      return
    b, t = row.case.bench, row.dsl.stats.value(row.stat)
    if b.bound == "compute":
      row.throughput, row.throughput_unit = b.flops(row.case.size) / t, "FLOP/s"
    else:
      row.throughput = b.io_bytes(row.case.size, self.o.dtype) / t
      row.throughput_unit = "B/s"
    if self.o.peak:
      row.peak_fraction = peak_mod.fraction(row.throughput,
                                            row.throughput_unit, self.o.peak)

  def finish(self):
    """Frees cached peer outputs and inputs."""
    self._single_runs.clear()
    self._inputs.clear()
    gc.collect()


# ---------------------------------------------------------------- goals

def _find(rows, kernel, size, config_match):
  for r in rows:
    c = r.case
    if (c.bench.name == kernel and c.size == size and c.backend == "interpret"
        and r.dtype == "float32" and all(c.config.get(k) == v
                                         for k, v in config_match.items())):
      return r
  return None


def _grade(value, goal):
  if value is None:
    return "n/a"
  if value <= goal:
    return "met"
  return "close" if value <= goal * 1.1 else "missed"


def goals(rows) -> list[dict]:
  """The interpret-speed goals, where their rows ran."""
  out = []
  cases = [
      ("add 4M f32, grid 4096 (block 1024)", "add", (1 << 22,),
       {"block": 1024}, 3.0),
      ("matmul 1024^3 f32, 128x128x128 blocks", "matmul", (1024,) * 3,
       {"variant": "grid_k", "bm": 128, "bn": 128, "bk": 128}, 2.0),
  ]
  for title, kernel, size, cfg, goal in cases:
    r = _find(rows, kernel, size, cfg)
    if r is None:
      continue
    ratio = r.ratio("xla")
    pallas, xla = r.peers["pallas"], r.peers["xla"]
    t = lambda cell: cell.stats.value(r.stat) if cell.ok else None
    mem = r.dsl.stats.memory if r.dsl.ok else None
    pmem = pallas.stats.memory if pallas.ok else None
    out.append({
        "case": title, "kernel": kernel, "size": sizes.key(size),
        "dsl_s": t(r.dsl), "xla_s": t(xla), "pallas_interpret_s": t(pallas),
        "pallas_note": pallas.note or None, "stat": r.stat,
        "ratio_to_xla": ratio, "ratio_goal": goal,
        "ratio_status": _grade(ratio, goal),
        "pallas_ratio_to_xla": (t(pallas) / t(xla)
                                if pallas.ok and xla.ok else None),
        "peak_bytes": mem.peak if mem else None,
        "io_bytes": mem.io if mem else None,
        "memory_ratio": mem.ratio if mem else None, "memory_goal": 2.0,
        "memory_status": _grade(mem.ratio if mem else None, 2.0),
        "pallas_memory_ratio": pmem.ratio if pmem else None,
    })
  return out
