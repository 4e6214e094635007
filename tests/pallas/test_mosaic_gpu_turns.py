"""Ping-pong in the automatic Mosaic GPU schedule: two consumer warpgroups
whose step issues a wgmma, works on its result and issues another wgmma on
what the work gave (attention: QK^T, softmax, PV) take turns at the tensor
core through a schedule mbarrier, as Pallas's `attention_mgpu` does
(lowering_mosaic/gpu/turns.py, schedule.py). Checked in the modules the
lowering builds on a CPU; SPIN checks the protocol
(test_mosaic_gpu_protocol.py), the comparison with `attention_mgpu` is in
test_mosaic_gpu_vs_plgpu.py."""
import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import dsl as pl
from lowering_mosaic.gpu import protocol_model as PM, schedule as S, turns
from lowering_mosaic.verification import promela
from lowering_mosaic.gpu.accumulators import dot_accumulate_p
from benchmarks.mosaic_gpu_kernels import flash_attention, matmul
from tests.pallas.mosaic_gpu_testing import (
    BF, count_op, gpu_module, mlir_region, warpgroup_roles)

WAIT = "nvvm.mbarrier.try_wait.parity"
SPIN_OK, SPIN_WHY = promela.spin_available()
F32 = jnp.float32


def _attention(q_rows=512, **params):
  return gpu_module(lambda q, k, v: flash_attention(q, k, v, **params),
                    BF(q_rows, 128), BF(1024, 128), BF(1024, 128))


def _two_dots(kernel, outputs=2, w2_rows=64):
  """`kernel(x, w1, w2, *outs)`, four steps along K: (64, 64) blocks of a
  (256, 256) x, (64, 128) ones of w1, (w2_rows, 128) ones of w2, into
  `outputs` (256, 128) arrays."""
  def f(x, w1, w2):
    out = jax.ShapeDtypeStruct((256, 128), F32)
    return pl.pallas_call(
        kernel, (out,) * outputs, grid=(4, 4),
        in_specs=[pl.BlockSpec((64, 64), lambda i, j: (i, j)),
                  pl.BlockSpec((64, 128), lambda i, j: (j, 0)),
                  pl.BlockSpec((w2_rows, 128), lambda i, j: (j, 0))],
        out_specs=[pl.BlockSpec((64, 128), lambda i, j: (i, 0))] * outputs,
        compiler_params=pl.mosaic_gpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary")),
        backend="mosaic_gpu")(x, w1, w2)
  return gpu_module(f, BF(256, 256), BF(256, 128), BF(4 * w2_rows, 128))


def _zero_first(*refs):
  @pl.when(pl.program_id(1) == 0)
  def _():
    for ref in refs:
      ref[...] = jnp.zeros_like(ref)


def _independent(x_ref, w1_ref, w2_ref, o1_ref, o2_ref):
  _zero_first(o1_ref, o2_ref)
  o1_ref[...] += jnp.dot(x_ref[...], w1_ref[...], preferred_element_type=F32)
  o2_ref[...] += jnp.dot(x_ref[...], w2_ref[...], preferred_element_type=F32)


def _chained(x_ref, w1_ref, w2_ref, o_ref):
  _zero_first(o_ref)
  h = jnp.dot(x_ref[...], w1_ref[...], preferred_element_type=F32)
  g = jnp.maximum(h, 0.0).astype(jnp.bfloat16)
  o_ref[...] += jnp.dot(g, w2_ref[...], preferred_element_type=F32)


def _barrier_inits(m):
  """(arrivals, barriers) of each mbarrier group the module initializes."""
  return re.findall(r'"mosaic_gpu.initialize_barrier"\(%\w+\) <\{arrival_'
                    r'count = (\d+) : i64, num_barriers = (\d+)',
                    m.dialect_text)


# ------------------------------------------------------------ which kernels

def test_attention_takes_turns_between_its_two_wgmmas():
  plan = _attention().plan
  first, last = turns.phases(plan.body)
  assert (first.primitive, last.primitive) == (lax.dot_general_p,
                                               dot_accumulate_p)
  sched = plan.schedule
  assert sched.consumers == 2 and sched.depth >= 2 and sched.turns
  assert "turns at the tensor core" in sched.describe()


def test_a_chain_of_dots_with_work_between_takes_turns():
  plan = _two_dots(_chained, outputs=1, w2_rows=128).plan
  assert plan.schedule.consumers == 2
  assert turns.phases(plan.body) is not None and plan.schedule.turns


@pytest.mark.skipif(not SPIN_OK, reason=SPIN_WHY)
def test_spin_verifies_the_turns_of_a_ring_without_blocks_loaded_once():
  # attention's have its q blocks (test_mosaic_gpu_protocol.py)
  plan = _two_dots(_chained, outputs=1, w2_rows=128).plan
  assert plan.schedule.turns
  rep = PM.verify(PM.Ring.of(plan, "chained"))
  assert rep.ok, rep.message


@pytest.mark.parametrize("build,why", [
    (lambda: gpu_module(matmul, BF(512, 256), BF(256, 256)),
     "one dot a step"),
    (lambda: _two_dots(_independent), "the second dot does not read the "
     "first's result"),
])
def test_kernels_without_two_phases_take_no_turns(build, why):
  m = build()
  assert m.plan.schedule.consumers == 2
  assert turns.phases(m.plan.body) is None, why
  assert not m.plan.schedule.turns
  # No schedule barrier: full, empty, fixed; the module as before turns.
  assert len(_barrier_inits(m)) == 3
  assert all(op.barrier != "schedule" for op in m.plan.schedule.consumer.ops())


@pytest.mark.parametrize("params,consumers,depth", [
    ({"num_consumers": 1}, 1, None),
    ({"pipeline_depth": 1}, 2, 1),
])
def test_one_consumer_or_one_slot_takes_no_turns(params, consumers, depth):
  plan = _attention(**params).plan
  sched = plan.schedule
  assert turns.phases(plan.body) is not None
  assert sched.consumers == consumers and not sched.turns
  assert depth is None or sched.depth == depth


def test_three_consumers_take_no_turns():
  # One barrier for three: two would issue in the same turn.
  assert not S.specialized(2, 3, 0, 8, False, two_phases=True).turns
  assert S.specialized(2, 2, 0, 8, False, two_phases=True).turns
  assert not S.specialized(2, 2, 0, 8, False, two_phases=False).turns


# ------------------------------------------------------------ the module

def test_turns_sit_around_the_wgmma_issues():
  """In the consumer's loop: the first wgmma issued, a round (arrive,
  wait) before its wait_group; after the softmax a round before the last
  wgmma's fence and issue."""
  m = _attention()
  consumer, _ = warpgroup_roles(m.dialect_text)
  loop = mlir_region(consumer, consumer.index("scf.for"))
  ops = re.findall(r"mosaic_gpu\.wgmma|wgmma\.commit|wgmma\.wait\.group|"
                   r"wgmma\.fence|mosaic_gpu\.arrive\"|try_wait|"
                   r"multi_reduction", loop)
  assert ops == [
      "try_wait",                                     # the full slot
      "wgmma.fence", "mosaic_gpu.wgmma", "wgmma.commit",   # QK^T issued
      'mosaic_gpu.arrive"', "try_wait",               # a turn
      "wgmma.wait.group",
      "multi_reduction", "multi_reduction",           # the softmax
      'mosaic_gpu.arrive"', "try_wait",               # a turn
      "wgmma.fence", "mosaic_gpu.wgmma", "wgmma.commit", "wgmma.wait.group",
      'mosaic_gpu.arrive"']                           # the slot released
  # The schedule barrier: one arrival per consumer, after the ring's.
  d = str(m.plan.schedule.depth)
  assert _barrier_inits(m) == [("1", d), ("2", d), ("1", "1"), ("2", "1")]
  # Outside the loop: the second consumer's round before it, the first's
  # after it, each under its `scf.if`.
  start = consumer.index("scf.for")
  before, after = consumer[:start], consumer[start + len(loop):]
  assert count_op(before, "scf.if") == 1 and count_op(before, WAIT) == 2
  assert count_op(after, "scf.if") == 1 and count_op(after, WAIT) == 1

