"""The Mosaic lowering's rule table, `TABLE`, and the rules that fill it.

A rule is `rule(ctx: RuleContext, *args, **params)`; `args` are MLIR values
(scalars, vectors) or `RefVal`s for refs, and it returns the output value
(or a list of them for multiple-result primitives), emitting operations at
the current insertion point. Each module in this package fills the table for
one family of primitives, the way JAX keys its lowering rules.

A primitive without a rule raises a `BackendError` naming the primitive,
the kernel and the user's source line.
"""
from __future__ import annotations

from dsl.core.jaxpr_walk import RuleTable

# The rule table, keyed by primitive; the modules below fill it.
TABLE = RuleTable("the Mosaic (TPU) lowering")
register = TABLE.register

from lowering_mosaic.tpu.rules import (control, elementwise, integer, memory,
                                       prng, reductions, shapes, tpu_ops)
