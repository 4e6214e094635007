"""SPIN verifies the mbarrier protocol of the warp-specialized schedules the
Mosaic GPU lowering emits (lowering_mosaic/gpu/protocol_model.py): for each
ring the lowering builds here (depths 1 to 4, one to three consumers, with
and without blocks loaded once), no warpgroup deadlocks, no consumer
computes on a slot before its copies landed, no slot is refilled
before every consumer released it, and consumers that take turns at the
tensor core (attention) never issue WGMMAs at once. Bugs seeded into the
schedule's roles (a missing wait, a missing release, a dropped turn) are
caught."""
import dataclasses

import pytest

from lowering_mosaic.verification import promela
from lowering_mosaic.gpu import protocol_model as PM, schedule as S
from lowering_mosaic.gpu import to_gpu_modules
from benchmarks.mosaic_gpu_kernels import flash_attention, matmul
from tests.pallas.mosaic_gpu_testing import BF, deep_ring

SPIN_OK, SPIN_WHY = promela.spin_available()
pytestmark = pytest.mark.skipif(not SPIN_OK, reason=SPIN_WHY)


def _plan(f, *args):
  (m,) = to_gpu_modules(f, *args)
  return m.plan


def _matmul():
  return _plan(matmul, BF(512, 256), BF(256, 256))


def _flash(**params):
  return _plan(lambda q, k, v: flash_attention(q, k, v, **params),
               BF(512, 128), BF(2048, 128), BF(2048, 128))


def _ring(steps=16, **params):
  f, x = deep_ring(64, 128, steps, **params)
  return _plan(f, x)


# name -> the plan of a kernel the lowering builds; the schedules differ
PLANS = {
    "matmul": _matmul,                                   # depth 2, 2 consumers
    "flash_attention": _flash,                           # + blocks loaded once
                                                         # + turns
    "flash_attention_depth2": lambda: _flash(pipeline_depth=2),
    "flash_attention_depth1": lambda: _flash(pipeline_depth=1),  # no turns
    "depth4_consumers2": _ring,
    "depth3_consumers2": lambda: _ring(pipeline_depth=3),
    "depth1_consumers2": lambda: _ring(pipeline_depth=1),
    "depth4_consumers1": lambda: _ring(num_consumers=1),
    "depth2_consumers1_3steps": lambda: _ring(3, pipeline_depth=2,
                                              num_consumers=1),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_emitted_rings_have_no_race_nor_deadlock(name):
  plan = PLANS[name]()
  ring = PM.Ring.of(plan, name)
  rep = PM.verify(ring)
  assert rep.ok, rep.message
  assert rep.states > 0 and not rep.trail
  # The whole ring is explored: every slot wraps around in both parities.
  assert ring.steps == min(plan.steps, 2 * plan.schedule.depth + 2)


def test_the_schedules_cover_depths_and_consumers():
  seen = {(PLANS[n]().schedule.depth, PLANS[n]().schedule.consumers)
          for n in ("depth4_consumers2", "depth3_consumers2",
                    "depth1_consumers2", "depth4_consumers1")}
  assert seen == {(4, 2), (3, 2), (1, 2), (4, 1)}


def test_model_is_written_from_the_roles():
  ring = PM.Ring.of(_matmul(), "matmul")
  text = PM.to_promela(ring)
  for role in (ring.schedule.producer, ring.schedule.consumer):
    for op in role.ops():
      assert f"/* {op} */" in text, op
  assert "#define DEPTH 2" in text and "#define NCONS 2" in text
  seeded = PM.to_promela(PM.seeded(ring, "consumer", "wait", "full"))
  assert "/* wait(full, phase) */" not in seeded


# ------------------------------------------------------------ seeded bugs

def test_a_consumer_missing_its_full_wait_is_a_race():
  ring = PM.seeded(PM.Ring.of(_matmul(), "matmul"), "consumer", "wait",
                   "full")
  rep = PM.verify(ring)
  assert rep.kind == "race"
  assert "computes on a slot before the copies of its step landed" in \
      rep.message


def test_a_producer_missing_its_empty_wait_is_caught():
  ring = PM.seeded(PM.Ring.of(_ring(), "ring"), "producer", "wait", "empty")
  rep = PM.verify(ring)
  # It re-arms a slot's barrier mid-phase or refills a slot in use.
  assert rep.kind in ("race", "error")
  assert ("more arrivals than its phase expects" in rep.message
          or "refills a slot" in rep.message), rep.message


def test_a_consumer_missing_its_release_deadlocks():
  ring = PM.seeded(PM.Ring.of(_matmul(), "matmul"), "consumer", "arrive",
                   "empty")
  rep = PM.verify(ring)
  assert rep.kind == "deadlock"
  assert "the producer waits on the empty barrier" in rep.message


def test_a_consumer_missing_its_wait_for_blocks_loaded_once_is_a_race():
  ring = PM.seeded(PM.Ring.of(_flash(), "flash"), "consumer", "wait",
                   "fixed")
  rep = PM.verify(ring)
  assert rep.kind == "race"
  assert "reads the blocks loaded once before they landed" in rep.message


def test_one_warpgroup_kernels_have_no_ring_to_model():
  plan = _ring(warp_specialize=False)
  with pytest.raises(ValueError, match="not warp-specialized"):
    PM.Ring.of(plan, "single")


# ------------------------------------------------------------ turns

def _with_consumer(ring, role):
  """`ring` with the consumers' role `role`."""
  return dataclasses.replace(ring, schedule=dataclasses.replace(
      ring.schedule, consumer=role))


def _without_turn(ring, consumer):
  """`ring` with the round `consumer` takes outside its loop (the second
  consumer's before it, the first's after it) dropped."""
  role = ring.schedule.consumer
  part = "before" if consumer == 1 else "after"
  ops = tuple(op for op in getattr(role, part)
              if not (op.barrier == "schedule" and op.only == consumer))
  return _with_consumer(ring, dataclasses.replace(role, **{part: ops}))


def test_attention_consumers_take_turns_in_the_model():
  ring = PM.Ring.of(_flash(), "flash")
  assert ring.schedule.turns
  text = PM.to_promela(ring)
  assert "#define SCHEDULE_COUNT 2" in text
  assert text.count("both consumers issue WGMMAs at once") == 2
  # Per step: the wgmma issued, a round, a round, the wgmma issued.
  step = text[text.index("proctype consumer"):]
  order = [step.index(f"/* {what} */") for what in (
      "compute(ring)", "a wgmma issued",
      "arrive(schedule, after_first_wgmma)",
      "wait(schedule, own, after_first_wgmma)",
      "arrive(schedule, before_last_wgmma)",
      "wait(schedule, other, before_last_wgmma)", "the body ran",
      "arrive(empty)")]
  assert order == sorted(order)
  assert "wait(schedule, first, consumer 1)" in step
  assert "wait(schedule, first, consumer 0)" in step
  assert PM.verify(ring).ok
  # The matmul's one dot a step: no turns, no schedule barrier.
  matmul_text = PM.to_promela(PM.Ring.of(_matmul(), "matmul"))
  assert "schedule" not in matmul_text and "issuing" not in matmul_text


@pytest.mark.parametrize("consumer", [0, 1])
def test_a_turn_dropped_for_one_consumer_deadlocks(consumer):
  rep = PM.verify(_without_turn(PM.Ring.of(_flash(), "flash"), consumer))
  assert rep.kind == "deadlock"
  assert "a consumer waits on the schedule barrier" in rep.message


def test_a_consumer_that_does_not_wait_for_its_turn_is_caught():
  # The second consumer arrives before its loop but issues its first
  # wgmma at once, while the first one issues its own.
  ring = PM.seeded(PM.Ring.of(_flash(), "flash"), "consumer", "wait",
                   "schedule")
  rep = PM.verify(ring)
  assert rep.kind == "race"
  assert "both consumers issue WGMMAs at once" in rep.message


def test_turns_on_a_one_slot_ring_would_deadlock():
  """Why a one-slot ring takes no turns: the first consumer, half a step
  ahead, waits for the slot's next step while the second, waiting for its
  turn, still holds it."""
  plan = _flash(pipeline_depth=1)
  assert plan.schedule.depth == 1 and not plan.schedule.turns
  ring = PM.Ring.of(plan, "flash")
  _, with_turns = S.protocol(has_fixed=True, turns=True)
  rep = PM.verify(_with_consumer(ring, with_turns))
  assert rep.kind == "deadlock"
  assert "waits on the schedule barrier" in rep.message
  assert "waits on the full barrier" in rep.message
