"""A case rendered as a `pallas_call` for a module that speaks Pallas.

The same code builds the call for `dsl` and for `jax.experimental.pallas`
(the `Mods` namespace holds the core, TPU and Triton modules). The kernel
body is the family's body function run on a `KernelCtx`, whose methods are
ref reads and writes, `lax` control flow and DMAs; the reference runs the
same body function on a `reference.RefCtx`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tests.pallas.fuzz.family_window import apply_scalar
from tests.pallas.fuzz.expr import evaluate
from tests.pallas.fuzz.spec import Case, Operand, index_map_fn


@dataclasses.dataclass(frozen=True)
class Mods:
  pl: Any
  tpu: Any
  triton: Any


def dsl_mods() -> Mods:
  import dsl
  return Mods(dsl, dsl.tpu, dsl.triton)


def pallas_mods() -> Mods:
  from jax.experimental import pallas
  from jax.experimental.pallas import tpu, triton
  return Mods(pallas, tpu, triton)


def block_spec(mods: Mods, case: Case, op: Operand):
  pl = mods.pl
  if op.space == "any":
    return pl.BlockSpec(memory_space=pl.ANY)
  if op.space == "scalar":       # a Python scalar: in SMEM, as TPUs keep it
    return pl.BlockSpec(memory_space=mods.tpu.SMEM)
  if op.dims is None:
    return pl.BlockSpec()
  squeeze = None if case.param("none_squeeze", True) else pl.squeezed
  shape = tuple(squeeze if d.kind == "squeezed" else
                pl.Element(d.size) if d.kind == "element" else d.size
                for d in op.dims)
  return pl.BlockSpec(shape, index_map_fn(op, case.grid))


def _scratch_shapes(mods: Mods, case: Case):
  out = []
  for kind, shape, dtype in case.param("scratch", ()):
    if kind == "vmem":
      out.append(mods.tpu.VMEM(shape, jnp.dtype(dtype)))
    elif kind == "smem":
      out.append(mods.tpu.SMEM(shape, jnp.dtype(dtype)))
    elif kind == "dma_sem":
      out.append(mods.tpu.SemaphoreType.DMA(shape) if shape
                 else mods.tpu.SemaphoreType.DMA)
    else:
      raise ValueError(kind)
  return out


def build_call(case: Case, mods: Mods, **backend_kw):
  """(function, args): `function(*args)` runs the case's kernel."""
  from tests.pallas.fuzz.families import FAMILIES
  from tests.pallas.fuzz.spec import make_inputs
  pl = mods.pl
  body = FAMILIES[case.family].body
  n_pf = 0 if case.prefetch is None else 1
  n_in = len(case.inputs)
  n_out = case.param("n_kernel_out", len(case.outputs))

  def kernel(*refs):
    pf = refs[0] if n_pf else None
    ins = refs[n_pf:n_pf + n_in]
    outs = refs[n_pf + n_in:n_pf + n_in + n_out]
    scratch = refs[n_pf + n_in + n_out:]
    body(case, KernelCtx(case, mods, pf, ins, outs, scratch))

  kernel.__name__ = case.name
  out_shape = [jax.ShapeDtypeStruct(op.shape, jnp.dtype(op.dtype))
               for op in case.outputs[:n_out]]
  kw = dict(name=case.name, **backend_kw)
  if case.aliases:
    kw["input_output_aliases"] = {k + n_pf: j for k, j in case.aliases}
  if case.semantics is not None:
    kw["compiler_params"] = mods.tpu.CompilerParams(
        dimension_semantics=case.semantics)
  specs = dict(grid=case.grid,
               in_specs=[block_spec(mods, case, op) for op in case.inputs],
               out_specs=[block_spec(mods, case, op)
                          for op in case.outputs[:n_out]],
               scratch_shapes=_scratch_shapes(mods, case))
  if case.param("no_specs"):
    specs.pop("in_specs"), specs.pop("out_specs")
  if n_pf:
    grid_spec = mods.tpu.PrefetchScalarGridSpec(num_scalar_prefetch=1,
                                                **specs)
    f = pl.pallas_call(kernel, out_shape, grid_spec=grid_spec, **kw)
  else:
    f = pl.pallas_call(kernel, out_shape, **specs, **kw)
  # Python scalars stay Python scalars (weakly typed operands)
  args = [a if isinstance(a, (int, float)) else jnp.asarray(a)
          for a in make_inputs(case)]
  if n_pf:
    args.insert(0, jnp.asarray(np.asarray(case.prefetch, np.int32)))
  return f, args


class KernelCtx:
  """What a family's body does, done on refs inside a kernel."""

  def __init__(self, case: Case, mods: Mods, pf, ins, outs, scratch):
    self.case, self.mods = case, mods
    self.pf, self.ins, self.outs, self.scratch = pf, ins, outs, scratch
    self.ids = tuple(mods.pl.program_id(a) for a in range(len(case.grid)))
    self.xp = jnp

  def pid(self, a):
    return self.ids[a]

  def eval(self, e, env):
    return evaluate(e, env)

  def prefetched(self, i):
    return self.pf[i]

  # whole blocks
  def load(self, k):
    return self.ins[k][...]

  def load_masked(self, k, mask, other):
    return self.mods.triton.load(self.ins[k], mask=mask, other=other)

  def row(self, k, r):
    return self.ins[k][r]

  def read_out(self, j):
    return self.outs[j][...]

  def store(self, j, v):
    self.outs[j][...] = v

  def store_masked(self, j, v, mask):
    self.mods.triton.store(self.outs[j], v, mask=mask)

  # windows of whole-array refs: `starts` are element offsets per dim
  def _window(self, ref, starts, sizes):
    pl = self.mods.pl
    return ref.at[tuple(pl.ds(s, z) for s, z in zip(starts, sizes))]

  def load_window(self, k, starts, sizes, mask, other):
    ref = self._window(self.ins[k], starts, sizes)
    if mask is None:
      return ref[...]
    return self.mods.triton.load(ref, mask=mask, other=other)

  def store_window(self, j, starts, sizes, v, mask):
    ref = self._window(self.outs[j], starts, sizes)
    if mask is None:
      ref[...] = v
    else:
      self.mods.triton.store(ref, v, mask=mask)

  def atomic_window(self, op, j, starts, sizes, v, mask):
    pl = self.mods.pl
    idx = tuple(pl.ds(s, z) for s, z in zip(starts, sizes))
    getattr(self.mods.triton, f"atomic_{op}")(self.outs[j], idx, v, mask=mask)

  def atomic_indexed(self, op, j, idx, v, mask):
    getattr(self.mods.triton, f"atomic_{op}")(self.outs[j], (idx,), v,
                                              mask=mask)

  def bernoulli(self, seeds, q, shape):
    self.mods.tpu.prng_seed(*seeds)
    return self.mods.tpu.stateful_bernoulli(q, shape)

  # strided windows of the block refs: (start, size, stride) per dim
  def _strided(self, ref, win):
    pl = self.mods.pl
    return tuple(pl.ds(s, n, stride=st) for s, n, st in win)

  def load_strided(self, k, win):
    return self.ins[k][self._strided(self.ins[k], win)]

  def store_strided(self, j, win, v):
    self.outs[j][self._strided(self.outs[j], win)] = v

  def with_scalar(self, name, v, k):
    return apply_scalar(jnp, name, v, self.ins[k][...])

  # scratch
  def scratch_get(self, s):
    return self.scratch[s][...]

  def scratch_set(self, s, v):
    self.scratch[s][...] = v

  # control flow
  def fori(self, n, f, init):
    return jax.lax.fori_loop(0, n, f, init)

  def cond(self, pred, f_true, f_false):
    return jax.lax.cond(pred, f_true, f_false)

  def when(self, pred, f):
    self.mods.pl.when(pred)(f)

  # DMAs: copy rows [start, start + rows) of input k (in ANY) to scratch
  # slot `slot` of buffer `buf`, signalling semaphore `sem` at `slot`.
  def _copy(self, k, start, rows, buf, sem, slot):
    pl, tpu = self.mods.pl, self.mods.tpu
    src = self.ins[k].at[pl.ds(start, rows)]
    return tpu.make_async_copy(src, self.scratch[buf].at[slot],
                               self.scratch[sem].at[slot])

  def dma_start(self, k, start, rows, buf, sem, slot):
    self._copy(k, start, rows, buf, sem, slot).start()

  def dma_wait(self, k, start, rows, buf, sem, slot):
    self._copy(k, start, rows, buf, sem, slot).wait()

  def buffer(self, buf, slot):
    return self.scratch[buf][slot]
