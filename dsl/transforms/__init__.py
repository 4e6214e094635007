"""Transformation rules of pallas_call_p: jvp, linearize/transpose, vmap,
checkify. Importing this package registers them with JAX."""
from dsl.transforms import (checkify_rule, jvp, ref_jvp, transpose,  # noqa: F401
                            vmap)
