"""What the transposed tangent map of a grid point needs of the forward.

Linearizing a kernel's grid point (JAX's jvp of the point function, then
partial evaluation) splits it into a *known* part, the forward computation
from the point's blocks that gives the values the tangent map needs (its
residuals), and the tangent map itself, linear in the tangents given the
residuals. The derived backward kernels recompute the residuals from the
primal inputs. Two questions about them decide what else they read:

- whether a residual depends on the state the point finds in its output
  or scratch blocks (`needs_entry_state`): then a recording kernel saves
  that state per point;
- which values of the known part the point also writes to its outputs
  (a softmax whose jvp is written in its result, `y * (dx - sum(y *
  dx))`; `tanh`, whose derivative is `1 - y**2`; a norm's row statistic,
  `rstd_ref[...] = rstd[:, 0]`): the forward pass has saved those blocks
  already, so the backward reads them rather than computing them from the
  inputs (`saved_outputs`), all of them where this spares it an input (a
  pass over that input less), else an output's where this spares it a
  reduction (`_COSTLY`) and its blocks lie inside its array. Only outputs
  whose every block is written by one grid point qualify (the saved array
  holds what that point wrote), in kernels without scalar prefetch,
  aliases or operands in HBM, and only the value the point writes or a
  reshape of it (an output stored in a narrower dtype is not the value
  the tangent map needs). The point is linearized with `rsqrt`'s
  derivative written in its result (`DERIVATIVES_OF_RESULTS`), so that a
  saved 1/rms gives its derivative too.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dsl.core import config
from dsl.core.dtypes import has_tangent
from dsl.core.jax_internals import ClosedJaxpr, close_jaxpr, core
from dsl.core.jax_internals import partial_eval as pe
from dsl.core.jaxpr_walk import sub_jaxprs
from dsl.core.pallas_call import KernelSpec
from dsl.transforms.common import point_function, sds
from dsl.transforms.dependencies import dependencies
from dsl.transforms.points import (float_call, overhangs, transposed_point,
                                   zero_past_array)
from dsl.transforms.staging import in_hbm


@jax.custom_jvp
def _rsqrt(x):
  return lax.rsqrt(x)


@_rsqrt.defjvp
def _rsqrt_jvp(primals, tangents):
  y = lax.rsqrt(primals[0])
  return y, tangents[0] * (-0.5 * y * y * y)


def _rsqrt_of_result(x, **params):
  if params.get("accuracy") is not None:
    return lax.rsqrt_p.bind(x, **params)
  return _rsqrt(x)


# Primitives linearized with their derivative written in their result
# (JAX's rules read the operand too: `rsqrt`'s, `-0.5 * y / x`), so that
# a saved result gives the residual (`-0.5 * y**3`) without the operand.
DERIVATIVES_OF_RESULTS = {lax.rsqrt_p: _rsqrt_of_result}


@dataclasses.dataclass(frozen=True)
class Linearization:
  """A grid point's function, linearized: `known` maps (ids, prefetch,
  inputs, outputs, scratch) to the float outputs and scratch it leaves and
  then the residuals; `unknown` maps (residuals, tangents of the float
  inputs, outputs and scratch) to the tangents of what it leaves."""
  known: ClosedJaxpr
  unknown: ClosedJaxpr
  n_residuals: int

  @property
  def residuals(self) -> list:
    outs = self.known.jaxpr.outvars
    return outs[len(outs) - self.n_residuals:]


def linearization(spec: KernelSpec) -> Linearization:
  """`spec`'s grid point linearized (cached per spec: reverse mode asks
  several questions of it)."""
  return _linearization(spec, config.poison_buffers())


@functools.lru_cache(maxsize=64)
def _linearization(spec: KernelSpec, poison_buffers: bool) -> Linearization:
  del poison_buffers          # read by the discharge of run_scoped
  gm = spec.grid_mapping
  F = point_function(spec, rules=DERIVATIVES_OF_RESULTS)
  ids = [jax.ShapeDtypeStruct((), jnp.int32)] * len(gm.grid)
  pf = [sds(a.inner_aval) for a in gm.prefetch_avals]
  ins = [sds(bm.ref_aval.inner_aval) for bm in gm.in_mappings]
  outs = [sds(bm.ref_aval.inner_aval) for bm in gm.out_mappings]
  scr = [sds(a.inner_aval) for a in gm.scratch_avals]
  fl = lambda xs: [x for x in xs if has_tangent(x.dtype)]

  def jvp_point(ids, pf, ins, outs, scr, tins, touts, tscr):
    def f(fi, fo, fs):
      return float_call(F, ids, pf, ins, outs, scr, fi, fo, fs)
    return jax.jvp(f, (fl(ins), fl(outs), fl(scr)), (tins, touts, tscr))

  closed = jax.make_jaxpr(jvp_point)(ids, pf, ins, outs, scr, fl(ins),
                                     fl(outs), fl(scr))
  n_primal = len(ids) + len(pf) + len(ins) + len(outs) + len(scr)
  n_tan = len(closed.jaxpr.invars) - n_primal
  n_left = len(closed.jaxpr.outvars) // 2
  known, unknown, _, res_avals = pe.partial_eval_jaxpr_nounits(
      closed, [False] * n_primal + [True] * n_tan,
      instantiate=[False] * n_left + [True] * n_left)
  return Linearization(known, unknown, len(res_avals))


def needs_entry_state(spec: KernelSpec) -> bool:
  """Does the tangent map at a point depend on its entry output/scratch
  state?"""
  gm = spec.grid_mapping
  if not any(has_tangent(bm.array_aval.dtype) for bm in gm.out_mappings) \
      and not any(has_tangent(a.inner_aval.dtype) for a in gm.scratch_avals):
    return False
  lin = linearization(spec)
  deps = dependencies(lin.known.jaxpr)
  return any(isinstance(v, core.Var) and deps.get(v, set()) & _state(gm)
             for v in lin.residuals)


def _state(gm) -> set:
  """The positions of the entry output and scratch blocks among the point
  function's inputs."""
  start = len(gm.grid) + gm.num_scalar_prefetch + gm.num_inputs
  return set(range(start, start + gm.num_outputs + len(gm.scratch_avals)))


# --------------------------------------------------------- saved outputs

@dataclasses.dataclass(frozen=True)
class SavedOutputs:
  """Residuals computed with the outputs the forward saved: `outputs` (the
  indices of those read, in order), `cuts` ((var, output index) of each
  value of the known part read from a saved output block, reshaped to
  the var's shape), `reads` (per input: whether the backward still reads
  it) and `rest` (the known part computing the residuals from the point
  function's inputs and then the cuts, those `used`)."""
  outputs: tuple[int, ...]
  cuts: tuple
  reads: tuple[bool, ...]
  rest: ClosedJaxpr
  used: tuple[bool, ...]
  lin: Linearization = dataclasses.field(repr=False)


# Equations whose result holds its operand's values unchanged, only in
# another shape: a value written through one of them is in the saved
# block too (`rstd_ref[...] = rstd[:, 0]` saves `rstd`).
_RESHAPES = {
    lax.squeeze_p: lambda eqn: True,
    lax.reshape_p: lambda eqn: eqn.params.get("dimensions") is None,
    lax.broadcast_in_dim_p: lambda eqn: (
        list(eqn.params["broadcast_dimensions"])
        == sorted(eqn.params["broadcast_dimensions"])),
}

# What makes recomputing a value worth a read of its saved block even
# where the backward reads the inputs anyway: a reduction over the block
# (a row statistic: a norm's mean and 1/rms, a log-sum-exp), a contraction
# or a loop. Elementwise work on blocks already read is cheaper than
# another read.
_COSTLY = frozenset({
    lax.reduce_sum_p, lax.reduce_max_p, lax.reduce_min_p, lax.reduce_prod_p,
    lax.argmax_p, lax.argmin_p, lax.dot_general_p, lax.cumsum_p,
    lax.while_p, lax.scan_p})


def _written_once(gm, bm) -> bool:
  idx = gm.block_indices(bm)
  if idx is None or not gm.grid:
    return False
  rows = idx.reshape(-1, idx.shape[-1])
  return len(np.unique(rows, axis=0)) == len(rows)


def _saved_values(jx, written: dict) -> dict:
  """{var: output index} of the values of `jx` that the saved outputs
  hold: the written vars, and the operands of reshapes to them (same
  values, same dtype), computed by an equation of one result."""
  saved = {v: o for v, o in written.items()
           if any(v in e.outvars and len(e.outvars) == 1 for e in jx.eqns)}
  for eqn in reversed(jx.eqns):
    ok = _RESHAPES.get(eqn.primitive)
    if ok is not None and eqn.outvars[0] in saved and ok(eqn):
      out, src = eqn.outvars[0], eqn.invars[0]
      if (isinstance(src, core.Var) and src.aval.dtype == out.aval.dtype
          and src.aval.size == out.aval.size and src not in jx.invars):
        saved.setdefault(src, saved[out])
  return saved


_CUT_INFO = core.DebugInfo("the residuals from saved outputs", "<point>",
                           None, None)


def _cut(lin: Linearization, cuts: dict):
  """The known part computing the residuals (non-literal ones) with the
  values `cuts` as inputs after the point's own: (closed jaxpr, used
  inputs)."""
  jx = lin.known.jaxpr
  eqns = [e for e in jx.eqns if not set(e.outvars) & set(cuts)]
  outs = [v for v in lin.residuals if isinstance(v, core.Var)]
  cut = jx.replace(invars=list(jx.invars) + list(cuts), outvars=outs,
                   eqns=eqns, debug_info=_CUT_INFO)
  pruned, used = pe.dce_jaxpr(cut, [True] * len(outs), instantiate=False)
  return close_jaxpr(pruned, lin.known.consts), tuple(used)


def _costly(jaxpr) -> int:
  """How many `_COSTLY` equations `jaxpr` holds, in its control flow too."""
  return sum((e.primitive in _COSTLY)
             + sum(_costly(j) for j in sub_jaxprs(e.params))
             for e in jaxpr.eqns)


def saved_outputs(spec: KernelSpec) -> SavedOutputs | None:
  """The residuals of `spec`'s points that its saved outputs give, or None
  when reading them spares the backward neither an input nor a reduction
  (`_COSTLY`)."""
  gm = spec.grid_mapping
  if (gm.num_scalar_prefetch or spec.input_output_aliases or gm.dynamic_dims
      or any(in_hbm(bm.ref_aval) or bm.has_element_dims
             for bm in gm.block_mappings)):
    return None
  lin = linearization(spec)
  jx = lin.known.jaxpr
  deps = dependencies(jx)
  if any(deps.get(v, set()) & _state(gm) for v in lin.residuals
         if isinstance(v, core.Var)):
    return None                    # the state a point finds: recorded
  floats = [o for o, bm in enumerate(gm.out_mappings)
            if has_tangent(bm.array_aval.dtype)]
  written = {v: o for o, v in zip(floats, jx.outvars)
             if isinstance(v, core.Var)
             and _written_once(gm, gm.out_mappings[o])}
  saved = _saved_values(jx, written)
  start = len(gm.grid) + gm.num_scalar_prefetch
  reads_of = lambda used: tuple(used[start:start + gm.num_inputs])
  inside = {o for o, bm in enumerate(gm.out_mappings) if not overhangs(bm)}
  kept = _chosen(lin, saved, reads_of, inside)
  if not kept:
    return None
  rest, used = _cut(lin, kept)
  n_point = len(jx.invars)
  cuts = tuple((v, o) for (v, o), u in zip(kept.items(), used[n_point:])
               if u)
  used = used[:n_point] + (True,) * len(cuts)
  return SavedOutputs(tuple(sorted({o for _, o in cuts})), cuts,
                      reads_of(used), rest, used, lin)


def _chosen(lin: Linearization, saved: dict, reads_of, inside) -> dict:
  """The saved values the backward reads: all of them where that spares
  it an input, else those of each output whose read spares it a
  reduction (`_COSTLY`) and whose blocks lie inside its array (`inside`:
  past the array, a saved statistic reads 0 where the inputs' zeros give
  the statistic of zeros, and `0 / 0` would reach the cotangents of the
  inputs that the points share)."""
  if not saved:
    return {}
  rest, used = _cut(lin, {})
  if sum(reads_of(_cut(lin, saved)[1])) < sum(reads_of(used)):
    return saved
  kept = {}
  for o in sorted(set(saved.values()) & inside):
    mine = {v: p for v, p in saved.items() if p == o}
    if _costly(_cut(lin, mine)[0].jaxpr) < _costly(rest.jaxpr):
      kept.update(mine)
  return kept


def point_transpose(F, so: SavedOutputs | None, gm, entry, saved_refs, in_nz):
  """The transpose of the tangent map at a grid point linearized at `entry`
  (ids, prefetch, inputs, outputs, scratch): its residuals recomputed
  (`points.transposed_point`), or with `so` computed from the saved
  outputs' blocks `saved_refs`."""
  ids, pf, ins, outs_e, scr_e = entry
  if so is None:
    return transposed_point(F, ids, pf, ins, outs_e, scr_e, in_nz)
  return transposed_from_saved(so, gm, ids, ins, outs_e, scr_e,
                               [r[...] for r in saved_refs], in_nz)


def transposed_from_saved(so: SavedOutputs, gm, ids, ins, outs_e, scr_e,
                          saved_blocks, in_nz):
  """`points.transposed_point`'s map for a kernel whose residuals `so`
  computes from its saved outputs: `ins` holds the blocks of the inputs it
  still reads (None for the others), `saved_blocks` the outputs' blocks
  at this point, in `so.outputs`' order."""
  blocks = {o: zero_past_array(b, gm.out_mappings[o], ids, [])
            for o, b in zip(so.outputs, saved_blocks)}
  args = (list(ids) + list(ins) + list(outs_e) + list(scr_e)
          + [blocks[o].reshape(v.aval.shape) for v, o in so.cuts])
  computed = iter(core.eval_jaxpr(
      so.rest.jaxpr, so.rest.consts,
      *[a for a, u in zip(args, so.used) if u]))
  res = [next(computed) if isinstance(v, core.Var) else v.val
         for v in so.lin.residuals]
  fl = lambda avals: [a for a in avals if has_tangent(a.dtype)]
  in_avals = [sds(bm.ref_aval.inner_aval) for bm in gm.in_mappings]
  out_avals = fl([sds(x) for x in outs_e])
  scr_avals = fl([sds(x) for x in scr_e])

  def tangent_map(t_in, t_out, t_scr):
    given = iter(t_in)
    t_in_all = [next(given) if nz else jnp.zeros(a.shape, a.dtype)
                for a, nz in zip(in_avals, in_nz) if has_tangent(a.dtype)]
    u = so.lin.unknown
    t = core.eval_jaxpr(u.jaxpr, u.consts, *res, *t_in_all, *t_out, *t_scr)
    n = len(out_avals)
    return list(t[:n]), list(t[n:])

  t_in_ex = [a for a, nz in zip(in_avals, in_nz) if nz]
  return jax.linear_transpose(tangent_map, t_in_ex, out_avals, scr_avals)
