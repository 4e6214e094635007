"""The warp-specialized schedule of backend "mosaic_gpu", checked on a CPU in
the modules the lowering builds: a producer warpgroup issuing the TMA copies
of the blocks that move along the sequential grid dims into a ring of
shared-memory slots, consumer warpgroups running the kernel body (wgmma and
the element-wise work), full/empty mbarriers per slot, `setmaxnreg`
between them, the ring depth from the shared-memory budget, and the
compiler params that override the lowering's choice."""
import re

import jax
import jax.numpy as jnp
import pytest

import dsl as pl
from dsl.core.errors import BackendError
from lowering_mosaic.gpu import plan as gpu_plan
from lowering_mosaic.gpu import schedule as S
from benchmarks.mosaic_gpu_kernels import CASES as SAMPLES
from benchmarks.mosaic_gpu_kernels import (SCHEDULES, add, flash_attention,
                                          matmul)
from tests.pallas.mosaic_gpu_testing import (
    BF, count_op, deep_ring, gpu_module, mlir_region, warpgroup_roles)

# A role's wait on an mbarrier phase, in the module before layout inference:
# the barrier ref's `wait_parity` (jaxlib 0.12's dialect has no wait op).
WAIT = "nvvm.mbarrier.try_wait.parity"


# ------------------------------------------------------------ the split

def test_matmul_k_loop_is_a_producer_and_two_consumers():
  m = gpu_module(matmul, BF(512, 256), BF(256, 256))
  sched = m.plan.schedule
  assert sched.warp_specialized and sched.consumers == 2
  assert sched.warpgroups == 3 and sched.threads == 384
  assert "threads(%arg5, %arg6, %arg7) in (%arg11 = %c384" in m.dialect_text
  consumer, producer = warpgroup_roles(m.dialect_text)
  # TMA copies only in the producer; wgmma and the body only in consumers.
  # x's two 64-row blocks (one per consumer) are neighbours: one copy.
  assert count_op(producer, "mosaic_gpu.async_load") == 2
  assert count_op(consumer, "mosaic_gpu.async_load") == 0
  assert count_op(consumer, "mosaic_gpu.wgmma") == 1
  assert count_op(producer, "mosaic_gpu.wgmma") == 0
  assert count_op(producer, "mosaic_gpu.vector_load") == 0
  # The protocol: the producer waits for an empty slot and arms its full
  # barrier; consumers wait for it full and release it.
  assert count_op(producer, WAIT) == 1
  assert count_op(producer, "mosaic_gpu.arrive_expect_tx") == 1
  assert count_op(consumer, WAIT) == 1
  assert count_op(consumer, "mosaic_gpu.arrive") == 1
  assert count_op(consumer, "mosaic_gpu.async_store") == 1   # after the loop
  # Register reallocation between them.
  assert f"nvvm.setmaxregister increase {sched.consumer_registers}" in consumer
  assert f"nvvm.setmaxregister decrease {sched.producer_registers}" in producer
  assert (sched.producer_registers, sched.consumer_registers) == (40, 232)
  assert 128 * (40 + 2 * 232) <= S.REGISTER_FILE


def test_the_lowered_module_keeps_the_split():
  m = gpu_module(matmul, BF(512, 256), BF(256, 256))
  lowered = m.module.operation.get_asm()
  assert "nvvm.setmaxregister increase 232" in lowered
  assert "nvvm.setmaxregister decrease 40" in lowered
  assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in lowered
  assert "cp.async.bulk.tensor" in lowered
  assert "mbarrier.try_wait.parity" in lowered
  assert "mbarrier.arrive.release.cta.shared::cta.b64" in lowered   # empty


def test_ring_barriers_and_buffers():
  m = gpu_module(matmul, BF(512, 256), BF(256, 256))
  sched = m.plan.schedule
  depth, c = sched.depth, sched.consumers
  text = m.dialect_text
  inits = re.findall(r'"mosaic_gpu.initialize_barrier"\(%\w+\) <\{arrival_count'
                     r' = (\d+) : i64, num_barriers = (\d+)', text)
  # full (one arrival: the producer's expect_tx), empty (one per consumer
  # warpgroup), the fixed blocks'.
  assert inits == [("1", str(depth)), (str(c), str(depth)), ("1", "1")]
  x_blk, y_blk, o_blk = m.plan.blocks
  # Split along M: each consumer has its own x and output block; y shared.
  assert sched.split_dim == 0
  assert x_blk.buffer_shape == (depth, c, 128, 64)
  assert y_blk.buffer_shape == (depth, 64, 128)
  assert o_blk.buffer_shape == (c, 128, 128)
  assert f"memref<{depth}x{c}x128x64xbf16" in text


def test_flash_attention_consumers_share_the_kv_ring():
  q, k = BF(512, 128), BF(1024, 128)
  m = gpu_module(flash_attention, q, k, k)
  sched = m.plan.schedule
  assert sched.warp_specialized and sched.consumers == 2
  q_blk, k_blk, v_blk, o_blk = m.plan.blocks
  assert (k_blk.replicas, v_blk.replicas) == (1, 1)      # shared K, V
  assert (q_blk.replicas, q_blk.slots) == (2, 1)         # own q, loaded once
  consumer, producer = warpgroup_roles(m.dialect_text)
  assert count_op(consumer, "mosaic_gpu.wgmma") == 2
  assert count_op(consumer, "vector.multi_reduction") == 2
  # q blocks on the fixed barrier before the loop; K, V per step.
  assert count_op(producer, "mosaic_gpu.async_load") == 4
  # fixed, full; the turns at the tensor core: two a step, one before the
  # loop (the second consumer's), one after it (the first's).
  assert count_op(consumer, WAIT) == 6
  assert sched.turns


# ------------------------------------------------------------ the depth

@pytest.mark.parametrize("rows,cols,depth", [(64, 128, 4), (128, 192, 2)])
def test_depth_is_the_deepest_ring_that_fits(rows, cols, depth):
  f, x = deep_ring(rows, cols, 8)
  plan = gpu_module(f, x).plan
  assert plan.schedule.depth == depth
  assert plan.smem_bytes <= gpu_plan.SMEM_LIMIT
  if depth < S.MAX_DEPTH:     # one slot more would not fit
    deeper = [b.__class__(**{**b.__dict__, "slots": depth + 1})
              if b.slots > 1 else b for b in plan.blocks]
    more = gpu_plan.smem_buffers(deeper, plan.scratch, plan.scoped,
                                 plan.schedule.consumers, 0)
    assert gpu_plan.smem_total(more, S.specialized(
        depth + 1, plan.schedule.consumers, 0, 8, False)) > gpu_plan.SMEM_LIMIT


def test_depth_never_exceeds_the_steps():
  f, x = deep_ring(64, 128, 3)
  assert gpu_module(f, x).plan.schedule.depth == 3


# ------------------------------------------------------------ overrides

def test_compiler_params_override_depth_and_consumers():
  f, x = deep_ring(64, 128, 8, pipeline_depth=2, num_consumers=1)
  m = gpu_module(f, x)
  assert (m.plan.schedule.depth, m.plan.schedule.consumers) == (2, 1)
  assert m.plan.cuda_grid == 2
  assert "threads(%arg5, %arg6, %arg7) in (%arg11 = %c256" in m.dialect_text


def test_compiler_params_turn_warp_specialization_off():
  f, x = deep_ring(64, 128, 8, warp_specialize=False)
  m = gpu_module(f, x)
  assert not m.plan.schedule.warp_specialized
  assert "nvvm.setmaxregister" not in m.dialect_text
  assert "threads(%arg5, %arg6, %arg7) in (%arg11 = %c128" in m.dialect_text


def test_kernels_whose_blocks_stay_keep_one_warpgroup():
  m = gpu_module(add, jnp.ones((512, 64)), jnp.ones((512, 64)))
  assert not m.plan.schedule.warp_specialized
  assert m.plan.schedule.threads == 128


def test_cross_warp_reductions_take_one_consumer():
  def k(x_ref, o_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += jnp.sum(x_ref[...].astype(jnp.float32), axis=0)
  f = lambda x: pl.pallas_call(
      k, jax.ShapeDtypeStruct((256,), jnp.float32), grid=(2, 4),
      in_specs=[pl.BlockSpec((64, 128), lambda i, j: (j, i))],
      out_specs=pl.BlockSpec((128,), lambda i, j: (i,)),
      backend="mosaic_gpu")(x)
  plan = gpu_module(f, BF(256, 256)).plan
  assert plan.schedule.warp_specialized and plan.schedule.consumers == 1
  assert plan.reduction_bytes == gpu_plan.REDUCTION_SCRATCH


@pytest.mark.parametrize("params,match", [
    (dict(pipeline_depth=0), "pipeline_depth must be a positive int"),
    (dict(num_consumers=5), "num_consumers must be an int from 1 to 3"),
    (dict(warp_specialize=False, pipeline_depth=3), "deeper rings need"),
    (dict(pipeline_depth=64), "no warp-specialized schedule of 64 slots"),
])
def test_bad_schedule_params_are_clear_errors(params, match):
  f, x = deep_ring(64, 128, 8, **params)
  with pytest.raises(BackendError, match=match) as e:
    gpu_module(f, x)
  assert "compiler_params" in str(e.value)


def test_warp_specialize_without_moving_blocks_is_a_clear_error():
  f = lambda x, y: pl.pallas_call(
      lambda x_ref, y_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
      jax.ShapeDtypeStruct((128, 64), jnp.float32),
      compiler_params=pl.mosaic_gpu.CompilerParams(warp_specialize=True),
      backend="mosaic_gpu")(x, y)
  with pytest.raises(BackendError, match="needs input blocks that move"):
    gpu_module(f, jnp.ones((128, 64)), jnp.ones((128, 64)))


# ------------------------------------------------------------ the protocol

def test_module_follows_the_schedule_roles():
  """Each op of a role (schedule.py) is one op in that warpgroup's region
  of the module: the roles are what is emitted (and what SPIN checks)."""
  m = gpu_module(flash_attention, BF(512, 128), BF(1024, 128), BF(1024, 128))
  sched = m.plan.schedule
  consumer, producer = warpgroup_roles(m.dialect_text)
  emitted = {"wait": WAIT, "arrive": "mosaic_gpu.arrive",
             "expect_tx": "mosaic_gpu.arrive_expect_tx"}
  for role, text in ((sched.producer, producer), (sched.consumer, consumer)):
    for kind, op in emitted.items():
      assert count_op(text, op) == sum(o.kind == kind for o in role.ops()), \
          (role.name, kind)


def test_a_one_slot_ring_copies_at_every_step():
  """With pipeline_depth=1 the moving blocks still go through the ring (one
  slot): copied inside the producer's loop, not once before it (SPIN
  found this schedule's bug in its model first)."""
  f, x = deep_ring(64, 128, 8, pipeline_depth=1)
  m = gpu_module(f, x)
  assert m.plan.schedule.depth == 1 and m.plan.schedule.warp_specialized
  _, producer = warpgroup_roles(m.dialect_text)
  loop = mlir_region(producer, producer.index("scf.for"))
  # The consumers' blocks are neighbours: one copy fills both.
  assert count_op(loop, "mosaic_gpu.async_load") == 1
  assert count_op(producer, "mosaic_gpu.async_load") == 1


def test_neighbouring_replicas_move_in_one_copy():
  """The consumers' x blocks are the next one down each (block index i*2
  + c): the producer moves both in one TMA copy, of x viewed as (blocks,
  rows, K), into the slot that holds both replicas; the module takes x
  in that shape (a reshape before the custom call)."""
  x, y = BF(512, 256), BF(256, 256)
  m = gpu_module(matmul, x, y)
  xb, yb = m.plan.blocks[:2]
  assert (xb.replicas, xb.stacked, xb.stacked_shape) == (2, True,
                                                         (4, 128, 256))
  assert (yb.replicas, yb.stacked, yb.transfers) == (1, False, 1)
  _, producer = warpgroup_roles(m.dialect_text)
  lengths = re.findall(r"slice_lengths = array<i64: ([\d, ]+)>", producer)
  assert lengths == ["2, 128, 64", "64, 128"]
  hlo = jax.jit(matmul).trace(x, y).lower(
      lowering_platforms=("cuda",)).as_text()
  assert re.search(r"stablehlo.reshape %arg0 : \(tensor<512x256xbf16>\) -> "
                   r"tensor<4x128x256xbf16>", hlo)


def _copy_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...]


@pytest.mark.parametrize("index_map,aliases", [
    (lambda i, j: (1 - i, j), {}),
    (lambda i, j: (i, j), {0: 0}),
])
def test_replicas_that_are_not_neighbours_move_apart(index_map, aliases):
  """Consumer c's block is not the next after consumer c - 1's (a reversed
  index map), or the operand is aliased to the output (it keeps its
  shape): one copy per replica."""
  def f(x):
    return pl.pallas_call(
        _copy_kernel, jax.ShapeDtypeStruct((128, 512), jnp.bfloat16),
        grid=(2, 4), in_specs=[pl.BlockSpec((64, 128), index_map)],
        out_specs=pl.BlockSpec((64, 128), lambda i, j: (i, 0)),
        input_output_aliases=aliases, backend="mosaic_gpu")(x)
  m = gpu_module(f, BF(128, 512))
  (xb, _) = m.plan.blocks
  assert m.plan.schedule.consumers == 2 and xb.replicas == 2
  assert not xb.stacked and xb.transfers == 2
  _, producer = warpgroup_roles(m.dialect_text)
  loop = mlir_region(producer, producer.index("scf.for"))
  assert count_op(loop, "mosaic_gpu.async_load") == 2


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_sample_and_schedule_the_gpu_check_runs_builds(name):
  """scripts/mosaic_gpu_export.py's cases (the GPU check's): each builds,
  under the schedule its overrides ask for."""
  fn, _, make, _ = SAMPLES[name]
  sched = gpu_module(fn, *make()).plan.schedule
  for variant, params in SCHEDULES.items():
    if name.endswith(variant):
      assert sched.warp_specialized == params.get("warp_specialize", True)
      assert sched.depth == params.get("pipeline_depth", sched.depth)
      assert sched.consumers == params.get("num_consumers", sched.consumers)
