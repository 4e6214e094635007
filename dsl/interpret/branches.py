"""Cheap `pl.when` bodies as selects, before the interpret backend runs a
kernel.

A discharged `pl.when` is a `cond` whose branches return the new values of
the refs it writes. Inside the sequential grid loop, a `cond` whose index
does not vary over the vectorized points stays an XLA conditional, which
the CPU dispatches per step at a cost well above that of a cheap body (the
accumulator reset `acc_ref[...] = zeros` at `program_id(k) == 0`). Where
every branch is a few elementwise operations without effects, both are
computed and the result selected: the same values, no conditional.
"""
from __future__ import annotations

import functools

from jax import lax

from dsl.core.jax_internals import ClosedJaxpr, core
from dsl.core.jaxpr_walk import CALL_PRIMITIVES, call_body
from dsl.core.normalize import rewrite_closed

# Primitives cheap enough to compute at every step whichever branch is taken:
# no reductions, contractions, loops, gathers or calls out.
_CHEAP = frozenset([
    lax.broadcast_in_dim_p, lax.convert_element_type_p, lax.iota_p,
    lax.reshape_p, lax.squeeze_p, lax.select_n_p, lax.copy_p,
    lax.add_p, lax.sub_p, lax.mul_p, lax.neg_p, lax.max_p, lax.min_p,
    lax.abs_p, lax.and_p, lax.or_p, lax.not_p, lax.xor_p,
    lax.eq_p, lax.ne_p, lax.lt_p, lax.le_p, lax.gt_p, lax.ge_p,
])

# At most this many equations over all branches of one `cond`.
MAX_SELECTED_EQNS = 16


def _cheap_eqns(jaxpr: core.Jaxpr) -> int | None:
  """How many cheap equations `jaxpr` holds (calls inlined), or None when
  it holds one that is not cheap."""
  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive in CALL_PRIMITIVES:
      body = call_body(eqn.params, eqn.invars)
      inner = _cheap_eqns(body[0]) if body is not None else None
      if inner is None:
        return None
      count += inner
    elif eqn.primitive in _CHEAP:
      count += 1
    else:
      return None
  return count


def selectable(branches) -> bool:
  """Whether the `cond` branches `branches` are cheap and without effects,
  so that computing all of them and selecting one gives the same result."""
  total = 0
  for branch in branches:
    if branch.effects:
      return False
    count = _cheap_eqns(branch.jaxpr)
    if count is None:
      return False
    total += count
  return total <= MAX_SELECTED_EQNS


def _cond_rule(index, *operands, branches, **params):
  if not selectable(branches):
    return lax.cond_p.bind(index, *operands, branches=branches, **params)
  index = lax.clamp(0, index, len(branches) - 1)   # as `cond` does
  results = [core.jaxpr_as_fun(b)(*operands) for b in branches]
  return [lax.select_n(index, *cases) for cases in zip(*results)]


RULES = {lax.cond_p: _cond_rule}


@functools.lru_cache(maxsize=256)
def cheap_branches_selected(jaxpr: ClosedJaxpr) -> ClosedJaxpr:
  """`jaxpr` (a discharged kernel) with each `cond` whose branches are
  `selectable` computed as a select of all of them."""
  return rewrite_closed(jaxpr, RULES)
