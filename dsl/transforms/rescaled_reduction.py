"""Reverse mode of a kernel whose sequential grid dim runs a rescaled
reduction: a running max `m` and states rescaled by `exp(m - m')` when it
grows (the online softmax of flash attention; `rescaled_steps` has the
algebra).

The per-point transposition (`transpose.py`) carries the states'
cotangents backwards through every step, with every step's entry state
recorded. Here, with the final max `M` and the final states recorded once
by the forward kernel itself (as a hand-written flash attention saves its
log-sum-exp), the derivation goes the way one writes the backward by hand:

- the kernel *at the final max* (every step `x' = x + e(M)`: a plain sum
  over the dim, `M` an input) is a reduction, which `reduction_transpose`
  derives: one accumulating kernel per group of inputs whose blocks stay
  put along the same grid dims (for attention, a dq kernel walking the kv
  blocks and a dk/dv kernel walking the q blocks);
- a *finalize* kernel over the other grid dims transposes the epilogue
  (what the last step computes from the final states: `acc / l`,
  `m + log(l)`) at the recorded states: the cotangent of each state, the
  same at every step of one reduction.

The outputs of such a kernel do not change with `M` (the rescaling
cancels), so holding `M` constant loses nothing. `find` recognizes the
pattern on the kernel's point function; a kernel without it keeps the
other paths.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from dsl.core.dtypes import has_tangent
from dsl.core.jax_internals import core, partial_eval as pe
from dsl.core.kernel_layout import KernelLayout
from dsl.core.pallas_call import KernelSpec, pallas_call_p, sharded_like
from dsl.core.primitives import when
from dsl.core.tracing import program_id
from dsl.transforms import grouped_grid, reduction_transpose, rescaled_steps
from dsl.transforms.common import (block_spec_of, derived_spec,
                                   discharged_point, eval_ref_jaxpr, sds,
                                   with_semantics)
from dsl.transforms.dependencies import dependencies
from dsl.transforms.points import overhangs, zero_past_array
from dsl.transforms.revisits import per_point_sds, per_point_spec
from dsl.transforms.simplify import simplify_closed
from dsl.transforms.specialize import at_step
from dsl.transforms.staging import in_hbm


@dataclasses.dataclass(frozen=True)
class Rescaled:
  dim: int                        # the sequential grid dim
  max_state: int                  # the running max, among the states
  rescaled: tuple[int, ...]       # the states that are sums at the max
  fixed: KernelSpec               # the kernel at the final max
  reduction: reduction_transpose.Reduction   # `fixed`'s structure

  @property
  def recorded(self) -> tuple[int, ...]:
    """The states the forward kernel records at the end: max first."""
    return (self.max_state,) + self.rescaled


def _states(gm):
  return ([bm.ref_aval.inner_aval for bm in gm.out_mappings]
          + [a.inner_aval for a in gm.scratch_avals])


def _has_max(jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "max":
      return True
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (tuple, list)) else (p,)):
        inner = getattr(sub, "jaxpr", sub)
        if isinstance(inner, core.Jaxpr) and _has_max(inner):
          return True
  return False


def _sequential_dim(spec: KernelSpec) -> int | None:
  """The kernel's one sequential grid dim, innermost, when the kernel is
  one this derivation can take, or None."""
  gm = spec.grid_mapping
  if (gm.num_scalar_prefetch or spec.input_output_aliases or gm.dynamic_dims
      or any(in_hbm(bm.ref_aval) or bm.has_element_dims
             for bm in gm.block_mappings)
      or any(overhangs(bm) for bm in gm.in_mappings)):
    return None
  if not all(has_tangent(a.dtype) for a in _states(gm)):
    return None
  seq = [e for e in gm.plan(spec.compiler_params, spec.jaxpr).sequential
         if gm.grid[e] != 1]     # a dim of one step carries nothing
  n = len(gm.grid)
  if list(seq) != [n - 1] or gm.grid[n - 1] < 2:
    return None
  if not _has_max(spec.jaxpr.jaxpr):
    return None
  return n - 1


def _step_tags(dj, n_front, m, rescaled):
  """The tags of the point function's results (`rescaled_steps`) with
  state `m` the max and `rescaled` the rescaled states, and the context."""
  ctx = rescaled_steps.Context("step")
  n_states = len(dj.jaxpr.invars) - n_front
  tags = _state_tags(n_front, n_states, m, rescaled)
  got = []

  def f(*xs):
    outs, ts = rescaled_steps.evaluate(ctx, dj.jaxpr, dj.consts, xs, tags)
    got.append(ts)
    return outs
  jax.make_jaxpr(f)(*[sds(v.aval) for v in dj.jaxpr.invars])
  return got[0][len(got[0]) - n_states:], ctx


def _rescaled_states(dj, n_front, m, candidates):
  """The states that are sums at the final max with state `m` the running
  max, or None when the step is not a rescaled reduction."""
  is_max = lambda t: t is not None and t[0] == "M"
  tags, ctx = _step_tags(dj, n_front, m, set())
  if not is_max(tags[m]) or not ctx.maxes:
    return None
  # A sum (something added to it), rescaled with the max it ends at.
  is_sum = lambda ts, s: ts[s] is not None and ts[s][:2] == ("acc", s) and (
      ts[s][-1] == ts[m][-1])
  rescaled = tuple(s for s in candidates
                   if is_sum(_step_tags(dj, n_front, m, {s})[0], s))
  if not rescaled:
    return None
  tags, ctx = _step_tags(dj, n_front, m, set(rescaled))
  if (not is_max(tags[m]) or len(ctx.exps) != 1
      or not all(is_sum(tags, s) for s in rescaled)):
    return None
  return rescaled


def _at_steps(dj, spec, d):
  """The point function at the dim's first, inside and last steps."""
  gm = spec.grid_mapping
  avals = [sds(v.aval) for v in dj.jaxpr.invars]
  names = ("first", "last") + (("inside",) if gm.grid[d] > 2 else ())
  return {step: at_step(dj, len(gm.grid), d, gm.grid[d], step, avals)
          for step in names}


def _caches(steps, spec, d, m, rescaled):
  """The states besides the max and the rescaled ones: every output must
  pass through the first and inside steps (the epilogue writes it), and
  every scratch must be a *cache* of inputs that stay put along `d` (a
  copy of the q block): written at the first step from them alone, passed
  through at the others. The caches, or None."""
  gm = spec.grid_mapping
  n_ids, n_in, n_out = len(gm.grid), gm.num_inputs, gm.num_outputs
  n_front = n_ids + n_in
  passes = lambda j, s: j.outvars[n_in + s] is j.invars[n_front + s]
  others = [s for s in range(len(_states(gm)))
            if s != m and s not in rescaled]
  if not all(passes(steps[st].jaxpr, s) for s in others if s < n_out
             for st in ("first", "inside") if st in steps):
    return None
  caches = tuple(s for s in others if s >= n_out)
  if not all(passes(steps[st].jaxpr, s) for s in caches
             for st in ("inside", "last") if st in steps):
    return None
  first = steps["first"].jaxpr
  deps = dependencies(first)
  stay = {n_ids + k for k, bm in enumerate(gm.in_mappings)
          if d in (reduction_transpose._constant_dims(gm, bm) or ())}
  allowed = set(range(n_ids)) | stay
  for s in caches:
    v = first.outvars[n_in + s]
    if isinstance(v, core.Var) and not deps.get(v, set()) <= allowed:
      return None
  return caches


def find(spec: KernelSpec) -> Rescaled | None:
  """The rescaled reduction of `spec` (module docstring), or None."""
  d = _sequential_dim(spec)
  if d is None:
    return None
  gm = spec.grid_mapping
  dj, _ = discharged_point(spec, transposable=True)
  n_front = len(gm.grid) + gm.num_inputs
  n_states = len(_states(gm))
  steps = None
  for m in range(n_states):
    rescaled = _rescaled_states(dj, n_front, m,
                                [s for s in range(n_states) if s != m])
    if rescaled is None:
      continue
    steps = steps or _at_steps(dj, spec, d)
    caches = _caches(steps, spec, d, m, rescaled)
    if caches is None:
      continue
    make = lambda group: _fixed_max_spec(spec, dj, steps["first"], d, m,
                                         rescaled, caches, group)
    fixed = make(None)
    red = _without_unit_dims(fixed, reduction_transpose.find(fixed))
    group = red and _grouping(fixed, red, d)
    if group is not None:
      fixed = make(group)
      red = _without_unit_dims(fixed, reduction_transpose.find(fixed))
    if (red is None or any(red.identity[k] != k
                           for k in range(len(rescaled)))
        or not _one_block_per_point(fixed, red)):
      continue
    resc = Rescaled(d, m, rescaled, fixed, red)
    if _epilogue_reads_inputs(spec, resc, dj):
      continue
    return resc
  return None


def _without_unit_dims(fixed, red):
  """`red` with the grid dims of one step left out of the dims blocks stay
  put along: they stay outer (parallel) dims of the accumulating kernels,
  whose scratch is then reset at the first step of one dim, which the
  grid plan reads as an accumulator's reset."""
  if red is None:
    return None
  grid = fixed.grid_mapping.grid
  return dataclasses.replace(red, const_dims=tuple(
      tuple(e for e in c if grid[e] != 1) for c in red.const_dims))


def _grouping(fixed, red, d):
  """The grouped grid the accumulating kernels of `fixed` need (several
  points sharing a block along a dim it does not stay put along: grouped
  kv heads; blocks staying put along two dims: one kv head), or None."""
  gm = fixed.grid_mapping
  if not _one_block_per_point(fixed, red):
    return grouped_grid.grouping(
        gm.grid, [gm.block_indices(bm) for bm in gm.in_mappings],
        red.const_dims, d)
  return grouped_grid.folding(gm.grid, red.const_dims, d)


def _one_block_per_point(fixed, red) -> bool:
  """Whether each input's blocks differ at every grid point but along the
  dims they stay put along: an accumulating kernel sums a block over those
  dims only. (Grouped-query attention's kv blocks serve several heads: a
  sum over heads too, which it does not do.)"""
  gm = fixed.grid_mapping
  for bm, const in zip(gm.in_mappings, red.const_dims):
    idx = gm.block_indices(bm)
    for e in const:
      idx = np.take(idx, [0], axis=e)
    rows = idx.reshape(-1, idx.shape[-1])
    if len(np.unique(rows, axis=0)) != len(rows):
      return False
  return True


# ----------------------------------------------------------- the kernels

def _per_reduction(gm, d):
  """(grid without `d`, its ids from the full grid's)."""
  grid_p = tuple(s for e, s in enumerate(gm.grid) if e != d)
  return grid_p, lambda ids: [i for e, i in enumerate(ids) if e != d]


def _state_tags(n_front, n_states, m, rescaled):
  return [None] * n_front + [
      rescaled_steps.M_TAG if s == m
      else rescaled_steps.state_tag(s) if s in rescaled else None
      for s in range(n_states)]


def _dce(jaxpr, n_in, n_states, keep):
  """`jaxpr` (a point function) computing only the states in `keep`."""
  used = [False] * n_in + [s in keep for s in range(n_states)]
  return pe.dce_jaxpr(jaxpr, used, instantiate=False)


def _fixed_max_spec(spec, dj, first, d, m, rescaled, caches, group=None):
  """The kernel at the final max: inputs, then `M` (per reduction); its
  outputs are the rescaled states (per reduction), accumulated along `d`;
  each cache is computed from the inputs at every step. On the grid of
  `group` (a `GroupedGrid`) when given."""
  gm = spec.grid_mapping
  n, n_in = len(gm.grid), gm.num_inputs
  shapes = _states(gm)
  jx, used_in = _dce(dj.jaxpr, n_in, len(shapes), rescaled)
  cx, cache_in = _dce(first.jaxpr, n_in, len(shapes), caches)
  grid_p, drop_d = _per_reduction(gm, d)
  grid = gm.grid if group is None else group.new_grid
  to_old = (lambda ids: list(ids)) if group is None else group.original_ids
  red_spec = lambda a: per_point_spec(a.shape, n,
                                      lambda ids: drop_d(to_old(ids)),
                                      n_lead=n - 1)
  tags = _state_tags(n + n_in, len(shapes), m, rescaled)
  tags = [t for t, u in zip(tags, used_in) if u]
  pick = lambda xs, used: [x for x, u in zip(xs, used) if u]

  def body(*refs):
    ids = to_old([program_id(e) for e in range(n)])
    ins, max_ref, outs = KernelLayout.of(
        inputs=n_in, max=1, outputs=len(rescaled)).split(refs)
    states = [np.zeros(a.shape, a.dtype) for a in shapes]
    args = ids + [r[...] for r in ins]
    for s, x in zip(caches, core.eval_jaxpr(cx, first.consts,
                                            *pick(args + states, cache_in))):
      states[s] = x
    states[m] = max_ref[0][...].reshape(shapes[m].shape)
    for s, r in zip(rescaled, outs):
      states[s] = r[...].reshape(shapes[s].shape)
    ctx = rescaled_steps.Context("step")
    vals, _ = rescaled_steps.evaluate(ctx, jx, dj.consts,
                                      pick(args + states, used_in), tags)
    for r, x in zip(outs, vals):
      r[...] = x.reshape(r.shape).astype(r.dtype)

  args = ([sds(bm.array_aval) for bm in gm.in_mappings]
          + [per_point_sds(shapes[m].shape, shapes[m].dtype, grid_p)])
  in_specs = ([block_spec_of(bm, n, to_old) for bm in gm.in_mappings]
              + [red_spec(shapes[m])])
  out_shapes = [per_point_sds(shapes[s].shape, shapes[s].dtype, grid_p)
                for s in rescaled]
  return derived_spec(spec, body, args, out_shapes, grid=grid,
                      in_specs=in_specs,
                      out_specs=[red_spec(shapes[s]) for s in rescaled],
                      scratch=[], suffix="at_max")


def _records(gm, resc):
  """The arrays of the records (the final max and sums per reduction) and
  their blocks on the kernel's grid."""
  shapes = _states(gm)
  n = len(gm.grid)
  grid_p, drop_d = _per_reduction(gm, resc.dim)
  return ([per_point_sds(shapes[s].shape, shapes[s].dtype, grid_p)
           for s in resc.recorded],
          [per_point_spec(shapes[s].shape, n, drop_d, n_lead=n - 1)
           for s in resc.recorded])


def recording_spec(spec: KernelSpec, resc: Rescaled) -> KernelSpec:
  """The forward kernel, also writing the final max and rescaled states
  of each reduction (at its last step) into outputs of their own."""
  gm = spec.grid_mapping
  n, d = len(gm.grid), resc.dim

  def body(*refs):
    ids = [program_id(e) for e in range(n)]
    parts = gm.ref_layout().insert(
        "outputs", records=len(resc.recorded)).split(refs)
    eval_ref_jaxpr(spec.jaxpr, *ids, *parts.inputs, *parts.outputs,
                   *parts.scratch)
    states = list(parts.outputs) + list(parts.scratch)

    @when(ids[d] == gm.grid[d] - 1)
    def _():
      for r, s in zip(parts.records, resc.recorded):
        r[...] = states[s][...].reshape(r.shape)

  rec_sds, rec_specs = _records(gm, resc)
  return derived_spec(spec, body, [sds(bm.array_aval) for bm in
                                   gm.in_mappings],
                      [sds(bm.array_aval) for bm in gm.out_mappings]
                      + rec_sds, grid=gm.grid,
                      in_specs=[block_spec_of(bm, n) for bm in gm.in_mappings],
                      out_specs=[block_spec_of(bm, n) for bm in
                                 gm.out_mappings] + rec_specs,
                      scratch=list(gm.scratch_avals), suffix="")


def linear_base(spec: KernelSpec, resc: Rescaled) -> KernelSpec:
  """`spec` taking the records as inputs it does not read: the kernel
  whose linearization reverse mode transposes here (its meta names
  `spec` and `resc`)."""
  gm = spec.grid_mapping
  n, n_rec = len(gm.grid), len(resc.recorded)

  def body(*refs):
    ids = [program_id(e) for e in range(n)]
    parts = gm.ref_layout().insert("inputs", records=n_rec).split(refs)
    eval_ref_jaxpr(spec.jaxpr, *ids, *parts.inputs, *parts.outputs,
                   *parts.scratch)

  rec_sds, rec_specs = _records(gm, resc)
  args = [sds(bm.array_aval) for bm in gm.in_mappings] + rec_sds
  in_specs = [block_spec_of(bm, n) for bm in gm.in_mappings] + rec_specs
  return derived_spec(spec, body, args,
                      [sds(bm.array_aval) for bm in gm.out_mappings],
                      grid=gm.grid, in_specs=in_specs,
                      out_specs=[block_spec_of(bm, n) for bm in
                                 gm.out_mappings],
                      scratch=list(gm.scratch_avals), suffix="",
                      meta=("rescaled", spec, resc))


def _epilogue(spec, resc, dj, ids):
  """The outputs the last step writes, as a function `f(ins, max,
  *finals)` of the inputs, the final max and rescaled states (the step's
  update left out)."""
  gm = spec.grid_mapping
  shapes = _states(gm)
  tags = _state_tags(len(gm.grid) + gm.num_inputs, len(shapes),
                    resc.max_state, resc.rescaled)

  def outputs(ins, max_value, *finals):
    states = [np.zeros(a.shape, a.dtype) for a in shapes]
    states[resc.max_state] = max_value
    for s, x in zip(resc.rescaled, finals):
      states[s] = x
    ctx = rescaled_steps.Context("epilogue")
    vals, _ = rescaled_steps.evaluate(ctx, dj.jaxpr, dj.consts,
                                      list(ids) + list(ins) + states, tags)
    return vals[gm.num_inputs:gm.num_inputs + gm.num_outputs]
  return outputs


def _block_avals(gm):
  return [sds(bm.ref_aval.inner_aval) for bm in gm.in_mappings]


def _epilogue_reads_inputs(spec, resc, dj) -> bool:
  """Whether the outputs the last step writes read an input block (their
  cotangents would not be the states' alone)."""
  gm = spec.grid_mapping
  shapes = _states(gm)
  f = _epilogue(spec, resc, dj, [np.int32(s - 1) for s in gm.grid])
  closed = jax.make_jaxpr(f)(_block_avals(gm),
                             *[sds(shapes[s]) for s in resc.recorded])
  deps = dependencies(closed.jaxpr)
  inputs = set(range(gm.num_inputs))
  return any(isinstance(v, core.Var) and deps.get(v, set()) & inputs
             for v in closed.jaxpr.outvars)


def _finalize(spec, resc, recs, ct_outs):
  """The cotangent of each rescaled state, per reduction: the epilogue's
  transpose at the recorded states, applied to the outputs' cotangents."""
  gm = spec.grid_mapping
  d, n_out = resc.dim, gm.num_outputs
  grid_p, _ = _per_reduction(gm, d)
  n_p = len(grid_p)
  full = lambda p: list(p[:d]) + [gm.grid[d] - 1] + list(p[d:])
  shapes = _states(gm)
  dj, _ = discharged_point(spec, transposable=True)

  def body(*refs):
    ids = full([program_id(e) for e in range(n_p)])
    rec_refs, ct_refs, c_refs = KernelLayout.of(
        records=len(recs), cotangents=n_out, states=len(resc.rescaled)
    ).split(refs)
    recorded = [r[...].reshape(shapes[s].shape)
                for r, s in zip(rec_refs, resc.recorded)]
    cts = [zero_past_array(r[...], bm, ids, [])
           for r, bm in zip(ct_refs, gm.out_mappings)]
    f = _epilogue(spec, resc, dj, ids)
    zeros = [np.zeros(a.shape, a.dtype) for a in _block_avals(gm)]
    _, pull = jax.vjp(lambda *xs: f(zeros, recorded[0], *xs),
                      *recorded[1:])
    for r, c in zip(c_refs, pull(cts)):
      r[...] = c.reshape(r.shape).astype(r.dtype)

  rec_spec = lambda a: per_point_spec(a.shape, n_p)
  args = ([jax.ShapeDtypeStruct(r.shape, r.dtype) for r in recs]
          + [sds(bm.array_aval) for bm in gm.out_mappings])
  in_specs = ([rec_spec(shapes[s]) for s in resc.recorded]
              + [block_spec_of(bm, n_p, full) for bm in gm.out_mappings])
  c_avals = [shapes[s] for s in resc.rescaled]
  fin = derived_spec(
      spec, body, args,
      [per_point_sds(a.shape, a.dtype, grid_p) for a in c_avals],
      grid=grid_p, in_specs=in_specs,
      out_specs=[rec_spec(a) for a in c_avals], scratch=[],
      suffix="finalize", compiler_params=with_semantics(
          spec, ("parallel",) * n_p))
  fin = fin.replace(jaxpr=simplify_closed(fin.jaxpr))
  return list(pallas_call_p.bind(*recs, *ct_outs, spec=fin))


def linearization(spec: KernelSpec, in_nz, primals):
  """For `spec`'s linearization, when it runs a rescaled reduction: its
  outputs from the forward kernel that also records the final max and
  sums, the kernel to linearize (`linear_base`: it takes the records as
  inputs, after `spec`'s), that kernel's inputs' tangent mask and the
  residuals (the inputs, then the records); else None."""
  resc = find(spec)
  if resc is None:
    return None
  n_out = spec.grid_mapping.num_outputs
  outs = pallas_call_p.bind(*primals, spec=recording_spec(spec, resc))
  recs = list(outs[n_out:])
  return (outs[:n_out], linear_base(spec, resc),
          tuple(in_nz) + (False,) * len(recs), list(primals) + recs)


def is_linear_base(spec: KernelSpec) -> bool:
  return bool(spec.meta) and spec.meta[0] == "rescaled"


def transpose(base: KernelSpec, in_nz, args, ct_outs):
  """The transpose rule's results for the linear kernel of `base` (a
  `linear_base`) applied to `args` (its inputs: the kernel's, then the
  records, then the tangents of the inputs flagged in `in_nz`): None for
  each input of `base`, then the cotangents of the tangents."""
  _, spec, resc = base.meta
  n_in = spec.grid_mapping.num_inputs
  n_primals = base.grid_mapping.num_inputs
  primals, tangents = args[:n_primals], args[n_primals:]
  ins, recs = list(primals[:n_in]), list(primals[n_in:])
  cs = _finalize(spec, resc, recs, ct_outs)
  nz = list(in_nz[:n_in]) + [False]
  cts = reduction_transpose.transpose(resc.fixed, resc.reduction, nz,
                                      ins + [recs[0]], cs)
  # A cotangent has its tangent's type (its sharding, under jit).
  return [None] * n_primals + [sharded_like(c, getattr(t, "aval", None))
                               for c, t in zip(cts, tangents)]
