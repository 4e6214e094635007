"""Pallas's Mosaic GPU API (`plgpu`) on dsl: `dsl.mosaic_gpu` has the names
the Hopper `*_mgpu` ops use, and the interpret backend runs `plgpu.kernel`s
(warpgroups that meet at mbarriers, TMA copies, WGMMA, pipelines) on a CPU.

Kernels here are written once against a `(pl, plgpu)` pair, so the same
source runs on dsl and, where it is cheap enough, on Pallas's GPU interpret
mode; every result is also compared with jax.numpy. The ops themselves run
in tests/pallas/test_pallas_ops.py (the `*_mgpu` rows).
"""
from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as jpl
from jax.experimental.pallas import mosaic_gpu as jplgpu

import dsl as pl
from dsl import mosaic_gpu as plgpu
from dsl.core.errors import (KernelCheckError, KernelDeadlockError,
                             KernelError, KernelRaceError, KernelTypeError)
from benchmarks.pallas_library import cases
from benchmarks.pallas_library.case import close
from tests.pallas import pallas_ops_swap as swap
from tests.pallas.plgpu_rings import producer_consumer

HERE = os.path.basename(__file__)
HOPPER_OPS = ("hopper_matmul_mgpu", "hopper_mixed_type_matmul_mgpu",
              "attention_mgpu", "ragged_dot_mgpu",
              "transposed_ragged_dot_mgpu", "collective_matmul_mgpu",
              "reduce_scatter_mgpu", "all_gather_mgpu")


def on_dsl(fn, *args):
  with pl.default_backend("interpret"):
    return np.asarray(fn(pl, plgpu)(*args))


def on_pallas(fn, *args):
  with jplgpu.force_gpu_interpret_mode():
    return np.asarray(fn(jpl, jplgpu)(*args))


def _names_used(prefix: str) -> set[str]:
  names = set()
  for op in HOPPER_OPS:
    with open(os.path.join(swap.ops_dir(), "gpu", f"{op}.py"),
              encoding="utf-8") as f:
      names |= set(re.findall(rf"\b{prefix}\.([A-Za-z_]+)", f.read()))
  return names


def test_the_hopper_ops_find_every_name_they_use():
  assert not {n for n in _names_used("plgpu") if not hasattr(plgpu, n)}
  assert not {n for n in _names_used("pl") if not hasattr(pl, n)}


def test_helpers_agree_with_pallas():
  for bits in (128, 256, 512, 1024, 2048):
    assert plgpu.find_swizzle(bits) == jplgpu.find_swizzle(bits)
  with pytest.raises(ValueError, match="not a multiple of 128"):
    plgpu.find_swizzle(72)
  for shape, minor, width in [((8, 8), 0, 2), ((7, 5), 1, 3)]:
    lin = jnp.arange(shape[0] * shape[1], dtype=jnp.int32)
    snake = lambda lib: jax.jit(jax.vmap(
        lambda i: lib.planar_snake(i, shape, minor, width)))(lin)
    np.testing.assert_array_equal(np.asarray(snake(plgpu)),
                                  np.asarray(snake(jplgpu)))


# ----------------------------------------------------------------- kernels

def wgmma_matmul(pl, plgpu, tile=64):
  """One warpgroup per output tile: a @ b with WGMMA over k blocks."""
  def body(a_ref, b_ref, o_ref):
    m, n = lax.axis_index("m"), lax.axis_index("n")
    k_steps = a_ref.shape[1] // tile

    def scope(a_smem, b_smem, o_smem, bars):
      def accumulate(acc):
        @pl.loop(0, k_steps)
        def _(k):
          plgpu.copy_gmem_to_smem(
              a_ref.at[pl.ds(m * tile, tile), pl.ds(k * tile, tile)], a_smem,
              bars.at[0])
          plgpu.copy_gmem_to_smem(
              b_ref.at[pl.ds(k * tile, tile), pl.ds(n * tile, tile)], b_smem,
              bars.at[1])
          plgpu.barrier_wait(bars.at[0])
          plgpu.barrier_wait(bars.at[1])
          plgpu.wgmma(acc, a_smem, b_smem)
          plgpu.wgmma_wait(0)
        return acc[...]
      acc = pl.run_scoped(accumulate, plgpu.ACC((tile, tile), jnp.float32))
      o_smem[...] = acc.astype(o_smem.dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(
          o_smem, o_ref.at[pl.ds(m * tile, tile), pl.ds(n * tile, tile)])
      plgpu.wait_smem_to_gmem(0)

    swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    pl.run_scoped(scope, plgpu.SMEM((tile, tile), jnp.float16, transforms=swz),
                  plgpu.SMEM((tile, tile), jnp.float16, transforms=swz),
                  plgpu.SMEM((tile, tile), jnp.float16),
                  plgpu.Barrier(num_barriers=2))

  def call(a, b):
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((a.shape[0], b.shape[1]),
                                            jnp.float16),
        grid=(a.shape[0] // tile, b.shape[1] // tile),
        grid_names=("m", "n"))(a, b)
  return call


def _f16(seed, shape):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float16)


def test_producer_consumer_warpgroups_agree_with_pallas():
  x = jax.random.normal(jax.random.key(0), (4 * 64, 128), jnp.float32)
  got = on_dsl(producer_consumer, x)
  np.testing.assert_allclose(got, np.asarray(2 * x + 1), rtol=1e-6)
  np.testing.assert_array_equal(got, on_pallas(producer_consumer, x))


def test_wgmma_matmul_agrees_with_pallas():
  a, b = _f16(0, (128, 128)), _f16(1, (128, 64))
  got = on_dsl(wgmma_matmul, a, b)
  want = jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.float16)
  np.testing.assert_allclose(got.astype(np.float32),
                             np.asarray(want, np.float32), atol=2e-2,
                             rtol=2e-2)
  np.testing.assert_allclose(got.astype(np.float32),
                             on_pallas(wgmma_matmul, a, b).astype(np.float32),
                             atol=1e-2, rtol=1e-2)


def test_run_state_accumulator_starts_from_its_value():
  x = _f16(0, (64, 64))
  c = jax.random.normal(jax.random.key(2), (64, 64), jnp.float32)

  def body(x_ref, c_ref, o_ref, x_smem, bar):
    plgpu.copy_gmem_to_smem(x_ref, x_smem, bar)
    plgpu.barrier_wait(bar)
    o_ref[...] = pl.run_state(lambda acc: plgpu.wgmma(acc, x_smem, x_smem))(
        plgpu.ACC.init(c_ref[...]))

  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
                   scratch_types=(plgpu.SMEM((64, 64), jnp.float16),
                                  plgpu.Barrier()))
  with pl.default_backend("interpret"):
    got = f(x, c)
  want = c + jnp.dot(x, x, preferred_element_type=jnp.float32)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-2,
                             rtol=1e-3)


def test_run_state_in_a_pallas_call_agrees_with_pallas():
  x = jnp.arange(8 * 128, dtype=jnp.float32).reshape(8, 128)

  def call(pl):
    def kernel(x_ref, o_ref):
      def double(refs):
        a, b = refs
        a[...] = a[...] * 2
        b[...] = a[...] + b[...]
      o_ref[...] = sum(pl.run_state(double)((x_ref[...], x_ref[...] + 1)))
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=True)(x)
  got = np.asarray(call(pl))
  np.testing.assert_array_equal(got, np.asarray(2 * x + 3 * x + 1))
  np.testing.assert_array_equal(got, np.asarray(call(jpl)))


def test_pipelines_stream_blocks():
  x = jax.random.normal(jax.random.key(0), (4 * 64, 2 * 128), jnp.float32)

  def body(x_ref, o_ref, sums_ref):
    def step(idx, x_smem, o_smem):
      o_smem[...] = x_smem[...] * 3

    @pl.when(lax.axis_index("wg") == 0)
    def _():
      plgpu.emit_pipeline(
          step, grid=(4, 2),
          in_specs=[plgpu.BlockSpec((64, 128), lambda i, j: (i, j))],
          out_specs=[plgpu.BlockSpec((64, 128), lambda i, j: (i, j))])(
              x_ref, o_ref)

    # warp-specialized: the carry (a value) sums the blocks of column j=0
    def ws_body(idx, x_smem, carry):
      return carry + x_smem[...]

    def context(run):
      sums_ref[...] = run(jnp.zeros((64, 128), jnp.float32))
    plgpu.emit_pipeline_warp_specialized(
        ws_body, grid=(4,), memory_registers=40, wg_axis="wg",
        num_compute_wgs=1, max_concurrent_steps=2, compute_context=context,
        in_specs=[plgpu.BlockSpec((64, 128), lambda i: (i, 0))])(x_ref)

  f = plgpu.kernel(body, out_type=(jax.ShapeDtypeStruct(x.shape, x.dtype),
                                   jax.ShapeDtypeStruct((64, 128), x.dtype)),
                   num_threads=2, thread_name="wg")
  with pl.default_backend("interpret"):
    tripled, sums = f(x)
  np.testing.assert_allclose(np.asarray(tripled), np.asarray(3 * x))
  np.testing.assert_allclose(np.asarray(sums), np.asarray(
      x[:, :128].reshape(4, 64, 128).sum(0)), rtol=1e-5)


def test_pipeline_keeps_slots_in_flight():
  """emit_pipeline with three slots and a carry: blocks stream in ahead of
  the body (a fetch after each step), an output that moves is copied out
  each step, one that stays (the running sum) once at the end."""
  x = jax.random.normal(jax.random.key(1), (5 * 64, 128), jnp.float32)

  def body(x_ref, o_ref, last_ref):
    def step(idx, x_smem, o_smem, last_smem, total):
      total = total + x_smem[...]
      o_smem[...] = total
      last_smem[...] = total * 2
      return total

    plgpu.emit_pipeline(
        step, grid=(5,), max_concurrent_steps=3,
        init_carry=jnp.zeros((64, 128), jnp.float32),
        in_specs=[plgpu.BlockSpec((64, 128), lambda i: (i, 0))],
        out_specs=[plgpu.BlockSpec((64, 128), lambda i: (i, 0)),
                   plgpu.BlockSpec((64, 128), lambda i: (0, 0))])(
                       x_ref, o_ref, last_ref)

  f = plgpu.kernel(body, out_type=(jax.ShapeDtypeStruct(x.shape, x.dtype),
                                   jax.ShapeDtypeStruct((64, 128), x.dtype)))
  with pl.default_backend("interpret"):
    running, last = f(x)
  expected = jnp.cumsum(x.reshape(5, 64, 128), axis=0)
  np.testing.assert_allclose(np.asarray(running),
                             np.asarray(expected.reshape(x.shape)), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(last), np.asarray(2 * expected[-1]),
                             rtol=1e-5)


def test_nd_loop_shares_items_among_blocks():
  def body(o_ref):
    @plgpu.nd_loop((2, 5), collective_axes="sm")
    def _(info):
      i, j = info.index
      o_ref[i * 5 + j] = lax.axis_index("sm") * 100 + info.local_index

  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((10,), jnp.int32),
                   grid=(3,), grid_names=("sm",))
  with pl.default_backend("interpret"):
    got = np.asarray(f())
  steps = np.arange(10)
  np.testing.assert_array_equal(got, (steps % 3) * 100 + steps // 3)


def test_collective_scope_and_globals_are_shared():
  def body(o_ref, mine, bar):
    wg = lax.axis_index("wg")
    shared = pl.get_global(plgpu.GMEM((2,), jnp.int32))

    def scope(ours):
      ours[wg] = wg + 10
      shared[wg] = wg + 20
      mine[wg] = wg + 30
      plgpu.barrier_arrive(bar)
      plgpu.barrier_wait(bar)
      o_ref[wg] = ours[1 - wg] * 10000 + shared[1 - wg] * 100 + mine[1 - wg]
    pl.run_scoped(scope, plgpu.SMEM((2,), jnp.int32), collective_axes="wg")

  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((2,), jnp.int32),
                   num_threads=2, thread_name="wg",
                   scratch_types=(plgpu.SMEM((2,), jnp.int32),
                                  plgpu.Barrier(num_arrivals=2)))
  with pl.default_backend("interpret"):
    got = np.asarray(f())
  np.testing.assert_array_equal(got, [112131, 102030])


# ---------------------------------------------------------------- failures

def test_get_global_outside_plgpu_kernels_is_refused():
  def kernel(x_ref, o_ref):
    pl.get_global(plgpu.SemaphoreType.REGULAR)
    o_ref[...] = x_ref[...]

  with pytest.raises(KernelError, match=rf"get_global.*plgpu.kernels.*{HERE}"):
    pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                   backend="interpret")(jnp.ones((8, 128)))


def test_a_wait_nobody_ends_is_a_deadlock_naming_the_line():
  def body(o_ref, bar):
    @pl.when(lax.axis_index("wg") == 0)
    def _():
      plgpu.barrier_wait(bar)          # no warpgroup arrives on it
    o_ref[...] = jnp.zeros_like(o_ref)

  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((8,), jnp.float32),
                   num_threads=2, thread_name="wg",
                   scratch_types=(plgpu.Barrier(),))
  with pl.default_backend("interpret"), pytest.raises(
      KernelDeadlockError, match=rf"deadlock.*warpgroup \(0,\).*{HERE}"):
    f()


def test_run_time_checks_fail_with_the_line():
  def body(x_ref, o_ref):
    pl.debug_check(x_ref[0] > 0, "x[0] must be positive")
    o_ref[...] = x_ref[...]

  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((8,), jnp.float32))
  with pl.default_backend("interpret"), pl.enable_debug_checks(True):
    np.testing.assert_array_equal(np.asarray(f(jnp.ones(8))), np.ones(8))
    with pytest.raises(KernelCheckError, match=rf"x\[0\] must be positive"
                       rf".*{HERE}"):
      f(-jnp.ones(8))


def test_a_skipped_phase_is_a_race():
  def body(o_ref, bar):
    plgpu.barrier_arrive(bar)
    plgpu.barrier_arrive(bar)          # two phases complete ...
    plgpu.barrier_wait(bar)            # ... before the first wait
    o_ref[...] = jnp.zeros_like(o_ref)

  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((8,), jnp.float32),
                   scratch_types=(plgpu.Barrier(),))
  with pl.default_backend("interpret"), pytest.raises(
      KernelRaceError, match=rf"completed 2 phases.*{HERE}"):
    f()


def _trace_error(body, scratch):
  f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float16),
                   scratch_types=scratch)
  with pl.default_backend("interpret"):
    f(_f16(0, (64, 64)))


def test_bad_operands_name_the_operand_and_line():
  smem = plgpu.SMEM((64, 64), jnp.float16)
  cases = [
      (lambda x, o, s, b: plgpu.copy_gmem_to_smem(x.at[:32], s, b),
       (smem, plgpu.Barrier()), KernelTypeError, "dst.*same shape"),
      (lambda x, o, s, b: plgpu.copy_gmem_to_smem(x, s, b),
       (smem, plgpu.Barrier(num_barriers=2)), KernelError,
       "barrier.*select one barrier"),
      (lambda x, o, s, b: plgpu.wgmma(s, s, s),
       (smem, plgpu.Barrier()), KernelTypeError, "acc.*plgpu.ACC"),
      (lambda x, o, s, b: plgpu.copy_smem_to_gmem(x, o),
       (smem, plgpu.Barrier()), KernelTypeError, "src.*SMEM"),
  ]
  for body, scratch, error, message in cases:
    with pytest.raises(error, match=rf"{message}.*{HERE}"):
      _trace_error(body, scratch)


def test_shared_memory_layouts_are_checked():
  with pytest.raises(ValueError, match="Swizzle 48"):
    plgpu.SwizzleTransform(48)
  bad = plgpu.SMEM((64, 48), jnp.float16,
                   transforms=(plgpu.TilingTransform((8, 64)),))
  with pytest.raises(KernelError, match="does not divide"):
    _trace_error(lambda x, o, s: None, (bad,))


def test_compiler_params_take_pallas_fields():
  params = plgpu.CompilerParams(
      approx_math=True, max_concurrent_steps=3,
      lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
  assert params.pipeline_depth == 3
  with pytest.raises(ValueError, match="same ring depth"):
    plgpu.CompilerParams(max_concurrent_steps=3, pipeline_depth=2)


@pytest.mark.slow
@pytest.mark.parametrize("steps,slots", [(5, 2), (6, 3)])
def test_producer_consumer_rings(steps, slots):
  x = jax.random.normal(jax.random.key(1), (steps * 64, 128), jnp.float32)
  make = functools.partial(producer_consumer, steps=steps, slots=slots)
  got = on_dsl(make, x)
  np.testing.assert_allclose(got, np.asarray(2 * x + 1), rtol=1e-6)
  np.testing.assert_array_equal(got, on_pallas(make, x))


def _view_past_the_end(pl, plgpu, blocks):
  """Copies `blocks` blocks of 64 rows through `x.at[pl.ds(start, 256)]`,
  start 64 read at run time, a view reaching 64 rows past the array's end
  (as transposed_ragged_dot_mgpu makes): only the blocks copied must lie
  inside."""
  def body(start_ref, x_ref, o_ref):
    plgpu.emit_pipeline(
        lambda idx, x_smem, o_smem: o_smem.__setitem__(..., x_smem[...]),
        grid=(blocks,),
        in_specs=[plgpu.BlockSpec((64, 128), lambda i: (i, 0))],
        out_specs=[plgpu.BlockSpec((64, 128), lambda i: (i, 0))])(
            x_ref.at[pl.ds(start_ref[0], 256), :], o_ref)
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((256, 128),
                                                          jnp.float32))


def test_a_view_may_reach_past_its_array_where_nothing_is_accessed():
  x = jax.random.normal(jax.random.key(0), (256, 128), jnp.float32)
  start = jnp.array([64], jnp.int32)
  got = on_dsl(lambda pl_, plgpu_: _view_past_the_end(pl_, plgpu_, 3),
               start, x)
  # (Pallas's GPU interpret mode runs this view in the op
  # gpu.transposed_ragged_dot_mgpu, compared in test_pallas_ops.py.)
  np.testing.assert_array_equal(got[:192], np.asarray(x[64:]))
  with pytest.raises(Exception, match="outside a dim"):
    on_dsl(lambda pl_, plgpu_: _view_past_the_end(pl_, plgpu_, 4), start, x)


# The Hopper ops Pallas's GPU interpret mode runs on a CPU (the others fail
# there: test_pallas_ops_limits.py holds how).
_PALLAS_INTERPRET_RUNS = (
    "gpu.hopper_matmul_mgpu", "gpu.transposed_ragged_dot_mgpu",
    pytest.param("gpu.ragged_dot_mgpu", marks=pytest.mark.slow))


@pytest.mark.parametrize("op", _PALLAS_INTERPRET_RUNS)
def test_hopper_op_on_interpret_is_pallas_interpret_bit_for_bit(op):
  """The op's case (benchmarks/pallas_library/cases_mgpu.py) on dsl's
  interpret backend and in Pallas's GPU interpret mode: the same bits (both
  accumulate each WGMMA's f32 products in the same order), and near the
  reference."""
  case, ours = cases.run_on_dsl(op, "interpret")
  theirs = cases.run_on_pallas(op, case)
  close(ours, theirs, 0, f"{op}: dsl's interpret vs Pallas's")
  want = case.reference(swap.original(cases.module_of(op)), *case.args)
  close(ours, want, case.ref_tol or case.tol, f"{op} vs its reference")
