"""Accumulators in registers: what the kernel body becomes before it is
emitted inside the loop over sequential steps.

Two rewrites of the kernel jaxpr, both sound by construction:

- **Carried refs.** A ref that keeps its value across the sequential steps
  and that the body reads (a matmul's output block `o_ref[...] += dot(..)`,
  attention's running `acc`, `m` and `l` scratch) is *discharged*: the body
  takes its value as an input and returns its new value (JAX's state
  discharge, which threads the value through `pl.when` branches as
  `cond` operands and results). The emitter carries that value through
  the loop (`scf.for` iter_args, in registers) and, for an output block,
  writes it to shared memory once, after the loop, before its TMA store.
  A ref is carried only if every use of it reads or writes it whole
  (`x_ref[...]`, directly or inside `cond` branches): a window of it, or
  a use by anything else (`run_scoped`, loops, DMAs), keeps it in shared
  memory. Its value before the first step is zero (the buffer it replaces
  held whatever shared memory held: kernels write it before reading), or
  what the kernel's first-step initialization computes, hoisted out of
  the loop (initial_values.py).
- **Accumulating dots.** `x + dot(a, b)` with a float32 2-D dot whose
  result has no other use becomes one `dot_accumulate(a, b, x)`: a
  `wgmma` that accumulates into `x` in place (rules/dot.py), so a carried
  accumulator goes straight into the tensor-core instruction. Only when no
  equation with effects sits between the dot and the add (the dot rule
  reads its operands from the shared memory they were loaded from, which
  such an equation could overwrite).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
from jax import lax
from dsl.core.jax_internals import (close_jaxpr, ClosedJaxpr, core,
                                    partial_eval as pe, state_discharge,
                                    state_indexing as indexing,
                                    state_primitives, state_types)

from dsl.core.access import SLICE, RefAccess
from dsl.core.jaxpr_walk import sub_jaxprs, used_vars
from dsl.core.operand_layout import eqn_ref_operands
from lowering_mosaic.gpu.schedule import WARPGROUP

# dot_accumulate(a, b, acc; dot_general's params) = acc + dot_general(a, b)
dot_accumulate_p = core.Primitive("dot_accumulate")
dot_accumulate_p.def_abstract_eval(lambda a, b, acc, **_: acc)
# Its meaning, which also runs rewritten bodies on the CPU (tests).
dot_accumulate_p.def_impl(
    lambda a, b, acc, **params: acc + lax.dot_general_p.bind(a, b, **params))

_REF_ACCESS = (state_primitives.get_p, state_primitives.swap_p,
               state_primitives.addupdate_p)


@dataclasses.dataclass(frozen=True)
class Body:
  """The jaxpr the emitter walks at each sequential step.

  `carried`: positions, among the kernel's refs (prefetch, blocks,
  scratch), of the refs whose values the loop carries; `jaxpr` takes
  those as values (in their place among its inputs) and returns their new
  values, in that order. `initial` (no inputs) gives the initial values
  of the carried refs at `initialized` (indices into `carried`; the
  others start at zero), `tensor_core` the indices of those only WGMMAs
  write inside the loop (initial_values.py)."""
  jaxpr: ClosedJaxpr
  carried: tuple[int, ...] = ()
  initial: ClosedJaxpr | None = None
  initialized: tuple[int, ...] = ()
  tensor_core: tuple[int, ...] = ()


# ------------------------------------------------------------ carried refs

def selects_whole(transforms) -> bool:
  """Whether a ref access's transforms select the whole ref."""
  for t in transforms or ():
    if not isinstance(t, indexing.NDIndexer) or t.int_indexer_shape:
      return False
    for w, n in zip(RefAccess.of(t).dims, t.shape):
      if not (w.kind == SLICE and isinstance(w.start, int) and w.start == 0
              and w.size == n and w.stride == 1):
        return False
  return True


def _uses(jaxpr: core.Jaxpr, var) -> tuple[bool, bool]:
  """(every use of `var` in `jaxpr` accesses it whole, some use reads it)."""
  ok, reads = True, False
  used = used_vars(jaxpr)
  for eqn in jaxpr.eqns:
    positions = [i for i, v in enumerate(eqn.invars) if v is var]
    if not positions:
      continue
    if eqn.primitive in _REF_ACCESS and positions == [0]:
      ok &= selects_whole(eqn_ref_operands(eqn).transforms)
      reads |= (eqn.primitive is not state_primitives.swap_p
                or eqn.outvars[0] in used)
    elif eqn.primitive is lax.cond_p and 0 not in positions:
      for branch in eqn.params["branches"]:
        for p in positions:
          b_ok, b_reads = _uses(branch.jaxpr, branch.jaxpr.invars[p - 1])
          ok &= b_ok
          reads |= b_reads
    else:
      ok = False
  if var in jaxpr.outvars:
    ok = False
  return ok, reads


def carriable(jaxpr: core.Jaxpr, position: int) -> bool:
  """Whether the kernel's input `position` (a ref) can be carried: every
  use accesses it whole, and the body reads it."""
  var = jaxpr.invars[position]
  if not isinstance(var.aval, state_types.AbstractRef):
    return False
  ok, reads = _uses(jaxpr, var)
  return ok and reads


def carried_body(kernel: ClosedJaxpr, refs: list[int],
                 grid_rank: int) -> Body:
  """The body with the refs at `refs` (positions among the kernel's refs,
  which follow the `grid_rank` program ids) discharged, and its
  accumulating dots fused."""
  if not refs:
    return Body(fuse_dots(kernel))
  should = [False] * len(kernel.jaxpr.invars)
  for r in refs:
    should[grid_rank + r] = True
  discharged = state_discharge.discharge_state(
      kernel, should_discharge=should, strip_memory_space=True)
  n_out = len(discharged.outvars)
  jaxpr, _ = pe.dce_jaxpr(discharged, [True] * n_out, instantiate=True)
  closed = close_jaxpr(jaxpr, kernel.consts)
  return Body(fuse_dots(closed), tuple(refs))


# Registers per consumer thread the carried accumulators may take: what
# two consumers get (schedule.py) less 64 for the body's own values.
CARRY_REGISTERS = 232 - 64


def carried_refs_body(spec, blocks, scratch, n_prefetch, steps) -> Body:
  """The body with the refs that stay across the sequential steps (output
  blocks that do not move, scratch) carried in registers where
  `carriable` says it is sound, within CARRY_REGISTERS (`blocks`: the
  plan's, plan.py)."""
  jaxpr, rank = spec.jaxpr, len(spec.grid_mapping.grid)
  if steps <= 1:
    return carried_body(jaxpr, [], rank)
  candidates = [(n_prefetch + k, b.kernel_shape, b.dtype)
                for k, b in enumerate(blocks)
                if b.is_output and not b.moves and not b.in_gmem]
  first = n_prefetch + len(blocks)
  candidates += [(first + i, s, d) for i, (s, d) in enumerate(scratch)]
  refs, registers = [], 0
  for pos, shape, dtype in candidates:
    need = -(-math.prod(shape) * np.dtype(dtype).itemsize // (WARPGROUP * 4))
    if registers + need <= CARRY_REGISTERS and carriable(
        jaxpr.jaxpr, rank + pos):
      refs.append(pos)
      registers += need
  return carried_body(jaxpr, refs, rank)


# ------------------------------------------------------------ fused dots

def _fusable_dot(eqn) -> bool:
  if eqn.primitive is not lax.dot_general_p:
    return False
  (_, _), (lb, rb) = eqn.params["dimension_numbers"]
  out = eqn.outvars[0].aval
  return (not lb and not rb and len(out.shape) == 2
          and np.dtype(out.dtype) == np.float32)


def _writes(eqn) -> bool:
  """Whether `eqn` may write memory (effects other than reads)."""
  return any(not isinstance(e, state_types.ReadEffect) for e in eqn.effects)


def _fuse_eqns(eqns, outvars) -> list:
  """`eqns` with `x + dot(a, b)` pairs fused (see the module doc)."""
  uses: dict = {}
  for e in eqns:
    for v in e.invars:
      if isinstance(v, core.Var):
        uses[v] = uses.get(v, 0) + 1
  for v in outvars:
    if isinstance(v, core.Var):
      uses[v] = uses.get(v, 0) + 1
  out = list(eqns)
  dots = {}                     # result var -> index of its dot in `out`
  for i, e in enumerate(out):
    if _fusable_dot(e) and uses.get(e.outvars[0]) == 1:
      dots[e.outvars[0]] = i
      continue
    if _writes(e):
      dots.clear()              # never move a dot past a write
      continue
    if e.primitive is not lax.add_p:
      continue
    x, y = e.invars
    for prod, acc in ((y, x), (x, y)):
      if (isinstance(prod, core.Var) and prod in dots
          and isinstance(acc, core.Var)
          and acc.aval.shape == prod.aval.shape
          and np.dtype(acc.aval.dtype) == np.float32):
        j = dots.pop(prod)
        d, out[j] = out[j], None
        out[i] = core.new_jaxpr_eqn(
            [*d.invars, acc], e.outvars, dot_accumulate_p, dict(d.params),
            core.no_effects, d.source_info, d.ctx)
        break
  return [e for e in out if e is not None]


def map_jaxpr_param(value, fn):
  """`value` (an equation's param) with `fn` applied to each jaxpr in it
  (a jaxpr, a closed jaxpr, or a tuple of them: cond's branches)."""
  if isinstance(value, ClosedJaxpr):
    return close_jaxpr(fn(value.jaxpr), value.consts)
  if isinstance(value, core.Jaxpr):
    return fn(value)
  if isinstance(value, tuple) and value and isinstance(
      value[0], (core.Jaxpr, ClosedJaxpr)):
    return tuple(map_jaxpr_param(v, fn) for v in value)
  return value


def _fuse_jaxpr(jaxpr: core.Jaxpr) -> core.Jaxpr:
  eqns = []
  for e in jaxpr.eqns:
    if any(True for _ in sub_jaxprs(e.params)):
      e = e.replace(params={k: map_jaxpr_param(v, _fuse_jaxpr)
                            for k, v in e.params.items()})
    eqns.append(e)
  return jaxpr.replace(eqns=_fuse_eqns(eqns, jaxpr.outvars))


def fuse_dots(closed: ClosedJaxpr) -> ClosedJaxpr:
  """`closed` with its accumulating dots fused (in nested jaxprs too)."""
  return close_jaxpr(_fuse_jaxpr(closed.jaxpr), closed.consts)
