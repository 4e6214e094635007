"""Ref indexing inside kernels: `pl.ds`, and static bounds checks.

Refs are JAX's own `jax.ref` state types. While a kernel is being traced,
every ref index goes through `check_static_indices`, so that a static index
outside the block is an error at trace time instead of a silent clamp.
"""
from __future__ import annotations

import contextvars
import dataclasses
import sys

import numpy as np
from dsl.core.jax_internals import (ds, NDIndexer, Slice,
                                    TransformedRef,
                                    state_indexing as indexing)

from dsl.core.access import SLICE, DimWindow, RefAccess, static_int
from dsl.core.errors import KernelError, source_excerpt, user_frame

dslice = ds

# id(ref tracer) -> "x_ref (in_specs[0])" while a kernel is traced.
_ACTIVE: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "dsl_kernel_refs", default=None)


def _text(x) -> str:
  """An index for a message: its value when static, else `...`."""
  v = static_int(x)
  return "..." if v is None else str(v)


def describe_ref_in_stack(names: dict) -> str | None:
  """Finds which of the kernel's refs is being indexed by scanning frames."""
  def lookup(value):
    base = getattr(value, "ref", value)
    return names.get(id(base)) if not isinstance(base, (int, str)) else None

  frames = []
  frame = sys._getframe(1)
  while frame is not None:
    frames.append(frame)
    frame = frame.f_back
  # First the ref being indexed (JAX's indexing helpers name it), then any.
  for frame in frames:
    local = frame.f_locals
    for value in (local.get("ref_or_view"), local.get("ref"),
                  getattr(local.get("self"), "ref_or_view", None)):
      if value is not None and (found := lookup(value)):
        return found
  for frame in frames:
    for value in frame.f_locals.values():
      if found := lookup(value):
        return found
  return None


def _bounds_error(names, message):
  ctx = names.get("__kernel__", "kernel")
  operand = describe_ref_in_stack(names)
  where = user_frame()
  raise KernelError(ctx, message, where, operand=operand,
                    detail=source_excerpt(where))


def check_static_indices(indices, shape) -> None:
  """While a kernel is traced: an index whose place is static and outside
  the ref (the access model's static exits, `dsl.core.access`) is a
  KernelError naming the kernel, the ref and the user's line."""
  names = _ACTIVE.get()
  if names is None:
    return
  if not isinstance(indices, tuple):
    indices = (indices,)
  n_real = sum(i is not ... and i is not None for i in indices)
  if n_real > len(shape):
    _bounds_error(names, f"{n_real} indices for a ref of shape {tuple(shape)}")
  if any(i is ... for i in indices):
    ip = next(k for k, i in enumerate(indices) if i is ...)
    indices = (indices[:ip] + (slice(None),) * (len(shape) - len(indices) + 1)
               + indices[ip + 1:])
  access = RefAccess.of(indices, shape)
  outside = access.leaving_dims(static=True)
  for dim, (idx, w, n) in enumerate(zip(indices, access.dims, shape)):
    message = _static_error(idx, w, dim, n, tuple(shape), dim in outside)
    if message is not None:
      _bounds_error(names, message)


def _static_error(idx, w: DimWindow, dim: int, n, shape,
                  outside: bool) -> str | None:
  """What is wrong with index `idx` (its window `w`) on `dim` (of `n`), if
  anything: `outside` when its window lies outside the ref."""
  if isinstance(idx, slice):
    return (f"slice {idx.start}:{idx.stop} on dim {dim} is outside the "
            f"ref's shape {shape}") if outside else None
  if w.kind == SLICE:
    size = w.size
    if size is not None and size < 0:
      return (f"pl.ds({_text(idx.start)}, {size}) on dim {dim} has a "
              f"negative size: pl.ds(start, size) takes the window's size "
              f"(not its end), which must be >= 0")
    if size is not None and isinstance(n, (int, np.integer)) and size > n:
      return (f"pl.ds(..., {size}) on dim {dim} is larger than the ref's "
              f"shape {shape}")
    if outside:
      return (f"pl.ds({_text(idx.start)}, {size}) on dim {dim} is outside "
              f"the ref's shape {shape}")
  elif outside:
    return f"index {_text(idx)} on dim {dim} is outside the ref's shape {shape}"
  return None


def past_bounds(ref, indices):
  """`ref.at[indices]`, whose static `pl.ds` windows may reach past the
  ref (not bounds-checked, by dsl or JAX): for the DMAs of
  `emit_pipeline`'s edge blocks on a TPU, which reach into the padding that
  an array in HBM has up to whole tiles."""
  shape = tuple(ref.shape)
  room = list(shape)
  for dim, idx in enumerate(indices[:len(room)]):
    w = DimWindow.of(idx, room[dim])
    if w.kind == SLICE and not isinstance(idx, slice) and \
        w.static_start is not None and w.size is not None:
      room[dim] = max(room[dim], w.static_start + w.size)
  indexer = _original_from_indices_shape(NDIndexer, tuple(indices),
                                         tuple(room))
  indexer = dataclasses.replace(indexer, shape=shape, validate=False)
  if isinstance(ref, TransformedRef):
    return TransformedRef(ref.ref, (*ref.transforms, indexer))
  return TransformedRef(ref, (indexer,))


_original_from_indices_shape = NDIndexer.from_indices_shape.__func__


def _checked_from_indices_shape(cls, indices, shape):
  check_static_indices(indices, shape)
  return _original_from_indices_shape(cls, indices, shape)


# The one hook in JAX's indexing: `x_ref[...]`, `x_ref.at[...]` and
# `jax.ref.get/swap` build their indexer here, from the user's own indices
# (a Python slice, which JAX clamps to the ref, still as written), before
# anything of dsl sees them; docs/architecture.md ("The access model") says
# why no local rule can take its place.
NDIndexer.from_indices_shape = classmethod(_checked_from_indices_shape)

__all__ = ["ds", "dslice", "Slice", "NDIndexer", "check_static_indices"]
del indexing
