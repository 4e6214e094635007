"""`dsl.autotune`: pick the fastest of several configs of a user's kernel.

    @pl.autotune(configs=[{"block": 256}, {"block": 1024}, {"block": 4096}],
                 key=["x"])
    def add(x, y, *, block=1024):
      return pl.pallas_call(...)(x, y)

The first call per key (the shapes and dtypes of the `key` arguments, and the
backend) times every config on the current device with `dsl.tools.timing`, keeps
the fastest, and records it in the autotuning cache on disk
(`dsl.tools.autotune_cache`: the one `python -m benchmarks --autotune` fills, keyed
by device kind and jax/triton versions). Later calls, and later processes,
reuse it. `DSL_AUTOTUNE=0` turns searching off: a cached winner is still used,
else the first config. Under `jax.jit` the search runs at trace time on
concrete inputs of the traced shapes and dtypes, outside the traced
computation; only the winner is traced into the caller's program.

A config is a dict of keyword arguments of the decorated function. On Triton
backends `num_warps` and `num_stages` may be given even when the function
does not take them: they become the `compiler_params` of every `pallas_call`
made by the function that names none.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import sys
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import tree_util
from dsl.core.jax_internals import core

from dsl.core.compiler_params import tuned_launch
from dsl.tools import autotune_cache
from dsl.core import config
from dsl.core.errors import KernelTypeError, user_frame
from dsl.tools import processes
from dsl.tools.timing import measure

ENV_SWITCH = "DSL_AUTOTUNE"
LAUNCH_KEYS = ("num_warps", "num_stages")

def searching_enabled() -> bool:
  return os.environ.get(ENV_SWITCH, "1").strip().lower() not in (
      "0", "false", "off", "no")


@dataclasses.dataclass(frozen=True)
class Choice:
  """The config used for one key, and where it came from."""
  config: dict
  source: str      # "searched", "cached", "default", or "shared" (from
  # process 0 of a job of several processes)
  median_s: float | None = None
  results: tuple = ()          # (config, seconds or error text) per config


def _module_path(fn) -> str | None:
  """The dotted path of the file that defines `fn`, from the root of its
  package (the highest folder above it holding an `__init__.py`): the same
  whether the file runs as a script (`__main__`) or is imported."""
  code = getattr(inspect.unwrap(fn), "__code__", None)
  filename = getattr(code, "co_filename", "")
  if not filename.endswith(".py") or not os.path.isfile(filename):
    return None
  folder, stem = os.path.split(os.path.abspath(filename))
  parts = [] if stem == "__init__.py" else [stem[:-3]]
  while os.path.isfile(os.path.join(folder, "__init__.py")):
    folder, package = os.path.split(folder)
    parts.insert(0, package)
  return ".".join(parts) or None


def default_name(fn) -> str:
  """`fn`'s name in the cache: `<module path>.<qualname>`, the module path
  found from its file (`_module_path`), else its `__module__`."""
  return f"{_module_path(fn) or fn.__module__}.{fn.__qualname__}"


def _is_array(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def _short_aval(x) -> str:
  return core.ShapedArray(tuple(x.shape), np.dtype(x.dtype)).str_short(
      short_dtypes=True)


def _key_part(value) -> str:
  leaves = tree_util.tree_leaves(value)
  if len(leaves) == 1 and leaves[0] is value:
    return _short_aval(value) if _is_array(value) else repr(value)
  return "(" + ",".join(_key_part(v) for v in leaves) + ")"


class Autotuned:
  """The decorated function; call it like the original."""

  def __init__(self, fn: Callable, configs: Sequence[dict], key, *,
               name: str | None, warmup: int, repeats: int, where: str):
    self.fn = fn
    self.name = name or default_name(fn)
    self.where = where
    self.warmup, self.repeats = warmup, repeats
    self.signature = inspect.signature(fn)
    self.configs = [dict(c) for c in self._check_configs(configs)]
    self.key = self._check_key(key)
    self.choices: dict[tuple[str, str], Choice] = {}
    functools.update_wrapper(self, fn)

  # ------------------------------------------------------------ validation
  def _error(self, message, operand=None):
    return KernelTypeError(self.name, message, self.where, operand=operand)

  def _keywords(self):
    params = self.signature.parameters.values()
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    names = [p.name for p in params
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return names, takes_any

  def _check_configs(self, configs):
    if isinstance(configs, dict) or not configs:
      raise self._error("autotune needs a non-empty list of configs (dicts of "
                        f"keyword arguments), got {configs!r}", "configs")
    names, takes_any = self._keywords()
    for i, c in enumerate(configs):
      if not isinstance(c, dict):
        raise self._error(f"a config is a dict of keyword arguments, got "
                          f"{c!r}", f"configs[{i}]")
      for k in c:
        if k not in names and not takes_any and k not in LAUNCH_KEYS:
          raise self._error(
              f"keyword {k!r} is not a parameter of {self.fn.__name__}"
              f"{self.signature}; its keywords: {', '.join(names) or 'none'}"
              f" (and {', '.join(LAUNCH_KEYS)} on Triton backends)",
              f"configs[{i}]")
    return configs

  def _check_key(self, key):
    if key is None:
      return None
    key = [key] if isinstance(key, (str, int)) else list(key)
    params = list(self.signature.parameters)
    for k in key:
      if isinstance(k, int):
        if not 0 <= k < len(params):
          raise self._error(f"key position {k} is out of range for "
                            f"{self.fn.__name__}{self.signature}", "key")
      elif k not in params:
        raise self._error(f"key {k!r} is not a parameter of "
                          f"{self.fn.__name__}{self.signature}", "key")
    return [params[k] if isinstance(k, int) else k for k in key]

  # ------------------------------------------------------------ keys
  def key_of(self, args, kwargs) -> str:
    """'x=f32[4096,1024],y=f32[4096,1024]': the key arguments' shapes."""
    bound = self.signature.bind_partial(*args, **kwargs).arguments
    if self.key is None:
      names = [n for n, v in bound.items()
               if any(_is_array(l) for l in _leaves(v))]
    else:
      names = self.key
    return ",".join(f"{n}={_key_part(bound[n])}" if n in bound else f"{n}=-"
                    for n in names)

  def backend_of(self, kwargs, config=None) -> str:
    b = kwargs.get("backend") or (config or {}).get("backend")
    return b or autotune_cache._default_backend()

  # ------------------------------------------------------------ calls
  def __call__(self, *args, **kwargs):
    tuned = [k for k in kwargs if any(k in c for c in self.configs)]
    if tuned:
      raise self._error(f"argument(s) {', '.join(tuned)} are chosen by "
                        "autotuning; do not pass them")
    choice = self.choose(*args, **kwargs)
    return self._call(choice.config, args, kwargs)

  def _call(self, config, args, kwargs):
    names, takes_any = self._keywords()
    launch = {k: v for k, v in config.items()
              if k in LAUNCH_KEYS and k not in names and not takes_any}
    own = {k: v for k, v in config.items() if k not in launch}
    with tuned_launch(launch):
      return self.fn(*args, **kwargs, **own)

  def choose(self, *args, **kwargs) -> Choice:
    """The config for these arguments: remembered, cached on disk, searched
    (first call per key) or, with DSL_AUTOTUNE=0, the first config. In a
    job of several processes, process 0 decides and shares its choice, so
    that every process compiles the same program."""
    key = self.key_of(args, kwargs)
    backend = self.backend_of(kwargs)
    hit = self.choices.get((key, backend))
    if hit is not None:
      return hit
    mine = []

    def decide():
      mine.append(self._decide(args, kwargs, key, backend))
      return self.configs.index(mine[0].config)
    index = processes.first_process_decides(
        decide, f"autotune/{self.name}/{key}/{backend}")
    choice = mine[0] if mine else Choice(self.configs[index], "shared")
    if choice.source != "default":
      self.choices[(key, backend)] = choice
    return choice

  def _decide(self, args, kwargs, key, backend) -> Choice:
    cached = _as_json(autotune_cache.lookup(self.name, key, backend=backend))
    known = [c for c in self.configs if _as_json(c) == cached]
    if cached is not None and known:
      return Choice(known[0], "cached")
    if not searching_enabled():
      return Choice(self.configs[0], "default")
    return self._search(args, kwargs, key, backend)

  # ------------------------------------------------------------ search
  def _search(self, args, kwargs, key, backend) -> Choice:
    with jax.ensure_compile_time_eval():
      dyn, rebuild = _split_arrays(args, kwargs)
      dyn = [_concrete(x) for x in dyn]
      results = []
      for config in self.configs:
        results.append((config, self._time(config, dyn, rebuild)))
    timed = [(c, t) for c, t in results if isinstance(t, float)]
    if not timed:
      raise self._error(
          f"no config ran for {key} on {backend}: " + "; ".join(
              f"{_fmt(c)}: {t}" for c, t in results), "configs")
    best, best_t = min(timed, key=lambda ct: ct[1])
    if _as_json(best) is not None:   # else remembered in this process only
      autotune_cache.store(self.name, key, backend, best, median_s=best_t,
                           candidates=len(results))
    choice = Choice(best, "searched", best_t, tuple(results))
    self._report(choice, key, backend)
    return choice

  def _time(self, config, dyn, rebuild):

    def run(*arrays):
      a, kw = rebuild(arrays)
      return self._call(config, a, kw)
    try:
      return measure(run, tuple(dyn), warmup=self.warmup,
                     repeats=self.repeats, keep_output=False).median
    except Exception as e:  # a config the kernel rejects is skipped
      lines = str(e).strip().splitlines()
      return f"{type(e).__name__}: {lines[0] if lines else ''}"

  def _report(self, choice: Choice, key, backend):
    if not config.verbose_errors():
      return
    failed = sum(1 for _, t in choice.results if not isinstance(t, float))
    print(f"dsl.autotune: {self.name} [{key}] on {backend}: "
          f"{_fmt(choice.config)} at {choice.median_s * 1e3:.3g} ms, best of "
          f"{len(choice.results)} config(s)"
          + (f", {failed} failed" if failed else "")
          + f"; saved to {autotune_cache.cache_path()}", file=sys.stderr)


def _leaves(v):
  return tree_util.tree_leaves(v)


def _split_arrays(args, kwargs):
  """The array leaves of (args, kwargs), and a function that puts new arrays
  in their places (other leaves stay as they are: static arguments)."""
  leaves, tree = tree_util.tree_flatten((args, kwargs))
  where = [i for i, l in enumerate(leaves) if _is_array(l)]

  def rebuild(arrays):
    new = list(leaves)
    for i, a in zip(where, arrays):
      new[i] = a
    return tree_util.tree_unflatten(tree, new)
  return [leaves[i] for i in where], rebuild


def _concrete(x):
  """x itself when concrete; else a deterministic array of its shape and
  dtype (normal floats, zeros otherwise) to time configs on."""
  if not isinstance(x, jax.core.Tracer):
    return x
  dtype = np.dtype(x.dtype)
  shape = tuple(x.shape)
  if jax.numpy.issubdtype(dtype, jax.numpy.floating) or \
      jax.numpy.issubdtype(dtype, jax.numpy.complexfloating):
    rng = np.random.default_rng(0)
    return jax.numpy.asarray(rng.standard_normal(shape, np.float32)).astype(
        dtype)
  return jax.numpy.zeros(shape, dtype)


def _as_json(config):
  """config as the cache's JSON reads it back (tuples become lists), or
  None when it does not fit in JSON."""
  if config is None:
    return None
  try:
    return json.loads(json.dumps(config, sort_keys=True))
  except (TypeError, ValueError):
    return None


def _fmt(config: dict) -> str:
  return "{" + ", ".join(f"{k}={v}" for k, v in config.items()) + "}"


def autotune(configs: Sequence[dict], key: Sequence[str | int] | str | None
             = None, *, name: str | None = None, warmup: int = 1,
             repeats: int = 3) -> Callable[[Callable], Autotuned]:
  """Decorator: time `configs` (dicts of keyword arguments of the decorated
  function) on the first call per `key` and use the fastest from then on.

  `key` names the arguments (by name or position) whose shapes and dtypes
  (values, for non-arrays) select a cache entry; None: every array argument.
  `name` is the kernel's name in the cache (default `module.qualname`).
  """
  where = user_frame()

  def decorate(fn):
    return Autotuned(fn, configs, key, name=name, warmup=warmup,
                     repeats=repeats, where=where)
  return decorate
