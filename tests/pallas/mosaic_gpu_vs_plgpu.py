"""dsl's automatic Mosaic GPU schedule against Pallas's explicit plgpu
kernels that compute the same thing, on paper.

Each pair is built for CUDA on this CPU at the same shapes and tiles:
`kernels.matmul` on "mosaic_gpu" against Pallas's `hopper_matmul_mgpu`,
`kernels.flash_attention` (forward) on "mosaic_gpu" against Pallas's
`attention_mgpu`. Both modules go through jaxlib's Mosaic GPU library
(layout inference, dialect lowering to NVVM and inline PTX); the lowered
module, canonicalized and CSE'd, is read here: per warpgroup role, its hot
loop (the innermost loop that issues WGMMAs: the consumers'; the innermost
that issues TMA loads: the producer's) and, per step of it, the WGMMA
instructions and their shapes, `wgmma.wait_group`s, mbarrier waits and
arrivals, TMA copies and ops; per module, the warpgroups, `setmaxnreg`
budgets, shared memory and CTAs. Registers need ptxas (not on a CPU).

    .venv/bin/python -m tests.pallas.mosaic_gpu_vs_plgpu

prints the table docs/mosaic-gpu.md shows; the contracts are
tests/pallas/test_mosaic_gpu_vs_plgpu.py.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import re
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import core as mgpu_core
from jaxlib.mlir import ir, passmanager

from benchmarks.pallas_library.cases_mgpu import simulated_gpu
from benchmarks.pallas_library.swap import original
from lowering_mosaic.gpu import to_gpu_modules
from tests.pallas.mosaic_gpu_testing import TMA_LOAD, mlir_region

F16 = jnp.float16
COMMAND = "python -m tests.pallas.mosaic_gpu_vs_plgpu"


# ------------------------------------------------------------ building

@contextlib.contextmanager
def lowered_modules():
  """A list that collects the text of each module jaxlib's Mosaic GPU
  library lowers while the block runs: lowered, then canonicalized and
  CSE'd (the unoptimized lowering leaves dead values and duplicates that
  any later pass removes)."""
  out, lower = [], mgpu_core.lower_mgpu_module

  def capture(module, *args, **kwargs):
    result = lower(module, *args, **kwargs)
    text = module.operation.get_asm(enable_debug_info=False)
    clone = ir.Module.parse(text, context=module.context)
    passmanager.PassManager.parse("builtin.module(canonicalize,cse)",
                                  context=module.context).run(clone.operation)
    out.append(clone.operation.get_asm(enable_debug_info=False))
    return result
  mgpu_core.lower_mgpu_module = capture
  try:
    yield out
  finally:
    mgpu_core.lower_mgpu_module = lower


def lowered(f: Callable, *args) -> str:
  """The lowered text of the one Mosaic GPU module `f` builds for CUDA."""
  with lowered_modules() as out:
    jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
  (text,) = out
  return text


@dataclasses.dataclass(frozen=True)
class Pair:
  """A computation as a plain pallas_call kernel of `kernels/` (the
  automatic schedule) and as Pallas's explicit plgpu kernel."""
  name: str
  shapes: str                       # for the table
  args: Callable[[], tuple]
  auto: Callable                    # (*args) -> out, backend "mosaic_gpu"
  plgpu: Callable[[], tuple]        # () -> (module, (*args) -> out)
  plgpu_depth: int                  # the explicit kernel's slots


def _kernel(name):
  return importlib.import_module(f"kernels.{name}")


def _hopper_matmul():
  m = original("gpu.hopper_matmul_mgpu")
  # 64 x 128 per consumer, the two consumers along M: the CTA tile of
  # kernels.matmul on mosaic_gpu (two 64 x 128 blocks), K blocks of 64.
  config = m.TuningConfig(tile_m=64, tile_n=128, tile_k=64,
                          max_concurrent_steps=4,
                          wg_dimension=m.MatmulDimension.M)
  return m, lambda a, b: m.matmul(a, b, None, config)


def _attention_mgpu():
  m = original("gpu.attention_mgpu")
  config = m.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2)
  return m, lambda q, k, v: m.attention(q, k, v, config)


PAIRS = {
    "matmul": Pair(
        "matmul", "512 x 512 x 512 f16, CTA tile 128 x 128, K block 64",
        lambda: (jnp.ones((512, 512), F16),) * 2,
        lambda a, b: _kernel("matmul").matmul(a, b, backend="mosaic_gpu"),
        _hopper_matmul, plgpu_depth=4),
    "attention": Pair(
        "attention", "1 x 1024 x 2 x 128 f16 (B, S, H, D), blocks 64 x 64",
        lambda: (jnp.ones((1, 1024, 2, 128), F16),) * 3,
        lambda q, k, v: _kernel("flash_attention").flash_attention(
            q, k, v, backend="mosaic_gpu"),
        _attention_mgpu, plgpu_depth=2),
}


# ------------------------------------------------------------ reading

@dataclasses.dataclass(frozen=True)
class Loop:
  """One step of a role's hot loop."""
  trips: str                        # the trip count as written
  wgmma: dict[str, int]             # instruction shape -> count
  wgmma_waits: list[int]            # the N of each wgmma.wait_group N
  wgmma_fences: int
  barrier_waits: int                # mbarrier try_wait sites
  barrier_arrives: int              # plain arrivals
  expect_tx: int                    # arrive.expect_tx
  turns: int                        # arrivals on barriers the step also
                                    # waits on: warpgroups taking turns
  bar_syncs: int                    # warpgroup/block barriers (bar.sync),
                                    # outside branches
  tma_loads: int
  ops: int                          # op lines after canonicalize + cse
  branch_ops: int                   # of those, in branches (scf.index_switch
                                    # cases, scf.if): not run at every step
  branch_results: int               # values those branches return (phis:
                                    # selects or moves at every step)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """What one lowered module gives each warpgroup."""
  ctas: int
  warpgroups: int
  smem_bytes: int
  maxnreg: dict[str, int]           # "inc"/"dec" -> registers per thread
  consumer: Loop
  producer: Loop
  depth: int = 0


_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)")
# jaxlib's library writes some as NVVM ops (`nvvm.wgmma.wait.group.sync.
# aligned 0`), some as inline PTX (`wgmma.wait_group.sync.aligned 0`).
_WAIT_GROUP = re.compile(r"wgmma\.wait[._]group\.sync\.aligned (\d+)")
_ARRIVE = re.compile(r"mbarrier\.arrive(?!\.expect_tx)")
_WAITED = re.compile(r"mbarrier\.try_wait\.parity (%[\w#]+),")
_ARRIVED = re.compile(r"mbarrier\.arrive\.release[^\n]*\"r\" (%[\w#]+) :")
_BRANCH = re.compile(r"%[\w#]+(?::(\d+))? = scf\.(?:index_switch|if)\b")
_FOR = re.compile(r"^\s*(?:%\S+ = )?scf\.for %\S+ = %\S+ to (%\S+) ", re.M)
_MAXNREG = re.compile(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32 (\d+)|"
                      r"nvvm\.setmaxregister (increase|decrease) (\d+)")
_LAUNCH = re.compile(r"gpu\.launch .*blocks\(.*\) in \(%\w+ = %c(\d+), "
                     r"%\w+ = %c(\d+), %\w+ = %c(\d+)\) threads\(.*\) in "
                     r"\(%\w+ = %c(\d+),.*dynamic_shared_memory_size "
                     r"%c(\d+)_i32")


def step_of(body: str) -> Loop:
  """The figures of one loop body."""
  lines = [line for line in body.splitlines()[1:-1] if line.strip()]
  every = unbranched(lines)
  every_text = "\n".join(every)
  ops = lambda lines: sum(not line.strip().startswith(("}", "case ",
                                                       "default {"))
                          for line in lines)
  return Loop(
      trips=_FOR.match(body).group(1).lstrip("%"),
      wgmma=dict(collections.Counter(_WGMMA.findall(body))),
      wgmma_waits=[int(n) for n in _WAIT_GROUP.findall(body)],
      wgmma_fences=body.count("wgmma.fence"),
      barrier_waits=body.count("mbarrier.try_wait"),
      barrier_arrives=len(_ARRIVE.findall(body)),
      expect_tx=body.count("mbarrier.arrive.expect_tx"),
      turns=turns(body),
      bar_syncs=every_text.count("bar.sync"),
      tma_loads=len(TMA_LOAD.findall(body)),
      ops=ops(lines), branch_ops=ops(lines) - ops(every),
      branch_results=sum(int(n or 1) for n in _BRANCH.findall(every_text)))


def turns(body: str) -> int:
  """The arrivals in `body` on mbarriers `body` also waits on (the same
  SSA address after CSE): rounds of warpgroups taking turns, as FA3's
  consumers do at the tensor core."""
  waited = set(_WAITED.findall(body))
  return sum(bar in waited for bar in _ARRIVED.findall(body))


def unbranched(lines: list[str]) -> list[str]:
  """`lines` less those in the regions of branches (`case N {`,
  `default {`, and `scf.if`'s `{`/`} else {` regions), whose opening line
  stays."""
  kept, closing = [], None
  for line in lines:
    indent = len(line) - len(line.lstrip())
    if closing is not None:
      if indent == closing and line.strip() == "}":
        closing = None
      continue
    kept.append(line)
    text = line.strip()
    if text.startswith(("case ", "default {")) or (
        "scf.if" in text and text.endswith("{")):
      closing = indent
  return kept


def innermost_loops(text: str, issues: Callable[[str], bool]) -> list[str]:
  """The bodies of the `scf.for` loops of `text` for which `issues` holds
  and for no loop nested in them."""
  bodies = [mlir_region(text, m.start()) for m in _FOR.finditer(text)]
  bodies = [b for b in bodies if issues(b)]
  return [b for b in bodies
          if not any(o is not b and o in b for o in bodies)]


def schedule_of(text: str) -> Schedule:
  """Read a lowered warp-specialized module."""
  gx, gy, gz, threads, smem = map(int, _LAUNCH.search(text).groups())
  maxnreg = {(a or b)[:3]: int(n or m)
             for a, n, b, m in _MAXNREG.findall(text)}
  (consumer,) = innermost_loops(text, lambda b: "wgmma.mma_async" in b)
  (producer,) = innermost_loops(
      text, lambda b: bool(TMA_LOAD.search(b)) and "wgmma" not in b)
  return Schedule(ctas=gx * gy * gz, warpgroups=threads // 128,
                  smem_bytes=smem, maxnreg=maxnreg,
                  consumer=step_of(consumer), producer=step_of(producer))


def automatic(pair: Pair) -> Schedule:
  args = pair.args()
  (module,) = to_gpu_modules(pair.auto, *args)
  found = schedule_of(lowered(pair.auto, *args))
  return dataclasses.replace(found, depth=module.plan.schedule.depth)


def explicit(pair: Pair) -> Schedule:
  module, f = pair.plgpu()
  with simulated_gpu(module):
    found = schedule_of(lowered(f, *pair.args()))
  return dataclasses.replace(found, depth=pair.plgpu_depth)


# ------------------------------------------------------------ comparing

def figures(s: Schedule) -> dict[str, object]:
  """The criteria, by name (as the contracts and the table name them)."""
  c, p = s.consumer, s.producer
  return {
      "warpgroups": s.warpgroups,
      "consumer setmaxnreg": s.maxnreg.get("inc"),
      "producer setmaxnreg": s.maxnreg.get("dec"),
      "depth (slots)": s.depth,
      "consumer wgmma per step": c.wgmma,
      "consumer wgmma.wait_group per step": len(c.wgmma_waits),
      "consumer wgmma.fence per step": c.wgmma_fences,
      "consumer mbarrier waits per step": c.barrier_waits,
      "consumer mbarrier arrivals per step": c.barrier_arrives,
      "consumer bar.sync per step": c.bar_syncs,
      "consumer turn-taking rounds per step": c.turns,
      "consumer ops per step": c.ops - c.branch_ops,
      "consumer ops in branches": c.branch_ops,
      "consumer values chosen by branches per step": c.branch_results,
      "producer TMA loads per step": p.tma_loads,
      "producer mbarrier waits per step": p.barrier_waits,
      "producer expect_tx per step": p.expect_tx,
      "producer bar.sync per step": p.bar_syncs,
      "producer ops per step": p.ops - p.branch_ops,
      "producer ops in branches": p.branch_ops,
      "shared memory (bytes)": s.smem_bytes,
      "CTAs": s.ctas,
  }


# criterion -> ours no worse than theirs. Shared memory and CTAs are
# shown, not judged: a deeper ring takes more shared memory (one CTA per
# SM either way), and Pallas's matmul is persistent (one CTA per SM).
NO_WORSE = {
    "warpgroups": lambda a, b: a == b,
    "consumer setmaxnreg": lambda a, b: a >= b,
    "producer setmaxnreg": lambda a, b: a <= b,
    "depth (slots)": lambda a, b: a >= b,
    "consumer wgmma per step": lambda a, b: a == b,
    "consumer wgmma.wait_group per step": lambda a, b: a <= b,
    "consumer mbarrier waits per step": lambda a, b: a <= b,
    "consumer mbarrier arrivals per step": lambda a, b: a <= b,
    "consumer bar.sync per step": lambda a, b: a <= b,
    # Turns cost barriers but buy overlap (one consumer's softmax under the
    # other's WGMMAs), which counting cannot weigh: as many as Pallas's.
    "consumer turn-taking rounds per step": lambda a, b: a >= b,
    "consumer ops per step": lambda a, b: a <= b,
    "consumer values chosen by branches per step": lambda a, b: a <= b,
    "producer TMA loads per step": lambda a, b: a <= b,
    "producer mbarrier waits per step": lambda a, b: a <= b,
    "producer expect_tx per step": lambda a, b: a <= b,
    "producer bar.sync per step": lambda a, b: a <= b,
    "producer ops per step": lambda a, b: a <= b,
}


def compare(name: str) -> dict[str, tuple[object, object]]:
  """criterion -> (ours, Pallas's) for the pair `name`."""
  pair = PAIRS[name]
  ours, theirs = figures(automatic(pair)), figures(explicit(pair))
  return {k: (ours[k], theirs[k]) for k in ours}


def table() -> str:
  rows = {name: compare(name) for name in PAIRS}
  head = "| criterion | " + " | ".join(
      f"{n}: ours / plgpu" for n in rows) + " |"
  lines = [head, "|---" * (len(rows) + 1) + "|"]
  for k in next(iter(rows.values())):
    cells = []
    for figs in rows.values():
      a, b = figs[k]
      worse = k in NO_WORSE and not NO_WORSE[k](a, b)
      fmt = lambda v: (", ".join(f"{n} {s}" for s, n in v.items())
                       if isinstance(v, dict) else str(v))
      cells.append(f"{fmt(a)} / {fmt(b)}" + (" (worse)" if worse else ""))
    lines.append(f"| {k} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


if __name__ == "__main__":
  for name, pair in PAIRS.items():
    print(f"{name}: {pair.shapes}")
  print(table())
