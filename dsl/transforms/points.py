"""A kernel's grid point under differentiation: its tangent map, that map's
transpose, and the positions of its blocks past their arrays."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsl.core.blockspec import Element
from dsl.core.dtypes import has_tangent
from dsl.core.jax_internals import core


def fill_floats(values, floats):
  it = iter(floats)
  return [next(it) if has_tangent(v.dtype) else v for v in values]


def float_call(F, ids, pf, ins, outs, scr, fi, fo, fs):
  o, s = F(ids, pf, fill_floats(ins, fi), fill_floats(outs, fo),
           fill_floats(scr, fs))
  return ([x for x in o if has_tangent(x.dtype)],
          [x for x in s if has_tangent(x.dtype)])


def overhangs(bm) -> bool:
  """Whether a block of `bm` may lie partly past its array."""
  return not bm.whole_array and any(
      isinstance(d, Element) or (b and n % b)
      for d, n, b in zip(bm.block_shape, bm.array_aval.shape, bm.block_sizes))


def zero_past_array(x, bm, ids, pf_refs):
  """`x`, the block of `bm` at grid point `ids`, with the positions past
  the array set to 0. The transposed kernel reads primal inputs, recorded
  output states and output cotangents there: the cotangent of a position
  that does not exist is 0, and a primal value there is garbage on hardware
  (poison on the CPU) that `0 * garbage` would carry into the cotangents of
  the array."""
  if not overhangs(bm):
    return x
  dims = list(zip(bm.block_shape, bm.array_aval.shape, bm.block_sizes))
  j = bm.index_map_jaxpr
  idx = core.eval_jaxpr(j.jaxpr, j.consts, *ids, *pf_refs)[:len(dims)]
  mask = jnp.bool_(True)
  for k, ((d, n, b), o) in enumerate(zip(dims, bm.element_offsets(idx))):
    start = o - d.padding[0] if isinstance(d, Element) else o
    pos = start + jax.lax.broadcasted_iota(jnp.int32, bm.block_sizes, k)
    mask = mask & (pos >= 0) & (pos < n)
  return jnp.where(mask.reshape(bm.kernel_shape), x, jnp.zeros_like(x))


def transposed_point(F, ids, pf, ins, outs_e, scr_e, in_nz):
  """The transpose of the kernel's tangent map at one grid point, linearized
  at the entry state (`ins`, `outs_e`, `scr_e`): cotangents of the outputs
  and scratch it leaves -> cotangents of the tangent inputs (`in_nz`) and of
  the outputs and scratch it found."""
  fl = lambda xs: [x for x in xs if has_tangent(x.dtype)]

  def tangent_map(t_in, t_out, t_scr):
    given = iter(t_in)
    t_in_all = [next(given) if nz else jnp.zeros(x.shape, x.dtype)
                for x, nz in zip(ins, in_nz) if has_tangent(x.dtype)]

    def f(fi, fo, fs):
      return float_call(F, ids, pf, ins, outs_e, scr_e, fi, fo, fs)
    _, tangents = jax.jvp(f, (fl(ins), fl(outs_e), fl(scr_e)),
                          (t_in_all, t_out, t_scr))
    return tangents

  t_in_ex = [x for x, nz in zip(ins, in_nz) if nz]
  return jax.linear_transpose(tangent_map, t_in_ex, fl(outs_e), fl(scr_e))
