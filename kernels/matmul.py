"""Matrix multiply with a fused epilogue: `activation(x @ y + bias)`.

Grid `(M/bm, N/bn, K/bk)`: the first two dims are parallel (each owns one
output block), the last walks K, accumulating in a float32 scratch block; at
the last K step the epilogue adds the bias, applies the activation and casts.
A partial last K block is masked to zero in both operands, so the padding of
any backend never reaches the sum.

Block sizes are chosen per backend (`kernels.blocking`): big, exactly dividing
blocks on the CPU `interpret` backend (its parallel dims run as one batched
XLA dot), power-of-two tiles for Triton, (8, 128)-aligned tiles for Mosaic.

The backward pass (`custom_vjp`) runs the same kernel with transposed
operands (`dx = dz @ y.T`, `dy = x.T @ dz`; the transposes are block index
maps, not copies), where `dz` is the output cotangent through the activation,
taken at the pre-activation the forward kernel saved.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

import dsl as pl
from dsl import tpu as pltpu
from kernels import blocking

ACTIVATIONS: dict[str, Callable] = {
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_exact": functools.partial(jax.nn.gelu, approximate=False),
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
}


def _activation_fn(activation):
  if activation is None or callable(activation):
    return activation
  try:
    return ACTIVATIONS[activation]
  except KeyError:
    raise ValueError(f"unknown activation {activation!r}; choose one of "
                     f"{sorted(ACTIVATIONS)}, a callable or None") from None


def reference(x, y, *, bias=None, activation=None):
  """Plain-jnp `activation(x @ y + bias)`, accumulated in float32."""
  out_dtype = jnp.result_type(x.dtype, y.dtype)
  z = jnp.dot(x, y, preferred_element_type=jnp.float32)
  if bias is not None:
    z = z + bias.astype(jnp.float32)
  act = _activation_fn(activation)
  if act is not None:
    z = act(z)
  return z.astype(out_dtype)


def block_sizes(m: int, n: int, k: int, backend: str, dtype=jnp.float32):
  """(bm, bn, bk) for an (m, k) @ (k, n) product on `backend`."""
  small = jnp.dtype(dtype).itemsize <= 2
  if blocking.is_triton(backend):
    t = (128, 128, 64) if small else (64, 64, 32)
    if blocking.runs_on_host(backend):
      t = (32, 32, 32)
    return tuple(min(blocking.pow2_floor(max(d, 1)), b)
                 for d, b in zip((m, n, k), t))
  if blocking.is_mosaic_gpu(backend):
    # 64-row blocks: two consumer warpgroups take a 128-row CTA tile (the
    # f32 accumulators of both, the outputs and a 4-deep ring fit in shared
    # memory); N at most 256; K one 128-byte swizzle span; K blocks
    # dividing K (TMA zero-fills partial M and N blocks, not masked K ones:
    # see _mm_kernel).
    span = 128 // jnp.dtype(dtype).itemsize
    bk = blocking.divisor_block(k, span, span)
    return blocking.gpu_rows(m, 64), min(n, 128), bk
  if blocking.is_mosaic(backend):
    bm = blocking.block_for(m, backend, interpret=0, triton=0, mosaic=512,
                            mosaic_multiple=8)
    bn = blocking.block_for(n, backend, interpret=0, triton=0, mosaic=512,
                            mosaic_multiple=128)
    bk = blocking.block_for(k, backend, interpret=0, triton=0, mosaic=512,
                            mosaic_multiple=128)
    return bm, bn, bk
  # interpret: whole dims up to these sizes; the K walk is a loop, so keep
  # it to as few steps as possible.
  return (blocking.divisor_block(m, 1024), blocking.divisor_block(n, 1024),
          blocking.divisor_block(k, 4096))


# ---------------------------------------------------------------- kernel

def _mm_kernel(*refs, nk, bk, k_size, trans_a, trans_b, has_bias, act,
               save_pre, upcast):
  a_ref, b_ref = refs[0], refs[1]
  bias_ref = refs[2] if has_bias else None
  outs = refs[3 if has_bias else 2:]
  o_ref = outs[0]
  pre_ref = outs[1] if save_pre else None
  acc_ref = outs[-1]
  kk = pl.program_id(2)

  @pl.when(kk == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  a = a_ref[...]
  b = b_ref[...]
  if k_size % bk:   # mask the partial last K block of both operands
    ka = kk * bk + lax.broadcasted_iota(jnp.int32, a.shape, 0 if trans_a else 1)
    kb = kk * bk + lax.broadcasted_iota(jnp.int32, b.shape, 1 if trans_b else 0)
    a = jnp.where(ka < k_size, a, jnp.zeros_like(a))
    b = jnp.where(kb < k_size, b, jnp.zeros_like(b))
  if upcast:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  acc_ref[...] += lax.dot_general(a, b, dims,
                                  preferred_element_type=jnp.float32)

  @pl.when(kk == nk - 1)
  def _():
    z = acc_ref[...]
    if has_bias:
      z = z + bias_ref[...].astype(jnp.float32)[None, :]
    if save_pre:
      pre_ref[...] = z.astype(pre_ref.dtype)
    if act is not None:
      z = act(z)
    o_ref[...] = z.astype(o_ref.dtype)


def matmul_2d(a, b, bias=None, *, activation=None, trans_a=False,
              trans_b=False, save_pre=False, out_dtype=None, backend=None,
              blocks=None):
  """`act(op(a) @ op(b) + bias)` where op transposes when `trans_*` is set.

  `a` is (M, K) or, with `trans_a`, (K, M); `b` is (K, N) or (N, K). Returns
  the output, and the pre-activation too when `save_pre`.
  """
  m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
  k2, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
  if k != k2:
    raise ValueError(f"matmul: contracting dims differ: {k} and {k2}")
  out_dtype = out_dtype or jnp.result_type(a.dtype, b.dtype)
  be = blocking.resolve_backend(backend)
  tuned = blocking.gpu_config("matmul", (m, k, n), a.dtype, be, blocks)
  bm, bn, bk = (blocks or tuned.get("block_sizes")
                or block_sizes(m, n, k, be, out_dtype))
  bm, bn, bk = (bm if blocking.is_mosaic_gpu(be) else min(bm, m)), \
      min(bn, n), min(bk, k)
  nk = pl.cdiv(k, bk)
  a_spec = (pl.BlockSpec((bk, bm), lambda i, j, kk: (kk, i)) if trans_a else
            pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)))
  b_spec = (pl.BlockSpec((bn, bk), lambda i, j, kk: (j, kk)) if trans_b else
            pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)))
  in_specs, args = [a_spec, b_spec], [a, b]
  if bias is not None:
    in_specs.append(pl.BlockSpec((bn,), lambda i, j, kk: (j,)))
    args.append(bias)
  o_spec = pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j))
  out_shape = [jax.ShapeDtypeStruct((m, n), out_dtype)]
  out_specs = [o_spec]
  if save_pre:
    out_shape.append(jax.ShapeDtypeStruct((m, n), out_dtype))
    out_specs.append(o_spec)
  # XLA:CPU can leave a vectorized transposed 16-bit dot with a float32
  # result to a runtime path that rejects it ("Unsupported element type for
  # DotThunk::Execute: BF16 x BF16 = F32"); on the CPU interpreter the
  # transposed (backward) products therefore multiply in float32.
  upcast = (blocking.is_jax(be) and (trans_a or trans_b)
            and jnp.dtype(a.dtype).itemsize < 4
            and jnp.issubdtype(a.dtype, jnp.floating))
  kernel = functools.partial(
      _mm_kernel, nk=nk, bk=bk, k_size=k, trans_a=trans_a, trans_b=trans_b,
      has_bias=bias is not None, act=_activation_fn(activation),
      save_pre=save_pre, upcast=upcast)
  outs = pl.pallas_call(
      kernel, tuple(out_shape), grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), nk),
      in_specs=in_specs, out_specs=tuple(out_specs),
      scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)], backend=backend,
      compiler_params=blocking.triton_params(
          be, num_warps=tuned.get("num_warps"),
          num_stages=tuned.get("num_stages")),
      name="matmul")(*args)
  return outs if save_pre else outs[0]


# ---------------------------------------------------------------- autodiff

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _matmul(x2, y, bias, activation, backend, blocks):
  return matmul_2d(x2, y, bias, activation=activation, backend=backend,
                   blocks=blocks)


def _matmul_fwd(x2, y, bias, activation, backend, blocks):
  if activation is None:
    out = matmul_2d(x2, y, bias, backend=backend, blocks=blocks)
    pre = None
  else:
    out, pre = matmul_2d(x2, y, bias, activation=activation, save_pre=True,
                         backend=backend, blocks=blocks)
  return out, (x2, y, bias, pre)


def _matmul_bwd(activation, backend, blocks, res, g):
  x2, y, bias, pre = res
  if activation is None:
    dz = g
  else:
    _, act_vjp = jax.vjp(
        lambda p: _activation_fn(activation)(p.astype(jnp.float32)), pre)
    dz = act_vjp(g.astype(jnp.float32))[0].astype(g.dtype)
  dx = matmul_2d(dz, y, trans_b=True, out_dtype=x2.dtype, backend=backend)
  dy = matmul_2d(x2, dz, trans_a=True, out_dtype=y.dtype, backend=backend)
  db = None if bias is None else jnp.sum(
      dz.astype(jnp.float32), axis=0).astype(bias.dtype)
  return dx, dy, db


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


@blocking.per_platform("matmul")
def matmul(x, y, *, bias=None, activation=None, backend=None,
           block_sizes=None):
  """`activation(x @ y + bias)` with the epilogue fused into the kernel.

  `x`: (..., K); `y`: (K, N); `bias`: (N,) or None; `activation`: None,
  one of "relu", "gelu" (tanh approximation), "gelu_exact", "silu",
  "sigmoid", "tanh", or a callable of a float32 array. Accumulates in float32
  and returns the inputs' result dtype. Differentiable (`custom_vjp`, the
  backward products are this kernel too). `block_sizes=(bm, bn, bk)`
  overrides the per-backend choice.
  """
  x, y = jnp.asarray(x), jnp.asarray(y)
  if y.ndim != 2 or x.ndim < 1 or x.shape[-1] != y.shape[0]:
    raise ValueError(f"matmul: cannot multiply {x.shape} by {y.shape}")
  if bias is not None and bias.shape != (y.shape[1],):
    raise ValueError(f"matmul: bias {bias.shape} must have shape "
                     f"({y.shape[1]},)")
  lead = x.shape[:-1]
  backend = blocking.choose_backend("matmul", backend)
  x2 = x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x
  if x.ndim == 1:
    x2 = x.reshape(1, -1)
  if block_sizes is None:
    block_sizes = blocking.tuned("matmul", (x2.shape[0], x2.shape[1],
                                            y.shape[1]), x2.dtype,
                                 backend).get("block_sizes")
  blocks = tuple(block_sizes) if block_sizes is not None else None
  out = _matmul(x2, y, bias, activation, backend, blocks)
  return out.reshape(*lead, y.shape[1])
