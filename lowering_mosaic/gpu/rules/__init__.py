"""The Mosaic GPU rule table, one module per family of primitives."""
from lowering_mosaic.gpu.rules import (control, dot, elementwise,  # noqa
                                       memory, shapes)
