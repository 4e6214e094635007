"""Ref windows whose place is computed at run time, on the interpret backend.

`x_ref[pl.ds(i, 8), :]` with `i` read from data may leave the ref. JAX's own
discharge of `get`/`swap` clamps the window back inside (`dynamic_slice`),
so the kernel would read and write rows it never addressed. Here, as on
every backend (docs/interpret.md, "Windows computed at run time"), the lanes
of a window that lie outside its ref read poison and write nothing.

A window of unit-stride slices and scalar indices (the common case) is read
as JAX reads it, at the start clamped inside the ref, and then shifted by
how far the clamp moved it, poison filling the lanes it pushed out: work in
the size of the window, so a loop that reads or writes a row per iteration
costs what it cost before. Windows of strided slices or arrays of indices
pad the ref with poison on both sides instead, and move their indices into
the padding where they leave the ref.

Which windows may leave their ref is the access model's decision
(`dsl.core.access`). JAX's `get`, `swap` and `addupdate` follow these
semantics where dsl discharges a kernel (`dsl.core.bounded_discharge`
gives the accesses that may leave a primitive of dsl's own); elsewhere
(Pallas's own interpreter in the same process) they are JAX's.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from dsl.core.jax_internals import state_discharge, state_indexing as indexing

from dsl.core.access import INDEX, INDICES, SLICE, RefAccess, slice_entry
from dsl.core.poison import poison_value

# ------------------------------------------------------------ index kinds


def may_leave(indexer, shape) -> bool:
  """Whether an indexer's window may leave a ref of `shape` (the access
  model's decision, `dsl.core.access`): it is placed by traced values
  (starts, indices, arrays of indices), or by static ones outside the ref
  (which kernels get past the trace-time checks only in derived kernels)."""
  return (isinstance(indexer, indexing.NDIndexer)
          and RefAccess.of(indexer, shape).may_leave())


def _kinds(indexer, shape=None) -> set[tuple[str, int]]:
  """The (kind, stride) of the windows `indexer` puts on a ref."""
  return {(w.kind, w.stride) for w in RefAccess.of(indexer, shape).dims}


def _fast(indexer, shape) -> bool:
  """Unit-stride slices and scalar indices only."""
  return _kinds(indexer, shape) <= {(SLICE, 1), (INDEX, 1)}


def _i32(x):
  return lax.convert_element_type(x, np.int32)


# ------------------------------------------------------------ unit strides

def _window(x, indexer):
  """(start, clamped start, size) per dim, and the dims a scalar index
  squeezes."""
  access = RefAccess.of(indexer, x.shape)
  leaving = access.leaving_dims()
  dims, squeeze = [], []
  for d, (w, n) in enumerate(zip(access.dims, x.shape)):
    if w.squeezed:
      squeeze.append(d)
    if d not in leaving:
      dims.append((w.static_start, w.static_start, w.size))
    else:
      start = _i32(w.start)
      dims.append((start, lax.clamp(np.int32(0), start,
                                    np.int32(max(n - w.size, 0))), w.size))
  return dims, tuple(squeeze)


def _shift(w, axis: int, off, fill):
  """`w` moved along `axis` so that lane j holds lane j + off; the lanes
  that come from outside hold `fill`."""
  k = w.shape[axis]
  pads = [(0, 0, 0)] * w.ndim
  pads[axis] = (k, k, 0)
  padded = lax.pad(w, jnp.asarray(fill, w.dtype), pads)
  starts = [np.int32(0)] * w.ndim
  starts[axis] = lax.clamp(np.int32(0), off + np.int32(k), np.int32(2 * k))
  return lax.dynamic_slice(padded, starts, w.shape)


def _lanes_inside(start, size: int, n: int):
  pos = start + jnp.arange(size, dtype=np.int32)
  return (pos >= 0) & (pos < n)


def _read_fast(x, indexer):
  dims, squeeze = _window(x, indexer)
  w = lax.dynamic_slice(x, [c for _, c, _ in dims], [k for _, _, k in dims])
  poison = poison_value(x.dtype)
  for d, (start, clamped, _) in enumerate(dims):
    if start is not clamped:
      w = _shift(w, d, start - clamped, poison)
  return lax.squeeze(w, squeeze) if squeeze else w


def _write_fast(x, indexer, val):
  dims, squeeze = _window(x, indexer)
  sizes = [k for _, _, k in dims]
  val = jnp.broadcast_to(jnp.asarray(val, x.dtype),
                         [k for d, k in enumerate(sizes) if d not in squeeze])
  val = lax.expand_dims(val, squeeze) if squeeze else val
  starts = [c for _, c, _ in dims]
  if all(s is c for s, c, _ in dims):
    return lax.dynamic_update_slice(x, val, starts)
  old = lax.dynamic_slice(x, starts, sizes)
  keep = jnp.bool_(True)
  for d, (start, clamped, k) in enumerate(dims):
    if start is clamped:
      continue
    off = start - clamped
    val = _shift(val, d, -off, 0)
    shape = [1] * x.ndim
    shape[d] = k
    keep = keep & _lanes_inside(clamped - start, k, k).reshape(shape)
  return lax.dynamic_update_slice(x, jnp.where(keep, val, old), starts)


# ------------------------------------------------------------ static strides

def _static_strided(indexer, shape) -> bool:
  """Slices with a stride, at static starts inside the ref, and static
  scalar indices only."""
  return (not _fast(indexer, shape) and not may_leave(indexer, shape)
          and all(k != INDICES for k, _ in _kinds(indexer, shape)))


def _write_strided(x, indexer, val):
  """A write through a strided window as a select of `val` spread by an
  interior pad: its transpose is a strided slice, which every lowering
  loads as a strided ref read (a scatter's transpose would be a gather)."""
  pads, sizes, squeeze = [], [], []
  access = RefAccess.of(indexer, x.shape)
  for d, (w, n) in enumerate(zip(access.dims, x.shape)):
    start, size, stride = w.static_start, w.size, w.stride
    if w.squeezed:
      squeeze.append(d)
    last = start + (size - 1) * stride if size else start - 1
    pads.append((start, n - 1 - last, stride - 1))
    sizes.append(size)
  val = jnp.broadcast_to(jnp.asarray(val, x.dtype),
                         [k for d, k in enumerate(sizes) if d not in squeeze])
  val = lax.expand_dims(val, squeeze) if squeeze else val
  spread = lax.pad(val, jnp.zeros((), x.dtype), pads)
  inside = lax.pad(jnp.ones(sizes, jnp.bool_), False, pads)
  return lax.select(inside, spread, x)


# ------------------------------------------------------------ padded

def _wrapped(i, n: int):
  """An array of indices with numpy's negative indices counted from the
  end, as JAX counts them."""
  i = _i32(i)
  return jnp.where(i < 0, i + np.int32(n), i)


def _padded(x, indexer, clamp_arrays: bool = False):
  """`x` padded with poison around the dims placed at run time, and the
  indexer moved into the padded array (indices outside the ref pointing
  into the padding). Arrays of indices follow JAX's indexing: negative
  ones count from the end, and with `clamp_arrays` (a read: a gather) the
  ones still outside are clamped to the ref as JAX clamps a gather's."""
  pads, indices = [], []
  access = RefAccess.of(indexer, x.shape)
  leaving = access.leaving_dims()
  for d, (i, w, n) in enumerate(zip(indexer.indices, access.dims, x.shape)):
    if d not in leaving:        # the entry stays as it is
      pads.append((0, 0))
      indices.append(i if w.kind == SLICE
                     else np.asarray(w.static_start, np.int32))
    elif w.kind == SLICE:
      room = (w.size - 1) * w.stride + 1
      start = lax.clamp(np.int32(0), _i32(w.start) + np.int32(room),
                        np.int32(n + room))
      pads.append((room, room))
      indices.append(slice_entry(start, w.size, w.stride))
    elif w.kind == INDICES and clamp_arrays:
      pads.append((0, 0))
      indices.append(jnp.clip(_wrapped(w.start, n), 0, n - 1).astype(
          np.int32))
    else:
      at = _wrapped(w.start, n) if w.kind == INDICES else _i32(w.start)
      pads.append((1, 1))
      indices.append(jnp.where((at >= 0) & (at < n), at + 1, 0).astype(
          np.int32))
  padded = jnp.pad(x, pads, constant_values=poison_value(x.dtype))
  moved = indexing.NDIndexer(tuple(indices), tuple(padded.shape),
                             indexer.int_indexer_shape, validate=False)
  return padded, moved, pads


def _unpad(x, pads, shape):
  return x[tuple(slice(lo, lo + n) for (lo, _), n in zip(pads, shape))]


# ------------------------------------------------------------ one indexer

def read_one(x, t):
  """`x` through transform `t`; a window placed at run time reads poison
  where it leaves `x`."""
  if not may_leave(t, x.shape):
    return state_discharge.transform_array(x, [t])
  if _fast(t, x.shape):
    return _read_fast(x, t)
  padded, moved, _ = _padded(x, t, clamp_arrays=True)
  return state_discharge.transform_array(padded, [moved])


def write_one(x, t, val):
  """`x` with `val` written through transform `t`; lanes of a window placed
  at run time that leave `x` are dropped."""
  if isinstance(t, indexing.NDIndexer) and _static_strided(t, x.shape):
    return _write_strided(x, t, val)
  if not may_leave(t, x.shape):
    return state_discharge.transform_swap_array(x, [t], val)[1]
  if _fast(t, x.shape):
    return _write_fast(x, t, val)
  padded, moved, pads = _padded(x, t)
  _, new = state_discharge.transform_swap_array(padded, [moved], val)
  return _unpad(new, pads, x.shape)


def read(x, transforms):
  for t in transforms or ():
    if t is not None:
      x = read_one(x, t)
  return x


def update(x, transforms, new_of_old):
  """(old, x'): `old` is `x` read through `transforms`, and `x'` is `x`
  with `new_of_old(old)` written through them."""
  transforms = [t for t in transforms or () if t is not None]
  if not transforms:
    return x, new_of_old(x)
  inner = read_one(x, transforms[0])
  old, new_inner = update(inner, transforms[1:], new_of_old)
  return old, write_one(x, transforms[0], new_inner)


def _has_arrays(transforms) -> bool:
  return any(isinstance(t, indexing.NDIndexer)
             and any(k == INDICES for k, _ in _kinds(t)) for t in transforms)


def atomic_update(x, transforms, combine, val, mask=None):
  """(old, x') for an atomic read-modify-write of `combine(old, val)`
  through `transforms` (lanes where `mask` is False keep their value). An
  array of indices may name one element several times: the lanes then
  apply one after another, in lane order, each seeing the value the lanes
  before it left, as the GPU's atomics serialize them."""
  transforms = [t for t in transforms or () if t is not None]
  if not _has_arrays(transforms):
    def new_of_old(old):
      new = combine(old, val).astype(old.dtype)
      return new if mask is None else jnp.where(mask, new, old)
    return update(x, transforms, new_of_old)
  if len(transforms) != 1:
    raise NotImplementedError("an atomic through an array of indices on a "
                              "view of a ref (x.at[...][idx])")
  (t,) = transforms
  padded, moved, pads = _padded(x, t)
  # The flat position in `padded` of each lane (the padding's for the lanes
  # outside the ref, which `_padded` points there).
  pos = state_discharge.transform_array(
      jnp.arange(padded.size, dtype=np.int32).reshape(padded.shape), [moved])
  inside = lanes_inside(x.shape, t)
  shape = pos.shape
  keep = inside if mask is None else inside & jnp.broadcast_to(mask, shape)
  vals = jnp.broadcast_to(jnp.asarray(val, x.dtype), shape).reshape(-1)
  pos, keep = pos.reshape(-1), keep.reshape(-1)

  def lane(k, carry):
    flat, olds = carry
    cur = lax.dynamic_index_in_dim(flat, pos[k], keepdims=False)
    new = jnp.where(keep[k], combine(cur, vals[k]).astype(flat.dtype), cur)
    flat = lax.dynamic_update_index_in_dim(flat, new, pos[k], 0)
    return flat, lax.dynamic_update_index_in_dim(olds, cur, k, 0)

  flat, olds = lax.fori_loop(0, pos.size, lane,
                             (padded.reshape(-1), jnp.zeros_like(vals)))
  olds = jnp.where(inside.reshape(-1), olds, poison_value(x.dtype))
  return olds.reshape(shape), _unpad(flat.reshape(padded.shape), pads,
                                     x.shape)


def lanes_inside(shape, indexer):
  """Per lane of `ref[indexer]` (a ref of `shape`), whether it lies inside
  the ref, as a bool array of the window's shape (an index of an array of
  indices that a read clamps lies outside)."""
  ones = jnp.ones(shape, jnp.int8)
  if not may_leave(indexer, shape) or _fast(indexer, shape):
    return read_one(ones, indexer) == 1
  padded, moved, _ = _padded(ones, indexer)
  return state_discharge.transform_array(padded, [moved]) == 1
