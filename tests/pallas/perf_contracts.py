"""Performance contracts: what decides GPU speed, checked on a CPU.

Every benchmark kernel and every kernel of `kernels/` that runs on Triton is
compiled ahead of time for sm_90 at its default GPU configuration, and its
PTX (`lowering_triton.ptx_stats`) is held to:

- the recorded baseline of each hot loop's instruction mix (selects,
  stores, predicated global loads, instructions per iteration must not
  grow; wgmma and async copies must not drop), one file per Triton
  release (major.minor), tests/pallas/data/perf_baselines/triton-X.Y.json:
  each release compiles the same source to its own PTX;
- no register spills (no local memory);
- wgmma for 16-bit dots on tiles of at least 64 x 64;
- no predicated global loads in hot loops where every block is whole and
  every run-time coordinate is proven inside its array;
- async copies in every hot loop that feeds a dot from global memory when
  num_stages > 1 (Triton's software pipelining);
- shared memory and registers that let as many programs share an SM as the
  baseline's (and at least one).

docs/performance.md says why each predicts speed and how to read a failure.
Re-record the baseline after an intended change (a new default config, a
faster loop) with

    .venv/bin/python -m tests.pallas.perf_contracts --record [CASE ...]

with the Triton the change is for, and commit the JSON diff, which shows
what moved.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import triton

import dsl
import kernels
from benchmarks import gpu_triton, grad_vs_hand, peers
from benchmarks.suite import by_name
from dsl.tools import autotune_cache, gpu_defaults
from dsl.core import config as dsl_config
from dsl.core import ranges, ref_ops
from dsl.core.blockspec import Element, squeezed
from lowering_triton import aot
from lowering_triton.ptx_stats import SM90, Mix, blocks_per_sm

TARGET = "sm_90"
# The GPU whose shipped defaults (dsl/tools/data/gpu_configs.json) the kernels are
# compiled at: the configs a user of that GPU runs.
DEVICE = ("NVIDIA H200", "9.0")
BASELINES_DIR = os.path.join(os.path.dirname(__file__), "data",
                             "perf_baselines")
RECORD = "python -m tests.pallas.perf_contracts --record"
S = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32

# Hot-loop classes that cost time when they grow, and those whose drop means
# Hopper's fast path was lost.
MUST_NOT_GROW = ("selp", "st_global", "st_shared", "st_local",
                 "ld_global_predicated", "ld_local")
MUST_NOT_DROP = ("wgmma", "cp_async_bulk")
# cp.async copies may drop only where TMA copies (cp_async_bulk) replace them.
INSTRUCTION_SLACK = 1.10


@dataclasses.dataclass(frozen=True)
class Case:
  """A function whose Triton kernels are held to the contracts."""
  name: str
  build: Callable[[], tuple]   # -> (function, abstract args)
  slow: bool = False
  exclude: str | None = None   # a case whose kernels this one leaves out
  # (the forward kernels of a backward case)


# ------------------------------------------------------------------ cases

def gpu_triton_call(which, dtype, pl=dsl):
  """A kernel of benchmarks/gpu_triton.py (written against `pl`: dsl or
  Pallas) at its benchmark size and default config, and abstract args."""
  if which == "matmul":
    x = S((4096, 4096), dtype)
    return gpu_triton.make_matmul(pl), (x, x)
  x = S((16384, 8192), dtype)
  if which == "softmax":
    return gpu_triton.make_softmax(pl), (x,)
  w = S((8192,), F32)
  return gpu_triton.make_layer_norm(pl), (x, w, w)


def suite_setup(name, dtype):
  """(bench, size, config, abstract args) of the benchmark suite's kernel
  `name` at its largest GPU size and the Triton config a user of DEVICE
  runs (its shipped default)."""
  bench = by_name()[name]
  size = bench.default_sizes("gpu")[-1]
  with gpu_defaults.for_device(*DEVICE):
    config, _ = bench.chosen_config(size, "triton", "gpu", dtype)
  args = tuple(S(a.shape, a.dtype) for a in jax.eval_shape(
      lambda: bench.inputs(size, dtype)))
  return bench, size, config, args


def _suite(name, dtype):
  bench, size, config, args = suite_setup(name, dtype)
  return peers.dsl_fn(bench, "triton", size, dtype, config), args


def _grad(fn, n_args):
  return jax.grad(lambda *a: jnp.sum(fn(*a).astype(F32)),
                  argnums=tuple(range(n_args)))


def _kernels(name, dtype, backward=False):
  rows = S((8192, 8192), dtype)
  vec = S((8192,), dtype)
  cases = {
      "softmax": (lambda x: kernels.softmax(x, backend="triton"), (rows,)),
      "layer_norm": (lambda x, w, b: kernels.layer_norm(
          x, w, b, backend="triton"), (rows, vec, vec)),
      "rms_norm": (lambda x, w: kernels.rms_norm(x, w, backend="triton"),
                   (rows, vec)),
      "matmul": (lambda x, y: kernels.matmul(x, y, backend="triton"),
                 (S((4096, 4096), dtype),) * 2),
      "flash_attention": (lambda q, k, v: kernels.flash_attention(
          q, k, v, backend="triton"), (S((4, 2048, 16, 128), dtype),) * 3),
      "flash_attention_causal": (lambda q, k, v: kernels.flash_attention(
          q, k, v, causal=True, backend="triton"),
          (S((4, 2048, 16, 128), dtype),) * 3),
      "flash_attention_d64": (lambda q, k, v: kernels.flash_attention(
          q, k, v, backend="triton"), (S((4, 2048, 16, 64), dtype),) * 3),
      "decode_attention": (lambda q, k, v, n: kernels.decode_attention(
          q, k, v, n, backend="triton"),
          (S((8, 32, 128), dtype), S((8, 4096, 8, 128), dtype),
           S((8, 4096, 8, 128), dtype), S((8,), jnp.int32))),
      "paged_attention": (lambda q, k, v, n, t: kernels.paged_attention(
          q, k, v, n, t, backend="triton"),
          (S((8, 32, 128), dtype), S((8, 1024, 16, 128), dtype),
           S((8, 1024, 16, 128), dtype), S((8,), jnp.int32),
           S((8, 128), jnp.int32))),
  }
  fn, args = cases[name]
  if backward:
    n = sum(1 for a in args if jnp.issubdtype(a.dtype, jnp.floating))
    return _grad(fn, n), args
  return fn, args


# Automatic reverse mode: jax.grad through a kernel's forward alone, whose
# backward kernels (linear, recording, transposed) dsl derives: the cases of
# benchmarks/grad_vs_hand.py (float32), at its `AOT` sizes (row tiles that
# compile in seconds).
GRAD_SIZES = {name: grad_vs_hand.AOT[name] for name in (
    "softmax", "layer_norm", "matmul", "flash_attention")}


def derived_backward(name):
  """The automatic gradient of grad_vs_hand's case `name` on Triton, and
  abstract args."""
  _, fns, args = grad_vs_hand.gradients(name, "triton", **GRAD_SIZES[name])
  return fns["auto"], tuple(S(a.shape, a.dtype) for a in args)


def _all_cases() -> list[Case]:
  out = [Case(f"grad.{name}.auto.f32", functools.partial(
      derived_backward, name), slow=name == "flash_attention")
         for name in GRAD_SIZES]
  for dtype, tag in ((BF16, "bf16"), (F32, "f32")):
    slow = dtype == F32
    for which in ("matmul", "softmax", "layer_norm"):
      out.append(Case(f"gpu_triton.{which}.{tag}",
                      functools.partial(gpu_triton_call, which, dtype), slow))
    for name in ("add", "matmul", "softmax", "layer_norm"):
      out.append(Case(f"suite.{name}.{tag}",
                      functools.partial(_suite, name, dtype), not slow))
    for name in ("softmax", "layer_norm", "rms_norm", "matmul",
                 "flash_attention", "flash_attention_causal",
                 "flash_attention_d64"):
      fwd = f"kernels.{name}.fwd.{tag}"
      out.append(Case(fwd, functools.partial(_kernels, name, dtype), slow))
      out.append(Case(f"kernels.{name}.bwd.{tag}", functools.partial(
          _kernels, name, dtype, True), slow, exclude=fwd))
    for name in ("decode_attention", "paged_attention"):
      out.append(Case(f"kernels.{name}.{tag}",
                      functools.partial(_kernels, name, dtype), slow))
  return out


CASES = {c.name: c for c in _all_cases()}


# ------------------------------------------------------------- compiling

@dataclasses.dataclass(frozen=True)
class KernelReport:
  """One compiled kernel and the facts its contracts depend on."""
  name: str
  num_warps: int
  num_stages: int
  shared: int
  registers: int | None
  local_bytes: int | None
  kernel: Mix
  hot_loops: tuple[Mix, ...]
  hot_labels: tuple[str, ...]
  dot16: bool            # a bf16/f16 dot on a tile of at least 64 x 64
  whole: bool            # whole blocks, every coordinate proven inside
  launch: tuple[int, int, int] = (1, 1, 1)   # programs along x, y, z

  @property
  def occupancy(self) -> int:
    return blocks_per_sm(self.registers, self.num_warps, self.shared)

  @property
  def hot(self) -> tuple[Mix, ...]:
    """The hot loops, or the whole kernel when it has no loop."""
    return self.hot_loops or (self.kernel,)

  def summary(self) -> dict:
    return {"name": self.name, "num_warps": self.num_warps,
            "num_stages": self.num_stages, "shared": self.shared,
            "registers": self.registers, "occupancy": self.occupancy,
            "kernel": self.kernel.as_dict(),
            "hot_loops": [m.as_dict() for m in self.hot_loops]}


def _eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for v in eqn.params.values():
      for sub in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _eqns(inner)


def _has_dot16(spec) -> bool:
  for eqn in _eqns(spec.jaxpr.jaxpr):
    if eqn.primitive is not jax.lax.dot_general_p:
      continue
    a, b = (v.aval for v in eqn.invars)
    out = eqn.outvars[0].aval.shape
    if (a.dtype in (BF16, jnp.float16) and b.dtype == a.dtype
        and len(out) >= 2 and min(out[-2:]) >= 64):
      return True
  return False


def _whole(spec) -> bool:
  gm = spec.grid_mapping
  if gm.num_scalar_prefetch:      # blocks placed by data may lie outside
    return False
  for bm in gm.block_mappings:
    for d, n in zip(bm.block_shape, bm.array_aval.shape):
      size = 1 if d is squeezed else getattr(d, "block_size", d)
      if isinstance(d, Element) or n % size or size & (size - 1):
        return False
  for eqn in _eqns(spec.jaxpr.jaxpr):
    if eqn.params.get("has_mask") or eqn.primitive in (
        ref_ops.atomic_rmw_p, ref_ops.atomic_cas_p):
      return False
  result = ranges.analyze_kernel(spec)
  return all(all(a.proven(d)) for _, a in result.items()
             for d in range(len(a.array_shape)))


@contextlib.contextmanager
def _no_autotune_cache():
  """Kernels pick their default configs, whatever the user's cache says."""
  old = os.environ.get(autotune_cache.ENV_VAR)
  os.environ[autotune_cache.ENV_VAR] = os.devnull
  try:
    yield
  finally:
    if old is None:
      os.environ.pop(autotune_cache.ENV_VAR)
    else:
      os.environ[autotune_cache.ENV_VAR] = old


def report(kernel: aot.AotKernel) -> KernelReport:
  stats = kernel.stats()
  return KernelReport(
      kernel.name, kernel.num_warps, kernel.num_stages, kernel.shared,
      stats.registers, stats.local_bytes, stats.kernel,
      tuple(lp.mix for lp in stats.hot_loops),
      tuple(lp.label for lp in stats.hot_loops), _has_dot16(kernel.spec),
      _whole(kernel.spec), kernel.launch)


def compile_case(name: str, tensor_descriptors: bool = True
                 ) -> tuple[KernelReport, ...]:
  """The reports of the kernels of case `name` (with TMA tensor descriptors
  where the lowering emits them, or none)."""
  case = CASES[name]
  with _no_autotune_cache(), gpu_defaults.for_device(*DEVICE), \
      dsl_config.triton_tensor_descriptors_option(tensor_descriptors):
    jax.clear_caches()   # kernels/ traces are cached per device's defaults
    fn, args = case.build()
    kernels = aot.compile_aot(fn, *args, target=TARGET)
  reports = [report(k) for k in kernels]
  if case.exclude:
    # A backward case's function runs the forward kernels first.
    fwd = [r.name for r in compiled(case.exclude, tensor_descriptors)]
    if [r.name for r in reports[:len(fwd)]] == fwd:
      reports = reports[len(fwd):]
  return tuple(reports)


compiled = functools.lru_cache(maxsize=None)(compile_case)   # per process


# ------------------------------------------------------------- contracts

_GROW_HINTS = {
    "selp": "selects: a mask or fill value the loop did not have",
    "st_shared": "shared-memory stores: a tile that no longer goes straight "
                 "from async copies to the dot",
    "ld_global_predicated": "predicated global loads: masked loads",
    "st_local": "local memory: register spills",
    "ld_local": "local memory: register spills",
}


def structural_problems(r: KernelReport) -> list[str]:
  """What `r` breaks of the contracts that need no baseline."""
  out = []
  local = r.kernel.ld_local + r.kernel.st_local
  if r.local_bytes or local:
    out.append(f"spills registers: {r.local_bytes or 0} bytes of local "
               f"memory per thread, {local} local loads/stores in the PTX")
  if r.dot16 and not r.kernel.wgmma:
    out.append("a bf16/f16 dot on a tile of at least 64 x 64 compiles "
               "without wgmma (Hopper's warpgroup MMA)")
  predicated = sum(m.ld_global_predicated for m in r.hot)
  if r.whole and predicated:
    out.append(f"{predicated} predicated global loads in the hot loop(s) "
               "although every block is whole and every coordinate proven "
               "inside its array")
  for j, m in enumerate(r.hot_loops):
    loads = m.ld_global + m.cp_async + m.cp_async_bulk
    if (r.num_stages > 1 and (m.wgmma or m.mma) and loads
        and not (m.cp_async or m.cp_async_bulk)):
      out.append(f"hot loop {j} feeds dots from global memory without async "
                 f"copies although num_stages={r.num_stages} (not pipelined)")
  if r.shared > SM90["shared"] or r.occupancy < 1:
    out.append(f"does not fit an SM: {r.shared} bytes of shared memory, "
               f"{r.registers} registers x {r.num_warps} warps")
  return out


def baseline_problems(r: KernelReport, base: dict) -> list[str]:
  """How `r` moved against its recorded baseline `base` (the worse way)."""
  config = (r.num_warps, r.num_stages)
  if config != (base["num_warps"], base["num_stages"]):
    return [f"the config changed from num_warps={base['num_warps']}, "
            f"num_stages={base['num_stages']} to num_warps={r.num_warps}, "
            f"num_stages={r.num_stages}"]
  out = []
  if r.occupancy < base["occupancy"]:
    out.append(f"{r.occupancy} programs per SM where the baseline fits "
               f"{base['occupancy']} ({r.registers} registers, was "
               f"{base['registers']}; {r.shared} bytes of shared memory, was "
               f"{base['shared']})")
  loops = base["hot_loops"]
  if len(loops) != len(r.hot_loops):
    return out + [f"{len(r.hot_loops)} hot loops where the baseline has "
                  f"{len(loops)}"]
  labels = r.hot_labels or ("",)
  for j, (mix, was) in enumerate(zip(r.hot, loops or [base["kernel"]])):
    now = mix.as_dict()
    where = (f"hot loop {j} ({labels[j]}), per iteration:" if r.hot_loops
             else "the kernel (it has no loop):")
    moved = [f"{k} {now[k]} (baseline {was[k]}"
             + (f"; {_GROW_HINTS[k]})" if k in _GROW_HINTS else ")")
             for k in MUST_NOT_GROW if now[k] > was[k]]
    moved += [f"{k} {now[k]} (baseline {was[k]}: lost)"
              for k in MUST_NOT_DROP if now[k] < was[k]]
    if now["cp_async"] < was["cp_async"] and not (
        now["cp_async_bulk"] > was["cp_async_bulk"]):
      moved.append(f"cp_async {now['cp_async']} (baseline {was['cp_async']}: "
                   "lost, and no TMA copies took their place)")
    if now["instructions"] > was["instructions"] * INSTRUCTION_SLACK + 4:
      moved.append(f"instructions {now['instructions']} (baseline "
                   f"{was['instructions']})")
    if moved:
      out.append(f"{where} " + ", ".join(moved))
  return out


def triton_release(version: str = triton.__version__) -> str:
  """"3.9.0" -> "3.9": the Triton release a baseline file belongs to."""
  return ".".join(version.split(".")[:2])


def baselines_path(version: str = triton.__version__) -> str:
  """The baseline file of the Triton release `version` belongs to."""
  return os.path.join(BASELINES_DIR, f"triton-{triton_release(version)}.json")


def load_baselines(path: str | None = None) -> dict:
  path = baselines_path() if path is None else path
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    return {"format": 1, "target": TARGET, "cases": {}}


def problems(name: str, reports=None, baselines=None) -> list[str]:
  """Every broken contract of case `name`, one readable line each."""
  reports = compiled(name) if reports is None else reports
  baselines = load_baselines() if baselines is None else baselines
  recorded = baselines["cases"].get(name)
  out = []
  if recorded is None:
    out.append(f"{name}: no baseline recorded for triton {triton_release()}")
  elif len(recorded) != len(reports):
    out.append(f"{name}: {len(reports)} kernels where the baseline has "
               f"{len(recorded)} ({[r.name for r in reports]} vs "
               f"{[b['name'] for b in recorded]})")
  for i, r in enumerate(reports):
    found = structural_problems(r)
    if recorded is not None and len(recorded) == len(reports):
      found += baseline_problems(r, recorded[i])
    out += [f"{name}: kernel {i} '{r.name}' (num_warps={r.num_warps}, "
            f"num_stages={r.num_stages}): {p}" for p in found]
  if out:
    out.append(f"If the change is intended, re-record the baseline: {RECORD} "
               f"{name}  (see docs/performance.md)")
  return out


def record(names, path: str | None = None) -> dict:
  """Compiles the cases `names` and writes their baselines into `path` (the
  running Triton release's file)."""
  path = baselines_path() if path is None else path
  data = load_baselines(path)
  data.update(format=1, target=TARGET,
              versions={"jax": jax.__version__, "triton": triton.__version__})
  for name in names:
    data["cases"][name] = [r.summary() for r in compiled(name)]
  data["cases"] = dict(sorted(data["cases"].items()))
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(data, f, indent=1, sort_keys=True)
    f.write("\n")
  return data


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
      prog="python -m tests.pallas.perf_contracts",
      description="Check or re-record the performance contracts (sm_90 PTX "
                  "of every benchmark and kernels/ kernel on Triton).")
  p.add_argument("cases", nargs="*", help="case names (default: all)")
  p.add_argument("--record", action="store_true",
                 help="write the current figures as the baseline")
  p.add_argument("--list", action="store_true", help="list the cases")
  a = p.parse_args(argv)
  unknown = [n for n in a.cases if n not in CASES]
  if unknown:
    p.error(f"unknown case(s) {unknown}; see --list")
  names = a.cases or list(CASES)
  if a.list:
    for n in names:
      print(f"{n}{'  (slow)' if CASES[n].slow else ''}")
    return 0
  if a.record:
    record(names)
    print(f"recorded {len(names)} case(s) in "
          f"{os.path.relpath(baselines_path())}")
    return 0
  failed = 0
  for n in names:
    found = problems(n)
    failed += bool(found)
    print(f"{n}: " + ("ok" if not found else "\n  " + "\n  ".join(found)))
  return int(bool(failed))


if __name__ == "__main__":
  sys.exit(main())
