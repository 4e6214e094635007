"""Peeling the first and last steps' `pl.when` blocks out of a grid loop.

A kernel that walks a sequential grid dim `j` usually starts with
`@pl.when(j == 0)` (zero an accumulator, stage a block in scratch) and ends
with `@pl.when(j == n - 1)` (normalize, store the output). Emitted as they
stand, both become `if` branches inside the `for j` loop, and Triton's
software pipeliner then sees a loop body with stores and branches around its
dots. `peel(...)` splits the step's jaxpr into

- a prologue: the leading `j == 0` blocks, run once before the loop with
  `j = 0`;
- the loop body: everything else;
- an epilogue: the trailing `j == n - 1` blocks, run once after the loop with
  `j = n - 1`;

so the loop reads like a hand-written one. A block moves only where that
keeps the step's order of effects: a prologue block may be preceded in the
step only by pure equations and reads of refs it does not write (decode
attention reads the sequence length before zeroing its scratch), an epilogue block followed only by pure
equations or other epilogue blocks, and each moved block may use only the
kernel's operands (refs, grid ids) and values computed from them by pure
equations in the same region, never a value of the loop body.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from jax import lax
from dsl.core.jax_internals import core, state_types


@dataclasses.dataclass(frozen=True)
class Peeled:
  prologue: core.Jaxpr | None   # run before the loop with j = 0
  body: core.Jaxpr
  epilogue: core.Jaxpr | None   # run after the loop with j = trip - 1


def _producers(jaxpr: core.Jaxpr) -> dict:
  return {v: e for e in jaxpr.eqns for v in e.outvars}


def _step_guard(eqn, step_var, producers) -> int | None:
  """The step k if `eqn` is `pl.when(step_var == k)` (a two-branch cond
  with no results whose false branch is empty), else None."""
  if eqn.primitive is not lax.cond_p or eqn.outvars:
    return None
  branches = eqn.params["branches"]
  if len(branches) != 2 or branches[0].jaxpr.eqns:
    return None
  index = eqn.invars[0]
  e = producers.get(index) if isinstance(index, core.Var) else None
  if e is not None and e.primitive is lax.convert_element_type_p:
    index = e.invars[0]
    e = producers.get(index) if isinstance(index, core.Var) else None
  if e is None or e.primitive is not lax.eq_p:
    return None
  a, b = e.invars
  if b is step_var and isinstance(a, core.Literal):
    a, b = b, a
  if a is not step_var or not isinstance(b, core.Literal):
    return None
  return int(np.asarray(b.val))


def _pure(eqn) -> bool:
  """No effects (JAX reports a sub-jaxpr's ref effects on its equation)."""
  return not eqn.effects


def _refs(eqn, kinds) -> set:
  return {ef.input for ef in eqn.effects if isinstance(ef, kinds)}


def _reads_only(eqn) -> bool:
  return bool(eqn.effects) and all(
      isinstance(ef, state_types.ReadEffect) for ef in eqn.effects)


def _leading_region(eqns, step_var, producers) -> int:
  """How many leading eqns may run before the first step's blocks: pure
  ones, `j == 0` blocks, and reads of refs that no such block writes."""
  lead, read = 0, set()
  for e in eqns:
    if _step_guard(e, step_var, producers) == 0:
      if _refs(e, (state_types.WriteEffect, state_types.AccumEffect)) & read:
        break
    elif _reads_only(e):
      read |= _refs(e, state_types.ReadEffect)
    elif not _pure(e):
      break
    lead += 1
  return lead


def _uses(eqn, available: set) -> bool:
  return all(isinstance(v, core.Literal) or v in available for v in eqn.invars)


def _moved(region, step_var, step: int, producers, available: set):
  """The eqns of `region` that run outside the loop: its `j == step` blocks
  whose inputs are available, and the pure eqns they may use."""
  available = set(available)
  eqns, blocks = [], []
  for e in region:
    if _pure(e):
      if _uses(e, available):
        available.update(e.outvars)
        eqns.append(e)
    elif (_step_guard(e, step_var, producers) == step
          and _uses(e, available)):
      eqns.append(e)
      blocks.append(e)
  return eqns, blocks


def peel(jaxpr: core.Jaxpr, step_var, trip: int) -> Peeled:
  """Splits `jaxpr` (one grid step) around the loop over `step_var`."""
  producers = _producers(jaxpr)
  eqns = list(jaxpr.eqns)
  operands = set(jaxpr.invars) | set(jaxpr.constvars)

  # Leading region: pure eqns, reads and `j == 0` blocks, up to the first
  # other effect.
  lead = _leading_region(eqns, step_var, producers)
  pro_eqns, pro_blocks = _moved(eqns[:lead], step_var, 0, producers, operands)

  # Trailing region: pure eqns and `j == trip - 1` blocks after the last
  # other effect or prologue block (its pure eqns may be the leading
  # region's too: they stay in the body and are emitted again after it).
  taken = {id(e) for e in pro_blocks}
  tail = len(eqns)
  while tail > 0 and id(eqns[tail - 1]) not in taken and (
      _pure(eqns[tail - 1])
      or _step_guard(eqns[tail - 1], step_var, producers) == trip - 1):
    tail -= 1
  epi_eqns, epi_blocks = _moved(eqns[tail:], step_var, trip - 1, producers,
                                operands)

  moved = {id(e) for e in pro_blocks + epi_blocks}
  body = jaxpr.replace(eqns=[e for e in eqns if id(e) not in moved])
  make = lambda es, bs: jaxpr.replace(eqns=es, outvars=[]) if bs else None
  return Peeled(make(pro_eqns, pro_blocks), body, make(epi_eqns, epi_blocks))
