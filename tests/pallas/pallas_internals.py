"""Pallas's private modules that the tests compare with (its Triton
lowering's IR context for PTX, its Mosaic lowering's exception class).

The library never uses Pallas; the tests reach into `jax._src.pallas` here
only (tests/pallas/test_layout.py holds every other module of the
repository to `dsl.core.jax_internals` for JAX's private names)."""
from jax._src.pallas.mosaic.lowering import LoweringException  # noqa: F401
from jax._src.pallas.triton import lowering as triton_lowering  # noqa: F401
# What Pallas's GPU interpret mode asks to be called after a kernel failed
# in it (its InterpretGPUParams docs).
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (  # noqa: F401,E402
    reset_gpu_interpret_mode_state)
