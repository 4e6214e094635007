"""Transformation rules of pallas_call_p: jvp, linearize/transpose, vmap,
checkify. Importing this package registers them with JAX."""
from dsl.transforms import jvp, transpose  # noqa: F401
