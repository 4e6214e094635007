"""Autotuning: search a kernel's block sizes (and on GPU num_warps and
num_stages) per size, and cache the winners on disk.

The cache is one JSON file, `$DSL_AUTOTUNE_CACHE` or
`$XDG_CACHE_HOME/dsl/autotune.json` (default `~/.cache/dsl/autotune.json`):

    {"format": 1,
     "devices": {
       "<device kind>|jax=<v>|triton=<v>": {
         "<kernel>/<backend>/<size key>": {"config": {...}, "median_s": ...,
                                           "candidates": 18, "tuned_at": ...}}}}

The cache itself (lookup, store, keys) lives in `dsl.tools.autotune_cache`, so that
kernels read it with no dependency on benchmarks/: `kernels/` looks up
`kernels.<name>` for its size and backend whenever the caller passes no block
sizes (`kernels.blocking.tuned`).

    from dsl.tools.autotune_cache import lookup, size_key
    cfg = lookup("kernels.matmul", size_key((m, k, n), x.dtype),
                 backend="interpret")
    # -> {"block_sizes": [512, 512, 1024]} or None
"""
from __future__ import annotations

import json
import random
import time

# The cache's API, used through this module by the CLI and its tests.
from dsl.tools.autotune_cache import (cache_path, device_key, lookup, size_key,
                                      store)


def candidates(bench, size, dtype, backend: str, platform: str,
               first: dict | None = None, shuffle: int | None = None
               ) -> list[dict]:
  """The configs to time, `first` (the row's current config) first; the
  rest in the search space's order, or shuffled with seed `shuffle` (a
  search stopped by a budget then tries other configs on another day)."""
  space = list(bench.search_space(size, backend, platform))
  if shuffle is not None:
    random.Random(shuffle).shuffle(space)
  out = [bench.fix_config(size, c, dtype)
         for c in ([first] if first else []) + space]
  seen, unique = set(), []
  for c in out:
    key = json.dumps(c, sort_keys=True, default=str)
    if key not in seen:
      seen.add(key)
      unique.append(c)
  return unique


def search(bench, size, dtype, backend: str, platform: str, *,
           repeats: int = 3, progress=None, first: dict | None = None,
           budget_s: float | None = None, shuffle: int | None = None
           ) -> tuple[dict, float, list]:
  """Times the candidate configs with dsl's `backend` (`first` first; with
  `budget_s`, no new candidate starts once that many seconds have passed);
  returns the winner, its median time and every (config, median or error)
  result, in the order timed."""
  from benchmarks import peers, sizes
  from benchmarks.report import fmt_config
  from dsl.tools.timing import measure
  inputs = bench.inputs(size, dtype)
  results = []
  start = time.perf_counter()
  for config in candidates(bench, size, dtype, backend, platform, first,
                           shuffle):
    if budget_s is not None and results and \
        time.perf_counter() - start > budget_s:
      break
    if progress:
      progress.status(f"autotune {bench.name} {sizes.label(size)} {backend}: "
                      f"{fmt_config(config)}")
    try:
      fn = peers.dsl_fn(bench, backend, size, dtype, config)
      stats = measure(fn, inputs, warmup=1, repeats=repeats, keep_output=False)
      results.append((config, stats.median))
    except Exception as e:  # a config the backend rejects is just skipped
      msg = str(e).splitlines()[0] if str(e) else ""
      results.append((config, f"{type(e).__name__}: {msg}"))
    if progress:
      progress.advance()
  timed = [(c, t) for c, t in results if isinstance(t, float)]
  if not timed:
    raise RuntimeError(f"autotune: no config of {bench.name} ran on {backend}: "
                       f"{results[0][1] if results else 'empty search space'}")
  best, best_t = min(timed, key=lambda ct: ct[1])
  return best, best_t, results
