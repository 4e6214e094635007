"""`dsl.profile`: the time of each kernel inside a jitted model.

Every kernel is lowered under its own name: the XLA ops made for it carry
`jit(model)/<kernel name>/...` as their `op_name` metadata, which the device
traces of `jax.profiler` show (a Triton kernel on a GPU is one such op).
Kernels that run on the host (`triton_interpret`, `mosaic_interpret`, and
`interpret` inside `dsl.profile`) run inside a `jax.profiler.TraceAnnotation`
named `<kernel name> (dsl kernel)` and are timed into every active profile:

    with pl.profile("/tmp/trace") as prof:     # the directory is optional
      model(x).block_until_ready()
    print(prof.summary())                       # kernel, calls, total, mean

Inside `dsl.profile` the `interpret` backend runs each kernel as its own
compiled program in a host callback (so XLA cannot fuse it into its
neighbours and its time is its own); the model is re-traced for that, since
the option is part of jit's cache key. `DSL_PROFILE=1` turns that mode on for
a whole process.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time

import jax

from dsl.core import config, host_failures

profile_option = config.bool_option(
    "dsl_profile", False,
    "If set, the interpret backend runs each kernel as its own program in a "
    "host callback, timed and named in jax.profiler traces (dsl.profile).")

_ACTIVE: list["Profile"] = []     # host callbacks run on XLA's threads
_LOCK = threading.Lock()


def enabled() -> bool:
  return bool(config.read_option("dsl_profile"))


class Profile:
  """Wall times of the kernels run on the host while it was active."""

  def __init__(self, trace_dir: str | None = None):
    self.trace_dir = trace_dir
    # (kernel name, where the kernel is defined) -> wall times
    self.times: dict[tuple, list[float]] = collections.defaultdict(list)

  def record(self, kernel: str, seconds: float,
             source: str | None = None) -> None:
    with _LOCK:
      self.times[(kernel, source)].append(seconds)

  def as_dict(self) -> dict[str, dict]:
    """Per kernel: calls, total and mean seconds. Kernels are told apart by
    where they are defined: two that share a name are listed as
    `name (file:line)`."""
    names = collections.Counter(name for name, _ in self.times)
    out = {}
    for (name, source), v in self.times.items():
      label = f"{name} ({source})" if names[name] > 1 and source else name
      out[label] = {"calls": len(v), "total_s": sum(v),
                    "mean_s": sum(v) / len(v)}
    return out

  def summary(self) -> str:
    rows = sorted(self.as_dict().items(), key=lambda kv: -kv[1]["total_s"])
    if not rows:
      return ("no kernel ran on the host; on a GPU or TPU, read each "
              "kernel's device time from a jax.profiler trace (its ops' "
              "op_name carries the kernel's name)")
    width = max(6, *(len(k) for k, _ in rows))
    lines = [f"{'kernel':<{width}}  {'calls':>5}  {'total ms':>10}  "
             f"{'mean ms':>10}"]
    for k, r in rows:
      lines.append(f"{k:<{width}}  {r['calls']:>5}  {r['total_s'] * 1e3:>10.3f}"
                   f"  {r['mean_s'] * 1e3:>10.3f}")
    if self.trace_dir:
      lines.append(f"trace: {self.trace_dir}")
    return "\n".join(lines)


@contextlib.contextmanager
def profile(trace_dir: str | None = None, *,
            create_perfetto_trace: bool = False):
  """Times every kernel run on the host inside the block; with `trace_dir`,
  also records a `jax.profiler` trace there (TensorBoard's profile plugin
  reads it; `create_perfetto_trace=True` adds a Perfetto JSON file)."""
  prof = Profile(trace_dir)
  with profile_option(True):
    with _LOCK:
      _ACTIVE.append(prof)
    try:
      if trace_dir:
        with jax.profiler.trace(trace_dir,
                                create_perfetto_trace=create_perfetto_trace):
          yield prof
      else:
        yield prof
    finally:
      with _LOCK:
        _ACTIVE.remove(prof)


@contextlib.contextmanager
def host_run(kernel: str, source: str | None = None):
  """Around one run of a kernel on the host (defined at `source`): a trace
  annotation named after the kernel, and its wall time for each active
  profile."""
  t0 = time.perf_counter()
  with jax.profiler.TraceAnnotation(f"{kernel} (dsl kernel)"):
    yield
  seconds = time.perf_counter() - t0
  with _LOCK:
    active = list(_ACTIVE)
  for p in active:
    p.record(kernel, seconds, source)


host_failures.AROUND_HOST_RUNS.append(host_run)
