"""Derived backward kernels held to their hand-written counterparts on sm_90.

For each pair of `benchmarks/grad_vs_hand.py` (a `kernels/` function with
a `custom_vjp`, against `jax.grad` through its forward kernel alone), both
gradients' Triton kernels are compiled ahead of time for sm_90 at the
`AOT` sizes, and the derived backward kernels are compared with the
hand-written ones on each criterion of `benchmarks.grad_structure` (hot
loop and straight-line instructions, registers, programs per SM, parallel
programs, spills, wgmma, passes over the inputs). The goal: within 1.25x
of the hand-written side, the better way (no more passes, wgmma wherever
the hand-written kernels have it).

A criterion a pair misses today is a strict xfail whose reason gives the
figures measured when it was marked (derived vs hand-written): when the
derived kernels improve enough, it XPASSes and the mark goes.
`python -m benchmarks.grad_vs_hand --aot sm_90` prints the current
figures. Timings are the benchmark's business, not these tests'.
"""
import functools

import pytest

from benchmarks import grad_structure, grad_vs_hand

ATTENTION = ("flash_attention", "flash_attention_noncausal",
             "flash_attention_gqa")
PAIRS = ("softmax", "layer_norm", "rms_norm", "matmul") + ATTENTION

# (pair, criterion) -> its figures (derived vs hand-written) when marked.
MISSES: dict = {}


@functools.lru_cache(maxsize=None)
def _sides(name):
  """{"hand": Side, "auto": Side} of pair `name`, compiled once per
  process."""
  return grad_vs_hand.compile_pair(name, "sm_90")[1]


def _cases():
  for name in PAIRS:
    for criterion in grad_structure.CRITERIA:
      marks = []
      if (name, criterion) in MISSES:
        marks.append(pytest.mark.xfail(
            strict=True, reason=MISSES[name, criterion]))
      yield pytest.param(name, criterion, marks=marks,
                         id=f"{name}-{criterion}")


def test_every_miss_names_a_pair_and_a_criterion():
  assert {n for n, _ in MISSES} <= set(PAIRS)
  assert {c for _, c in MISSES} <= set(grad_structure.CRITERIA)
  assert set(PAIRS) == set(grad_vs_hand.CASES)


@pytest.mark.parametrize("name,criterion", list(_cases()))
def test_derived_backward_is_within_goal_of_hand_written(name, criterion):
  sides = _sides(name)
  verdict = grad_structure.compare(sides["hand"], sides["auto"])[criterion]
  slack = grad_structure.CRITERIA[criterion].slack
  assert verdict.holds, (f"{name}: {verdict}, derived vs hand-written "
                         f"(goal: within {slack}x)")


@pytest.mark.parametrize("name", PAIRS)
def test_both_sides_have_backward_kernels_and_leave_the_forward_out(name):
  """What the comparison stands on: each gradient starts with the kernels
  of its forward function (left out), then has backward kernels, and
  reads the inputs at least in its forward pass."""
  for side in _sides(name).values():
    assert side.forward and side.backward
    assert side.passes >= 1
