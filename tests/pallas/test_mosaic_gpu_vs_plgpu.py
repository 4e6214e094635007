"""Performance contracts of the automatic Mosaic GPU schedule: a plain
pallas_call kernel of `kernels/` on "mosaic_gpu" is no worse, on paper,
than Pallas's explicit plgpu kernel computing the same thing at the same
tiles (`tests/pallas/mosaic_gpu_vs_plgpu.py` builds and reads both
modules; docs/mosaic-gpu.md, "Automatic against explicit", has the table).

Where the automatic schedule is worse, the criterion is a strict xfail
naming the figures and the cause, and `KNOWN_WORSE`'s figures are held
exactly, so a change in either direction shows.
"""
from __future__ import annotations

import functools

import pytest

from tests.pallas import mosaic_gpu_vs_plgpu as V

# (pair, criterion) -> (ours, Pallas's, why).
KNOWN_WORSE = {}


@functools.cache
def figures(pair: str) -> dict[str, tuple[object, object]]:
  return V.compare(pair)


def _cases():
  for pair in V.PAIRS:
    for criterion in V.NO_WORSE:
      known = KNOWN_WORSE.get((pair, criterion))
      marks = [pytest.mark.xfail(
          strict=True, reason=f"{known[0]} against {known[1]}: {known[2]}")
      ] if known else []
      yield pytest.param(pair, criterion, marks=marks,
                         id=f"{pair}-{criterion.replace(' ', '_')}")


@pytest.mark.parametrize("pair,criterion", list(_cases()))
def test_automatic_schedule_is_no_worse_than_plgpu(pair, criterion):
  ours, theirs = figures(pair)[criterion]
  assert V.NO_WORSE[criterion](ours, theirs), (
      f"{pair}: {criterion}: ours {ours}, Pallas's {theirs}")


def test_known_worse_figures_are_as_recorded():
  found = {key: figures(key[0])[key[1]] for key in KNOWN_WORSE}
  assert found == {key: v[:2] for key, v in KNOWN_WORSE.items()}


def test_both_schedules_are_warp_specialized_with_the_same_tensor_core_work():
  for pair in V.PAIRS:
    f = figures(pair)
    assert f["warpgroups"] == (3, 3)
    assert f["consumer setmaxnreg"] == (232, 232)
    assert f["producer setmaxnreg"] == (40, 40)
  # Per consumer and step: a 64 x 128 x 64 product (four k16 WGMMAs);
  # attention's QK^T (64 x 64 x 128: eight) and PV (64 x 128 x 64: four).
  assert figures("matmul")["consumer wgmma per step"] == (
      {"m64n128k16": 4},) * 2
  assert figures("attention")["consumer wgmma per step"] == (
      {"m64n64k16": 8, "m64n128k16": 4},) * 2
  # The automatic schedule: one full-slot wait and one release per
  # consumer step, and two turns at the tensor core (schedule-barrier
  # rounds) as the explicit attention takes; that one also waits for K and
  # V apart and releases them apart.
  attention = figures("attention")
  assert attention["consumer mbarrier waits per step"] == (3, 4)
  assert attention["consumer mbarrier arrivals per step"] == (3, 4)
  assert attention["consumer turn-taking rounds per step"] == (2, 2)
  assert figures("matmul")["consumer turn-taking rounds per step"] == (0, 0)


def test_turns_are_arrivals_on_barriers_the_step_waits_on():
  body = """\
  scf.for %i = %c0 to %n step %c1 {
    nvvm.mbarrier.try_wait.parity %full, %p, %c : !llvm.ptr<3>, i32, i32
    %1 = llvm.inline_asm "mbarrier.arrive.release.cta.shared::cta.b64 _, [$0], 1;", "r" %sched : (!llvm.ptr<3>) -> !llvm.void
    nvvm.mbarrier.try_wait.parity %sched, %q, %c : !llvm.ptr<3>, i32, i32
    %2 = llvm.inline_asm "mbarrier.arrive.release.cta.shared::cta.b64 _, [$0], 1;", "r" %empty : (!llvm.ptr<3>) -> !llvm.void
  }"""
  step = V.step_of(body)
  assert (step.barrier_waits, step.barrier_arrives, step.turns) == (2, 2, 1)


def test_branch_regions_are_not_counted_as_every_step():
  body = """\
  scf.for %i = %c0 to %c8 step %c1 {
    %a = arith.addi %x, %y : i32
    %b = scf.index_switch %c -> i32
    case 0 {
      %d = arith.muli %x, %y : i32
      scf.yield %d : i32
    }
    default {
      scf.yield %x : i32
    }
    scf.if %p {
      bar.sync
    } else {
      bar.sync
    }
  }"""
  step = V.step_of(body)
  assert (step.trips, step.ops, step.branch_ops, step.bar_syncs,
          step.branch_results) == ("c8", 8, 5, 0, 1)
