"""Derived backward kernels against hand-written ones, compiled for a GPU.

`compile_side(grad_fn, forward_fn, args)` compiles the Triton kernels of
one side of a `benchmarks.grad_vs_hand` pair ahead of time (no GPU needed)
and keeps, of each backward kernel (those `forward_fn` does not make
itself), what decides its speed; `compare(hand, auto)` holds the derived
side to the hand-written one on each of `CRITERIA`:

- hot loop: instructions per iteration of the longest innermost loop;
- straight line: instructions of the longest kernel without a loop;
- registers per thread (the most of any kernel);
- resident warps per SM (occupancy: the fewest of any kernel; programs
  per SM times the warps of each, so that kernels launched with different
  num_warps compare);
- parallel programs: the fewest programs any kernel launches (a grid
  whose dims are all sequential runs as one program);
- spilled bytes per thread (the stack frame and local memory ptxas gives
  spilled registers; the most of any kernel): registers per thread and
  programs per SM flatter a kernel that spills;
- wgmma: whether any kernel uses Hopper's warpgroup MMA;
- passes over the inputs: kernel launches (forward included) that read the
  function's inputs or views of them (`dsl.core.inspection`).

Each holds when the derived figure is within `slack` of the hand-written
one (1.25x, or equal for wgmma and passes), the better way.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

from dsl.core.inspection import traced_kernel_calls, traced_kernels
from lowering_triton import aot
from lowering_triton.ptx_stats import blocks_per_sm

SLACK = 1.25


@dataclasses.dataclass(frozen=True)
class KernelFacts:
  """What one compiled kernel's speed depends on."""
  name: str
  registers: int
  programs_per_sm: int
  num_warps: int
  spill_bytes: int
  wgmma: int           # wgmma instructions in the kernel
  hot_loop: int | None  # instructions of its longest innermost loop
  instructions: int    # of the whole kernel
  programs: int        # launched (its sequential grid dims loop inside)


@dataclasses.dataclass(frozen=True)
class Side:
  """One side of a pair: its backward kernels, and the passes its whole
  gradient (forward included) makes over the inputs."""
  backward: tuple[KernelFacts, ...]
  forward: tuple[str, ...]   # the forward kernels left out, by name
  passes: int


@dataclasses.dataclass(frozen=True)
class Criterion:
  label: str
  unit: str
  measure: Callable[[Side], int]
  higher_is_better: bool = False
  slack: float = SLACK


def _most(values) -> int:
  return max(values, default=0)


CRITERIA = {
    "hot_loop": Criterion("hot loop", "instructions", lambda s: _most(
        k.hot_loop for k in s.backward if k.hot_loop is not None)),
    "straight_line": Criterion("straight line", "instructions",
                               lambda s: _most(k.instructions
                                               for k in s.backward
                                               if k.hot_loop is None)),
    "registers": Criterion("registers", "per thread", lambda s: _most(
        k.registers for k in s.backward)),
    "occupancy": Criterion("occupancy", "warps per SM", lambda s: min(
        (k.programs_per_sm * k.num_warps for k in s.backward), default=0),
        True),
    "programs": Criterion("parallel programs", "launched", lambda s: min(
        (k.programs for k in s.backward), default=0), True),
    "spills": Criterion("spills", "bytes spilled per thread", lambda s:
                        _most(k.spill_bytes for k in s.backward)),
    "wgmma": Criterion("wgmma", "kernels using it", lambda s: sum(
        1 for k in s.backward if k.wgmma), True, 1.0),
    "passes": Criterion("passes over the inputs", "launches", lambda s:
                        s.passes, False, 1.0),
}


@dataclasses.dataclass(frozen=True)
class Verdict:
  criterion: str
  auto: int
  hand: int

  @property
  def holds(self) -> bool:
    c = CRITERIA[self.criterion]
    worse, better = ((self.hand, self.auto) if c.higher_is_better
                     else (self.auto, self.hand))
    return worse <= better * c.slack

  @property
  def ratio(self) -> float:
    return self.auto / self.hand if self.hand else (
        1.0 if not self.auto else float("inf"))

  def __str__(self) -> str:
    c = CRITERIA[self.criterion]
    return f"{c.label} {self.auto} vs {self.hand} {c.unit} ({self.ratio:.2f}x)"


def facts(kernel: aot.AotKernel) -> KernelFacts:
  st = kernel.stats()
  hot = [lp.mix.instructions for lp in st.hot_loops]
  return KernelFacts(
      kernel.name, st.registers or 0,
      blocks_per_sm(st.registers, kernel.num_warps, kernel.shared),
      kernel.num_warps, st.spill_bytes,
      st.kernel.wgmma, max(hot) if hot else None, st.kernel.instructions,
      math.prod(kernel.launch))


def compile_side(grad_fn, forward_fn, args, target: str = "sm_90",
                 compiled: list | None = None) -> Side:
  """`grad_fn(*args)`'s kernels compiled for `target`, less the leading ones
  that `forward_fn(*args)` makes (its forward pass). `compiled`: receives
  every AotKernel, for a report."""
  kernels = aot.compile_aot(grad_fn, *args, target=target)
  if compiled is not None:
    compiled.extend(kernels)
  fwd = tuple(spec.name for spec, _ in traced_kernels(forward_fn, *args))
  n = len(fwd) if tuple(k.name for k in kernels[:len(fwd)]) == fwd else 0
  passes = sum(1 for call in traced_kernel_calls(grad_fn, *args)
               if call.reads_inputs)
  return Side(tuple(facts(k) for k in kernels[n:]), fwd[:n], passes)


def compare(hand: Side, auto: Side) -> dict[str, Verdict]:
  """Each criterion's figures of both sides."""
  return {name: Verdict(name, c.measure(auto), c.measure(hand))
          for name, c in CRITERIA.items()}
