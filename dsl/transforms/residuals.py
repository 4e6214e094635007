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
- whether residuals are computed from the blocks the point writes to its
  outputs alone (a softmax whose jvp is written in its result, `y * (dx -
  sum(y * dx))`; `tanh`, whose derivative is `1 - y**2`): the forward
  pass has saved those blocks already, so the backward computes the
  residuals from the output's block rather than from the inputs
  (`saved_outputs`), where this spares it an input: a pass over that
  input less. Only outputs whose every block is written by one grid point
  qualify (the saved array holds what that point wrote), in kernels
  without scalar prefetch, aliases or operands in HBM, and only the value
  the point writes (an output stored in a narrower dtype is not the
  value the tangent map needs).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsl.core import config
from dsl.core.dtypes import has_tangent
from dsl.core.jax_internals import ClosedJaxpr, close_jaxpr, core
from dsl.core.jax_internals import partial_eval as pe
from dsl.core.pallas_call import KernelSpec
from dsl.transforms.common import point_function, sds
from dsl.transforms.dependencies import dependencies
from dsl.transforms.points import (float_call, transposed_point,
                                   zero_past_array)
from dsl.transforms.staging import in_hbm


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
  F = point_function(spec)
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
  """Residuals computed from the outputs the forward saved: `outputs` (the
  indices of those read, in order), `written` (the point's result var of
  each, -> output index), `derived` (residual positions computed from them
  by the equations `from_outputs`, and from the grid ids), `reads` (per
  input: whether the backward still reads it) and `rest` (the known part
  computing the other residuals, from the point function's inputs
  `used`)."""
  outputs: tuple[int, ...]
  written: dict
  derived: frozenset
  from_outputs: tuple
  reads: tuple[bool, ...]
  rest: ClosedJaxpr
  used: tuple[bool, ...]
  lin: Linearization = dataclasses.field(repr=False)


def _written_once(gm, bm) -> bool:
  idx = gm.block_indices(bm)
  if idx is None or not gm.grid:
    return False
  rows = idx.reshape(-1, idx.shape[-1])
  return len(np.unique(rows, axis=0)) == len(rows)


def _equations_to(jx, targets, stops) -> tuple:
  """The equations of `jx` that compute `targets` from `stops` (and the
  jaxpr's inputs and consts), in order."""
  needed, found = set(targets) - set(stops), []
  for eqn in reversed(jx.eqns):
    if any(v in needed for v in eqn.outvars):
      found.append(eqn)
      needed |= {v for v in eqn.invars
                 if isinstance(v, core.Var) and v not in stops}
  return tuple(found[::-1])


def saved_outputs(spec: KernelSpec) -> SavedOutputs | None:
  """The residuals of `spec`'s points that its saved outputs give, or None
  when reading them spares the backward no input."""
  gm = spec.grid_mapping
  if (gm.num_scalar_prefetch or spec.input_output_aliases or gm.dynamic_dims
      or any(in_hbm(bm.ref_aval) or bm.has_element_dims
             for bm in gm.block_mappings)):
    return None
  lin = linearization(spec)
  jx = lin.known.jaxpr
  floats = [o for o, bm in enumerate(gm.out_mappings)
            if has_tangent(bm.array_aval.dtype)]
  written = {v: o for o, v in zip(floats, jx.outvars)
             if isinstance(v, core.Var)
             and _written_once(gm, gm.out_mappings[o])}
  cut = dependencies(jx, cuts={v: ("output", o) for v, o in written.items()})
  ids = set(range(len(gm.grid)))
  outs_of = lambda v: {d for d in cut.get(v, ()) if isinstance(d, tuple)}
  derived = frozenset(
      i for i, v in enumerate(lin.residuals) if isinstance(v, core.Var)
      and outs_of(v) and not cut[v] - outs_of(v) - ids)
  if not derived:
    return None
  deps = dependencies(jx)
  if any(deps.get(v, set()) & _state(gm) for v in lin.residuals
         if isinstance(v, core.Var)):
    return None                    # the state a point finds: recorded
  rest = [isinstance(v, core.Var) and i not in derived
          for i, v in enumerate(lin.residuals)]
  needed = set().union(*(deps.get(v, set()) for v, r in zip(
      lin.residuals, rest) if r))
  first = len(gm.grid) + gm.num_scalar_prefetch
  reads = tuple(first + k in needed for k in range(gm.num_inputs))
  if all(reads):
    return None
  targets = [v for i, v in enumerate(lin.residuals) if i in derived]
  outputs = sorted({o for v in targets for _, o in outs_of(v)})
  n_left = len(jx.outvars) - lin.n_residuals
  pruned, used = pe.dce_jaxpr(jx, [False] * n_left + rest,
                              instantiate=False)
  return SavedOutputs(
      tuple(outputs), {v: o for v, o in written.items() if o in outputs},
      derived, _equations_to(jx, targets, written), reads,
      close_jaxpr(pruned, lin.known.consts), tuple(used), lin)


def _from_outputs(so: SavedOutputs, gm, ids, saved_blocks) -> dict:
  """{residual var: value} of the residuals `so` computes from the saved
  output blocks at grid point `ids` (zero past their arrays)."""
  jx = so.lin.known.jaxpr
  blocks = {o: zero_past_array(b, gm.out_mappings[o], ids, [])
            for o, b in zip(so.outputs, saved_blocks)}
  env = dict(zip(jx.constvars, so.lin.known.consts))
  env.update(zip(jx.invars[:len(ids)], ids))
  env.update((v, blocks[o]) for v, o in so.written.items())
  read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
  for eqn in so.from_outputs:
    out = eqn.primitive.bind(*map(read, eqn.invars),
                             **eqn.primitive.get_bind_params(eqn.params))
    env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results
                   else [out]))
  return env


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
  args = list(ids) + list(ins) + list(outs_e) + list(scr_e)
  computed = iter(core.eval_jaxpr(
      so.rest.jaxpr, so.rest.consts,
      *[a for a, u in zip(args, so.used) if u]))
  env = _from_outputs(so, gm, ids, saved_blocks)
  res = [env[v] if i in so.derived
         else (next(computed) if isinstance(v, core.Var) else v.val)
         for i, v in enumerate(so.lin.residuals)]
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
