"""Layer normalization over the last axis, forward and backward kernels.

    y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias

The array is seen as rows `(R, D)`; a parallel grid walks blocks of rows and
each block holds whole rows (the statistics need all of a row). The forward
kernel also writes each row's mean and 1/std (float32) for the backward
kernel, which computes `dx` per row and per-row-block partial sums of
`dweight` and `dbias`; those partials (one row per block) are summed after
the kernel. Rows of a partial last block are masked out of the partials.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import dsl as pl
from kernels import blocking


def reference(x, weight, bias, eps: float = 1e-5):
  """Plain-jnp layer norm, computed in float32 and cast back."""
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + eps)
  if weight is not None:
    y = y * weight.astype(jnp.float32)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(x.dtype)


def row_block(rows: int, width: int, backend: str, block_rows=None) -> int:
  """Rows per block for a normalization over rows of `width` elements."""
  if block_rows is not None:
    return min(block_rows, rows) if not blocking.is_mosaic_gpu(backend) \
        else block_rows
  if blocking.is_mosaic_gpu(backend):
    return blocking.gpu_rows(rows)
  if blocking.is_triton(backend):
    target = max(1, min(16, 2048 // max(width, 1)))   # one row per program
  elif blocking.is_mosaic(backend):
    target = max(8, min(512, (1 << 20) // max(width * 4, 1)))
  else:
    target = max(8, (1 << 22) // max(width, 1))
  return blocking.block_for(rows, backend, interpret=target, triton=target,
                            mosaic=target)


def _valid_rows(br: int, rows: int):
  """(br, 1) mask of the rows of this block that lie inside the array."""
  ids = pl.program_id(0) * br + jax.lax.broadcasted_iota(jnp.int32, (br, 1), 0)
  return ids < rows


# ---------------------------------------------------------------- kernels

def _fwd_kernel(x_ref, w_ref, b_ref, y_ref, mean_ref, rstd_ref, *, eps):
  x = x_ref[...].astype(jnp.float32)
  mean = jnp.mean(x, axis=1, keepdims=True)
  xc = x - mean
  rstd = jax.lax.rsqrt(jnp.mean(xc * xc, axis=1, keepdims=True) + eps)
  y = xc * rstd * w_ref[...].astype(jnp.float32) + b_ref[...].astype(
      jnp.float32)
  y_ref[...] = y.astype(y_ref.dtype)
  mean_ref[...] = mean[:, 0]
  rstd_ref[...] = rstd[:, 0]


def _bwd_kernel(x_ref, w_ref, mean_ref, rstd_ref, dy_ref, dx_ref, dw_ref,
                db_ref, *, rows, br):
  x = x_ref[...].astype(jnp.float32)
  dy = dy_ref[...].astype(jnp.float32)
  rstd = rstd_ref[...][:, None]
  xhat = (x - mean_ref[...][:, None]) * rstd
  if rows % br:   # rows past the array hold poison: keep them out of the sums
    valid = _valid_rows(br, rows)
    dy = jnp.where(valid, dy, 0.0)
    xhat = jnp.where(valid, xhat, 0.0)
  wdy = w_ref[...].astype(jnp.float32) * dy
  c1 = jnp.mean(xhat * wdy, axis=1, keepdims=True)
  c2 = jnp.mean(wdy, axis=1, keepdims=True)
  dx_ref[...] = ((wdy - (xhat * c1 + c2)) * rstd).astype(dx_ref.dtype)
  dw_ref[...] = jnp.sum(dy * xhat, axis=0, keepdims=True)
  db_ref[...] = jnp.sum(dy, axis=0, keepdims=True)


# ---------------------------------------------------------------- calls

def forward(x2, weight, bias, *, eps, backend=None, block_rows=None):
  """The forward kernel on rows `(R, D)`: returns (y, mean, rstd)."""
  rows, d = x2.shape
  be = blocking.resolve_backend(backend)
  tuned = blocking.gpu_config("layer_norm", x2.shape, x2.dtype, be, block_rows)
  br = row_block(rows, d, be, tuned.get("block_rows", block_rows))
  row_spec = pl.BlockSpec((br, d), lambda i: (i, 0))
  vec_spec = pl.BlockSpec((d,), lambda i: (0,))
  stat_spec = pl.BlockSpec((br,), lambda i: (i,))
  stat = jax.ShapeDtypeStruct((rows,), jnp.float32)
  return pl.pallas_call(
      functools.partial(_fwd_kernel, eps=eps),
      (jax.ShapeDtypeStruct(x2.shape, x2.dtype), stat, stat),
      grid=(pl.cdiv(rows, br),), in_specs=[row_spec, vec_spec, vec_spec],
      out_specs=(row_spec, stat_spec, stat_spec), backend=backend,
      compiler_params=blocking.triton_params(
          be, num_warps=tuned.get("num_warps", blocking.row_warps(d)),
          num_stages=tuned.get("num_stages")),
      name="layer_norm_fwd")(x2, weight, bias)


def backward(x2, weight, mean, rstd, dy2, *, backend=None, block_rows=None):
  """The backward kernel: returns (dx, dweight, dbias)."""
  rows, d = x2.shape
  be = blocking.resolve_backend(backend)
  tuned = blocking.gpu_config("layer_norm", x2.shape, x2.dtype, be, block_rows)
  br = row_block(rows, d, be, tuned.get("block_rows", block_rows))
  nb = pl.cdiv(rows, br)
  row_spec = pl.BlockSpec((br, d), lambda i: (i, 0))
  vec_spec = pl.BlockSpec((d,), lambda i: (0,))
  stat_spec = pl.BlockSpec((br,), lambda i: (i,))
  part_spec = pl.BlockSpec((1, d), lambda i: (i, 0))
  part = jax.ShapeDtypeStruct((nb, d), jnp.float32)
  dx, dw, db = pl.pallas_call(
      functools.partial(_bwd_kernel, rows=rows, br=br),
      (jax.ShapeDtypeStruct(x2.shape, x2.dtype), part, part),
      grid=(nb,), in_specs=[row_spec, vec_spec, stat_spec, stat_spec, row_spec],
      out_specs=(row_spec, part_spec, part_spec), backend=backend,
      name="layer_norm_bwd")(x2, weight, mean, rstd, dy2)
  return dx, jnp.sum(dw, axis=0), jnp.sum(db, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _layer_norm(x, weight, bias, eps, backend, block_rows):
  return _layer_norm_fwd(x, weight, bias, eps, backend, block_rows)[0]


def _layer_norm_fwd(x, weight, bias, eps, backend, block_rows):
  x2 = x.reshape(-1, x.shape[-1])
  y, mean, rstd = forward(x2, weight, bias, eps=eps, backend=backend,
                          block_rows=block_rows)
  return y.reshape(x.shape), (x2, weight, bias, mean, rstd)


def _layer_norm_bwd(eps, backend, block_rows, res, dy):
  x2, weight, bias, mean, rstd = res
  dx, dw, db = backward(x2, weight, mean, rstd, dy.reshape(x2.shape),
                        backend=backend, block_rows=block_rows)
  return (dx.reshape(dy.shape), dw.astype(weight.dtype),
          db.astype(bias.dtype))


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


@blocking.per_platform("layer_norm")
def layer_norm(x, weight, bias, eps: float = 1e-5, *, backend=None,
               block_rows=None):
  """Layer norm of `x` over its last axis; `weight`, `bias`: `(D,)` or None.

  Differentiable in `x`, `weight` and `bias` through hand-written backward
  kernels (`custom_vjp`).
  """
  x = jnp.asarray(x)
  d = x.shape[-1]
  if weight is None:
    weight = jnp.ones((d,), x.dtype)
  if bias is None:
    bias = jnp.zeros((d,), x.dtype)
  if weight.shape != (d,) or bias.shape != (d,):
    raise ValueError(f"layer_norm: weight {weight.shape} and bias "
                     f"{bias.shape} must both have shape ({d},)")
  backend = blocking.choose_backend("layer_norm", backend)
  if block_rows is None:
    block_rows = blocking.tuned("layer_norm", (x.size // max(d, 1), d),
                                x.dtype, backend).get("block_rows")
  return _layer_norm(x, weight, bias, float(eps), backend, block_rows)
