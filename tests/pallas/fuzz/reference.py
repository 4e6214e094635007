"""The reference: a case's body run on numpy blocks, one grid point after the
other in row-major order, with plain Python control flow.

It shares nothing with the backends: the expressions are computed by numpy
(with ml_dtypes for bfloat16), one operation at a time. Reads past an array give poison (NaN, the integer
minimum), writes past it are dropped, outputs not written keep poison and
scratch starts as poison, so a generated kernel that depended on undefined
memory would show up as a disagreement with every backend and with Pallas.
"""
from __future__ import annotations

import numpy as np

from tests.pallas.fuzz.family_window import apply_scalar
from tests.pallas.fuzz.expr import dt, evaluate
from tests.pallas.fuzz.spec import (Case, grid_points, make_inputs, poison,
                                    read_block, write_block)


def run_reference(case: Case) -> list[np.ndarray]:
  from tests.pallas.fuzz.families import FAMILIES
  inputs = make_inputs(case)
  outs = []
  for j, op in enumerate(case.outputs):
    alias = [k for k, jj in case.aliases if jj == j]
    if alias:
      outs.append(np.array(inputs[alias[0]], copy=True))
    else:
      outs.append(np.full(op.shape, poison(op.dtype), dt(op.dtype)))
  scratch = [np.full(shape, poison(dtype), dt(dtype))
             if kind in ("vmem", "smem") else None
             for kind, shape, dtype in case.param("scratch", ())]
  pf = None if case.prefetch is None else np.asarray(case.prefetch, np.int32)
  body = FAMILIES[case.family].body
  with np.errstate(all="ignore"):
    for ids in grid_points(case.grid):
      ctx = RefCtx(case, inputs, outs, scratch, ids, pf)
      body(case, ctx)
      ctx.flush()
  return outs


class RefCtx:
  """What a family's body does, done on numpy arrays at one grid point."""

  def __init__(self, case, inputs, outs, scratch, ids, pf):
    self.case, self.inputs, self.outs, self.scratch = case, inputs, outs, scratch
    self.ids = tuple(int(i) for i in ids)
    self.pf = pf
    self.blocks = {}
    self.xp = np

  def pid(self, a):
    return np.int32(self.ids[a])

  def eval(self, e, env):
    return evaluate(e, env, np)

  def prefetched(self, i):
    return np.int32(self.pf[int(i)])

  def _read(self, k):
    return read_block(self.inputs[k], self.case.inputs[k], self.ids,
                      self.case.grid, self.pf)

  def load(self, k):
    return self._read(k)

  def load_masked(self, k, mask, other):
    x = self._read(k)
    return np.where(mask, x, np.asarray(other, x.dtype))

  def row(self, k, r):
    return self._read(k)[r]

  def _out_block(self, j):
    if j not in self.blocks:
      self.blocks[j] = read_block(self.outs[j], self.case.outputs[j],
                                  self.ids, self.case.grid, self.pf)
    return self.blocks[j]

  def read_out(self, j):
    return self._out_block(j).copy()

  def store(self, j, v):
    blk = self._out_block(j)
    blk[...] = np.asarray(v).astype(blk.dtype)

  def store_masked(self, j, v, mask):
    blk = self._out_block(j)
    blk[...] = np.where(np.asarray(mask), np.asarray(v).astype(blk.dtype), blk)

  def flush(self):
    for j, blk in self.blocks.items():
      write_block(self.outs[j], self.case.outputs[j], self.ids,
                  self.case.grid, self.pf, blk)
    self.blocks = {}

  # windows of whole arrays; elements past the array are masked off
  @staticmethod
  def _positions(arr, starts, sizes):
    grids = np.meshgrid(*[np.arange(int(s), int(s) + z)
                          for s, z in zip(starts, sizes)], indexing="ij")
    inside = np.ones(grids[0].shape, bool)
    for g, n in zip(grids, arr.shape):
      inside &= (g >= 0) & (g < n)
    clipped = tuple(np.clip(g, 0, n - 1) for g, n in zip(grids, arr.shape))
    return clipped, inside

  def load_window(self, k, starts, sizes, mask, other):
    arr = self.inputs[k]
    pos, inside = self._positions(arr, starts, sizes)
    vals = np.where(inside, arr[pos], poison(self.case.inputs[k].dtype))
    if mask is None:
      return vals.astype(arr.dtype)
    return np.where(np.asarray(mask), vals.astype(arr.dtype),
                    np.asarray(other, arr.dtype))

  def store_window(self, j, starts, sizes, v, mask):
    arr = self.outs[j]
    pos, inside = self._positions(arr, starts, sizes)
    keep = inside if mask is None else inside & np.asarray(mask)
    v = np.broadcast_to(np.asarray(v).astype(arr.dtype), inside.shape)
    arr[tuple(p[keep] for p in pos)] = v[keep]

  def atomic_window(self, op, j, starts, sizes, v, mask):
    arr = self.outs[j]
    pos, inside = self._positions(arr, starts, sizes)
    keep = inside if mask is None else inside & np.asarray(mask)
    idx = tuple(p[keep] for p in pos)
    new = np.broadcast_to(np.asarray(v).astype(arr.dtype), inside.shape)[keep]
    combine = {"add": lambda a, b: a + b,
               "max": np.maximum, "min": np.minimum,
               "and": lambda a, b: a & b, "or": lambda a, b: a | b,
               "xor": lambda a, b: a ^ b}[op]
    arr[idx] = np.asarray(combine(arr[idx], new)).astype(arr.dtype)

  def atomic_indexed(self, op, j, idx, v, mask):
    """Every lane applies, in lane order; as in JAX's indexing, a negative
    index counts from the end and the indices still outside are dropped."""
    arr = self.outs[j]
    idx = np.asarray(idx)
    idx = np.where(idx < 0, idx + arr.shape[0], idx)
    keep = (idx >= 0) & (idx < arr.shape[0])
    if mask is not None:
      keep &= np.asarray(mask)
    v = np.broadcast_to(np.asarray(v).astype(arr.dtype), idx.shape)
    ufunc = {"add": np.add, "max": np.maximum, "min": np.minimum,
             "and": np.bitwise_and, "or": np.bitwise_or,
             "xor": np.bitwise_xor}[op]
    ufunc.at(arr, idx[keep], v[keep])

  # strided windows of the blocks: (start, size, stride) per dim
  @staticmethod
  def _strided(win):
    return tuple(slice(s, s + (n - 1) * st + 1, st) for s, n, st in win)

  def load_strided(self, k, win):
    return self._read(k)[self._strided(win)]

  def store_strided(self, j, win, v):
    blk = self._out_block(j)
    blk[self._strided(win)] = np.asarray(v).astype(blk.dtype)

  def with_scalar(self, name, v, k):
    return apply_scalar(np, name, v, self.inputs[k])

  def scratch_get(self, s):
    return self.scratch[s].copy()

  def scratch_set(self, s, v):
    self.scratch[s][...] = np.asarray(v).astype(self.scratch[s].dtype)

  def fori(self, n, f, init):
    v = init
    for t in range(n):
      v = f(np.int32(t), v)
    return v

  def cond(self, pred, f_true, f_false):
    return f_true() if bool(pred) else f_false()

  def when(self, pred, f):
    if bool(pred):
      f()

  # DMAs complete at once in the reference; `buffer` reads the copy.
  def dma_start(self, k, start, rows, buf, sem, slot):
    self.scratch[buf][int(slot)] = self.inputs[k][int(start):int(start) + rows]

  def dma_wait(self, k, start, rows, buf, sem, slot):
    pass

  def buffer(self, buf, slot):
    return self.scratch[buf][int(slot)].copy()
