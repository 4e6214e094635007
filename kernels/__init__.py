"""kernels: a library of kernels written in the dsl (see docs/kernels.md).

Each kernel lives in its own module beside a plain-jnp `reference`, takes a
`backend=None` argument that it passes to `pallas_call` (None: the platform's
default backend; "interpret" on CPU), and is differentiable where that makes
sense through hand-written backward kernels attached with `jax.custom_vjp`.

    import kernels
    y = kernels.flash_attention(q, k, v, causal=True)
"""
import importlib

from kernels.collectives import all_gather, reduce_scatter
from kernels.decode_attention import decode_attention
from kernels.flash_attention import flash_attention
from kernels.layer_norm import layer_norm
from kernels.matmul import matmul
from kernels.paged_attention import paged_attention
from kernels.rms_norm import rms_norm
from kernels.softmax import softmax

# The kernels with a plain-jnp reference. Each lives in the module of its own
# name with its `reference` and forward/backward pieces: `kernels.softmax` is
# the kernel function, `from kernels.softmax import reference` reaches the
# rest (or `importlib.import_module("kernels.softmax")`).
KERNELS = ("softmax", "layer_norm", "rms_norm", "matmul", "flash_attention",
           "decode_attention", "paged_attention")

# kernel name -> its plain-jnp reference, with the same signature.
REFERENCES = {name: importlib.import_module(f"kernels.{name}").reference
              for name in KERNELS}

__all__ = ["all_gather", "reduce_scatter", "softmax", "layer_norm", "rms_norm",
           "matmul", "flash_attention", "decode_attention", "paged_attention",
           "KERNELS", "REFERENCES"]
