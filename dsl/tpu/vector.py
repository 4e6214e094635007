"""TPU vector helpers: `roll`, `repeat` and `bitcast` as primitives.

Each runs as its jnp meaning on the `"interpret"` backend (and batches under
vmap); `lowering_mosaic` gives it its TPU meaning (`tpu.dynamic_rotate`,
`tpu.concatenate` of copies, `tpu.bitcast`).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from dsl.core.jax_internals import batching, core, mlir
from jax.extend.core import Primitive

from dsl.core.errors import KernelError, user_frame

def _value_primitive(name, impl, abstract_eval):
  prim = Primitive(name)
  prim.def_impl(impl)
  prim.def_abstract_eval(abstract_eval)
  mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=False))
  return prim


def _roll_impl(x, shift, *, axis, stride, stride_axis):
  if stride is None:
    return jnp.roll(x, shift, axis)
  n = x.shape[stride_axis]
  rows = [jnp.roll(lax.index_in_dim(x, k, stride_axis, keepdims=True),
                   shift + k * stride, axis) for k in range(n)]
  return jnp.concatenate(rows, axis=stride_axis)


roll_p = _value_primitive(
    "tpu_roll", _roll_impl,
    lambda x, shift, **p: core.ShapedArray(x.shape, x.dtype))


def _roll_batch(args, dims, *, axis, stride, stride_axis):
  x, shift = args
  xd, sd = dims
  if sd is not None:
    raise NotImplementedError("tpu.roll with a batched shift")
  x = batching.moveaxis(x, xd, 0)
  return roll_p.bind(x, shift, axis=axis + 1, stride=stride,
                     stride_axis=None if stride_axis is None
                     else stride_axis + 1), 0


batching.primitive_batchers[roll_p] = _roll_batch


def roll(x, shift, axis: int, *, stride: int | None = None,
         stride_axis: int | None = None):
  """Rotates `x` by `shift` along `axis`, like `jnp.roll` (TPU's rotate).

  With `stride`, row k along `stride_axis` rotates by `shift + k * stride`.
  """
  x = jnp.asarray(x)
  axis = axis % x.ndim
  if stride_axis is not None:
    stride_axis %= x.ndim
  if isinstance(shift, (int, np.integer)) and shift < 0:
    shift = int(shift) % x.shape[axis]
  return roll_p.bind(x, jnp.asarray(shift, jnp.int32), axis=axis,
                     stride=stride, stride_axis=stride_axis)


def _repeat_impl(x, *, repeats, axis):
  reps = [1] * x.ndim
  reps[axis] = repeats
  return jnp.tile(x, reps)


def _repeat_aval(x, *, repeats, axis):
  shape = list(x.shape)
  shape[axis] *= repeats
  return core.ShapedArray(tuple(shape), x.dtype)


repeat_p = _value_primitive("tpu_repeat", _repeat_impl, _repeat_aval)
batching.primitive_batchers[repeat_p] = lambda args, dims, *, repeats, axis: (
    repeat_p.bind(batching.moveaxis(args[0], dims[0], 0), repeats=repeats,
                  axis=axis + 1), 0)


def repeat(x, repeats: int, axis: int):
  """Concatenates `repeats` copies of `x` along `axis` (TPU's repeat)."""
  x = jnp.asarray(x)
  return repeat_p.bind(x, repeats=int(repeats), axis=axis % x.ndim)


def _bits(dtype) -> int:
  return jnp.dtype(dtype).itemsize * 8


def _bitcast_impl(x, *, ty):
  src, dst = _bits(x.dtype), _bits(ty)
  if src == dst:
    return lax.bitcast_convert_type(x, ty)
  if src > dst:   # e.g. i32[M, N] -> bf16[2M, N]: the halves stack along -2
    r = src // dst
    y = lax.bitcast_convert_type(x, ty)                    # [..., M, N, r]
    y = jnp.moveaxis(y, -1, -2)                             # [..., M, r, N]
    return y.reshape(x.shape[:-2] + (x.shape[-2] * r, x.shape[-1]))
  r = dst // src  # e.g. bf16[2M, N] -> i32[M, N]
  y = x.reshape(x.shape[:-2] + (x.shape[-2] // r, r, x.shape[-1]))
  y = jnp.moveaxis(y, -2, -1)                               # [..., M, N, r]
  return lax.bitcast_convert_type(y, ty)


def _bitcast_aval(x, *, ty):
  src, dst = _bits(x.dtype), _bits(ty)
  shape = list(x.shape)
  shape[-2] = shape[-2] * src // dst
  return core.ShapedArray(tuple(shape), jnp.dtype(ty))


bitcast_p = _value_primitive("tpu_bitcast", _bitcast_impl, _bitcast_aval)
batching.primitive_batchers[bitcast_p] = lambda args, dims, *, ty: (
    bitcast_p.bind(batching.moveaxis(args[0], dims[0], 0), ty=ty), 0)


def bitcast(x, ty):
  """Reinterprets the bits of `x` as dtype `ty`. Between widths, the
  second-minor dim scales by the width ratio (i32[8, 128] -> bf16[16, 128]),
  as TPU registers pack narrow types along sublanes."""
  x = jnp.asarray(x)
  ty = jnp.dtype(ty)
  src, dst = _bits(x.dtype), _bits(ty)
  if src != dst:
    if x.ndim < 2:
      raise KernelError(None, f"bitcast between {x.dtype} and {ty} "
                        "needs at least 2 dims (the second-minor one scales)",
                        user_frame())
    if src < dst and x.shape[-2] % (dst // src):
      raise KernelError(None, f"bitcast {x.dtype}{list(x.shape)} to "
                        f"{ty}: dim -2 ({x.shape[-2]}) must be a multiple of "
                        f"{dst // src}", user_frame())
  return bitcast_p.bind(x, ty=ty)


__all__ = ["bitcast", "bitcast_p", "repeat", "repeat_p", "roll", "roll_p"]
