"""The Triton lowering rules, keyed by primitive: `rules[primitive] = rule`.

A rule is `rule(ctx, *args, **params)`: `ctx` is a `RuleContext` (the
equation and emission helpers), `args` the lowered operands (`TVal`s, refs)
and `params` the equation's parameters. It returns the lowered result (a list
of them for primitives with multiple results). Each module below fills the
table for one family of primitives.
"""
from __future__ import annotations

from typing import Callable

rules: dict = {}
_rules_by_name: dict[str, Callable] = {}


def register(*primitives):
  """Decorator: registers a rule for primitives (objects, or names for
  primitives that are not importable in every JAX version)."""
  def decorate(rule):
    for p in primitives:
      if p is None:
        continue
      if isinstance(p, str):
        _rules_by_name[p] = rule
      else:
        rules[p] = rule
    return rule
  return decorate


def lookup(primitive) -> Callable | None:
  rule = rules.get(primitive)
  if rule is None:
    rule = _rules_by_name.get(primitive.name)
  return rule


def supported_primitives() -> list[str]:
  return sorted({p.name for p in rules} | set(_rules_by_name))


# Importing the modules fills the table.
from lowering_triton.rules import (control_flow, debug, dot, elementwise,  # noqa: E402,F401
                                   integer, reductions, shapes, state)
