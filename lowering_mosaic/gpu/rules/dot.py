"""`dot_general` as one warpgroup matrix-multiply-accumulate (`wgmma`).

`wgmma` reads its right operand (and optionally its left) straight from
shared memory, in a swizzled tiling that layout inference chooses for the
buffer; the accumulator lives in registers (f32). So a dot's operands must
be read straight from refs (`x_ref[...]`, a block or a scratch buffer): the
rule looks through the `vector_load` to the buffer behind it, and the load,
now unused, is dropped by the library's canonicalization.

A wgmma is issued, committed and waited for at once, except where the
schedule puts the consumers' turns at the tensor core (turns.py): before
the issue of the step's last wgmma, and between the issue of its first
and the wait for it (`GpuHost.take_turns`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from dsl.core.jax_internals import ir, mosaic_gpu_dialect as mgpu, nvvm
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from dsl.core import dtypes
from lowering_mosaic.gpu.accumulators import dot_accumulate_p
from lowering_mosaic.gpu.host import TRITON_HINT, constant
from lowering_mosaic.gpu.mesh_accumulators import fenced
from lowering_mosaic.gpu.rules import TABLE
from lowering_mosaic.gpu.rules.elementwise import convert

WGMMA_INPUTS = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2",
                "float32")
# What a float32 dot may round its operands to: tf32, as XLA's GPU dots do at
# JAX's default precision; asked for more, the lowering refuses.
_TF32_OK = (None, "default", "bfloat16", "tensorfloat32", "fastest")


def _tf32_allowed(precision) -> bool:
  """float32 dots run as tf32 wgmma at JAX's default precision only."""
  configured = jax.config.jax_default_matmul_precision
  if configured is not None and str(configured).lower() not in _TF32_OK:
    return False
  for p in (precision if isinstance(precision, tuple) else (precision,)):
    name = getattr(p, "name", p)
    if name is not None and str(name).lower() not in _TF32_OK:
      return False
  return True


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


def a_t_of(lhs_contracting) -> bool:
  """Whether the left operand is contracted over its first dim (M-major)."""
  return tuple(lhs_contracting) == (0,)


def _stage(value, aval, buffer):
  """`value` (in registers) written to the shared-memory `buffer` the plan
  set aside (converted to its type), made visible to wgmma's reads."""
  value = convert(value, aval.dtype, _buffer_dtype(buffer), tuple(aval.shape))
  mgpu.vector_store(value, buffer)
  mgpu_utils.commit_shared()         # generic-proxy writes -> wgmma reads
  return buffer


def _buffer_dtype(buffer) -> np.dtype:
  t = ir.MemRefType(buffer.type).element_type
  for name in WGMMA_INPUTS:
    dtype = np.dtype(getattr(jnp, name))
    if t == mgpu_utils.dtype_to_ir_type(dtype):
      return dtype
  raise ValueError(f"no wgmma input type for {t}")


def _input_dtype(ctx, lhs, rhs, precision) -> np.dtype:
  """The type wgmma reads: the operands' 16-bit type (a float32 operand is
  rounded to it), or float32 (tf32) for two float32 operands in shared
  memory, or bfloat16 when a float32 right operand is computed in
  registers. Rounding float32 operands is what JAX's default precision
  lets GPU dots do; asked for more, the lowering refuses."""
  a_dt, b_dt = (np.dtype(a.dtype) for a in ctx.avals_in[:2])
  bad = [d for d in (a_dt, b_dt) if d.name not in WGMMA_INPUTS]
  narrow = {d for d in (a_dt, b_dt) if d.itemsize <= 2}
  if bad or len(narrow) > 1:
    raise ctx.error(f"wgmma takes {', '.join(WGMMA_INPUTS)} operands (one "
                    f"16-bit or 8-bit type, float32 rounded to it or to "
                    f"tf32), got {a_dt} and {b_dt}" + TRITON_HINT)
  if (a_dt.itemsize > 2 or b_dt.itemsize > 2) and not _tf32_allowed(precision):
    raise ctx.error("a float32 dot runs as a tf32 (or 16-bit) wgmma (JAX's "
                    "default precision on GPUs); this one asks for full "
                    f"float32 precision "
                    f"({precision or 'jax_default_matmul_precision'}), "
                    "which wgmma cannot give" + TRITON_HINT)
  if narrow:
    return narrow.pop()
  return np.dtype(np.float32) if smem_source(rhs) is not None else \
      np.dtype(jnp.bfloat16)


def _operands(ctx, lhs, rhs, a_t, dtype):
  """(left operand: a value or a shared-memory ref, right operand ref) of
  a wgmma of `dtype` inputs, staging operands computed in registers (or of
  another type) through the buffers the plan reserved for this equation
  (plan.dot_staging)."""
  a_aval, b_aval = ctx.avals_in[:2]
  staged = list(ctx.host.scoped.get(id(ctx.eqn), ()))

  def in_smem(value, aval):
    ref = smem_source(value)
    if ref is not None and np.dtype(aval.dtype) == dtype:
      return ref
    if not staged:
      raise ctx.error("internal error: no staging buffer was planned for "
                      "an operand of this dot")
    return _stage(value, aval, staged.pop(0))

  b_ref = in_smem(rhs, b_aval)
  if a_t:
    return in_smem(lhs, a_aval), b_ref
  if smem_source(lhs) is not None and np.dtype(a_aval.dtype) == dtype:
    return smem_source(lhs), b_ref
  return convert(lhs, a_aval.dtype, dtype, tuple(a_aval.shape)), b_ref


@TABLE.register(lax.dot_general_p)
def _dot_general(ctx, lhs, rhs, *, dimension_numbers, preferred_element_type,
                 precision=None, **_):
  return _wgmma(ctx, lhs, rhs, None, dimension_numbers, precision)


@TABLE.register(dot_accumulate_p)
def _dot_accumulate(ctx, lhs, rhs, acc, *, dimension_numbers,
                    precision=None, **_):
  """`acc + dot(lhs, rhs)` (accumulators.py): the wgmma accumulates into
  `acc` (a float32 tile in registers, a loop's carried accumulator)."""
  return _wgmma(ctx, lhs, rhs, acc, dimension_numbers, precision)


def _ordered(ctx, acc):
  """`acc`, fenced (`mesh_accumulators.fenced`) unless only WGMMAs have
  touched its registers: PTX asks a `wgmma.fence` between other accesses
  of a WGMMA's registers and the WGMMA, not between WGMMAs of one shape.
  Those are the result of a WGMMA nothing has read yet, and the steps
  loop's carried accumulators fenced before it (kernel.py)."""
  owner = getattr(getattr(acc, "owner", None), "opview", None)
  by_wgmma = (owner is not None
              and owner.operation.name == "mosaic_gpu.wgmma")
  carried = any(acc == v for v in ctx.host.fenced_carry)
  if (by_wgmma or carried) and not list(acc.uses):
    return acc
  return fenced(acc)


def _wgmma(ctx, lhs, rhs, acc, dimension_numbers, precision):
  """One wgmma of `lhs` and `rhs` into `acc` (zeros if None)."""
  (lc, rc), (lb, rb) = dimension_numbers
  a_aval, b_aval = ctx.avals_in[:2]
  out_aval = ctx.out_aval
  if lb or rb or len(a_aval.shape) != 2 or len(b_aval.shape) != 2:
    raise ctx.error("only 2-D dots without batch dimensions lower to wgmma"
                    + TRITON_HINT)
  dtype = _input_dtype(ctx, lhs, rhs, precision)
  a_t, b_t = a_t_of(lc), tuple(rc) == (1,)
  if dtype.itemsize > 2 and (a_t or not b_t):
    raise ctx.error("a tf32 wgmma reads both operands K-major: a float32 "
                    "dot needs its left operand as (M, K) and its right "
                    "one as an (N, K) block used transposed (x @ y.T); "
                    "cast to bfloat16 for other layouts" + TRITON_HINT)
  m = a_aval.shape[1 if a_t else 0]
  k = a_aval.shape[0 if a_t else 1]
  n = b_aval.shape[0 if b_t else 1]
  _check_shapes(ctx, m, n, k, dtype)
  a, b_ref = _operands(ctx, lhs, rhs, a_t, dtype)
  if b_t:
    b_ref = mgpu_utils.memref_transpose(b_ref, (1, 0))
  if a_t:
    a = mgpu_utils.memref_transpose(a, (1, 0))
  if acc is None:
    acc = constant(0.0, (m, n), np.float32)
  ctx.host.take_turns(ctx.eqn, "before")
  out = mgpu.wgmma(_ordered(ctx, acc), a, b_ref)
  nvvm.wgmma_commit_group_sync_aligned()
  ctx.host.take_turns(ctx.eqn, "after")     # between the issue and its wait
  nvvm.wgmma_wait_group_sync_aligned(0)
  return convert(out, np.float32, out_aval.dtype, (m, n))
