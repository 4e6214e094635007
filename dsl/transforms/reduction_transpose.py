"""Reverse mode of a kernel that accumulates along its sequential grid dim.

A matmul over a K grid dim keeps `acc += x @ y` in a scratch (or output)
block: zeroed at the first K step, added to at every step, read at the last
(the epilogue). The generic transposed kernel (`transpose.py`) carries the
accumulator's cotangent backwards through the K steps, so every grid point
depends on the one after it, and the cotangents of `x` and `y`, whose
blocks the grid revisits along the *other* dims, are written per point and
summed outside the kernel.

Here the derivation reads what each step does to the kernel's state from the
point function itself (`specialize`: the step with its id fixed at the first
or last step, or known to lie between): when every step in between only adds
to the state (`s' = s + e`, `e` not reading the state), the first step does
not read the state it finds in scratch, and the last step reads it only
through its own sum, the cotangent of the state is the same at every step of
one reduction: the one the epilogue gives it, `c`. So:

- a *finalize* kernel over the other grid dims runs the transposed last step
  and keeps `c`, and the cotangents of inputs only the epilogue reads (a
  bias); it is skipped when `c` is an output's cotangent as it is;
- one kernel per group of inputs whose blocks stay put along the same grid
  dims applies every step's transposed map to `c` and sums the cotangents:
  its grid visits those dims innermost (they become its reduction, with an
  accumulator in scratch), so `dx = c @ y.T` is a matmul kernel over a
  reduction of its own, as one writes it by hand; where its step is a
  contraction of whole blocks, over tiles of its own (`retile`: the
  forward's tile with the reduced and kept dims swapped).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dsl.core.dtypes import has_tangent
from dsl.core.jax_internals import core, partial_eval as pe
from dsl.core.kernel_layout import KernelLayout
from dsl.core.memory import MemorySpace
from dsl.core.pallas_call import KernelSpec, pallas_call_p
from dsl.core.primitives import when
from dsl.core.tracing import program_id
from dsl.transforms.common import (block_spec_of, derived_spec,
                                   discharged_point, eval_ref_jaxpr,
                                   point_function, sds, with_semantics)
from dsl.transforms import retile
from dsl.transforms.dependencies import dependencies
from dsl.transforms.points import (overhangs, transposed_point,
                                   zero_past_array)
from dsl.transforms.revisits import (per_point_sds, per_point_spec,
                                     scatter_contributions, zero_unvisited)
from dsl.transforms.simplify import simplify_closed
from dsl.transforms.specialize import at_step
from dsl.transforms.staging import in_hbm, is_semaphore


@dataclasses.dataclass(frozen=True)
class Reduction:
  dim: int                            # the sequential grid dim
  carried: tuple[bool, ...]           # per state block (outputs, scratch)
  identity: tuple[int | None, ...]    # per state: output whose ct `c` is
  direct: tuple[int, ...]             # inputs only the last step reads
  const_dims: tuple[tuple[int, ...], ...]   # per input: dims it stays put
  # The last step's tangent map reads the state it finds (a relu epilogue):
  # that state is recorded per reduction, and every kernel here
  # linearizes there (the other steps' maps read no state).
  recorded: bool = False


def _constant_dims(gm, bm) -> tuple[int, ...] | None:
  idx = gm.block_indices(bm)
  if idx is None:
    return None
  return tuple(e for e in range(len(gm.grid))
               if bool(np.all(idx == np.take(idx, [0], axis=e))))


def _fits(spec: KernelSpec) -> int | None:
  """The sequential dim of a kernel this derivation can take, or None."""
  gm = spec.grid_mapping
  if (gm.num_scalar_prefetch or spec.input_output_aliases or gm.dynamic_dims
      or any(in_hbm(bm.ref_aval) or bm.has_element_dims
             for bm in gm.block_mappings)):
    return None
  states = [bm.ref_aval for bm in gm.out_mappings] + list(gm.scratch_avals)
  if any(is_semaphore(a) or not has_tangent(a.inner_aval.dtype)
         for a in states):
    return None
  seq = [e for e in gm.plan(spec.compiler_params, spec.jaxpr).sequential
         if gm.grid[e] != 1]     # a dim of one step carries nothing
  if len(seq) != 1 or gm.grid[seq[0]] < 2:
    return None
  d = seq[0]
  for bm in gm.out_mappings:
    const = _constant_dims(gm, bm)
    if const is None or d not in const:
      return None
  return d


def _roles(closed, n_ids, n_in):
  """Per state block, what the step does to it: ("pass",), ("fresh",
  deps) (a value not read from the state), ("acc", sum var, deps of the
  addend) (`s + e`) or ("other",)."""
  jx = closed.jaxpr
  state = set(range(n_ids + n_in, len(jx.invars)))
  deps = dependencies(jx)
  dep = lambda v: deps.get(v, set()) if isinstance(v, core.Var) else set()
  defs = {v: e for e in jx.eqns for v in e.outvars}
  roles = []
  # The point's results: its inputs (as they were), then its state.
  for sv, ov in zip(jx.invars[n_ids + n_in:], jx.outvars[n_in:]):
    if ov is sv:
      roles.append(("pass",))
      continue
    if not dep(ov) & state:
      roles.append(("fresh", dep(ov)))
      continue
    e = defs.get(ov)
    role = ("other",)
    if e is not None and e.primitive.name in ("add", "add_any"):
      for x, y in (e.invars, e.invars[::-1]):
        if x is sv and not dep(y) & state:
          role = ("acc", ov, dep(y))
    roles.append(role)
  return roles


def _steps(spec, d):
  gm = spec.grid_mapping
  dj, _ = discharged_point(spec, transposable=True)
  avals = ([jax.ShapeDtypeStruct((), jnp.int32)] * len(gm.grid)
           + [sds(bm.ref_aval.inner_aval) for bm in gm.in_mappings]
           + [sds(bm.ref_aval.inner_aval) for bm in gm.out_mappings]
           + [sds(a.inner_aval) for a in gm.scratch_avals])
  n = gm.grid[d]
  names = ("first", "last") + (("inside",) if n > 2 else ())
  return {s: at_step(dj, len(gm.grid), d, n, s, avals) for s in names}


def find(spec: KernelSpec, reads_state: bool = False) -> Reduction | None:
  """The reduction structure of `spec` (see the module docstring), or None
  when the kernel does not have it. `reads_state`: the kernel's tangent
  map reads the state a step finds somewhere (`needs_entry_state`)."""
  d = _fits(spec)
  if d is None:
    return None
  gm = spec.grid_mapping
  if reads_state and (d != len(gm.grid) - 1
                      or any(overhangs(bm) for bm in gm.in_mappings)):
    return None      # the record per reduction must be revisited in a row
  n_ids, n_in, n_out = len(gm.grid), gm.num_inputs, gm.num_outputs
  steps = _steps(spec, d)
  if reads_state and any(_tangent_reads_state(j, n_ids, n_in)
                         for s, j in steps.items() if s != "last"):
    return None
  roles = {s: _roles(j, n_ids, n_in) for s, j in steps.items()}
  inputs = set(range(n_ids, n_ids + n_in))
  first, last = roles["first"], roles["last"]
  if any(r[0] != "fresh" and not (r[0] == "pass" and i < n_out)
         for i, r in enumerate(first)):
    return None
  carried = tuple(r[0] == "acc" for r in last)
  if any(c and r[0] not in ("pass", "acc")
         for c, r in zip(carried, roles.get("inside", ()))):
    return None
  # The last step reads the state it finds only through its sums.
  jx = steps["last"].jaxpr
  cuts = {r[1]: ("sum", i) for i, r in enumerate(last) if r[0] == "acc"}
  deps = dependencies(jx, cuts=cuts)
  reads = set().union(*(deps.get(v, set()) for v in jx.outvars[n_in:]
                        if isinstance(v, core.Var)))
  if reads & set(range(n_ids + n_in, len(jx.invars))):
    return None
  added = set()
  for step in roles.values():
    for r in step:
      if r[0] in ("fresh", "acc"):
        added |= r[-1] & inputs
  direct = reads & inputs
  if direct & added:
    return None
  const = [_constant_dims(gm, bm) for bm in gm.in_mappings]
  if any(c is None for c in const):
    return None
  return Reduction(d, carried, _identities(spec, d, carried),
                   tuple(sorted(k - n_ids for k in direct)), tuple(const),
                   reads_state)


def _tangent_reads_state(closed, n_ids, n_in) -> bool:
  """Whether the tangent map of the step `closed` (ids, inputs, state ->
  inputs, state) depends on the state it finds."""
  jx = closed.jaxpr
  n = len(jx.invars)
  floats = [k for k in range(n_ids, n) if has_tangent(jx.invars[k].aval.dtype)]

  def jvp(*args):
    primals, tangents = args[:n], args[n:]

    def f(*xs):
      full = list(primals)
      for k, x in zip(floats, xs):
        full[k] = x
      return core.eval_jaxpr(jx, closed.consts, *full)
    return jax.jvp(f, [primals[k] for k in floats], list(tangents))
  avals = [sds(v.aval) for v in jx.invars]
  traced = jax.make_jaxpr(jvp)(*avals, *[avals[k] for k in floats])
  known, _, _, res_avals = pe.partial_eval_jaxpr_nounits(
      traced, [False] * n + [True] * len(floats), instantiate=False)
  deps = dependencies(known.jaxpr)
  residuals = known.jaxpr.outvars[len(known.jaxpr.outvars) - len(res_avals):]
  state = set(range(n_ids + n_in, n))
  return any(isinstance(v, core.Var) and deps.get(v, set()) & state
             for v in residuals)


def _identities(spec, d, carried):
  """Per state block: the output whose cotangent its `c` is, unchanged
  (the epilogue copies the sum out), or None."""
  gm = spec.grid_mapping
  F = point_function(spec, transposable=True)
  n_ids, n_out = len(gm.grid), gm.num_outputs

  def c_of(*args):
    ids, ins, cts = KernelLayout.of(ids=n_ids, inputs=gm.num_inputs,
                                    cotangents=n_out).split(args)
    zeros = _zero_states(gm)
    tp = transposed_point(F, ids, [], ins, zeros[:n_out], zeros[n_out:],
                          [False] * len(ins))
    _, ct_out, ct_scr = tp((list(cts), zeros[n_out:]))
    return list(ct_out) + list(ct_scr)
  avals = ([jax.ShapeDtypeStruct((), jnp.int32)] * n_ids
           + [sds(bm.ref_aval.inner_aval) for bm in gm.in_mappings]
           + [sds(bm.ref_aval.inner_aval) for bm in gm.out_mappings])
  closed = at_step(jax.make_jaxpr(c_of)(*avals), n_ids, d, gm.grid[d],
                   "last", avals)
  jx = closed.jaxpr
  ct_vars = jx.invars[n_ids + gm.num_inputs:]
  defs = {v: e for e in jx.eqns for v in e.outvars}
  zero = {v for v, x in zip(jx.constvars, closed.consts)
          if not np.any(np.asarray(x))}
  zero |= {e.outvars[0] for e in jx.eqns if e.primitive.name ==
           "broadcast_in_dim" and isinstance(e.invars[0], core.Literal)
           and not np.any(e.invars[0].val)}
  return tuple(_copied_from(v, defs, zero, ct_vars) if c else None
               for c, v in zip(carried, jx.outvars))


def _copied_from(v, defs, zero, sources):
  """The position in `sources` of the value `v` is a copy of (through
  same-dtype conversions and additions of zeros), or None."""
  while v not in sources:
    e = defs.get(v)
    if e is None:
      return None
    name = e.primitive.name
    if (name == "convert_element_type"
        and e.invars[0].aval.dtype == v.aval.dtype):
      v = e.invars[0]
    elif name in ("add", "add_any") and len(e.invars) == 2:
      a, b = e.invars
      if a in zero:
        v = b
      elif b in zero:
        v = a
      else:
        return None
    else:
      return None
  return sources.index(v)


def _zero_states(gm):
  avals = ([bm.ref_aval.inner_aval for bm in gm.out_mappings]
           + [a.inner_aval for a in gm.scratch_avals])
  # Concrete zeros: the clean-up of the transposed step sees them as such.
  return [np.zeros(a.shape, a.dtype) for a in avals]


def _entry_states(gm, rec_refs):
  """The state a step finds, as the kernels here linearize at it: the
  recorded state of the reduction's last step (`rec_refs`, one per state
  block), or zeros where no step's tangent map reads it."""
  if not rec_refs:
    return _zero_states(gm)
  return [r[...].reshape(a.shape) for r, a in zip(rec_refs,
                                                   _state_shapes(gm))]


def _record_at_last(spec, red, primals):
  """Replays the forward kernel, recording the state its reduction's last
  step finds, per reduction (arrays over the other grid dims)."""
  gm = spec.grid_mapping
  d, n, n_out = red.dim, len(gm.grid), gm.num_outputs
  grid_p = tuple(s for e, s in enumerate(gm.grid) if e != d)
  drop_d = lambda ids: [i for e, i in enumerate(ids) if e != d]
  shapes = _state_shapes(gm)

  def body(*refs):
    ids = [program_id(e) for e in range(n)]
    parts = gm.ref_layout().insert("outputs", records=len(shapes)).split(refs)
    ins, outs, recs, scr = (parts.inputs, parts.outputs, parts.records,
                            parts.scratch)

    @when(ids[d] == gm.grid[d] - 1)
    def _():
      for r, state in zip(recs, list(outs) + list(scr)):
        r[...] = state[...].reshape(r.shape)
    eval_ref_jaxpr(spec.jaxpr, *ids, *ins, *outs, *scr)

  out_shapes = ([sds(bm.array_aval) for bm in gm.out_mappings]
                + [per_point_sds(a.shape, a.dtype, grid_p) for a in shapes])
  out_specs = ([block_spec_of(bm, n) for bm in gm.out_mappings]
               + [per_point_spec(a.shape, n, drop_d, n_lead=n - 1)
                  for a in shapes])
  rec = derived_spec(spec, body, [sds(bm.array_aval) for bm in gm.in_mappings],
                     out_shapes, grid=gm.grid,
                     in_specs=[block_spec_of(bm, n) for bm in gm.in_mappings],
                     out_specs=out_specs, scratch=list(gm.scratch_avals),
                     suffix="record")
  return list(pallas_call_p.bind(*primals, spec=rec))[n_out:]


def _state_shapes(gm):
  return ([bm.ref_aval.inner_aval for bm in gm.out_mappings]
          + [a.inner_aval for a in gm.scratch_avals])


# ----------------------------------------------------------- the kernels

def _with_dim(ids, d, value):
  return list(ids[:d]) + [value] + list(ids[d:])


def _finalize(spec, red, in_nz, primals, ct_outs, recs):
  """Runs the transposed last step over the other grid dims: the carried
  states' `c` (per point) and the direct inputs' cotangents."""
  gm = spec.grid_mapping
  d, n_out = red.dim, gm.num_outputs
  grid_p = tuple(s for e, s in enumerate(gm.grid) if e != d)
  n_p = len(grid_p)
  full = lambda p: _with_dim(p, d, gm.grid[d] - 1)
  shapes = _state_shapes(gm)
  keep = [c and i is None for c, i in zip(red.carried, red.identity)]
  direct = [k for k in red.direct if in_nz[k]]
  mask = [k in direct for k in range(gm.num_inputs)]
  F = point_function(spec, transposable=True)

  def body(*refs):
    ids = full([program_id(e) for e in range(n_p)])
    in_refs, ct_refs, rec_refs, c_refs, dir_refs = KernelLayout.of(
        inputs=gm.num_inputs, cotangents=n_out, records=len(recs),
        carried=sum(keep), direct=len(direct)).split(refs)
    ins = [zero_past_array(r[...], bm, ids, [])
           for r, bm in zip(in_refs, gm.in_mappings)]
    entry = _entry_states(gm, rec_refs)
    cts = [zero_past_array(r[...], bm, ids, [])
           for r, bm in zip(ct_refs, gm.out_mappings)]
    tp = transposed_point(F, ids, [], ins, entry[:n_out], entry[n_out:], mask)
    zeros = _zero_states(gm)
    ct_tin, ct_tout, ct_tscr = tp((cts, zeros[n_out:]))
    found = iter(c_refs)
    for c, k in zip(list(ct_tout) + list(ct_tscr), keep):
      if k:
        r = next(found)
        r[...] = c.reshape(r.shape).astype(r.dtype)
    for r, c in zip(dir_refs, ct_tin):
      r[...] = c.reshape(r.shape).astype(r.dtype)

  spec_of = lambda bm: block_spec_of(bm, n_p, full)
  args = ([sds(bm.array_aval) for bm in gm.in_mappings]
          + [sds(bm.array_aval) for bm in gm.out_mappings]
          + [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in recs])
  in_specs = ([spec_of(bm) for bm in gm.in_mappings]
              + [spec_of(bm) for bm in gm.out_mappings]
              + [per_point_spec(a.shape, n_p) for a in shapes][:len(recs)])
  c_avals = [a for a, k in zip(shapes, keep) if k]
  dir_maps = [gm.in_mappings[k] for k in direct]
  out_shapes = ([per_point_sds(a.shape, a.dtype, grid_p) for a in c_avals]
                + [per_point_sds(bm.kernel_shape, bm.array_aval.dtype, grid_p)
                   for bm in dir_maps])
  out_specs = ([per_point_spec(a.shape, n_p) for a in c_avals]
               + [per_point_spec(bm.kernel_shape, n_p) for bm in dir_maps])
  fin = derived_spec(spec, body, args, out_shapes, grid=grid_p,
                     in_specs=in_specs, out_specs=out_specs, scratch=[],
                     suffix="finalize",
                     compiler_params=with_semantics(spec, ("parallel",) * n_p))
  fin = fin.replace(jaxpr=simplify_closed(fin.jaxpr))
  outs = list(pallas_call_p.bind(*primals, *ct_outs, *recs, spec=fin))
  cs, dirs = outs[:len(c_avals)], outs[len(c_avals):]
  fgm = fin.grid_mapping
  dir_cts = {k: scatter_contributions(c, fgm.in_mappings[k], grid_p, ())
             for k, c in zip(direct, dirs)}
  return cs, dir_cts


def _groups(red, in_nz, n_in):
  """The inputs each accumulating kernel takes: those with cotangents that
  the sums read, grouped by the grid dims their blocks stay put along."""
  groups: dict[tuple[int, ...], list[int]] = {}
  for k in range(n_in):
    if in_nz[k] and k not in red.direct:
      groups.setdefault(red.const_dims[k], []).append(k)
  return groups


def _accumulating(spec, red, const, ks, primals, feed_args, recs):
  """The kernel summing the cotangents of inputs `ks`, whose blocks stay
  put along grid dims `const`: its grid visits those dims innermost and
  accumulates each block in scratch over them."""
  gm = spec.grid_mapping
  grid, n, n_out = gm.grid, len(gm.grid), gm.num_outputs
  perm = [e for e in range(n) if e not in const] + list(const)
  grid_perm = tuple(grid[e] for e in perm)
  inner = list(range(n - len(const), n))
  to_orig = lambda raw: [raw[perm.index(e)] for e in range(n)]
  shapes = _state_shapes(gm)
  mask = [k in ks for k in range(gm.num_inputs)]
  maps = [gm.in_mappings[k] for k in ks]
  acc_dtypes = [jnp.promote_types(bm.array_aval.dtype, jnp.float32)
                for bm in maps]
  F = point_function(spec, transposable=True)

  def body(*refs):
    raw = [program_id(p) for p in range(n)]
    ids = to_orig(raw)
    in_refs, feed_refs, rec_refs, out_refs, acc_refs = KernelLayout.of(
        inputs=gm.num_inputs, carried=len(feed_args), records=len(recs),
        cotangents=len(ks), accumulators=len(ks) if inner else 0).split(refs)
    ins = [zero_past_array(r[...], bm, ids, [])
           for r, bm in zip(in_refs, gm.in_mappings)]
    fed = _fed(gm, red, [r[...] for r in feed_refs], ids)
    ct_tin = _step(F, gm, mask, ids, ins, fed, _entry_states(gm, rec_refs))
    if not inner:
      for r, c in zip(out_refs, ct_tin):
        r[...] = c.reshape(r.shape).astype(r.dtype)
      return
    retile.accumulate_over(raw, inner, grid_perm, acc_refs, out_refs, ct_tin)

  spec_of = lambda bm: block_spec_of(bm, n, to_orig)
  args = [sds(bm.array_aval) for bm in gm.in_mappings] + [
      jax.ShapeDtypeStruct(x.shape, x.dtype) for x in feed_args + recs]
  in_specs = _accumulating_in_specs(gm, red, to_orig, len(recs))
  scratch = ([jax.ShapeDtypeStruct(bm.kernel_shape, t)
              for bm, t in zip(maps, acc_dtypes)] if inner else [])
  semantics = ["parallel"] * (n - len(const)) + ["arbitrary"] * len(const)
  acc = derived_spec(spec, body, args,
                     [sds(bm.array_aval) for bm in maps], grid=grid_perm,
                     in_specs=in_specs, out_specs=[spec_of(bm) for bm in maps],
                     scratch=[MemorySpace.VMEM(s.shape, s.dtype) for s in scratch],
                     suffix="transpose",
                     compiler_params=with_semantics(spec, semantics))
  acc = acc.replace(jaxpr=simplify_closed(acc.jaxpr))
  outs = pallas_call_p.bind(*primals, *feed_args, *recs, spec=acc)
  return [zero_unvisited(c, bm, grid) for c, bm in zip(outs, maps)]


def _fed(gm, red, feeds, ids):
  """The cotangents of the states a step leaves: the carried states' from
  `feeds` (an output's cotangent block, zeroed past its array at grid
  point `ids` unless None; or `c` per reduction), zeros for the others."""
  feeds, out = iter(feeds), []
  for a, c, j in zip(_state_shapes(gm), red.carried, red.identity):
    if not c:
      out.append(np.zeros(a.shape, a.dtype))
    elif j is not None:
      x = next(feeds)
      if ids is not None:
        x = zero_past_array(x, gm.out_mappings[j], ids, [])
      out.append(x.astype(a.dtype))
    else:
      out.append(next(feeds).reshape(a.shape))
  return out


def _step(F, gm, mask, ids, ins, fed, entry):
  """The cotangents of the inputs in `mask` that one step gives, from
  the cotangents `fed` of the states it leaves."""
  n_out = gm.num_outputs
  tp = transposed_point(F, ids, [], ins, entry[:n_out], entry[n_out:], mask)
  return tp((fed[:n_out], fed[n_out:]))[0]


def _step_jaxpr(spec, red, k, feed_args):
  """One step's cotangent of input `k`, as a closed jaxpr of the grid ids,
  the input blocks and the carried states' cotangents (blocks as the
  forward has them; nothing zeroed past the arrays)."""
  gm = spec.grid_mapping
  n, n_in = len(gm.grid), gm.num_inputs
  F = point_function(spec, transposable=True)
  mask = [j == k for j in range(n_in)]

  def step(*args):
    ids, ins, feeds = KernelLayout.of(ids=n, inputs=n_in,
                                      carried=len(feed_args)).split(args)
    fed = _fed(gm, red, feeds, None)
    return _step(F, gm, mask, list(ids), list(ins), fed, _zero_states(gm))[0]
  feeds = [gm.out_mappings[j].ref_aval.inner_aval if j is not None else a
           for a, c, j in zip(_state_shapes(gm), red.carried, red.identity)
           if c]
  avals = ([jax.ShapeDtypeStruct((), jnp.int32)] * n
           + [sds(bm.ref_aval.inner_aval) for bm in gm.in_mappings]
           + [sds(a) for a in feeds])
  return simplify_closed(jax.make_jaxpr(step)(*avals))


def _retiled(spec, red, k, primals, feed_args):
  """Input `k`'s cotangent from a kernel with tiles of its own (`retile`),
  or None where its steps are no contraction of whole blocks."""
  if red.recorded:
    return None
  gm = spec.grid_mapping
  step = _step_jaxpr(spec, red, k, feed_args)
  feeds = [gm.out_mappings[j] if j is not None else None
           for c, j in zip(red.carried, red.identity) if c]
  tiling = retile.plan(spec, red.dim, step, list(gm.in_mappings) + feeds,
                       gm.in_mappings[k])
  if tiling is None:
    return None
  arrays = list(primals) + list(feed_args)
  return retile.retiled(spec, tiling, step, gm.in_mappings[k],
                        [arrays[p] for p, _ in tiling.operands])


def _accumulating_in_specs(gm, red, to_orig, n_recs):
  """The accumulating kernel's input specs: the kernel's inputs, the
  carried states' cotangents (an output's, or `c` per reduction) and the
  recorded states (per reduction), for the grid whose ids `to_orig` maps
  back."""
  n, d = len(gm.grid), red.dim
  spec_of = lambda bm: block_spec_of(bm, n, to_orig)
  drop_d = lambda raw: [i for e, i in enumerate(to_orig(raw)) if e != d]
  per_reduction = lambda a: per_point_spec(a.shape, n, drop_d, n_lead=n - 1)
  shapes = _state_shapes(gm)
  feeds = [spec_of(gm.out_mappings[j]) if j is not None else per_reduction(a)
           for a, c, j in zip(shapes, red.carried, red.identity) if c]
  return ([spec_of(bm) for bm in gm.in_mappings] + feeds
          + [per_reduction(a) for a in shapes][:n_recs])


def transpose(spec: KernelSpec, red: Reduction, in_nz, primals, ct_outs):
  """The cotangents of the inputs flagged in `in_nz` (in order), given the
  outputs' (one per output: all are float here)."""
  gm = spec.grid_mapping
  fin_needed = (any(c and j is None for c, j in zip(red.carried,
                                                      red.identity))
                or any(in_nz[k] for k in red.direct))
  recs = _record_at_last(spec, red, primals) if red.recorded else []
  cs, got = (_finalize(spec, red, in_nz, primals, ct_outs, recs)
             if fin_needed else ([], {}))
  cs = iter(cs)
  feed_args = [ct_outs[j] if j is not None else next(cs)
               for c, j in zip(red.carried, red.identity) if c]
  for const, ks in _groups(red, in_nz, gm.num_inputs).items():
    for k in ks:
      got[k] = _retiled(spec, red, k, primals, feed_args)
    ks = [k for k in ks if got[k] is None]
    if ks:
      got.update(zip(ks, _accumulating(spec, red, const, ks, primals,
                                       feed_args, recs)))
  return [got[k] for k in range(gm.num_inputs) if in_nz[k]]
