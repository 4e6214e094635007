"""Blackwell's names of `plgpu` on the interpret backend: tensor memory
(`TMEM`), the tcgen05 MMA and its barriers, TMEM loads and stores, warps
(`warp_map`) and `dynamic_scheduling_loop`.

Kernels are written once against a `(pl, plgpu)` pair and compared with
jax.numpy and with Pallas's GPU interpret mode; the races a missing wait
makes are `KernelRaceError`s naming the line. The op itself
(`blackwell_matmul_mgpu`) runs in tests/pallas/test_pallas_ops.py.
"""
from __future__ import annotations

import os
import re
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as jpl
from jax.experimental.pallas import mosaic_gpu as jplgpu

import dsl as pl
from dsl import mosaic_gpu as plgpu
from dsl.core.errors import (BackendError, KernelDeadlockError, KernelError,
                             KernelRaceError)
from tests.pallas import pallas_ops_swap as swap

HERE = os.path.basename(__file__)
F16, F32 = jnp.float16, jnp.float32
M, N, K = 128, 64, 128


def on_dsl(fn, *args):
  with pl.default_backend("interpret"):
    return np.asarray(fn(pl, plgpu)(*args))


def on_pallas(fn, *args):
  params = jplgpu.InterpretGPUParams(inline_mgpu="ignore")
  with jplgpu.force_gpu_interpret_mode(params):
    return np.asarray(fn(jpl, jplgpu)(*args))


def _f16(seed, shape):
  return jax.random.uniform(jax.random.key(seed), shape, F16, -1, 1)


def _dot(a, b):
  return np.asarray(jnp.dot(a, b, preferred_element_type=F32))


def _scratch(plgpu, **more):
  return dict(a_smem=plgpu.SMEM((M, K), F16), b_smem=plgpu.SMEM((K, N), F16),
              acc=plgpu.TMEM((M, N), F32),
              loaded=plgpu.Barrier(num_arrivals=2),
              done=plgpu.Barrier(orders_tensor_core=True), **more)


def _load(plgpu, a_gmem, b_gmem, a_smem, b_smem, loaded):
  plgpu.copy_gmem_to_smem(a_gmem, a_smem, loaded)
  plgpu.copy_gmem_to_smem(b_gmem, b_smem, loaded)
  plgpu.barrier_wait(loaded)


# ------------------------------------------------------------------- values

def chunked_mma(pl, plgpu, chunk=32):
  """a @ b as MMAs over k chunks (the first overwrites the accumulator),
  their completion awaited through tcgen05_commit_arrive."""
  def body(a_gmem, b_gmem, o_gmem, a_smem, b_smem, acc, loaded, done):
    _load(plgpu, a_gmem, b_gmem, a_smem, b_smem, loaded)
    for i in range(K // chunk):
      ks = pl.ds(i * chunk, chunk)
      plgpu.tcgen05_mma(acc, a_smem.at[:, ks], b_smem.at[ks],
                        accumulate=i > 0)
    plgpu.tcgen05_commit_arrive(done)
    plgpu.barrier_wait(done)
    o_gmem[...] = plgpu.async_load_tmem(acc)
    plgpu.wait_load_tmem()
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((M, N), F32),
                      scratch_types=_scratch(plgpu))


def onto(accumulate):
  """The MMA onto a TMEM accumulator holding `c` (async_store_tmem)."""
  def make(pl, plgpu):
    def body(a_gmem, b_gmem, c_gmem, o_gmem, a_smem, b_smem, acc, loaded,
             done):
      _load(plgpu, a_gmem, b_gmem, a_smem, b_smem, loaded)
      plgpu.async_store_tmem(acc, c_gmem[...])
      plgpu.commit_tmem()
      plgpu.tcgen05_mma(acc, a_smem, b_smem, done, accumulate=accumulate)
      plgpu.barrier_wait(done)
      o_gmem[...] = plgpu.async_load_tmem(acc)
      plgpu.wait_load_tmem()
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((M, N), F32),
                        scratch_types=_scratch(plgpu))
  return make


def handoff(wait=True):
  """Warpgroup 0 issues the MMA, warpgroup 1 waits for its barrier and
  reads the accumulator (without `wait`: it does not wait)."""
  def make(pl, plgpu):
    def body(a_gmem, b_gmem, o_gmem, a_smem, b_smem, acc, loaded, done):
      wg = lax.axis_index("wg")

      @pl.when(wg == 0)
      def _():
        _load(plgpu, a_gmem, b_gmem, a_smem, b_smem, loaded)
        plgpu.tcgen05_mma(acc, a_smem, b_smem, done, accumulate=False)

      @pl.when(wg == 1)
      def _():
        if wait:
          plgpu.barrier_wait(done)
        o_gmem[...] = plgpu.async_load_tmem(acc)
        plgpu.wait_load_tmem()
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((M, N), F32),
                        num_threads=2, thread_name="wg",
                        scratch_types=_scratch(plgpu))
  return make


def test_chunked_mma_agrees_with_numpy_and_pallas():
  a, b = _f16(0, (M, K)), _f16(1, (K, N))
  got = on_dsl(chunked_mma, a, b)
  np.testing.assert_allclose(got, _dot(a, b), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got, on_pallas(chunked_mma, a, b))


@pytest.mark.parametrize("accumulate", [True, False])
def test_accumulate_adds_to_what_tmem_holds_or_overwrites_it(accumulate):
  a, b = _f16(2, (M, K)), _f16(3, (K, N))
  c = jax.random.normal(jax.random.key(4), (M, N), F32)
  got = on_dsl(onto(accumulate), a, b, c)
  want = _dot(a, b) + (np.asarray(c) if accumulate else 0)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got, on_pallas(onto(accumulate), a, b, c))


def test_the_mma_barrier_hands_the_accumulator_to_another_warpgroup():
  a, b = _f16(5, (M, K)), _f16(6, (K, N))
  got = on_dsl(handoff(), a, b)
  np.testing.assert_allclose(got, _dot(a, b), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got, on_pallas(handoff(), a, b))


# ------------------------------------------------------------------- races

def test_reading_the_accumulator_without_the_mma_wait_is_a_race():
  a, b = _f16(5, (M, K)), _f16(6, (K, N))
  with pytest.raises(KernelRaceError, match=(
      rf"warpgroup \(1,\) .* reads acc while the tcgen05_mma of warpgroup "
      rf"\(0,\) .*{HERE}:\d+.* in flight.*barrier.*\(at \S*{HERE}:\d+\)")):
    on_dsl(handoff(wait=False), a, b)


def _racy(step):
  """One MMA into the accumulator, then `step` races with it."""
  def make(pl, plgpu):
    def body(a_gmem, b_gmem, o_gmem, a_smem, b_smem, acc, loaded, done):
      _load(plgpu, a_gmem, b_gmem, a_smem, b_smem, loaded)
      step(plgpu, a_gmem, a_smem, acc, loaded, done)
      plgpu.barrier_wait(done)
      o_gmem[...] = plgpu.async_load_tmem(acc)
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((M, N), F32),
                        scratch_types=_scratch(plgpu))
  return make


def _refill_operand(plgpu, a_gmem, a_smem, acc, loaded, done):
  plgpu.tcgen05_mma(acc, a_smem, a_smem.at[:, :N], done, accumulate=False)
  plgpu.copy_gmem_to_smem(a_gmem, a_smem, loaded)   # before done's wait


def _store_into_operand(plgpu, a_gmem, a_smem, acc, loaded, done):
  plgpu.tcgen05_mma(acc, a_smem, a_smem.at[:, :N], done, accumulate=False)
  a_smem[...] = jnp.zeros((M, K), F16)              # before done's wait


def _read_accumulator(plgpu, a_gmem, a_smem, acc, loaded, done):
  plgpu.tcgen05_mma(acc, a_smem, a_smem.at[:, :N], done, accumulate=False)
  a_smem[:, :N] = acc[...].astype(F16)              # before done's wait


def _mma_over_a_load(plgpu, a_gmem, a_smem, acc, loaded, done):
  plgpu.async_store_tmem(acc, jnp.zeros((M, N), F32))
  plgpu.commit_tmem()
  plgpu.async_load_tmem(acc)                        # no wait_load_tmem
  plgpu.tcgen05_mma(acc, a_smem, a_smem.at[:, :N], done)


def _mma_over_a_store(plgpu, a_gmem, a_smem, acc, loaded, done):
  plgpu.async_store_tmem(acc, jnp.zeros((M, N), F32))  # no commit_tmem
  plgpu.tcgen05_mma(acc, a_smem, a_smem.at[:, :N], done)


@pytest.mark.parametrize("step,pattern", [
    (_refill_operand, r"writes a_smem while the tcgen05_mma .* "
     r"wait on the barrier"),
    (_store_into_operand, r"writes a_smem while the tcgen05_mma .* "
     r"wait on the barrier"),
    (_read_accumulator, r"reads acc while the tcgen05_mma .* "
     r"wait on the barrier"),
    (_mma_over_a_load, r"writes acc while the async_load_tmem .* "
     r"wait_load_tmem"),
    (_mma_over_a_store, r"reads acc while the async_store_tmem .* "
     r"commit_tmem"),
], ids=["tma-refills-an-mma-operand", "store-into-an-mma-operand",
        "read-of-an-mma-accumulator", "mma-overwrites-a-load",
        "mma-reads-an-uncommitted-store"])
def test_a_missing_tensor_core_wait_is_a_race(step, pattern):
  a = _f16(7, (M, K))
  with pytest.raises(KernelRaceError, match=pattern + rf".*{HERE}:\d+"):
    on_dsl(_racy(step), a, a[:, :N])


def _seeded_blackwell_matmul(drop: str, monkeypatch):
  """The swapped blackwell_matmul_mgpu with the call `drop` taken out."""
  path = os.path.join(swap.ops_dir(), "gpu", "blackwell_matmul_mgpu.py")
  with open(path, encoding="utf-8") as f:
    source = swap.rewrite(f.read(), path)
  assert source.count(drop) == 1
  module = types.ModuleType("seeded_blackwell_matmul")
  monkeypatch.setitem(sys.modules, module.__name__, module)  # (dataclasses)
  exec(compile(source.replace(drop, "pass"), "seeded_blackwell_matmul.py",
               "exec"), module.__dict__)
  return module


@pytest.mark.parametrize("drop,pattern", [
    ("plgpu.barrier_wait(mma_done_barrier.at[acc_slot])",
     r"warpgroup \(1,\) .* reads acc_tmem while the tcgen05_mma of warp 1 "),
    ("plgpu.barrier_wait(consumed_barrier.at[slot])",
     r"warp 1 of .* waits for phase 0 of ab_tma_barrier, but the barrier "
     r"has completed 2 phases"),
], ids=["store-skips-the-mma-wait", "tma-skips-the-consumed-wait"])
def test_the_blackwell_matmul_without_a_wait_races(drop, pattern,
                                                  monkeypatch):
  m = _seeded_blackwell_matmul(drop, monkeypatch)
  a = _f16(8, (256, 256))
  config = m.TuningConfig(tile_m=128, tile_n=128, tile_k=64,
                          max_concurrent_steps=2, collective=False)
  with pl.default_backend("interpret"), pytest.raises(
      KernelRaceError, match=pattern + r".*seeded_blackwell_matmul.py:\d+"):
    m.matmul_kernel(a, a, config)


# ------------------------------------------------------- warps, scheduling

def warps_meet(pl, plgpu):
  """Warp 3 writes its row, then arrives; warp 0 waits for it and reads
  that row: warps run at the same time."""
  def body(o_gmem, ready):
    @plgpu.warp_map
    def _(w):
      @pl.when(w == 3)
      def _():
        o_gmem[pl.ds(3, 1)] = jnp.full((1, 128), 3.0, F32)
        plgpu.barrier_arrive(ready)

      @pl.when(w == 0)
      def _():
        plgpu.barrier_wait(ready)
        o_gmem[pl.ds(0, 1)] = o_gmem[pl.ds(3, 1)] + 1.0

      @pl.when(jnp.logical_and(w > 0, w < 3))
      def _():
        o_gmem[pl.ds(w, 1)] = jnp.full((1, 128), w, F32) * 10
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((4, 128), F32),
                      scratch_types=[plgpu.Barrier()])


def test_warps_run_at_once_and_meet_at_barriers():
  got = on_dsl(warps_meet)
  want = np.repeat(np.array([[4.0], [10.0], [20.0], [3.0]], np.float32),
                   128, axis=1)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got, on_pallas(warps_meet))


def warps_of_two_warpgroups(pl, plgpu):
  """Each warp of each warpgroup writes its row (`lax.axis_index` inside
  the warp map)."""
  def body(o_gmem):
    @plgpu.warp_map
    def _(w):
      row = lax.axis_index("wg") * 4 + w
      o_gmem[pl.ds(row, 1)] = jnp.full((1, 128), row, F32)
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((8, 128), F32),
                      num_threads=2, thread_name="wg")


def test_the_grid_axes_are_known_inside_the_warp_map():
  got = on_dsl(warps_of_two_warpgroups)
  np.testing.assert_array_equal(
      got, np.repeat(np.arange(8, dtype=np.float32)[:, None], 128, 1))
  np.testing.assert_array_equal(got, on_pallas(warps_of_two_warpgroups))


def test_a_warp_waiting_forever_is_a_deadlock_naming_the_warp():
  def make(pl, plgpu):
    def body(o_gmem, never):
      @plgpu.warp_map
      def _(w):
        @pl.when(w == 2)
        def _():
          plgpu.barrier_wait(never)
      o_gmem[...] = jnp.zeros((8, 128), F32)
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((8, 128), F32),
                        scratch_types=[plgpu.Barrier()])
  with pytest.raises(KernelDeadlockError,
                     match=rf"warp 2 of warpgroup .*{HERE}:\d+"):
    on_dsl(make)


def scheduled(pl, plgpu):
  """Each block's dynamic_scheduling_loop runs its own grid index."""
  def body(o_gmem):
    @plgpu.dynamic_scheduling_loop(grid_names=("x",), thread_axis="wg")
    def _(info):
      (i,) = info.index

      @pl.when(lax.axis_index("wg") == 0)
      def _():
        row = (i * 10 + info.local_index).astype(F32)
        o_gmem[pl.ds(i, 1)] = jnp.full((1, 128), row, F32)
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((4, 128), F32),
                      grid=(4,), grid_names=("x",), num_threads=2,
                      thread_name="wg")


def test_dynamic_scheduling_loop_runs_each_block_once_as_pallas():
  got = on_dsl(scheduled)
  want = np.repeat(np.arange(4, dtype=np.float32)[:, None] * 10, 128, 1)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got, on_pallas(scheduled))


# ------------------------------------------------------------- bad input

def _traced(body, scratch, out=(M, N)):
  with pl.default_backend("interpret"):
    plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(out, F32),
                 scratch_types=scratch)(jnp.zeros((M, K), F16),
                                        jnp.zeros((K, N), F16))


def test_bad_tensor_memory_names_the_operand_and_line():
  with pytest.raises(KernelError, match=rf"narrower than 32 bits.*{HERE}"):
    plgpu.TMEM((M, N), F16)
  with pytest.raises(KernelError, match=rf"512 32-bit columns.*{HERE}"):
    plgpu.TMEM((M, 1024), F32)
  assert plgpu.TMEM((M, 256), F16, packed=True).packed

  def mma(a_gmem, b_gmem, o_gmem, a_smem, b_smem, acc, loaded, done):
    plgpu.tcgen05_mma(acc, a_smem, b_smem.at[:, :32], done)
  with pytest.raises(KernelError, match=rf"b: tcgen05_mma.*\(m, n\) \+= "
                     rf".*{HERE}"):
    _traced(mma, _scratch(plgpu))

  def wrong_barrier(a_gmem, b_gmem, o_gmem, a_smem, b_smem, acc, loaded,
                    done):
    plgpu.tcgen05_mma(acc, a_smem, b_smem, loaded)
  with pytest.raises(KernelError, match=rf"barrier: .*orders_tensor_core"
                     rf".*{HERE}"):
    _traced(wrong_barrier, _scratch(plgpu))

  def acc_in_smem(a_gmem, b_gmem, o_gmem, a_smem, b_smem, acc, loaded, done):
    plgpu.tcgen05_mma(b_smem, a_smem, b_smem)
  with pytest.raises(KernelError, match=rf"acc: .*TMEM, got one in smem"
                     rf".*{HERE}"):
    _traced(acc_in_smem, _scratch(plgpu))


def test_a_collective_mma_along_an_axis_not_of_the_cluster_is_refused():
  """(Collective MMAs of a cluster: tests/pallas/test_plgpu_cluster.py.)"""
  def body(a_gmem, b_gmem, o_gmem, a_smem, b_smem, acc, loaded, done):
    plgpu.tcgen05_mma(acc, a_smem, b_smem.at[:, :N // 2], done,
                      collective_axis="x")
  with pytest.raises(BackendError, match=rf"collective_axis: 'x' is not a "
                     rf"cluster axis of this kernel.*{HERE}"):
    _traced(body, _scratch(plgpu))


def test_the_blackwell_matmul_finds_every_name_it_uses():
  with open(os.path.join(swap.ops_dir(), "gpu", "blackwell_matmul_mgpu.py"),
            encoding="utf-8") as f:
    names = set(re.findall(r"\bplgpu\.(\w+)", f.read()))
  assert {"tcgen05_mma", "TMEM", "warp_map"} <= names
  assert not {n for n in names if not hasattr(plgpu, n)}
