"""lowering_triton: kernels as readable Triton source.

Importing this package registers two backends with dsl:

* ``"triton"``: the generated source is compiled by the ``triton`` package and
  launched inside ``jax.jit`` through jaxlib's Triton kernel-call custom call
  (GPUs);
* ``"triton_interpret"``: the same source runs in Triton's interpreter on
  numpy buffers, through ``jax.pure_callback`` (any platform, for testing).

``to_source(f, *args)`` returns the source of the kernels ``f`` calls and
``compile_aot(f, *args, target="sm_90")`` compiles them ahead of time for a
CUDA architecture without a GPU. See docs/triton.md.
"""
from dsl.core.errors import hide_package_frames as _hide

_hide(__file__)   # JAX's traceback filtering leaves our frames out
from dsl.core import backends as _backends
from lowering_triton.kernel import GeneratedKernel, generate
from lowering_triton.aot import AotKernel, compile_aot, kernel_specs, to_source
from lowering_triton import interpret_launch as _interpret_backend
from lowering_triton import launch as _launch

from lowering_triton.rules import TABLE as _TABLE

_backends.register_backend("triton_interpret", _interpret_backend._lowering,
                           rules=_TABLE)
_backends.register_backend("triton", _launch._lowering, rules=_TABLE)

__all__ = ["AotKernel", "GeneratedKernel", "compile_aot", "generate",
           "kernel_specs", "to_source"]
