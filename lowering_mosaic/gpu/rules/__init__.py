"""The Mosaic GPU lowering's rule table, `TABLE`, and the rules that fill
it, one module per family of primitives."""
from dsl.core.jaxpr_walk import RuleTable

TABLE = RuleTable("the Mosaic GPU backend")

from lowering_mosaic.gpu.rules import (control, dot, elementwise,  # noqa: E402,F401
                                       memory, plgpu, shapes, collectives)
