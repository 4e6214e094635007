"""Performance contracts (tests/pallas/perf_contracts.py, docs/performance.md):
every benchmark and kernels/ kernel on Triton, compiled for sm_90 on the
CPU, against its recorded baseline and the structural rules; the same
kernel sources lowered by Pallas's Triton lowering, which ours must not be
worse than; and a mask put back into the matmul's K loop, which must fail."""
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

import lowering_triton.kernel
from dsl.core import ranges
from tests.pallas import perf_contracts
from tests.pallas.perf_contracts import CASES

with warnings.catch_warnings():
  warnings.simplefilter("ignore")
  from jax.experimental import pallas as jpl
  from jax.experimental.pallas import triton as jpl_triton
  from tests.pallas.pallas_ptx import compile_with_pallas, worse_than

# Known failures of a contract, each a finding for the kernel's owner (the
# test fails loudly, strict, as soon as the kernel is fixed), per Triton
# release: where a release compiles the same source worse than the one
# before it, its baseline keeps the older figures and the case is listed
# here (docs/performance.md, "Triton 3.6 and 3.9").
_OCCUPANCY_39 = ("triton 3.9 compiles the same source to more registers: one "
                 "program fewer per SM than triton 3.6")
_SASS_39 = ("triton 3.9 compiles the same source to a longer hot loop than "
            "triton 3.6 (more SASS instructions, not only the PTX)")
KNOWN_BY_RELEASE: dict[str, dict[str, str]] = {
    "3.9": {
        "grad.softmax.auto.f32": _OCCUPANCY_39 + "; its reductions take "
        "more shuffles and SASS instructions",
        "grad.layer_norm.auto.f32": _SASS_39 + ": its reductions take more "
        "shuffles",
        "gpu_triton.softmax.bf16": _OCCUPANCY_39,
        "gpu_triton.softmax.f32": _OCCUPANCY_39,
        "suite.layer_norm.f32": _OCCUPANCY_39,
        "kernels.softmax.fwd.f32": _OCCUPANCY_39,
        "kernels.flash_attention_d64.bwd.bf16": _OCCUPANCY_39 + " (dkdv)",
        "kernels.flash_attention_causal.fwd.bf16": _SASS_39 + " (the "
        "loop off the diagonal: 590 instructions against 529; the baseline "
        "keeps 3.6's figures from before its diagonal, a single block, "
        "stopped being a loop)",
        "kernels.flash_attention_causal.fwd.f32": _SASS_39 + " (the diagonal "
        "loop, with more selects)",
        "kernels.flash_attention.bwd.f32": _SASS_39 + " (dq)",
        "kernels.flash_attention_causal.bwd.f32": _SASS_39 + " (dq)",
    },
}
KNOWN: dict[str, str] = KNOWN_BY_RELEASE.get(perf_contracts.triton_release(),
                                             {})


def _marks(name):
  marks = [pytest.mark.slow] if CASES[name].slow else []
  if name in KNOWN:
    marks.append(pytest.mark.xfail(reason=KNOWN[name], strict=True))
  return marks


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n), id=n)
                                  for n in CASES])
def test_performance_contract(name):
  found = perf_contracts.problems(name)
  assert not found, "\n".join(found)


def test_a_mask_back_in_the_matmul_k_loop_fails_the_contract(monkeypatch):
  """Without the range analysis the benchmark matmul's K loop loads are
  masked again (the regression this suite exists for): its contract
  reports the TMA copies lost (a masked tile is no tensor-descriptor load)
  and the instructions that came back. (The masks no longer bring a fill
  of NaN with them, whose selects and shared-memory stores cost the loop
  most: masked-off lanes of a load without `other` are Triton's.)"""
  monkeypatch.setattr(lowering_triton.kernel, "analyze_kernel",
                      lambda spec: ranges.KernelRanges())
  name = "gpu_triton.matmul.bf16"
  found = perf_contracts.problems(name, perf_contracts.compile_case(name))
  text = "\n".join(found)
  assert "hot loop 0" in text and "per iteration" in text
  assert "cp_async_bulk 0 (baseline 2: lost)" in text
  assert re.search(r"instructions \d+ \(baseline \d+\)", text)
  assert "selp" not in text and "st_shared" not in text
  assert f"re-record the baseline: {perf_contracts.RECORD} {name}" in text


@pytest.mark.parametrize("which", ["fwd", "bwd"])
def test_causal_attention_loops_off_the_diagonal_are_the_non_causal_loop(
    which):
  """Causal flash attention on Triton: per kernel, the loop over the blocks
  below the diagonal compiles to the non-causal kernel's loop (no select
  for the causal mask, the same wgmma and async copies, as many
  instructions within the contracts' slack); the masked diagonal loop comes
  beside it, or, where the compiler proves it runs once (a diagonal of one
  block), its body follows the loop."""
  causal = perf_contracts.compiled(
      f"kernels.flash_attention_causal.{which}.bf16")
  plain = perf_contracts.compiled(f"kernels.flash_attention.{which}.bf16")
  assert [r.name for r in causal] == [r.name for r in plain]
  for c, p in zip(causal, plain):
    if not p.hot_loops:
      continue
    assert len(c.hot_loops) in (1, 2), c.name     # off the diagonal, on it
    (loop,) = p.hot_loops
    off = min(c.hot_loops, key=lambda m: m.selp)
    on = max(c.hot_loops, key=lambda m: m.selp)
    assert off.selp <= loop.selp, c.name
    if len(c.hot_loops) == 2:
      assert on.selp > loop.selp, c.name      # the mask lives here only
    assert c.kernel.selp - off.selp > p.kernel.selp - loop.selp, c.name
    assert (off.wgmma, off.cp_async) == (loop.wgmma, loop.cp_async), c.name
    assert off.instructions <= loop.instructions * 1.1 + 4, c.name


def test_every_case_has_a_baseline_and_the_config_it_was_recorded_with():
  recorded = perf_contracts.load_baselines()
  assert sorted(recorded["cases"]) == sorted(CASES)
  assert recorded["target"] == perf_contracts.TARGET


# ------------------------------------------------------------ vs Pallas

def _suite_pallas(name, dtype):
  bench, size, config, args = perf_contracts.suite_setup(name, dtype)
  params = {k: config[k] for k in ("num_warps", "num_stages") if k in config}
  kw = {"compiler_params": jpl_triton.CompilerParams(**params)} if params \
      else {}
  return bench.build(jpl, size, dtype, config, **kw), args


PEERS = {
    f"gpu_triton.{which}.{tag}": functools.partial(
        perf_contracts.gpu_triton_call, which, dtype, jpl)
    for which in ("matmul", "softmax", "layer_norm")
    for dtype, tag in ((jnp.bfloat16, "bf16"), (jnp.float32, "f32"))}
PEERS.update({
    f"suite.{name}.{tag}": functools.partial(_suite_pallas, name, dtype)
    for name in ("add", "matmul", "softmax", "layer_norm")
    for dtype, tag in ((jnp.float32, "f32"), (jnp.bfloat16, "bf16"))})


@pytest.mark.parametrize("name", [
    pytest.param(n, id=n, marks=[pytest.mark.slow] if CASES[n].slow else [])
    for n in PEERS])
def test_not_worse_than_pallas_on_the_same_source(name):
  fn, args = PEERS[name]()
  theirs = compile_with_pallas(fn, *args)
  # Pallas has no tensor descriptors: the same lowering strategy is compared
  # (test_tensor_descriptors_* judge TMA).
  ours = perf_contracts.compiled(name, tensor_descriptors=False)
  assert len(theirs) == len(ours) == 1
  found = worse_than(ours[0], theirs[0])
  assert not found, f"{name}: " + "; ".join(found)


def test_pallas_ttir_is_compiled_as_a_gpu_run_compiles_it():
  """XLA compiles Pallas's Triton IR starting with Triton's front-end
  passes (canonicalization, the dot/add combiner, CSE); the comparison
  does too: a zero accumulator plus a dot becomes the dot alone, and the
  bias it is added to becomes the dot's accumulator."""
  def kernel(x_ref, y_ref, b_ref, o_ref):
    acc = jnp.zeros((64, 64), jnp.float32) + jpl_triton.dot(x_ref[...],
                                                           y_ref[...])
    o_ref[...] = acc + b_ref[...]

  s = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  fn = lambda x, y, b: jpl.pallas_call(kernel, out_shape=s)(x, y, b)
  (theirs,) = compile_with_pallas(fn, s, s, s)
  dots = re.findall(r"tt\.dot (%\w+), (%\w+), (%\w+)", theirs.ttir)
  assert len(dots) == 1
  assert "tt.splat %cst" not in theirs.ttir
  assert "arith.addf" not in theirs.ttir      # both adds folded into the dot
