"""`dot_general` as one warpgroup matrix-multiply-accumulate (`wgmma`).

`wgmma` reads its right operand (and optionally its left) straight from
shared memory, in a swizzled tiling that layout inference chooses for the
buffer; the accumulator lives in registers (f32). So a dot's operands must
be read straight from refs (`x_ref[...]`, a block or a scratch buffer): the
rule looks through the `vector_load` to the buffer behind it, and the load,
now unused, is dropped by the library's canonicalization.
"""
from __future__ import annotations

import numpy as np
from jax import lax
from jax._src.lib import mosaic_gpu_dialect as mgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import nvvm
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from dsl import dtypes
from lowering_mosaic.gpu.host import TABLE, TRITON_HINT, constant
from lowering_mosaic.gpu.rules.elementwise import convert

WGMMA_INPUTS = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


def smem_source(v: ir.Value) -> ir.Value | None:
  """The shared-memory ref a vector was loaded from whole, or None."""
  owner = getattr(v, "owner", None)
  op = getattr(owner, "opview", None)
  if op is not None and op.operation.name == "mosaic_gpu.vector_load":
    return op.operands[0]
  return None


def _check_shapes(ctx, m, n, k, dtype):
  bits = dtypes.bits(dtype)
  k_unit = 256 // bits            # one 32-byte wgmma K step
  problems = []
  if m % 64:
    problems.append(f"M={m} is not a multiple of 64 (one warpgroup's rows)")
  if n % 8 or n > 256:
    problems.append(f"N={n} must be a multiple of 8 and at most 256")
  if k % k_unit:
    problems.append(f"K={k} is not a multiple of {k_unit} for {dtype}")
  if problems:
    raise ctx.error("jnp.dot of shape (M, K) x (K, N) cannot become a wgmma: "
                    + "; ".join(problems) + TRITON_HINT)


@TABLE.register(lax.dot_general_p)
def _dot_general(ctx, lhs, rhs, *, dimension_numbers, preferred_element_type,
                 **_):
  (lc, rc), (lb, rb) = dimension_numbers
  a_aval, b_aval = ctx.avals_in
  out_aval = ctx.avals_out[0]
  if lb or rb or len(a_aval.shape) != 2 or len(b_aval.shape) != 2:
    raise ctx.error("only 2-D dots without batch dimensions lower to wgmma"
                    + TRITON_HINT)
  dtype = np.dtype(a_aval.dtype)
  if dtype.name not in WGMMA_INPUTS or dtype != np.dtype(b_aval.dtype):
    raise ctx.error(f"wgmma takes {', '.join(WGMMA_INPUTS)} operands of one "
                    f"dtype (with f32 accumulation), got {a_aval.dtype} and "
                    f"{b_aval.dtype}" + TRITON_HINT)
  a_t, b_t = tuple(lc) == (0,), tuple(rc) == (1,)
  m = a_aval.shape[1 if a_t else 0]
  k = a_aval.shape[0 if a_t else 1]
  n = b_aval.shape[0 if b_t else 1]
  _check_shapes(ctx, m, n, k, dtype)
  b_ref = smem_source(rhs)
  if b_ref is None:
    raise ctx.error("the right operand of a dot must be read straight from a "
                    "ref (a block or a scratch buffer in shared memory): "
                    "wgmma reads it from shared memory" + TRITON_HINT)
  if b_t:
    b_ref = mgpu_utils.memref_transpose(b_ref, (1, 0))
  a = lhs
  if a_t:
    a_ref = smem_source(lhs)
    if a_ref is None:
      raise ctx.error("a transposed left operand of a dot must be read "
                      "straight from a ref" + TRITON_HINT)
    a = mgpu_utils.memref_transpose(a_ref, (1, 0))
  elif smem_source(lhs) is not None:
    a = smem_source(lhs)
  acc = constant(0.0, (m, n), np.float32)
  out = mgpu.wgmma(acc, a, b_ref)
  nvvm.wgmma_commit_group_sync_aligned()
  nvvm.wgmma_wait_group_sync_aligned(0)
  return convert(out, np.float32, out_aval.dtype, (m, n))
