"""The Mosaic lowering's rule table: `RULES[primitive] = rule`.

A rule is `rule(ctx: RuleContext, *args, **params)`; `args` are MLIR values
(scalars, vectors) or `RefVal`s for refs, and it returns the output value
(or a list of them for multiple-result primitives), emitting operations at
the current insertion point. Each module in this package fills the table for
one family of primitives, the way JAX keys its lowering rules.

A primitive without a rule raises a `BackendError` naming the primitive,
the kernel and the user's source line.
"""
from __future__ import annotations

from typing import Callable

RULES: dict = {}
RULES_BY_NAME: dict[str, Callable] = {}


def register(*primitives):
  """Decorator: registers a rule for primitives (objects or names)."""
  def deco(rule):
    for p in primitives:
      if isinstance(p, str):
        RULES_BY_NAME[p] = rule
      else:
        RULES[p] = rule
    return rule
  return deco


def rule_for(primitive, lctx) -> Callable:
  rule = RULES.get(primitive) or RULES_BY_NAME.get(primitive.name)
  if rule is None:
    raise lctx.error(
        "is not supported by the Mosaic (TPU) lowering; rewrite the kernel "
        "without it or run it with backend='interpret'", primitive.name)
  return rule


from lowering_mosaic.rules import (control, elementwise, memory,  # noqa: E402,F401
                                   reductions, shapes, tpu_ops)
