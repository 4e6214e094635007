"""`plgpu.kernel`s (Pallas's Mosaic GPU API on dsl) lowered by backend
"mosaic_gpu" for CUDA on a CPU, compared with the module Pallas's own
Mosaic GPU lowering builds from the same source.

Both lowerings hand their module to jaxlib's Mosaic GPU library
(`core.lower_mgpu_module`: layout inference, dialect lowering); the tests
catch it there, before (the `mosaic_gpu` dialect, as emitted) and after,
and compare the two texts with SSA names dropped (`canonical`). Kernels are
written once against a `(pl, plgpu)` pair and built with each library.
"""
from __future__ import annotations

import difflib
import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import pallas as jpl
from jax.experimental.pallas import mosaic_gpu as jplgpu

import dsl as pl
from dsl import mosaic_gpu as plgpu
from dsl.core.errors import BackendError
from benchmarks.pallas_library.cases_mgpu import simulated_gpu
from benchmarks.pallas_library.swap import original, swapped
from tests.pallas.plgpu_modules import captured  # noqa: F401 -- a fixture
from tests.pallas.plgpu_modules import (canonical, capture_into, key_ops,
                                        lower_op_both, module_name, only_in,
                                        schedule, unnamed)

F32 = jnp.float32


# The warpgroup index: thread index (x + y * dx + z * dx * dy) >> 7,
# broadcast from lane 0 of the warp. dsl computes each mesh axis index once,
# at the top of the block; Pallas at each `lax.axis_index`.
_WG_INDEX = re.compile(
    r"(%v = gpu\.thread_id x\n(?:.*\n){17}%v = arith\.constant 7 : i32\n"
    r"%v = arith\.shrui %v, %v : i32\n(?:.*\n){3}%v = nvvm\.shfl\.sync[^\n]*\n)")


def without_wg_index(lines: list[str]) -> tuple[list[str], int]:
  """`lines` without the computations of the warpgroup index, and their
  count."""
  text, n = _WG_INDEX.subn("", "\n".join(lines) + "\n")
  return text.splitlines(), n


def lower_both(make, *args, captured):
  """[(dialect, lowered) of dsl's module, the same of Pallas's]."""
  modules = []
  for lib, extra in (((pl, plgpu), dict(backend="mosaic_gpu")),
                     ((jpl, jplgpu), {})):
    captured.clear()
    jax.jit(make(*lib, **extra)).trace(*args).lower(
        lowering_platforms=("cuda",))
    (module,) = captured
    modules.append(module)
  return modules


# ------------------------------------------------------------------ kernels

def copy_kernel(pl, plgpu, **extra):
  """GMEM -> SMEM (TMA, a barrier) -> GMEM."""
  def body(x_ref, o_ref, smem, barrier):
    plgpu.copy_gmem_to_smem(x_ref, smem, barrier)
    plgpu.barrier_wait(barrier)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, o_ref)
    plgpu.wait_smem_to_gmem(0)
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 128), F32),
                      scratch_types=(plgpu.SMEM((64, 128), F32),
                                     plgpu.Barrier()), **extra)


def producer_consumer(pl, plgpu, **extra):
  """Two blocks of two warpgroups: warpgroup 1 loads two halves of a
  window into SMEM slots (a barrier each), warpgroup 0 waits for each and
  stores it back; then a second scope reuses the shared memory."""
  def body(x_ref, o_ref):
    def scope(smem, barriers):
      wg = lax.axis_index("wg")

      @pl.when(wg == 1)
      def _():
        for i in range(2):
          plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(i * 64, 64)], smem.at[i],
                                  barriers.at[i])

      @pl.when(wg == 0)
      def _():
        for i in range(2):
          plgpu.barrier_wait(barriers.at[i])
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(smem.at[i], o_ref.at[pl.ds(i * 64, 64)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(scope, plgpu.SMEM((2, 64, 128), F32),
                  plgpu.Barrier(num_barriers=2), collective_axes="wg")

    def again(smem, barrier):
      plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(0, 64)], smem, barrier)
      plgpu.barrier_wait(barrier)
    pl.run_scoped(again, plgpu.SMEM((64, 128), F32), plgpu.Barrier(),
                  collective_axes="wg")
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128, 128), F32),
                      num_threads=2, thread_name="wg", grid=(2,),
                      grid_names=("x",), **extra)


# -------------------------------------------------------------------- tests

def test_copy_kernel_module_is_pallas_module(captured):
  x = jnp.ones((64, 128), F32)
  (ours, ours_low), (theirs, theirs_low) = lower_both(copy_kernel, x,
                                                      captured=captured)
  assert "mosaic_gpu.async_load" in ours and "mosaic_gpu.async_store" in ours
  assert canonical(ours) == canonical(theirs)
  assert canonical(ours_low) == canonical(theirs_low)


def test_warpgroups_module_is_pallas_module_but_for_hoisted_axis_index(
    captured):
  x = jnp.ones((128, 128), F32)
  (ours, ours_low), (theirs, theirs_low) = lower_both(
      producer_consumer, x, captured=captured)
  ours, n_ours = without_wg_index(canonical(ours))
  theirs, n_theirs = without_wg_index(canonical(theirs))
  assert (n_ours, n_theirs) == (1, 1)
  assert ours == theirs
  # The shared memory: the larger of the two scopes (64 KiB), then the
  # barriers; the launch: 2 blocks of 256 threads.
  assert "dynamic_shared_memory_size %v" in "\n".join(ours)
  assert any("65536xi8" in line for line in ours)
  # Lowered (CSE merges the thread index computations): the same ops, the
  # warpgroup index's last two at another place.
  assert sorted(canonical(ours_low)) == sorted(canonical(theirs_low))


def test_lowered_plgpu_kernel_is_a_mosaic_gpu_custom_call():
  x = jnp.ones((64, 128), F32)
  text = jax.jit(copy_kernel(pl, plgpu, backend="mosaic_gpu")).trace(x).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu_v2" in text


def test_lane_semantics_are_refused_by_name():
  x = jnp.ones((64, 128), F32)
  params = plgpu.CompilerParams(
      lowering_semantics=plgpu.LoweringSemantics.Lane)

  def body(x_ref, o_ref):
    plgpu.wait_smem_to_gmem(0)
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 128), F32),
                   compiler_params=params, backend="mosaic_gpu")
  with pytest.raises(BackendError, match="Warpgroup semantics"):
    jax.jit(f).trace(x).lower(lowering_platforms=("cuda",))


def wgmma_kernel(pl, plgpu, swizzled=False, **extra):
  """One WGMMA of two f16 tiles in SMEM into an accumulator, stored; with
  `swizzled`, the SMEM tiles are tiled (8, 64) and swizzled (128 bytes),
  as WGMMA and TMA read them best."""
  transforms = (plgpu.TilingTransform((8, 64)),
                plgpu.SwizzleTransform(128)) if swizzled else ()
  def body(a_ref, b_ref, o_ref):
    def scope(a, b, out, barrier, acc):
      plgpu.copy_gmem_to_smem(a_ref, a, barrier)
      plgpu.barrier_wait(barrier)
      plgpu.copy_gmem_to_smem(b_ref, b, barrier)
      plgpu.barrier_wait(barrier)
      plgpu.wgmma(acc, a, b)
      plgpu.wgmma_wait(0)
      out[...] = acc[...].astype(jnp.float16)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out, o_ref)
      plgpu.wait_smem_to_gmem(0)
    smem = lambda: plgpu.SMEM((64, 64), jnp.float16, transforms=transforms)
    pl.run_scoped(scope, smem(), smem(), smem(), plgpu.Barrier(),
                  plgpu.ACC((64, 64), F32))
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 64),
                                                          jnp.float16),
                      **extra)


def differences(ours: list[str], theirs: list[str]) -> list[str]:
  """The lines of `ours` and `theirs` that differ ('-' ours, '+' theirs)."""
  return [line for line in difflib.unified_diff(ours, theirs, n=0,
                                                lineterm="")
          if line[:1] in "-+" and not line.startswith(("---", "+++"))]


# `out[...] = x`: Pallas's swap reads the old value (unused; the library's
# lowering drops it) and spells out the library's default `optimized`.
_SWAP_STORE = ["+%v = \"mosaic_gpu.vector_load\"(%v) <{optimized = true}> : "
               "(memref<64x64xf16, #gpu.address_space<workgroup>>) -> "
               "vector<64x64xf16>"]


@pytest.mark.parametrize("swizzled", [False, True],
                         ids=["plain", "tiled_swizzled"])
def test_wgmma_module_is_pallas_module(captured, swizzled):
  a = jnp.ones((64, 64), jnp.float16)
  (ours, ours_low), (theirs, theirs_low) = lower_both(
      lambda *lib, **extra: wgmma_kernel(*lib, swizzled, **extra), a, a,
      captured=captured)
  # The accumulator: zeros behind a barrier and a fence, one wgmma on it,
  # committed; `wgmma_wait(0)` and the read of `acc` each wait.
  assert ours.count("mosaic_gpu.optimization_barrier") == 1
  assert ours.count("mosaic_gpu.wgmma accumulator") == 1
  assert ours.count("wgmma.wait_group.sync.aligned 0") == 2
  assert ours.count("mosaic_gpu.with_transforms") == (6 if swizzled else 0)
  diff = differences(canonical(ours), canonical(theirs))
  store = [line for line in diff if "vector_store" in line]
  assert [line for line in diff if line not in store] == _SWAP_STORE
  assert [line.replace(", optimized = true", "")[1:] for line in store] == [
      store[0][1:]] * 2
  assert canonical(ours_low) == canonical(theirs_low)


def _hopper_matmul(module):
  a = jnp.ones((128, 128), jnp.float16)
  config = module.TuningConfig(tile_m=64, tile_n=64, tile_k=64,
                               max_concurrent_steps=2)
  with simulated_gpu(module):
    return jax.jit(lambda a, b: module.matmul(a, b, None, config)).trace(
        a, a).lower(lowering_platforms=("cuda",))


def test_pallas_lowers_hopper_matmul_on_a_cpu(captured):
  _hopper_matmul(original("gpu.hopper_matmul_mgpu"))
  ((dialect, _),) = captured
  assert dialect.count("mosaic_gpu.wgmma") == 1


def test_hopper_matmul_lowers(captured):
  with pl.default_backend("mosaic_gpu"):
    _hopper_matmul(swapped("gpu.hopper_matmul_mgpu"))
  ((dialect, lowered),) = captured
  _hopper_matmul(original("gpu.hopper_matmul_mgpu"))
  ((theirs, _),) = captured[1:]
  # One WGMMA in the consumers' loop over K, on the carried accumulator
  # (zero behind a barrier and a fence), from swizzled tiles; the read of
  # the accumulator after the loop waits for it.
  assert dialect.count("mosaic_gpu.wgmma accumulator") == 1
  assert dialect.count("mosaic_gpu.optimization_barrier") == 1
  assert re.search(r"iter_args\(.*\) -> \(vector<64x64xf32>|"
                   r"scf\.while \(.*\) : \(vector<64x64xf32>", dialect)
  assert "wgmma.mma_async" in lowered
  # The same shared memory as Pallas's: the pipeline's slots of A and B
  # and the output's, tiled (8, 64) and swizzled 128 bytes.
  smem = lambda text: sorted(re.findall(r"slice_smem.*memref<(\d\S*xf16)",
                                        text))
  assert smem(dialect) == smem(theirs) == [
      "2x1x8x1x8x64xf16", "2x8x1x8x64xf16", "2x8x2x8x64xf16"]
  assert canonical(dialect).count(
      '%v = "mosaic_gpu.with_transforms"(%v) <{transforms = '
      '[#mosaic_gpu.tile<[8, 64]>, #mosaic_gpu.swizzle<128 : i32>]}> : '
      '(memref<2x64x64xf16, #gpu.address_space<workgroup>>) -> '
      'memref<2x64x64xf16, #gpu.address_space<workgroup>>') >= 2


def assert_lowered_as_hopper_matmul(ours_low: str, theirs_low: str):
  """Lowered, the modules are the same but for the grid index, which dsl
  reads once at the top of the block (so one block_id moves above the
  allocations' barrier) and the warpgroup index, read once (one warp
  shuffle fewer)."""
  ours_low, theirs_low = unnamed(ours_low), unnamed(theirs_low)
  assert only_in(ours_low, theirs_low) == (
      [], ["%v = nvvm.shfl.sync idx %v, %v, %v, %v : i32 -> i32"])
  moved = ["%v = gpu.block_id x", "%v = arith.index_cast %v : index to i32"]
  assert [line[1:] for line in differences(ours_low, theirs_low)
          if "shfl" not in line] == moved + ["gpu.barrier"] * 2 + moved


def test_hopper_matmul_module_is_pallas_module(captured):
  ((ours, ours_low), (theirs, theirs_low)) = lower_op_both(
      _hopper_matmul, "gpu.hopper_matmul_mgpu", captured)
  # The same schedule: a consumed and a produced barrier (2 arrivals
  # each), the memory warpgroup's two prologue steps, its steady-state
  # loop and its two waits for the last slots, the consumers' loop
  # (scf.for), register budgets.
  assert schedule(ours) == schedule(theirs)
  assert schedule(ours).count("scf.for %v = %v to %v step %v  : i32 {") == 1
  assert "setmaxnreg.dec.sync.aligned.u32 40" in ours
  assert "setmaxnreg.inc.sync.aligned.u32 232" in ours
  assert ours.count("arrival_count = 2 : i64") == 2
  assert "scf.while" not in ours
  assert_lowered_as_hopper_matmul(ours_low, theirs_low)


def test_ragged_dot_module_is_pallas_module(captured):
  ((ours, ours_low), (theirs, theirs_low)) = lower_op_both(
      _ragged_dot, "gpu.ragged_dot_mgpu", captured)
  # emit_pipeline keeps two slots in flight: one barrier of 2 arrivals
  # (both inputs' copies), two prologue copies each, a fetch per step.
  assert schedule(ours) == schedule(theirs)
  assert ours.count("memref<2x64x64xf16") >= 2
  assert unnamed(ours_low) == unnamed(theirs_low)


@pytest.mark.parametrize("causal", [False, pytest.param(True,
                                                        marks=pytest.mark.slow)])
def test_attention_module_is_pallas_module(captured, causal):
  ((ours, ours_low), (theirs, theirs_low)) = lower_op_both(
      lambda m: _attention(m, causal), "gpu.attention_mgpu", captured)
  assert schedule(ours) == schedule(theirs)
  # Lowered: the same but for the grid indices, read once at the top, and
  # values the library leaves dead in the loops (casts of ours, broadcasts
  # of Pallas's), which its later passes erase.
  extra_ours, extra_theirs = only_in(unnamed(ours_low), unnamed(theirs_low))
  assert extra_ours and extra_theirs
  assert all(line.startswith("%v = builtin.unrealized_conversion_cast")
             for line in extra_ours)
  assert extra_theirs == ["%v = vector.broadcast %v : f32 to "
                          "vector<1xf32>"] * len(extra_theirs)


# ------------------------------------------------ Pallas's kernel library

def _attention(module, causal):
  q = jnp.ones((1, 256, 1, 64), jnp.float16)
  config = module.TuningConfig(block_q=64, block_kv=64,
                               max_concurrent_steps=2, causal=causal)
  with simulated_gpu(module):
    jax.jit(lambda q, k, v: module.attention(q, k, v, config)).trace(
        q, q, q).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("causal", [False, pytest.param(True,
                                                        marks=pytest.mark.slow)])
def test_attention_has_pallas_instructions(captured, causal):
  ((ours, ours_low), (theirs, theirs_low)) = lower_op_both(
      lambda m: _attention(m, causal), "gpu.attention_mgpu", captured)
  assert key_ops(ours) == key_ops(theirs)
  assert key_ops(ours_low) == key_ops(theirs_low)
  # QK^T and PV, two exp2s with approx_math; the causal kernel has a
  # second loop, for the blocks on the diagonal.
  assert key_ops(ours)["mosaic_gpu.wgmma"] == 2 * (1 + causal)
  assert key_ops(ours)["fastmath<afn>"] == 2 * (1 + causal)
  assert key_ops(ours_low)["wgmma.mma_async"] > 0


def _attention_grad(module, compute_wgs):
  """`jax.grad` of `module.attention` (f16, block 64, depth 2): its forward
  with residuals, then its two backward kernels (dq; dk and dv), each of
  `compute_wgs` compute warpgroups and a memory one."""
  q = jnp.ones((1, 256, 1, 64), jnp.float16)
  config = module.TuningConfig(
      block_q=64, block_kv=64, max_concurrent_steps=2, causal=False,
      block_q_dq=64, block_kv_dq=64, block_q_dkv=64, block_kv_dkv=64,
      compute_wgs_bwd=compute_wgs)
  loss = lambda q, k, v: module.attention(q, k, v, config).astype(F32).sum()
  with simulated_gpu(module):
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q).lower(
        lowering_platforms=("cuda",))


@pytest.fixture(scope="module", params=[1, 2],
                ids=["1_compute_wg", "2_compute_wgs"])
def attention_grad_modules(request):
  """{kernel: ((dialect, lowered) of dsl's module, the same of Pallas's)}
  of `_attention_grad` (the op's default of one compute warpgroup, and
  two), lowered once for the tests below."""
  with pytest.MonkeyPatch.context() as monkeypatch:
    modules = lower_op_both(
        lambda m: _attention_grad(m, request.param), "gpu.attention_mgpu",
        capture_into(monkeypatch))
  kernels = ("forward", "dq", "dkv")
  assert len(modules) == 2 * len(kernels)
  return {k: (modules[i], modules[len(kernels) + i])
          for i, k in enumerate(kernels)}


# Lowered, only Pallas's backward kernels read the warpgroup index again
# (one shuffle: dsl reads it once, at the top of the block); the dk/dv
# kernel's also reads the grid indices and the warpgroup index between the
# barriers of its two shared scopes (its scratch, the pipeline's), which
# keeps them apart: in dsl's, with the indices read at the top, nothing
# lies between them and the library merges them into one.
_SHUFFLE = "%v = nvvm.shfl.sync idx %v, %v, %v, %v : i32 -> i32"
_ONLY_PALLAS_BACKWARD = {"dq": [_SHUFFLE],
                         "dkv": sorted([_SHUFFLE, "gpu.barrier"])}


@pytest.mark.parametrize("kernel", ["dq", "dkv"])
def test_attention_backward_module_is_pallas_module(attention_grad_modules,
                                                    kernel):
  (ours, ours_low), (theirs, theirs_low) = attention_grad_modules[kernel]
  # The memory warpgroup waits for each input's consumed barrier right
  # before that input's copy; the dk/dv kernel's two WGMMAs in one
  # run_state wait once.
  assert schedule(ours) == schedule(theirs)
  assert key_ops(ours) == key_ops(theirs)
  assert key_ops(ours_low) == key_ops(theirs_low)
  assert key_ops(ours)["mosaic_gpu.wgmma"] == (3 if kernel == "dq" else 4)
  # Pallas names a plgpu.kernel whose body is a functools.partial
  # "anonymous"; dsl after the function inside, as its errors do.
  assert module_name(ours) == f"kernel_{kernel}"
  assert module_name(theirs) == "anonymous"
  extra_ours, extra_theirs = only_in(unnamed(ours_low), unnamed(theirs_low))
  assert extra_ours == []
  assert extra_theirs == _ONLY_PALLAS_BACKWARD[kernel]
  # As emitted, both open each shared scope with a block barrier.
  assert canonical(ours).count("gpu.barrier") == canonical(theirs).count(
      "gpu.barrier") == 3


def test_attention_forward_with_residuals_is_pallas_schedule(
    attention_grad_modules):
  (ours, ours_low), (theirs, theirs_low) = attention_grad_modules["forward"]
  assert schedule(ours) == schedule(theirs)
  assert key_ops(ours_low) == key_ops(theirs_low)
  # The log-sum-exp residual: one more TMA store than the plain forward.
  assert ours.count("mosaic_gpu.async_store") == 2


def _grouped(op, module, rhs_shape, sizes):
  """`module.op` (ragged_dot or transposed_ragged_dot) of f16 ones, blocks
  of 64, depth 2, lowered for CUDA."""
  lhs, rhs = jnp.ones((256, 128), jnp.float16), jnp.ones(rhs_shape,
                                                         jnp.float16)
  sizes = jnp.array(sizes, jnp.int32)
  with simulated_gpu(module):
    jax.jit(lambda a, b, s: getattr(module, op)(
        a, b, group_sizes=s, block_m=64, block_n=64, block_k=64,
        max_concurrent_steps=2, grid_block_n=1)).trace(
            lhs, rhs, sizes).lower(lowering_platforms=("cuda",))


def _ragged_dot(module):
  _grouped("ragged_dot", module, (2, 128, 128), [128, 128])


def test_ragged_dot_lowers(captured):
  with pl.default_backend("mosaic_gpu"):
    _ragged_dot(swapped("gpu.ragged_dot_mgpu"))
  ((dialect, lowered),) = captured
  assert key_ops(dialect)["mosaic_gpu.wgmma"] == 1
  assert key_ops(lowered)["wgmma.mma_async"] > 0


def _mixed_type_matmul(module):
  a = jnp.ones((128, 128), jnp.int8)
  b = jnp.ones((128, 128), jnp.bfloat16)
  config = module.TuningConfig(tile_m=64, tile_n=64, tile_k=64,
                               max_concurrent_steps=2)
  with simulated_gpu(module):
    jax.jit(lambda a, b: module.mixed_matmul_kernel(
        a, b, out_dtype=jnp.bfloat16, config=config)).trace(a, b).lower(
            lowering_platforms=("cuda",))


def test_mixed_type_matmul_module_is_pallas_module(captured):
  ((ours, ours_low), (theirs, theirs_low)) = lower_op_both(
      _mixed_type_matmul, "gpu.hopper_mixed_type_matmul_mgpu", captured)
  # The int8 tiles are converted to bf16 in registers before the WGMMA.
  assert schedule(ours) == schedule(theirs)
  assert key_ops(ours) == key_ops(theirs)
  assert key_ops(ours)["mosaic_gpu.wgmma"] == 1
  assert_lowered_as_hopper_matmul(ours_low, theirs_low)


def _transposed_ragged_dot(module):
  _grouped("transposed_ragged_dot", module, (256, 128), [96, 160])


def test_transposed_ragged_dot_module_is_pallas_module(captured):
  ((ours, ours_low), (theirs, theirs_low)) = lower_op_both(
      _transposed_ragged_dot, "gpu.transposed_ragged_dot_mgpu", captured)
  # `pl.multiple_of` on the group's first block becomes
  # `mosaic_gpu.assume_multiple` (layout inference needs it to prove the
  # window's TMA offset aligned).
  assert ours.count("mosaic_gpu.assume_multiple") == theirs.count(
      "mosaic_gpu.assume_multiple") == 1
  assert schedule(ours) == schedule(theirs)
  assert unnamed(ours_low) == unnamed(theirs_low)
