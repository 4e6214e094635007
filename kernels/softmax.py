"""Softmax over one axis, as an online (one-read-for-statistics) kernel.

The softmax axis is moved last and the array seen as rows `(R, C)`. Rows are
cut into blocks of `block_rows` (a parallel grid dim) and each row into blocks
of `block_cols`:

- when one column block covers the row, one kernel computes the max, the sum
  of exponentials and the result from a single read of the block (on the
  CPU `interpret` backend rows up to 65536 long are one block: that backend
  has no on-chip memory to fit, and one block avoids the padding and the
  transposed copies that a sequential column walk costs there);
- otherwise a statistics kernel walks the column blocks in order, keeping the
  running max `m` and the running sum `l` (rescaled by `exp(m_old - m_new)`
  whenever the max grows: the online softmax), masking the columns of the
  partial last block; a second, fully parallel kernel writes
  `exp(x - m) / l` block by block.

The backward pass, `dx = y * (dy - sum(dy * y))`, has the same two shapes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import dsl as pl
from kernels import blocking

_NEG_INF = -float("inf")


def reference(x, axis=-1):
  """Plain-jnp softmax, computed in float32 and cast back."""
  return jax.nn.softmax(x.astype(jnp.float32), axis=axis).astype(x.dtype)


def _blocks(rows: int, cols: int, backend: str, block_rows, block_cols,
            itemsize: int = 4):
  if blocking.is_mosaic_gpu(backend):
    bc = block_cols or blocking.gpu_cols(cols, itemsize)
    return block_rows or blocking.gpu_rows(rows), min(bc, cols)
  bc = block_cols or blocking.block_for(cols, backend, interpret=1 << 16,
                                        triton=16384, mosaic=2048,
                                        mosaic_multiple=128)
  if block_rows is None:
    if blocking.is_triton(backend):
      block_rows = max(1, min(16, 2048 // max(bc, 1)))  # a row per program
    elif blocking.is_mosaic(backend):
      block_rows = max(8, min(256, (1 << 19) // max(bc, 1)))
    else:
      block_rows = max(8, (1 << 21) // max(bc, 1))
    block_rows = blocking.block_for(rows, backend, interpret=block_rows,
                                    triton=block_rows, mosaic=block_rows)
  return min(block_rows, rows), min(bc, cols)


def _col_mask(j, bc: int, cols: int):
  """True for the columns of block j that lie inside the row."""
  return (j * bc + jax.lax.broadcasted_iota(jnp.int32, (1, bc), 1)) < cols


# ---------------------------------------------------------------- kernels

@jax.custom_jvp
def _rows_softmax(x):
  """Softmax along the last axis of a block."""
  m = jnp.max(x, axis=-1, keepdims=True)
  e = jnp.exp(x - m)
  return e / jnp.sum(e, axis=-1, keepdims=True)


@_rows_softmax.defjvp
def _rows_softmax_jvp(primals, tangents):
  # Written in the result y, as the backward kernels have it: a derived
  # backward (jax.grad of `softmax_2d`) reads the saved output instead of
  # recomputing it from x (docs/transformations.md, "Residuals").
  (x,), (dx,) = primals, tangents
  y = _rows_softmax(x)
  return y, y * (dx - jnp.sum(y * dx, axis=-1, keepdims=True))


def _fused_kernel(x_ref, o_ref):
  x = x_ref[...].astype(jnp.float32)
  o_ref[...] = _rows_softmax(x).astype(o_ref.dtype)


def _stats_kernel(x_ref, m_ref, l_ref, *, bc: int, cols: int):
  """Online max and sum of exponentials over the column blocks of a row."""
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _():
    m_ref[...] = jnp.full_like(m_ref, _NEG_INF)
    l_ref[...] = jnp.zeros_like(l_ref)

  x = x_ref[...].astype(jnp.float32)
  if cols % bc:
    x = jnp.where(_col_mask(j, bc, cols), x, _NEG_INF)
  m_old = m_ref[...]
  m_new = jnp.maximum(m_old, jnp.max(x, axis=1))
  scale = jnp.exp(m_old - m_new)
  l_ref[...] = l_ref[...] * scale + jnp.sum(jnp.exp(x - m_new[:, None]), axis=1)
  m_ref[...] = m_new


def _normalize_kernel(x_ref, m_ref, l_ref, o_ref):
  x = x_ref[...].astype(jnp.float32)
  inv = 1.0 / l_ref[...]
  o_ref[...] = (jnp.exp(x - m_ref[...][:, None]) * inv[:, None]).astype(
      o_ref.dtype)


def _bwd_fused_kernel(y_ref, dy_ref, dx_ref):
  y = y_ref[...].astype(jnp.float32)
  dy = dy_ref[...].astype(jnp.float32)
  s = jnp.sum(y * dy, axis=1, keepdims=True)
  dx_ref[...] = (y * (dy - s)).astype(dx_ref.dtype)


def _bwd_dot_kernel(y_ref, dy_ref, s_ref, *, bc: int, cols: int):
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _():
    s_ref[...] = jnp.zeros_like(s_ref)

  prod = y_ref[...].astype(jnp.float32) * dy_ref[...].astype(jnp.float32)
  if cols % bc:
    prod = jnp.where(_col_mask(j, bc, cols), prod, 0.0)
  s_ref[...] += jnp.sum(prod, axis=1)


def _bwd_apply_kernel(y_ref, dy_ref, s_ref, dx_ref):
  y = y_ref[...].astype(jnp.float32)
  dy = dy_ref[...].astype(jnp.float32)
  dx_ref[...] = (y * (dy - s_ref[...][:, None])).astype(dx_ref.dtype)


# ---------------------------------------------------------------- calls

def _row_specs(br, bc, two_d: bool):
  if two_d:
    block = pl.BlockSpec((br, bc), lambda i, j: (i, j))
    row = pl.BlockSpec((br,), lambda i, j: (i,))
  else:
    block = pl.BlockSpec((br, bc), lambda i: (i, 0))
    row = pl.BlockSpec((br,), lambda i: (i,))
  return block, row


def softmax_2d(x, *, backend=None, block_rows=None, block_cols=None):
  """Softmax over the last axis of a 2-D array (the kernels, no autodiff)."""
  rows, cols = x.shape
  be = blocking.resolve_backend(backend)
  tuned = blocking.gpu_config("softmax", x.shape, x.dtype, be, block_rows,
                              block_cols)
  br, bc = _blocks(rows, cols, be, tuned.get("block_rows", block_rows),
                   tuned.get("block_cols", block_cols), x.dtype.itemsize)
  nr, nc = pl.cdiv(rows, br), pl.cdiv(cols, bc)
  out = jax.ShapeDtypeStruct(x.shape, x.dtype)
  if nc == 1:
    block, _ = _row_specs(br, cols, False)
    return pl.pallas_call(_fused_kernel, out, grid=(nr,), in_specs=[block],
                          out_specs=block, backend=backend,
                          compiler_params=blocking.triton_params(
                              be, num_warps=tuned.get(
                                  "num_warps", blocking.row_warps(cols)),
                              num_stages=tuned.get("num_stages")),
                          name="softmax_fused")(x)
  block, row = _row_specs(br, bc, True)
  stat = jax.ShapeDtypeStruct((rows,), jnp.float32)
  m, l = pl.pallas_call(
      functools.partial(_stats_kernel, bc=bc, cols=cols), (stat, stat),
      grid=(nr, nc), in_specs=[block], out_specs=(row, row), backend=backend,
      name="softmax_stats")(x)
  return pl.pallas_call(_normalize_kernel, out, grid=(nr, nc),
                        in_specs=[block, row, row], out_specs=block,
                        backend=backend, name="softmax_normalize")(x, m, l)


def softmax_bwd_2d(y, dy, *, backend=None, block_rows=None, block_cols=None):
  rows, cols = y.shape
  be = blocking.resolve_backend(backend)
  tuned = blocking.gpu_config("softmax", y.shape, y.dtype, be, block_rows,
                              block_cols)
  br, bc = _blocks(rows, cols, be, tuned.get("block_rows", block_rows),
                   tuned.get("block_cols", block_cols),
                   max(y.dtype.itemsize, dy.dtype.itemsize))
  nr, nc = pl.cdiv(rows, br), pl.cdiv(cols, bc)
  out = jax.ShapeDtypeStruct(y.shape, dy.dtype)
  if nc == 1:
    block, _ = _row_specs(br, cols, False)
    return pl.pallas_call(_bwd_fused_kernel, out, grid=(nr,),
                          in_specs=[block, block], out_specs=block,
                          backend=backend, name="softmax_bwd_fused")(y, dy)
  block, row = _row_specs(br, bc, True)
  s = pl.pallas_call(
      functools.partial(_bwd_dot_kernel, bc=bc, cols=cols),
      jax.ShapeDtypeStruct((rows,), jnp.float32), grid=(nr, nc),
      in_specs=[block, block], out_specs=row, backend=backend,
      name="softmax_bwd_dot")(y, dy)
  return pl.pallas_call(_bwd_apply_kernel, out, grid=(nr, nc),
                        in_specs=[block, block, row], out_specs=block,
                        backend=backend, name="softmax_bwd_apply")(y, dy, s)


def _to_rows(x, axis):
  x = jnp.moveaxis(x, axis, -1)
  return x.reshape(-1, x.shape[-1]) if x.ndim != 2 else x, x.shape


def _from_rows(y, shape, axis):
  return jnp.moveaxis(y.reshape(shape), -1, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _softmax(x, axis, backend, block_rows, block_cols):
  rows, shape = _to_rows(x, axis)
  y = softmax_2d(rows, backend=backend, block_rows=block_rows,
                 block_cols=block_cols)
  return _from_rows(y, shape, axis)


def _softmax_fwd(x, axis, backend, block_rows, block_cols):
  y = _softmax(x, axis, backend, block_rows, block_cols)
  return y, y


def _softmax_bwd(axis, backend, block_rows, block_cols, y, dy):
  y_rows, shape = _to_rows(y, axis)
  dy_rows, _ = _to_rows(dy, axis)
  dx = softmax_bwd_2d(y_rows, dy_rows, backend=backend, block_rows=block_rows,
                      block_cols=block_cols)
  return (_from_rows(dx, shape, axis),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


@blocking.per_platform("softmax")
def softmax(x, axis: int = -1, *, backend=None, block_rows=None,
            block_cols=None):
  """Softmax of `x` along `axis`, any shape and row length.

  Differentiable: the backward pass is a kernel too (`custom_vjp`).
  `block_rows`/`block_cols` override the per-backend block sizes.
  """
  x = jnp.asarray(x)
  if x.ndim == 0:
    raise ValueError("softmax needs an array with at least one dimension")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis {axis} is out of range for an array of rank "
                     f"{x.ndim}")
  axis = axis % x.ndim
  backend = blocking.choose_backend("softmax", backend)
  if block_rows is None and block_cols is None:
    rows = x.size // max(x.shape[axis], 1)
    block_rows = blocking.tuned("softmax", (rows, x.shape[axis]), x.dtype,
                                backend).get("block_rows")
  return _softmax(x, axis, backend, block_rows, block_cols)
