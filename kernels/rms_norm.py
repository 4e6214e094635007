"""RMS normalization over the last axis, forward and backward kernels.

    y = x / sqrt(mean(x**2) + eps) * weight

Same layout as `kernels.layer_norm`: blocks of whole rows on a parallel grid;
the forward kernel keeps each row's 1/rms (float32) for the backward kernel,
which writes `dx` and one partial `dweight` row per block.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import dsl as pl
from kernels import blocking
from kernels.layer_norm import row_block


def reference(x, weight, eps: float = 1e-6):
  """Plain-jnp RMS norm, computed in float32 and cast back."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if weight is not None:
    y = y * weight.astype(jnp.float32)
  return y.astype(x.dtype)


def _fwd_kernel(x_ref, w_ref, y_ref, rstd_ref, *, eps):
  x = x_ref[...].astype(jnp.float32)
  rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + eps)
  y_ref[...] = (x * rstd * w_ref[...].astype(jnp.float32)).astype(y_ref.dtype)
  rstd_ref[...] = rstd[:, 0]


def _bwd_kernel(x_ref, w_ref, rstd_ref, dy_ref, dx_ref, dw_ref, *, rows, br):
  x = x_ref[...].astype(jnp.float32)
  dy = dy_ref[...].astype(jnp.float32)
  rstd = rstd_ref[...][:, None]
  xhat = x * rstd
  if rows % br:   # rows past the array hold poison: keep them out of the sums
    ids = (pl.program_id(0) * br
           + jax.lax.broadcasted_iota(jnp.int32, (br, 1), 0))
    dy = jnp.where(ids < rows, dy, 0.0)
    xhat = jnp.where(ids < rows, xhat, 0.0)
  wdy = w_ref[...].astype(jnp.float32) * dy
  c = jnp.mean(xhat * wdy, axis=1, keepdims=True)
  dx_ref[...] = ((wdy - xhat * c) * rstd).astype(dx_ref.dtype)
  dw_ref[...] = jnp.sum(dy * xhat, axis=0, keepdims=True)


def forward(x2, weight, *, eps, backend=None, block_rows=None):
  """The forward kernel on rows `(R, D)`: returns (y, rstd)."""
  rows, d = x2.shape
  be = blocking.resolve_backend(backend)
  tuned = blocking.gpu_config("rms_norm", x2.shape, x2.dtype, be, block_rows)
  br = row_block(rows, d, be, tuned.get("block_rows", block_rows))
  row_spec = pl.BlockSpec((br, d), lambda i: (i, 0))
  return pl.pallas_call(
      functools.partial(_fwd_kernel, eps=eps),
      (jax.ShapeDtypeStruct(x2.shape, x2.dtype),
       jax.ShapeDtypeStruct((rows,), jnp.float32)),
      grid=(pl.cdiv(rows, br),),
      in_specs=[row_spec, pl.BlockSpec((d,), lambda i: (0,))],
      out_specs=(row_spec, pl.BlockSpec((br,), lambda i: (i,))),
      backend=backend, name="rms_norm_fwd",
      compiler_params=blocking.triton_params(
          be, num_warps=tuned.get("num_warps", blocking.row_warps(d)),
          num_stages=tuned.get("num_stages")),
  )(x2, weight)


def backward(x2, weight, rstd, dy2, *, backend=None, block_rows=None):
  """The backward kernel: returns (dx, dweight)."""
  rows, d = x2.shape
  be = blocking.resolve_backend(backend)
  tuned = blocking.gpu_config("rms_norm", x2.shape, x2.dtype, be, block_rows)
  br = row_block(rows, d, be, tuned.get("block_rows", block_rows))
  nb = pl.cdiv(rows, br)
  row_spec = pl.BlockSpec((br, d), lambda i: (i, 0))
  dx, dw = pl.pallas_call(
      functools.partial(_bwd_kernel, rows=rows, br=br),
      (jax.ShapeDtypeStruct(x2.shape, x2.dtype),
       jax.ShapeDtypeStruct((nb, d), jnp.float32)),
      grid=(nb,),
      in_specs=[row_spec, pl.BlockSpec((d,), lambda i: (0,)),
                pl.BlockSpec((br,), lambda i: (i,)), row_spec],
      out_specs=(row_spec, pl.BlockSpec((1, d), lambda i: (i, 0))),
      backend=backend, name="rms_norm_bwd",
      # Twice the forward's warps: a thread holds x and dy (at the forward's
      # count, 205 registers per thread on sm_90; at Triton's default of 4
      # warps, 3 KB spilled per thread).
      compiler_params=blocking.triton_params(
          be, num_warps=tuned.get("num_warps",
                                  min(16, 2 * blocking.row_warps(d))),
          num_stages=tuned.get("num_stages")),
  )(x2, weight, rstd, dy2)
  return dx, jnp.sum(dw, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rms_norm(x, weight, eps, backend, block_rows):
  return _rms_norm_fwd(x, weight, eps, backend, block_rows)[0]


def _rms_norm_fwd(x, weight, eps, backend, block_rows):
  x2 = x.reshape(-1, x.shape[-1])
  y, rstd = forward(x2, weight, eps=eps, backend=backend,
                    block_rows=block_rows)
  return y.reshape(x.shape), (x2, weight, rstd)


def _rms_norm_bwd(eps, backend, block_rows, res, dy):
  x2, weight, rstd = res
  dx, dw = backward(x2, weight, rstd, dy.reshape(x2.shape), backend=backend,
                    block_rows=block_rows)
  return dx.reshape(dy.shape), dw.astype(weight.dtype)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@blocking.per_platform("rms_norm")
def rms_norm(x, weight, eps: float = 1e-6, *, backend=None, block_rows=None):
  """RMS norm of `x` over its last axis; `weight`: `(D,)` or None.

  Differentiable in `x` and `weight` through hand-written backward kernels.
  """
  x = jnp.asarray(x)
  d = x.shape[-1]
  if weight is None:
    weight = jnp.ones((d,), x.dtype)
  if weight.shape != (d,):
    raise ValueError(f"rms_norm: weight {weight.shape} must have shape ({d},)")
  backend = blocking.choose_backend("rms_norm", backend)
  if block_rows is None:
    block_rows = blocking.tuned("rms_norm", (x.size // max(d, 1), d), x.dtype,
                                backend).get("block_rows")
  return _rms_norm(x, weight, float(eps), backend, block_rows)
