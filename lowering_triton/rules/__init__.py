"""The Triton lowering's rule table, keyed by primitive.

A rule is `rule(ctx, *args, **params)`: `ctx` is a `RuleContext` (the
equation and emission helpers), `args` the lowered operands (`TVal`s, refs)
and `params` the equation's parameters. It returns the lowered result (a list
of them for primitives with multiple results). Each module below fills the
table for one family of primitives; `dsl.core.jaxpr_walk.walk_jaxpr` dispatches.
"""
from __future__ import annotations

from dsl.core.jaxpr_walk import RuleTable

TABLE = RuleTable("the Triton backend")
register = TABLE.register

# Importing the modules fills the table.
from lowering_triton.rules import (control_flow, debug, dot, elementwise,  # noqa: E402,F401
                                   integer, reductions, shapes, state)
