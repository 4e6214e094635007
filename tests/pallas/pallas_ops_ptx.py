"""Pallas's GPU kernel library compiled twice for sm_90: by dsl (the
swapped copy, benchmarks/pallas_library/swap.py) and by Pallas's own Triton
lowering (the original, tests/pallas/pallas_ptx.py), from the same source
at the same shapes, kernel by kernel.

Each case is an op of `jax.experimental.pallas.ops.gpu` that Pallas lowers
through Triton (not the `*_mgpu` ones) at a realistic GPU shape: forward,
and backward where the op has a custom_vjp with backward kernels (the
gradient's function runs the forward kernels too; every kernel is
compared). `python -m tests.pallas.pallas_ops_ptx [CASE ...]` prints the
figures of docs/performance.md ("Pallas's kernel library").
"""
from __future__ import annotations

import dataclasses
import functools
import re
import sys
import warnings
from typing import Callable

import jax
import jax.numpy as jnp

from dsl.core import config as dsl_config
from lowering_triton import aot
from benchmarks.pallas_library import swap
from tests.pallas import perf_contracts
from tests.pallas.pallas_ptx import compile_with_pallas, figures, worse_than

S = jax.ShapeDtypeStruct
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32


@dataclasses.dataclass(frozen=True)
class PtxCase:
  """`build(module)` -> (function, abstract args), `module` being the op's
  module of `jax.experimental.pallas.ops` (swapped or Pallas's); the names
  of the kernels it compiles, in dsl's order."""
  module: str
  build: Callable
  kernels: tuple[str, ...]
  slow: bool = False


def _grad(f, n):
  return jax.grad(lambda *a: jnp.sum(f(*a).astype(F32)),
                  argnums=tuple(range(n)))


_QKV = (S((2, 1024, 4, 64), BF16),) * 3       # batch, seq, heads, head dim


def _attention(causal=False, segments=False, backward=False):
  def build(m):
    if segments:
      f = lambda q, k, v, s: m.mha(q, k, v, s, causal=causal)
      return f, _QKV + (S((2, 1024), I32),)
    f = lambda q, k, v: m.mha(q, k, v, None, causal=causal)
    return (_grad(f, 3) if backward else f), _QKV
  return build


def _decode(kind, lengths=False):
  def build(m):
    if kind == "mqa":
      q, kv = S((2, 16, 128), BF16), S((2, 1024, 128), BF16)
      return (lambda q, k, v: m.mqa(q, k, v)), (q, kv, kv)
    q, kv = S((2, 32, 128), BF16), S((2, 1024, 8, 128), BF16)
    if lengths:
      return (lambda q, k, v, n: m.gqa(q, k, v, kv_seq_len=n),
              (q, kv, kv, S((2,), I32)))
    return (lambda q, k, v: m.gqa(q, k, v)), (q, kv, kv)
  return build


def _paged(pages_per_sequence):
  """2 sequences, 16 query heads on 4 KV heads of dim 128, pages of 16
  tokens, the op's defaults (16 splits, up to 8 pages per step)."""
  def build(m):
    kv = S((4, 2 * pages_per_sequence, 16, 128), BF16)
    return ((lambda q, k, v, t, n: m.paged_attention(q, k, v, t, n)),
            (S((2, 16, 128), BF16), kv, kv,
             S((2, pages_per_sequence), I32), S((2,), I32)))
  return build


def _norm(name, backward=False):
  def build(m):
    f = getattr(m, name)
    args = (S((1, 4096, 1024), BF16), S((1024,), BF16), S((1024,), BF16))
    return (_grad(f, 3) if backward else f), args
  return build


def _softmax(m):
  return m.softmax, (S((4096, 1024), BF16),)


_ATTENTION_BWD = ("mha_forward", "mha_preprocess_backward", "mha_backward")
_PAGED = "paged_attention_block_h={}_pages_per_compute_block={}"

CASES: dict[str, PtxCase] = {
    "attention.fwd": PtxCase("gpu.attention", _attention(), ("mha_forward",)),
    "attention.causal.fwd": PtxCase("gpu.attention", _attention(True),
                                    ("mha_forward",), slow=True),
    "attention.segment_ids.fwd": PtxCase(
        "gpu.attention", _attention(segments=True), ("mha_forward",),
        slow=True),
    "attention.bwd": PtxCase("gpu.attention", _attention(backward=True),
                             _ATTENTION_BWD, slow=True),
    "attention.causal.bwd": PtxCase(
        "gpu.attention", _attention(True, backward=True), _ATTENTION_BWD,
        slow=True),
    "decode_attention.mqa": PtxCase("gpu.decode_attention", _decode("mqa"),
                                    ("mha_forward",), slow=True),
    "decode_attention.gqa": PtxCase("gpu.decode_attention", _decode("gqa"),
                                    ("mha_forward",)),
    "decode_attention.gqa.lengths": PtxCase(
        "gpu.decode_attention", _decode("gqa", lengths=True),
        ("mha_forward",), slow=True),
    "paged_attention": PtxCase("gpu.paged_attention", _paged(128),
                               (_PAGED.format(16, 8),)),
    "paged_attention.short": PtxCase("gpu.paged_attention", _paged(32),
                                     (_PAGED.format(16, 2),), slow=True),
    "layer_norm.fwd": PtxCase("gpu.layer_norm", _norm("layer_norm"),
                              ("layer_norm_forward_kernel",)),
    "layer_norm.bwd": PtxCase("gpu.layer_norm", _norm("layer_norm", True),
                              ("ln_forward", "ln_backward_dx",
                               "ln_backward_dw_db")),
    "rms_norm.fwd": PtxCase("gpu.rms_norm", _norm("rms_norm"),
                            ("rms_norm_forward_kernel",)),
    "rms_norm.bwd": PtxCase("gpu.rms_norm", _norm("rms_norm", True),
                            ("rms_forward", "ln_backward_dx",
                             "ln_backward_dw_db"), slow=True),
    "softmax": PtxCase("gpu.softmax", _softmax,
                       ("_vmappable_softmax_kernel",)),
}


def _key(name: str) -> str:
  return re.sub(r"\W+", "_", name)


@functools.lru_cache(maxsize=None)
def compiled_by_dsl(name: str) -> tuple:
  """The AotKernels of case `name` compiled by dsl (no tensor descriptors:
  Pallas's lowering has none, the same strategy is compared)."""
  case = CASES[name]
  with warnings.catch_warnings(), \
      dsl_config.triton_tensor_descriptors_option(False):
    warnings.simplefilter("ignore")
    fn, args = case.build(swap.swapped(case.module))
    return tuple(aot.compile_aot(fn, *args, target=perf_contracts.TARGET))


@functools.lru_cache(maxsize=None)
def compiled_by_pallas(name: str) -> tuple:
  """The PallasKernels of case `name` compiled from Pallas's lowering."""
  case = CASES[name]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    fn, args = case.build(swap.original(case.module))
    return tuple(compile_with_pallas(fn, *args))


def pairs(name: str) -> list[tuple]:
  """(our AotKernel, Pallas's PallasKernel) per kernel of case `name`,
  matched by kernel name in the order each compiler met them (the two
  orders differ)."""
  ours, theirs = compiled_by_dsl(name), list(compiled_by_pallas(name))
  out = []
  for r in ours:
    match = next((t for t in theirs if _key(t.name) == _key(r.name)), None)
    if match is None:
      raise AssertionError(f"{name}: Pallas compiles no kernel named "
                           f"{r.name!r} ({[t.name for t in theirs]})")
    theirs.remove(match)
    out.append((r, match))
  if theirs:
    raise AssertionError(f"{name}: dsl compiles no kernel named "
                         f"{[t.name for t in theirs]}")
  return out


@functools.lru_cache(maxsize=None)
def kernel_problems(name: str) -> dict[str, list[str]]:
  """Per kernel of case `name`, where it compiles worse than Pallas's."""
  return {ours.name: worse_than(perf_contracts.report(ours), theirs)
          for ours, theirs in pairs(name)}


def problems(name: str) -> list[str]:
  """Where case `name` compiles worse than Pallas's, one line each."""
  return [f"{name}: kernel '{kernel}': {p}"
          for kernel, found in kernel_problems(name).items() for p in found]


def rows(name: str) -> list[str]:
  """The table rows of case `name`: per kernel, ours / Pallas's figures."""
  out = []
  for ours, theirs in pairs(name):
    a, b = figures(ours.ptx, ours.cubin), figures(theirs.ptx, theirs.cubin)
    cells = [f"{a[k]} / {b[k]}" for k in COLUMNS]
    out.append(f"| {name} | {ours.name} | " + " | ".join(cells) + " |")
  return out


COLUMNS = ("lines", "instructions", "selp", "registers", "hot")
HEADER = ("| case | kernel | PTX lines | instructions | selp | registers "
          "| hot-loop instructions |\n|---|---|---|---|---|---|---|")


def main(names) -> int:
  print(HEADER)
  found = []
  for name in names:
    try:
      print("\n".join(rows(name)), flush=True)
      found += problems(name)
    except Exception as e:  # noqa: BLE001 - reported, the others go on
      found.append(f"{name}: fails: {type(e).__name__}: "
                   f"{str(e).splitlines()[0]}")
  print("\n".join(found) or "no kernel compiles worse than Pallas's")
  return int(bool(found))


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:] or list(CASES)))
