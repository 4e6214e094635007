"""Timing functions: ahead-of-time compile, warm-up, repeats, statistics,
and XLA's memory analysis of the compiled program.

Two ways to take a sample of `number` calls, one per caller:

* waited (the benchmark CLI, `measure`): each call is waited for, so samples
  are latencies with one output alive at a time, the same for every
  implementation;
* queued (the GPU scripts, `time_queued`; `benchmarks.kernel_timing`): the
  calls are queued back to back and waited for once (JAX dispatches
  asynchronously), so the host's dispatch and synchronization latency hides
  behind the device's work.

Several functions timed together (`run_interleaved`) take their samples in
alternating rounds, so that ratios between them stay fair on a noisy machine.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import jax
import numpy as np

from dsl.core.host_failures import raising_kernel_errors


@dataclasses.dataclass
class Memory:
  """From `compiled.memory_analysis()`: bytes of arguments, outputs, temps."""
  argument: int
  output: int
  temp: int
  alias: int

  @property
  def peak(self) -> int:
    return self.argument + self.output + self.temp - self.alias

  @property
  def io(self) -> int:
    return self.argument + self.output

  @property
  def ratio(self) -> float:
    return self.peak / self.io if self.io else math.nan

  def as_dict(self):
    return {"argument_bytes": self.argument, "output_bytes": self.output,
            "temp_bytes": self.temp, "alias_bytes": self.alias,
            "peak_bytes": self.peak, "io_bytes": self.io,
            "peak_over_io": self.ratio}


@dataclasses.dataclass
class Stats:
  samples: list[float]          # seconds per call
  number: int                   # calls averaged into each sample
  compile_s: float
  memory: Memory | None
  output: Any = None            # the first call's output (for checks)

  @property
  def median(self) -> float:
    return float(np.median(self.samples))

  def value(self, stat: str = "median") -> float:
    """The headline time: the median, or the minimum (`--stat min`)."""
    return self.median if stat == "median" else float(min(self.samples))

  @property
  def q1(self) -> float:
    return float(np.percentile(self.samples, 25))

  @property
  def q3(self) -> float:
    return float(np.percentile(self.samples, 75))

  @property
  def spread(self) -> float:
    """Half the interquartile range, relative to the median."""
    if len(self.samples) < 2 or self.median == 0:
      return 0.0
    return (self.q3 - self.q1) / 2 / self.median

  def as_dict(self):
    return {"median_s": self.median, "q1_s": self.q1, "q3_s": self.q3,
            "min_s": min(self.samples), "max_s": max(self.samples),
            "spread": self.spread, "samples_s": list(self.samples),
            "calls_per_sample": self.number, "compile_s": self.compile_s,
            "memory": self.memory.as_dict() if self.memory else None}


def memory_of(compiled) -> Memory | None:
  try:
    m = compiled.memory_analysis()
  except Exception:
    return None
  if m is None:
    return None
  return Memory(int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                int(m.temp_size_in_bytes), int(m.alias_size_in_bytes))


def _block(x):
  return jax.block_until_ready(x)


@dataclasses.dataclass
class _Prepared:
  compiled: Any
  stats: Stats
  number: int = 1
  done: bool = False      # timed by its first call alone
  queued: bool = False    # a sample's calls queued back to back


def prepare(fn: Callable, args: tuple, *, slow_s: float = 1.0,
            min_sample_s: float = 0.005, min_number: int = 1,
            max_number: int = 100, keep_output: bool = True,
            trust_first: bool = False, queued: bool = False) -> _Prepared:
  """Compiles `fn` ahead of time and makes the first (warm-up) call.

  A call slower than `slow_s` is the only measurement (one run, no repeats):
  with `trust_first` the first call already (Pallas's interpret mode on a big
  grid, ~10 s); otherwise a second call, since a first call also pays one-off
  costs (page-faulting fresh output memory: ~1 s for 256 MiB). Otherwise each
  later sample averages enough calls to last `min_sample_s`, between
  `min_number` and `max_number` of them, waited for one by one or, with
  `queued`, queued back to back.
  """
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  compile_s = time.perf_counter() - t0
  memory = memory_of(compiled)
  t0 = time.perf_counter()
  # a kernel failing on the first call raises its KernelError class
  out = raising_kernel_errors(compiled)(*args)
  first = time.perf_counter() - t0
  stats = Stats([first], 1, compile_s, memory, out if keep_output else None)
  del out
  if first >= slow_s and not trust_first:
    t0 = time.perf_counter()
    _block(compiled(*args))
    first = time.perf_counter() - t0
    stats.samples = [first]
  if first >= slow_s:
    return _Prepared(None, stats, 1, True)
  number = min(max_number,
               max(min_number, math.ceil(min_sample_s / max(first, 1e-7))))
  stats.number = number
  return _Prepared(compiled, stats, number, queued=queued)


def _sample(p: _Prepared, args) -> float:
  t0 = time.perf_counter()
  if p.queued:
    out = None
    for _ in range(p.number):
      out = p.compiled(*args)
    _block(out)
  else:
    for _ in range(p.number):
      _block(p.compiled(*args))
  return (time.perf_counter() - t0) / p.number


def run_interleaved(prepared: dict[str, _Prepared], args: tuple, *,
                    warmup: int = 1, repeats: int = 5,
                    on_sample: Callable | None = None) -> dict[str, Stats]:
  """Times the prepared functions together: in every round each one takes a
  sample, in alternating order (A B C, C B A, ...), so that they all see the
  same machine state and ratios between them stay fair on a noisy machine.
  The first (warm-up) call counts as a sample only when warmup is 0."""
  live = {k: p for k, p in prepared.items() if not p.done}
  for p in live.values():
    for _ in range(max(0, warmup - 1)):
      _block(p.compiled(*args))
    if warmup > 0:
      p.stats.samples = []
  order = list(live)
  for r in range(repeats - (1 if warmup <= 0 else 0)):
    for name in (order if r % 2 == 0 else order[::-1]):
      live[name].stats.samples.append(_sample(live[name], args))
    if on_sample:
      on_sample(r)
  for p in live.values():
    p.compiled = None
  return {k: p.stats for k, p in prepared.items()}


def measure(fn: Callable, args: tuple, *, warmup: int = 1, repeats: int = 5,
            slow_s: float = 1.0, min_sample_s: float = 0.005,
            max_number: int = 100, keep_output: bool = True,
            trust_first: bool = False) -> Stats:
  """Times one function: see `prepare` and `run_interleaved`."""
  p = prepare(fn, args, slow_s=slow_s, min_sample_s=min_sample_s,
              max_number=max_number, keep_output=keep_output,
              trust_first=trust_first)
  return run_interleaved({"f": p}, args, warmup=warmup, repeats=repeats)["f"]


def time_queued(fn: Callable, *args, min_sample_s: float = 0.2,
                repeats: int = 5) -> float:
  """Median seconds per call of `fn`, each sample 3 to 1000 calls queued
  back to back for about `min_sample_s` (the GPU scripts' timer: the same
  for every kernel and peer)."""
  p = prepare(fn, args, slow_s=math.inf, min_sample_s=min_sample_s,
              min_number=3, max_number=1000, keep_output=False, queued=True)
  return run_interleaved({"f": p}, args, repeats=repeats)["f"].median
