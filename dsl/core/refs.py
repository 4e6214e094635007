"""Ref indexing inside kernels: `pl.ds`, and static bounds checks.

Refs are JAX's own `jax.ref` state types. While a kernel is being traced,
every ref index goes through `check_static_indices`, so that a static index
outside the block is an error at trace time instead of a silent clamp.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys

import numpy as np
from dsl.core.jax_internals import (core, ds, NDIndexer, Slice,
                                    state_indexing as indexing)

from dsl.core.errors import KernelError, source_excerpt, user_frame

dslice = ds

# id(ref tracer) -> "x_ref (in_specs[0])" while a kernel is traced.
_ACTIVE: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "dsl_kernel_refs", default=None)


def _static_int(x):
  if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
    return int(x)
  try:
    return int(core.concrete_or_error(None, x))
  except Exception:
    return None


def _text(x) -> str:
  """An index for a message: its value when static, else `...`."""
  v = _static_int(x)
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
  for dim, (idx, n) in enumerate(zip(indices, shape)):
    if not isinstance(n, (int, np.integer)):
      continue
    if isinstance(idx, slice):
      if idx.step not in (None, 1) and _static_int(idx.step) is None:
        continue
      start = 0 if idx.start is None else _static_int(idx.start)
      stop = n if idx.stop is None else _static_int(idx.stop)
      if start is not None and start < 0:
        start += n
      if stop is not None and stop < 0:
        stop += n
      if (start is not None and not 0 <= start <= n) or (
          stop is not None and stop > n):
        _bounds_error(names, f"slice {idx.start}:{idx.stop} on dim {dim} is "
                      f"outside the ref's shape {tuple(shape)}")
    elif isinstance(idx, Slice):
      start, size = _static_int(idx.start), _static_int(idx.size)
      if size is not None and size < 0:
        _bounds_error(names, f"pl.ds({_text(idx.start)}, {size}) on dim {dim} "
                      f"has a negative size: pl.ds(start, size) takes the "
                      f"window's size (not its end), which must be >= 0")
      if size is not None and size > n:
        _bounds_error(names, f"pl.ds(..., {size}) on dim {dim} is larger than "
                      f"the ref's shape {tuple(shape)}")
      if start is not None and size is not None and (
          start < 0 or start + size * max(idx.stride, 1) - (idx.stride - 1) > n):
        _bounds_error(names, f"pl.ds({start}, {size}) on dim {dim} is outside "
                      f"the ref's shape {tuple(shape)}")
    else:
      i = _static_int(idx)
      if i is not None and not -n <= i < n:
        _bounds_error(names, f"index {i} on dim {dim} is outside the ref's "
                      f"shape {tuple(shape)}")


# Set while windows that may reach past their ref are made.
_UNCHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "dsl_unchecked_bounds", default=False)


@contextlib.contextmanager
def unchecked_bounds():
  """Windows made inside are not bounds-checked (by dsl or JAX): for the
  DMAs of `emit_pipeline`'s edge blocks on a TPU, which reach into the
  padding that an array in HBM has up to whole tiles."""
  token = _UNCHECKED.set(True)
  try:
    yield
  finally:
    _UNCHECKED.reset(token)


def _past_bounds(cls, indices, shape):
  """The indexer of `indices` on `shape`, whose static `pl.ds` windows may
  reach past `shape`."""
  room = list(shape)
  if isinstance(indices, tuple) and all(i is not ... for i in indices):
    for dim, idx in enumerate(indices[:len(room)]):
      if isinstance(idx, Slice):
        start, size = _static_int(idx.start), _static_int(idx.size)
        if start is not None and size is not None:
          room[dim] = max(room[dim], start + size)
  out = _original_from_indices_shape(cls, indices, tuple(room))
  return dataclasses.replace(out, shape=tuple(shape), validate=False)


_original_from_indices_shape = NDIndexer.from_indices_shape.__func__


def _checked_from_indices_shape(cls, indices, shape):
  if _UNCHECKED.get():
    return _past_bounds(cls, indices, shape)
  check_static_indices(indices, shape)
  return _original_from_indices_shape(cls, indices, shape)


NDIndexer.from_indices_shape = classmethod(_checked_from_indices_shape)

__all__ = ["ds", "dslice", "Slice", "NDIndexer", "check_static_indices"]
del indexing
