"""Memref values as boxes of buffers and semaphore arrays (`View`), and
the rules of the ops that make them: kernel arguments become whole views
(extract.py), `memref.alloca` / `tpu.sem_alloc` / `tpu.sem_barrier` new
buffers and semaphores, `tpu.memref_slice` / `tpu.memref_squeeze` narrow
a view, and reshapes or bitcasts make it opaque (any access covers it)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from dsl.core.jax_internals import ir

from lowering_mosaic.verification.promela import model as M
from lowering_mosaic.verification.promela.model import Expr, binop, const
from lowering_mosaic.verification.promela.mosaic_ir import (handles, itemsize,
                                                            location_of,
                                                            sem_kind, shape_of,
                                                            short, space)


@dataclasses.dataclass
class View:
  """A box of a buffer or semaphore array; `dims` lists the base dims the
  memref value still has (slicing keeps them, squeezing drops some)."""
  base: object               # M.Buffer | M.SemArray
  offsets: list
  sizes: list
  dims: list
  opaque: bool = False       # reshaped/bitcast: any access covers the box

  @staticmethod
  def whole(base, shape):
    return View(base, [const(0)] * len(shape), list(shape),
                list(range(len(shape))))

  @property
  def shape(self):
    return [self.sizes[d] for d in self.dims]

  def slice(self, starts, sizes) -> "View":
    if self.opaque:
      return self
    offs, szs = list(self.offsets), list(self.sizes)
    for d, s, n in zip(self.dims, starts, sizes):
      offs[d] = binop("+", offs[d], s)
      szs[d] = n
    return View(self.base, offs, szs, list(self.dims))

  def squeeze(self, out_shape) -> "View":
    """Drops unit dims, the leading ones first (the indexed-away dims)."""
    if self.opaque:
      return View(self.base, self.offsets, self.sizes, [], True)
    drops = len(self.dims) - len(out_shape)
    keep = []
    for d in self.dims:
      if drops > 0 and self.sizes[d] == 1:
        drops -= 1
      else:
        keep.append(d)
    return View(self.base, self.offsets, self.sizes, keep)

  def window(self, indices=None, sizes=None) -> M.Window:
    """The box an access at `indices` of extent `sizes` (view dims) covers."""
    if self.opaque or indices is None:
      return M.Window(self.base, list(self.offsets), list(self.sizes))
    v = self.slice(indices, sizes)
    return M.Window(self.base, v.offsets, v.sizes)

  def sem_index(self) -> Optional[Expr]:
    """The flat element index of a single-semaphore view."""
    shape = self.base.shape
    idx = const(0)
    stride = 1
    for d in reversed(range(len(shape))):
      idx = binop("+", idx, binop("*", self.offsets[d], const(stride)))
      stride *= shape[d]
    return idx


# ------------------------------------------------------------ view ops

@handles("tpu.memref_slice")
def _memref_slice(x, op, env, out):
  v = x.view(env, op.operands[0], op, "sliced")
  starts = [x.int_value(env, i) for i in op.base_idx]
  sizes = list(shape_of(op.results[0].type))
  if list(op.dynamic_sizes):
    x.note("a tpu.memref_slice with dynamic sizes is modelled as its whole "
           "source window")
    env[op.results[0]] = View(v.base, v.offsets, v.sizes, v.dims, True)
    return
  env[op.results[0]] = v.slice(starts, sizes)


@handles("tpu.memref_squeeze")
def _memref_squeeze(x, op, env, out):
  v = x.view(env, op.operands[0], op, "squeezed")
  env[op.results[0]] = v.squeeze(list(shape_of(op.results[0].type)))


@handles("tpu.memref_reshape", "tpu.memref_bitcast", "memref.reinterpret_cast",
         "memref.collapse_shape", "memref.expand_shape", "memref.cast",
         "tpu.reinterpret_cast", "memref.subview", "memref.view")
def _opaque_view(x, op, env, out):
  v = x.view(env, op.operands[0], op, "reshaped")
  env[op.results[0]] = View(v.base, v.offsets, v.sizes, [], True)


@handles("tpu.sem_barrier")
def _sem_barrier(x, op, env, out):
  s = x.barrier_sem()
  env[op.results[0]] = View.whole(s, ())


@handles("memref.alloca", "memref.alloc")
def _alloca(x, op, env, out):
  t = op.results[0].type
  line, _ = location_of(op)
  b = M.Buffer(f"run_scoped buffer at {short(line or x.line)}",
               space(t), shape_of(t), itemsize(ir.MemRefType(t).element_type),
               "instance", "scoped")
  x.buffers.append(b)
  if x.scopes:
    x.scopes[-1].append(b)
  env[op.results[0]] = View.whole(b, b.shape)


@handles("tpu.sem_alloc")
def _sem_alloc(x, op, env, out):
  t = op.results[0].type
  line, _ = location_of(op)
  s = M.SemArray(f"run_scoped semaphore at {short(line or x.line)}",
                 sem_kind(t) or "regular", shape_of(t), "instance", scoped=True)
  x.sems.append(s)
  if x.scopes:
    x.scopes[-1].append(s)
  env[op.results[0]] = View.whole(s, s.shape)
