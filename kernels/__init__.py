"""kernels: a library of kernels written in the dsl (see docs/kernels.md).

Each kernel lives in its own module beside a plain-jnp `reference`, takes a
`backend=None` argument that it passes to `pallas_call` (None: the platform's
default backend; "interpret" on CPU), and is differentiable where that makes
sense through hand-written backward kernels attached with `jax.custom_vjp`.

    import kernels
    y = kernels.flash_attention(q, k, v, causal=True)
"""
from kernels import (collectives, decode, flash, fused_matmul, layernorm,
                     online_softmax, paged, rmsnorm)
from kernels.collectives import all_gather, reduce_scatter
from kernels.decode import decode_attention
from kernels.flash import flash_attention
from kernels.fused_matmul import matmul
from kernels.layernorm import layer_norm
from kernels.online_softmax import softmax
from kernels.paged import paged_attention
from kernels.rmsnorm import rms_norm

# kernel name -> its module (kernel function, `reference`, forward/backward).
MODULES = {
    "softmax": online_softmax,
    "layer_norm": layernorm,
    "rms_norm": rmsnorm,
    "matmul": fused_matmul,
    "flash_attention": flash,
    "decode_attention": decode,
    "paged_attention": paged,
}

# kernel name -> its plain-jnp reference, with the same signature.
REFERENCES = {name: module.reference for name, module in MODULES.items()}

__all__ = ["all_gather", "reduce_scatter", "softmax", "layer_norm", "rms_norm", "matmul", "flash_attention",
           "decode_attention", "paged_attention", "MODULES", "REFERENCES"]
