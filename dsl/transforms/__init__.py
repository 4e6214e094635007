"""The rules of pallas_call_p: jvp, linearize/transpose, vmap, checkify and
the MLIR lowering (which partitions under a sharded jit). Importing this
package registers them with JAX."""
from dsl.transforms import (checkify_rule, jvp, lowering_rule, ref_jvp,  # noqa: F401
                            transpose, vmap)
