"""Semaphores in global memory, for a `plgpu.kernel` that signals other
blocks or other devices (Pallas's collectives: all-gather, reduce-scatter,
the all-gather matmul).

A kernel allocates them two ways, each a *scope* with its own buffer of
int32 counters:

  - "block": `plgpu.SemaphoreType.REGULAR` scratch (a `run_scoped` shared by
    the block's warpgroups): each block has its own counters, at
    `block index * count` of the buffer (a buffer of `blocks * count`);
  - "global": `pl.get_global(plgpu.SemaphoreType.REGULAR)`: every block of
    the launch sees the same counters (a buffer of `count`), one per call
    site.

Each buffer is an extra operand of the custom call, aliased to an extra
output and zero-initialized by the caller (launch.py), so a semaphore
starts at 0 at each launch; peers reach it through the library's symmetric
memory (`LaunchContext.to_remote`, `to_remote_multicast`). The buffers are
ordered as Pallas orders them (by the scope's collective axes), so both
lowerings hand the library the same kernel signature.
"""
from __future__ import annotations

import collections
import contextlib
import math

import jax
import numpy as np
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from dsl.core.jax_internals import arith, ir

BLOCK, GLOBAL = "block", "global"


def scope_axes(scope: str, mesh) -> tuple:
  """The collective axes Pallas names `scope` by (its buffers' order):
  a block's warpgroups, or every axis of the mesh (minor first)."""
  threads = () if mesh.thread_name is None else (mesh.thread_name,)
  if scope == BLOCK:
    return threads
  return (*tuple(mesh.grid_names)[::-1], *tuple(mesh.cluster_names)[::-1],
          *threads)


def merged(counts: collections.Counter, mesh) -> collections.Counter:
  """`counts` with the global semaphores among the block's where the two
  scopes are one (a launch of one block, with no named grid): one buffer,
  as Pallas makes."""
  if scope_axes(GLOBAL, mesh) != scope_axes(BLOCK, mesh) or not counts[
      GLOBAL]:
    return counts
  return collections.Counter({BLOCK: counts[BLOCK] + counts[GLOBAL]})


def ordered(counts: collections.Counter, mesh) -> list[str]:
  """The scopes that hold semaphores, in the order of their buffers."""
  return sorted((s for s in counts if counts[s]),
                key=lambda s: scope_axes(s, mesh))


def buffer_shapes(counts, mesh, blocks: int) -> tuple:
  """The buffers' shapes (as operands of the custom call), in order."""
  return tuple(jax.ShapeDtypeStruct(
      ((blocks if s == BLOCK else 1) * counts[s],), np.int32)
      for s in ordered(counts, mesh))


def either(a: collections.Counter, b: collections.Counter):
  """The semaphores of one allocation or another: a block's are reused,
  each global one (one per call site) is its own."""
  out = collections.Counter()
  for s in set(a) | set(b):
    out[s] = max(a[s], b[s]) if s == BLOCK else a[s] + b[s]
  return out


class SemaphorePool:
  """The semaphores of a launch: each scope's slice of its buffer for this
  block, handed out in stack order."""

  def __init__(self):
    self.bases = {}
    self.used = collections.Counter()
    self.scopes = {BLOCK: BLOCK, GLOBAL: GLOBAL}  # scope -> its buffer's

  def slice_buffers(self, counts, mesh, buffers) -> None:
    """This block's counters of each buffer (the output side of its
    aliased pair), made at the top of the block, last scope first."""
    if merged(counts, mesh) is not counts:
      self.scopes[GLOBAL] = BLOCK
      counts = merged(counts, mesh)
    index = ir.IndexType.get()
    for scope, buf in reversed(list(zip(ordered(counts, mesh), buffers))):
      n = counts[scope]
      if scope == BLOCK:
        at = arith.index_castui(index, mgpu_utils.block_idx())
      else:
        at = arith.constant(index, 0)
      start = arith.muli(at, arith.constant(index, n))
      self.bases[scope] = mgpu_utils.memref_slice(buf,
                                                  mgpu_utils.ds(start, n))

  def take(self, scope: str, shape) -> ir.Value:
    """The next `shape` of counters of `scope`, held until released."""
    n = math.prod(shape)
    scope = self.scopes[scope]
    ref = mgpu_utils.memref_slice(self.bases[scope],
                                  mgpu_utils.ds(self.used[scope], n))
    self.used[scope] += n
    return mgpu_utils.memref_reshape(ref, tuple(shape))

  @contextlib.contextmanager
  def scoped(self, scope: str, shape):
    try:
      yield self.take(scope, shape)
    finally:
      self.used[self.scopes[scope]] -= math.prod(shape)
