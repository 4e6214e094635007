"""Automatic reverse mode against the hand-written backward kernels.

    python -m benchmarks.grad_vs_hand [--backend interpret] [--repeats 7]
                                      [--kernels softmax,layer_norm,...]
                                      [--small] [--aot sm_90]

For each kernel of `kernels/` that has a hand-written backward pass
(`custom_vjp`), times `jax.grad` of a loss through it (forward kernel plus
the hand-written backward kernels) and through its forward kernel alone,
whose backward pass the DSL derives (linear, transposed and, where needed,
recording kernels). Both use the same block sizes and the same cotangent;
the gradients are checked to agree before timing. Samples are taken in
alternating rounds (`dsl.tools.timing.run_interleaved`, the benchmark timer), so
the ratio is fair on a shared machine; `--stat min` is steadier on a loaded one.

The cases: softmax, layer_norm, rms_norm, matmul, and flash attention
causal (`flash_attention`), non-causal and with grouped kv heads
(`flash_attention_gqa`: 4 query heads on 2 kv heads).

`--aot sm_90` runs no kernel: it compiles both gradients' Triton kernels
ahead of time for that architecture (no GPU needed; at the `AOT` sizes,
whose kernels compile in seconds, or `--small`) and prints, per kernel,
the compile time, launch grid, registers, shared memory, programs per SM
and hot-loop instructions: the compile path of `--backend triton`, and
the structure its timings will depend on. Then it compares the derived
backward kernels with the hand-written ones (`benchmarks.grad_structure`:
hot loops, registers, occupancy, spills, wgmma, passes over the inputs).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import grad_structure
from dsl.tools import timing
from lowering_triton.ptx_stats import blocks_per_sm

_mod = lambda name: importlib.import_module(f"kernels.{name}")


def _rand(seed, *shapes):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in shapes)


def _grad(f, args, ct):
  """The gradient of `sum(f(*args) * ct)` in every arg."""
  return jax.grad(lambda *xs: jnp.sum(f(*xs) * ct),
                  tuple(range(len(args))))


def softmax_case(backend, rows=2048, cols=1024, block_rows=64):
  sm = _mod("softmax")
  (x,) = _rand(0, (rows, cols))
  (ct,) = _rand(1, (rows, cols))
  hand = functools.partial(sm.softmax, backend=backend, block_rows=block_rows)
  auto = functools.partial(sm.softmax_2d, backend=backend,
                           block_rows=block_rows)
  return f"softmax {rows}x{cols}", hand, auto, (x,), ct


def layer_norm_case(backend, rows=2048, cols=1024, block_rows=64):
  ln = _mod("layer_norm")
  x, w, b = _rand(0, (rows, cols), (cols,), (cols,))
  (ct,) = _rand(1, (rows, cols))
  hand = functools.partial(ln.layer_norm, backend=backend,
                           block_rows=block_rows)

  def auto(x, w, b):
    return ln.forward(x, w, b, eps=1e-5, backend=backend,
                      block_rows=block_rows)[0]
  return f"layer_norm {rows}x{cols}", hand, auto, (x, w, b), ct


def rms_norm_case(backend, rows=2048, cols=1024, block_rows=64):
  rn = _mod("rms_norm")
  x, w = _rand(0, (rows, cols), (cols,))
  (ct,) = _rand(1, (rows, cols))
  hand = functools.partial(rn.rms_norm, backend=backend,
                           block_rows=block_rows)

  def auto(x, w):
    return rn.forward(x, w, eps=1e-6, backend=backend,
                      block_rows=block_rows)[0]
  return f"rms_norm {rows}x{cols}", hand, auto, (x, w), ct


def flash_attention_case(backend, batch=1, seq=512, heads=4, head_dim=64,
                         block=128, causal=True, kv_heads=None):
  """`kv_heads` < `heads`: grouped-query attention (each kv head serves
  `heads // kv_heads` query heads)."""
  fa = _mod("flash_attention")
  kv_heads = heads if kv_heads is None else kv_heads
  q_shape = (batch, seq, heads, head_dim)
  kv_shape = (batch, seq, kv_heads, head_dim)
  q, k, v = _rand(0, q_shape, kv_shape, kv_shape)
  (ct,) = _rand(1, q_shape)
  scale = 1 / math.sqrt(head_dim)
  hand = functools.partial(fa.flash_attention, causal=causal, sm_scale=scale,
                           backend=backend, block_q=block, block_k=block)

  def auto(q, k, v):
    # The grid kernel: reverse mode cannot differentiate the Triton loops,
    # whose trip counts depend on the program id.
    return fa.forward(q, k, v, causal=causal, sm_scale=scale,
                      backend=backend, block_q=block, block_k=block,
                      loops=False)[0]
  kind = ("causal" if causal else "non-causal") + (
      f" gqa {heads}/{kv_heads}" if kv_heads != heads else "")
  return (f"flash_attention {kind} {batch}x{seq}x{heads}x{head_dim}", hand,
          auto, (q, k, v), ct)


def matmul_case(backend, m=1024, k=1024, n=1024, blocks=None):
  mm = _mod("matmul")
  x, y = _rand(0, (m, k), (k, n))
  (ct,) = _rand(1, (m, n))
  hand = functools.partial(mm.matmul, backend=backend, block_sizes=blocks)
  auto = functools.partial(mm.matmul_2d, backend=backend, blocks=blocks)
  return f"matmul {m}x{k}x{n}", hand, auto, (x, y), ct


CASES = {"softmax": softmax_case, "layer_norm": layer_norm_case,
         "rms_norm": rms_norm_case, "matmul": matmul_case,
         "flash_attention": flash_attention_case,
         "flash_attention_noncausal": functools.partial(
             flash_attention_case, causal=False),
         "flash_attention_gqa": functools.partial(flash_attention_case,
                                                  kv_heads=2)}
# `--small`: seconds-long smoke runs (the tests use them).
_SMALL_ATTENTION = dict(seq=32, heads=1, head_dim=32, block=16)
SMALL = {"softmax": dict(rows=16, cols=128, block_rows=8),
         "layer_norm": dict(rows=16, cols=128, block_rows=8),
         "rms_norm": dict(rows=16, cols=128, block_rows=8),
         "matmul": dict(m=32, k=32, n=32, blocks=(16, 16, 16)),
         "flash_attention": _SMALL_ATTENTION,
         "flash_attention_noncausal": _SMALL_ATTENTION,
         "flash_attention_gqa": dict(_SMALL_ATTENTION, heads=2, kv_heads=1)}
# `--aot`: sizes whose kernels compile in seconds (row tiles of 16 rows,
# 64 x 64 attention tiles); the tests and the docs' table use them.
_AOT_ATTENTION = dict(seq=256, heads=2, head_dim=64, block=64)
AOT = {"softmax": dict(block_rows=16), "layer_norm": dict(block_rows=16),
       "rms_norm": dict(block_rows=16), "matmul": {},
       "flash_attention": _AOT_ATTENTION,
       "flash_attention_noncausal": _AOT_ATTENTION,
       "flash_attention_gqa": dict(_AOT_ATTENTION, heads=4, kv_heads=2)}


def measure(name: str, backend: str, repeats: int, small: bool = False,
            stat: str = "median") -> dict:
  label, fns, args = gradients(name, backend, small)
  prepared = {k: timing.prepare(f, args, slow_s=30.0) for k, f in fns.items()}
  for g_hand, g_auto in zip(prepared["hand"].stats.output,
                            prepared["auto"].stats.output):
    np.testing.assert_allclose(g_auto, g_hand, rtol=2e-3, atol=2e-3)
  stats = timing.run_interleaved(prepared, args, repeats=repeats)
  return {"case": label, "hand_s": stats["hand"].value(stat),
          "auto_s": stats["auto"].value(stat),
          "spread": max(stats["hand"].spread, stats["auto"].spread)}


def pair(name: str, backend: str, small: bool = False, **sizes):
  """(label, {"hand": f, "auto": f}, args, ct) of case `name` (at its
  `--small` sizes, or `sizes`): the two functions whose gradients meet."""
  label, hand, auto, args, ct = CASES[name](
      backend, **(SMALL[name] if small else sizes))
  return label, {"hand": hand, "auto": auto}, args, ct


def gradients(name: str, backend: str, small: bool = False, **sizes):
  """(label, {"hand": grad fn, "auto": grad fn}, args) of case `name` (at
  its `--small` sizes, or `sizes`)."""
  label, fns, args, ct = pair(name, backend, small, **sizes)
  return label, {side: _grad(f, args, ct) for side, f in fns.items()}, args


def compile_pair(name: str, target: str = "sm_90", small: bool = False,
                 compiled: dict | None = None):
  """(label, {"hand": Side, "auto": Side}) of case `name` at its `AOT`
  sizes (or `--small` ones), compiled for `target` (`grad_structure`);
  `compiled`, when given, receives each side's AotKernels and compile
  seconds."""
  sizes = {} if small else AOT[name]
  label, fns, args, ct = pair(name, "triton", small, **sizes)
  sides = {}
  for side, f in fns.items():
    t0, kernels = time.perf_counter(), []
    sides[side] = grad_structure.compile_side(
        _grad(f, args, ct), f, args, target, kernels)
    if compiled is not None:
      compiled[side] = (kernels, time.perf_counter() - t0)
  return label, sides


def _kernel_line(k) -> str:
  st = k.stats()
  hot = [lp.mix.instructions for lp in st.hot_loops]
  grid = k.spec.grid_mapping.grid
  return (f"  {k.name:36} grid {str(tuple(grid)):16} launch "
          f"{str(k.launch):14} w{k.num_warps} s{k.num_stages} "
          f"{st.registers} regs {k.shared // 1024} KiB "
          f"{blocks_per_sm(st.registers, k.num_warps, k.shared)}/SM "
          + (f"hot loops {hot} instr" if hot else
             f"{st.kernel.instructions} instr, no loop")
          + (f" SPILLS {st.spill_bytes} B" if st.spills else ""))


def compile_report(name: str, target: str, small: bool = False) -> list[str]:
  """Lines describing both gradients' Triton kernels compiled for `target`
  and how the derived backward kernels compare (see the module
  docstring)."""
  compiled = {}
  label, sides = compile_pair(name, target, small, compiled)
  out = []
  for side, (kernels, seconds) in compiled.items():
    out.append(f"{label} {side}: {len(kernels)} kernels compiled for "
               f"{target} in {seconds:.1f} s")
    out += [_kernel_line(k) for k in kernels]
  verdicts = grad_structure.compare(sides["hand"], sides["auto"])
  out.append(f"{label} auto vs hand (backward kernels; goal "
             f"<= {grad_structure.SLACK}x):")
  out += [f"  {'ok  ' if v.holds else 'MISS'} {v}" for v in verdicts.values()]
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks.grad_vs_hand",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--backend", default="interpret")
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--kernels", default=",".join(CASES),
                 help=f"comma-separated, of {', '.join(CASES)}")
  p.add_argument("--stat", choices=("median", "min"), default="median",
                 help="min is steadier on a loaded machine")
  p.add_argument("--small", action="store_true", help="tiny sizes (a smoke "
                 "test; the figures mean little)")
  p.add_argument("--aot", metavar="TARGET", help="compile the Triton "
                 "kernels of both gradients for TARGET (e.g. sm_90) and "
                 "describe them, running nothing (no GPU needed)")
  args = p.parse_args(argv)
  names = [n for n in args.kernels.split(",") if n]
  unknown = [n for n in names if n not in CASES]
  if unknown:
    p.error(f"unknown kernels {unknown}; choose from {', '.join(CASES)}")
  if args.aot:
    for name in names:
      print("\n".join(compile_report(name, args.aot, args.small)),
            flush=True)
    return 0
  print(f"jax.grad, backend={args.backend}, {args.stat} of {args.repeats} "
        f"samples, {jax.devices()[0].platform}")
  print(f"{'case':44} {'hand (ms)':>10} {'auto (ms)':>10} {'auto/hand':>9}")
  for name in names:
    r = measure(name, args.backend, args.repeats, args.small, args.stat)
    print(f"{r['case']:44} {r['hand_s'] * 1e3:10.2f} {r['auto_s'] * 1e3:10.2f}"
          f" {r['auto_s'] / r['hand_s']:9.2f}  (spread {r['spread']:.0%})",
          flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
