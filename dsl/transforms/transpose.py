"""Reverse mode without a hand-written custom_vjp.

Linearization splits a pallas_call into its primal kernel (run now) and the
linear kernel from `jvp_spec` (run on tangents, with the primal inputs as
residuals). The transpose of that linear kernel is a kernel too: it visits
the grid with its sequential dims reversed and, at each point, applies the
transpose of the point's tangent map (JAX's own `linear_transpose` of the
per-point function). Cotangents of input blocks read by many grid points are
accumulated (`+=`) into their blocks; cotangents of output and scratch state
flow backwards through the revisits.

Where the tangent map at a point depends on the state the point finds in its
output or scratch blocks (not only on its inputs), a recording kernel first
replays the forward pass and saves that entry state for every grid point.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from dsl.core.jax_internals import ad
from dsl.core.kernel_layout import KernelLayout

from dsl.core.errors import KernelError
from dsl.core.grid_plan import all_arbitrary, reset_dim
from dsl.core.pallas_call import KernelSpec, pallas_call_p, sharded_like
from dsl.core.primitives import run_scoped, when
from dsl.core.tracing import program_id
from dsl.core.dtypes import has_tangent
from dsl.transforms.common import (block_spec_of, derived_spec, eval_ref_jaxpr,
                                   point_function, sds,
                                   written_prefetch)
from dsl.transforms.prefetch_reads import restore_reads
from dsl.transforms.simplify import simplify_closed
from dsl.transforms.jvp import (input_tangent_mask, jvp_spec, split_outputs,
                                tangent_pattern, _zero_tangent)
from dsl.transforms.revisits import (every_step_new, first_visit,
                                    per_point_sds,
                                    per_point_spec, revisits_consecutively,
                                    scatter_contributions, zero_unvisited)
from dsl.transforms.staging import in_hbm, is_semaphore, with_vmem_copies
from dsl.transforms.synchronous_dmas import synchronous_dmas
from dsl.transforms import prefetch_state, reduction_transpose, residuals
from dsl.transforms import rescaled_reduction
from dsl.transforms.points import overhangs, zero_past_array


# ----------------------------------------------------------- linearize

def pallas_call_linearize(is_vjp, nonzeros, *primals, spec: KernelSpec):
  gm = spec.grid_mapping
  in_nz = input_tangent_mask(spec, nonzeros)
  out_nz, _ = tangent_pattern(spec, in_nz)
  if not any(in_nz):
    primal_out = pallas_call_p.bind(*primals, spec=spec)
    zeros = [_zero_tangent(bm.array_aval) for bm in gm.out_mappings]
    return primal_out, [False] * len(zeros), [], None, lambda *_: zeros
  # A rescaled reduction's forward kernel also records its final max and
  # sums: the kernel it linearizes takes them as residuals.
  rescaled = rescaled_reduction.linearization(spec, in_nz, primals)
  if rescaled is not None:
    primal_out, base, base_nz, res = rescaled
    lin = jvp_spec(base, base_nz, meta=("linear", base, base_nz, ()))
  else:
    primal_out = pallas_call_p.bind(*primals, spec=spec)
    # Outputs whose blocks are residuals of the tangent map ride along as
    # residuals (operands the linear kernel does not read): its transpose
    # reads them instead of recomputing them.
    so = residuals.saved_outputs(spec)
    saved = so.outputs if so is not None else ()
    lin = jvp_spec(spec, in_nz, meta=("linear", spec, tuple(in_nz), saved),
                   saved=[gm.out_mappings[o] for o in saved])
    res = list(primals) + [primal_out[o] for o in saved]

  def linearized(res, _, *tangents):
    tins = [ad.instantiate_zeros(t) for t, nz in
            zip(gm.split_operands(tangents).inputs, in_nz) if nz]
    outs = pallas_call_p.bind(*res, *tins, spec=lin)
    return split_outputs(spec, outs, out_nz)[1]

  return primal_out, out_nz, res, None, linearized


def _state_refs(gm):
  """The kernel's output and scratch refs (their avals), and which of them
  the recording kernel saves: all but semaphores, whose counts no tangent
  depends on."""
  avals = ([bm.ref_aval for bm in gm.out_mappings] + list(gm.scratch_avals))
  return avals, [not is_semaphore(a) for a in avals]


def _record(rec, states, firsts):
  """Saves each state into its record (zeros at a first visit, `firsts`:
  True, a traced bool, or None for never)."""
  for r, s, first in zip(rec, states, firsts):
    if first is True:
      r[...] = jnp.zeros(s.shape, s.dtype)
    else:
      r[...] = s[...] if first is None else jnp.where(
          first, jnp.zeros(s.shape, s.dtype), s[...])


def _recording_spec(spec: KernelSpec) -> KernelSpec:
  """The forward kernel, also saving every point's entry out/scratch blocks."""
  gm = spec.grid_mapping
  n_grid, n_pf = len(gm.grid), gm.num_scalar_prefetch
  n_in, n_out, n_scr = gm.num_inputs, gm.num_outputs, len(gm.scratch_avals)
  state_refs, kept = _state_refs(gm)
  state_avals = [a.inner_aval for a, k in zip(state_refs, kept) if k]
  written = written_prefetch(spec)
  pf_avals = prefetch_state.prefetch_states(spec)
  # The replay lets each DMA land when it starts, as the differentiated
  # function does: no DMA is in flight when a point's entry state is saved.
  replayed = synchronous_dmas(spec.jaxpr)

  aliased = {o for _, o in spec.input_output_aliases}
  # A TPU never reads an output block in: at the first of a run of visits
  # it holds stale data, which a correct kernel does not read; its entry
  # state is recorded as zeros (aliased outputs keep theirs, as on the
  # host backends).
  fresh = [bm if o not in aliased else None
           for o, bm in enumerate(gm.out_mappings)] + [None] * n_scr
  fresh = [f for f, k in zip(fresh, kept) if k]
  resets = scratch_reset_dims(spec)
  # The recording kernel's refs: the kernel's operands and outputs, the
  # records, the kernel's scratch.
  layout = gm.ref_layout().insert("outputs", records=len(state_avals),
                                  pf_records=len(pf_avals))

  def body(*refs):
    # refs: the kernel's prefetch, inputs and outputs, the records, scratch.
    ids = [program_id(d) for d in range(n_grid)]
    parts = layout.split(refs)
    pf_refs, in_refs, scr = parts.prefetch, parts.inputs, parts.scratch
    prefetch_state.save(parts.pf_records, pf_refs, written)
    ops = gm.split(pf_refs + in_refs + parts.outputs + scr)
    # A scratch the kernel starts afresh at the first step of a dim holds
    # garbage there that it never reads: zeroed first, the grid plan sees
    # the reset, and the dims before it stay parallel.
    fresh_scr = [(r, d) for r, d, a in zip(scr, resets, gm.scratch_avals)
                 if d is not None and not is_semaphore(a)]
    _zero_at_reset(ids, [r for r, _ in fresh_scr], [d for _, d in fresh_scr])
    states = [s for s, k in zip(ops.outputs + ops.scratch, kept) if k]
    firsts = [None if bm is None else first_visit(
        bm, gm.grid, ids, lambda i: i, pf_refs) for bm in fresh]
    with_vmem_copies(states, [True] * len(states), [False] * len(states),
                     lambda *s: _record(parts.records, s, firsts))
    copied = [k for k, bm in enumerate(gm.in_mappings) if overhangs(bm)]
    if not copied:
      eval_ref_jaxpr(replayed, *ids, *pf_refs, *in_refs, *parts.outputs,
                     *scr)
      return

    # The replay sees zeros past the arrays, so the recorded states (an
    # accumulator's rows past the array) hold no garbage that the
    # transposed kernel would multiply by a zero cotangent.
    def replay(*bufs):
      refs_in = list(in_refs)
      for k, buf in zip(copied, bufs):
        buf[...] = zero_past_array(in_refs[k][...], gm.in_mappings[k], ids,
                                    pf_refs)
        refs_in[k] = buf
      eval_ref_jaxpr(replayed, *ids, *pf_refs, *refs_in, *parts.outputs,
                     *scr)
    run_scoped(replay, *[gm.in_mappings[k].ref_aval for k in copied])

  rec_specs = ([_record_block_spec(a, n_grid) for a in state_avals]
               + [prefetch_state.record_spec(a, n_grid) for a in pf_avals])
  args = ([sds(a.inner_aval) for a in gm.prefetch_avals]
          + [sds(bm.array_aval) for bm in gm.in_mappings])
  out_shapes = ([sds(bm.array_aval) for bm in gm.out_mappings]
                + [_record_sds(a, gm.grid) for a in state_avals]
                + [prefetch_state.record_sds(a, gm.grid) for a in pf_avals])
  return derived_spec(
      spec, body, args, out_shapes, grid=gm.grid,
      in_specs=[block_spec_of(bm, n_grid) for bm in gm.in_mappings],
      out_specs=[block_spec_of(bm, n_grid) for bm in gm.out_mappings] + rec_specs,
      scratch=list(gm.scratch_avals), aliases=dict(spec.input_output_aliases),
      suffix="record")


def _record_sds(aval, grid) -> jax.ShapeDtypeStruct:
  """The array recording state `aval` at every grid point."""
  return per_point_sds(aval.shape, aval.dtype, grid)


def _record_block_spec(aval, n_grid, ids_fn=lambda ids: ids):
  return per_point_spec(aval.shape, n_grid, ids_fn)


# ----------------------------------------------------------- transpose

def scratch_reset_dims(spec: KernelSpec) -> list[int | None]:
  """Per scratch buffer, the grid dim at whose first step the kernel
  writes it whole before reading it (the accumulator pattern), or None."""
  gm = spec.grid_mapping
  n_scr = len(gm.scratch_avals)
  if not n_scr:
    return []
  refs = spec.jaxpr.jaxpr.invars[len(spec.jaxpr.jaxpr.invars) - n_scr:]
  sequential = gm.plan(spec.compiler_params, spec.jaxpr).sequential
  # Only a sequential dim after which no dim takes steps: then its first
  # step starts the scratch afresh for the rest of the grid's order.
  fits = lambda d: (d is not None and d in sequential
                    and all(n == 1 for n in gm.grid[d + 1:]))
  return [d if fits(d) else None
          for d in (reset_dim(spec.jaxpr, r, len(gm.grid)) for r in refs)]


def _zero_at_reset(ids, refs, dims):
  """Zeros each of `refs` at the first step of its dim in `dims` (where
  the forward kernel starts that scratch afresh, so no cotangent flows
  past it; written as `pl.when(program_id(d) == 0)`, which the grid plan
  reads as a reset: the dims before it stay parallel), and the rest at
  the first grid point."""
  rest = [r for r, d in zip(refs, dims) if d is None]
  _zero_at_first_point(ids, rest)
  for r, d in zip(refs, dims):
    if d is not None:
      @when(ids[d] == 0)
      def _(r=r):
        r[...] = jnp.zeros(r.shape, r.dtype)


def _zero_at_first_point(ids, refs):
  """Zeros `refs` at the first grid point (e.g. the cotangent of the
  scratch state the kernel leaves is 0; scratch starts as poison with
  jax_pallas_poison_buffers, as on hardware)."""
  if not refs:
    return
  first = jnp.bool_(True)
  for i in ids:
    first = first & (i == 0)

  @when(first)
  def _():
    for r in refs:
      r[...] = jnp.zeros(r.shape, r.dtype)


def _staged(raw_ids, in_refs, ct_in_refs, ct_out_refs, run):
  """`run(ins, ct_ins, ct_outs)` on VMEM copies of the refs in HBM (see
  `staging`); the cotangents are copied back."""
  n_in, n_ct_in, n_ct_out = len(in_refs), len(ct_in_refs), len(ct_out_refs)
  refs = list(in_refs) + list(ct_in_refs) + list(ct_out_refs)
  writes = [False] * n_in + [True] * (n_ct_in + n_ct_out)
  whole = [in_hbm(r.aval) for r in ct_in_refs]

  def on_buffers(*r):
    ins, ct_ins, ct_outs = KernelLayout.of(
        inputs=n_in, ct_inputs=n_ct_in, ct_outputs=n_ct_out).split(r)
    # A cotangent in HBM is the whole array at every point: it starts at 0
    # (the output it is copied from starts uninitialized on a TPU).
    _zero_at_first_point(raw_ids, [c for c, w in zip(ct_ins, whole) if w])
    run(ins, ct_ins, ct_outs)
  with_vmem_copies(refs, [True] * len(refs), writes, on_buffers)


# The most bytes of per-point contributions kept for a cotangent whose
# blocks the forward revisits along a parallel grid dim (a layer norm's
# weight, read by every row block): below it each point writes its own
# block and the dim stays parallel; above it the blocks accumulate in place
# and the dim runs in order.
PER_POINT_BYTES = 64 << 20


def _revisited_along_parallel(gm, bm, sequential) -> bool:
  """Whether some parallel dim of the forward grid (of size > 1) keeps the
  block index of `bm` fixed: accumulating in place would make it run in
  order (on a GPU: one program walking the whole dim)."""
  idx, grid = gm.block_indices(bm), gm.grid
  if idx is None:
    return False
  return any(n > 1 and d not in sequential
             and bool(np.all(idx == np.take(idx, [0], axis=d)))
             for d, n in enumerate(grid))


def _ct_in_kinds(gm, in_nz, sequential) -> list[str]:
  """How each input cotangent is summed over the grid: "staged" (an operand
  in HBM, staged whole through VMEM at every point), "inplace" (blocks
  revisited only over consecutive steps of the transposed grid, and no two
  blocks overlapping: zeroed at the first, accumulated in the block) or
  "per_point" (each point's contribution written to its own block, summed
  outside the kernel; also for blocks revisited along a parallel dim, up to
  PER_POINT_BYTES, so that dim stays parallel)."""
  kinds = []
  for bm, nz in zip(gm.in_mappings, in_nz):
    if not nz:
      continue
    per_point_bytes = (math.prod(gm.grid) * math.prod(bm.kernel_shape)
                       * np.dtype(bm.array_aval.dtype).itemsize)
    if in_hbm(bm.ref_aval):
      kinds.append("staged")
    elif (_revisited_along_parallel(gm, bm, sequential)
          and per_point_bytes <= PER_POINT_BYTES):
      kinds.append("per_point")
    elif not bm.has_element_dims and revisits_consecutively(
        bm, gm.grid, sequential):     # Element windows may overlap
      kinds.append("inplace")
    else:
      kinds.append("per_point")
  return kinds


def _accumulate(r, c, kind, first):
  """Adds the cotangent `c` of a point into the ct_in ref `r` (see
  `_ct_in_kinds`)."""
  c = c.astype(r.dtype)
  if kind == "per_point":
    r[...] = c.reshape(r.shape)
  elif kind == "inplace" and first is True:     # a new block every step
    r[...] = c
  elif kind == "inplace":
    r[...] = jnp.where(first, jnp.zeros(r.shape, r.dtype), r[...]) + c
  else:
    r[...] += c


def _garbage_free_at(first, x, old, bm, ids, pf_refs):
  """`x()`, or where `first` holds `old()` with no garbage past the array
  (`first` True: at every step, and `x` is not read)."""
  if first is None:
    return x()
  fresh = zero_past_array(old(), bm, ids, pf_refs)
  return fresh if first is True else jnp.where(first, fresh, x())


def _entry_state(gm, rec_refs, ids, pf_refs, written):
  """(outputs, scratch, prefetch) that the forward point at `ids` found:
  the recorded states (`rec_refs`; zeros where the tangent map does not
  depend on them, `rec_refs` None), and the scalar-prefetch refs, those the
  kernel writes as the values recorded (the others stay refs, read a
  scalar at a time)."""
  state_refs, kept = _state_refs(gm)
  recs = iter(rec_refs or ())
  entry = [next(recs)[...] if rec_refs is not None and k
           else jnp.zeros(a.inner_aval.shape, a.inner_aval.dtype)
           for a, k in zip(state_refs, kept)]
  pf = [prefetch_state.value_of(next(recs)) if w else r
        for r, w in zip(pf_refs, written)]
  n_out = gm.num_outputs
  if rec_refs is not None:
    # Past the array, an output block holds what the kernel wrote there at
    # earlier visits (a TPU keeps the block in VMEM), and garbage at the
    # forward pass's first visit.
    entry[:n_out] = [_garbage_free_at(
        None if in_hbm(bm.ref_aval) else first_visit(
            bm, gm.grid, ids, lambda i: i, pf_refs), lambda x=x: x,
        lambda x=x: x, bm, ids, pf_refs) for x, bm in zip(entry,
                                                          gm.out_mappings)]
  return entry[:n_out], entry[n_out:], pf


def _transpose_spec(spec: KernelSpec, in_nz, recorded: bool, so=None):
  """The transposed kernel's spec, and `_ct_in_kinds` of its ct_ins; with
  `so` (`residuals.SavedOutputs`), it reads the saved outputs and only the
  inputs `so.reads`."""
  gm = spec.grid_mapping
  grid, n_grid = gm.grid, len(gm.grid)
  n_pf, n_in = gm.num_scalar_prefetch, gm.num_inputs
  sequential = set(gm.plan(spec.compiler_params, spec.jaxpr).sequential)
  F = point_function(spec, transposable=True)

  def rev(ids):
    return [grid[d] - 1 - i if d in sequential else i
            for d, i in enumerate(ids)]

  out_f = [has_tangent(bm.array_aval.dtype) for bm in gm.out_mappings]
  scr_f = [has_tangent(a.inner_aval.dtype) for a in gm.scratch_avals]
  state_refs, kept = _state_refs(gm)
  state_avals = [a.inner_aval for a, k in zip(state_refs, kept) if k]
  written = written_prefetch(spec)
  pf_avals = prefetch_state.prefetch_states(spec)
  n_rec = len(state_avals) + len(pf_avals) if recorded else 0
  n_ct_out, n_ct_in = sum(out_f), sum(in_nz)
  ct_scr_avals = [a for a, f in zip(gm.scratch_avals, scr_f) if f]
  in_maps = list(gm.in_mappings)
  ct_out_maps = [bm for bm, f in zip(gm.out_mappings, out_f) if f]
  ct_in_maps = [bm for bm, nz in zip(in_maps, in_nz) if nz]
  kinds = _ct_in_kinds(gm, in_nz, sequential)
  resets = scratch_reset_dims(spec)
  flows = _ct_out_flows(spec, rev, out_f)
  reads, saved = (so.reads, so.outputs) if so else ((True,) * n_in, ())
  layout = KernelLayout.of(prefetch=n_pf, inputs=sum(reads), saved=len(saved),
                           records=n_rec, ct_outputs_in=n_ct_out,
                           ct_inputs=n_ct_in, ct_outputs=sum(flows),
                           ct_scratch=len(ct_scr_avals))

  def body(*refs):
    raw = [program_id(d) for d in range(n_grid)]
    ids = rev(raw)
    (pf_refs, in_refs, saved_refs, rec_refs, ct_out_in, ct_in_refs,
     ct_out_refs, ct_scr_refs) = layout.split(refs)
    _zero_at_reset(raw, ct_scr_refs, [d for d, f in zip(resets, scr_f) if f])
    out_first, in_first = _first_visits(gm, raw, rev, pf_refs, ct_in_maps,
                                        kinds)
    _staged(raw, in_refs, ct_in_refs, ct_out_refs, lambda *r: point(
        ids, pf_refs, rec_refs, ct_scr_refs, (ct_out_in, out_first, in_first),
        saved_refs, *r))

  def point(ids, pf_refs, rec_refs, ct_scr_refs, firsts, saved_refs, in_refs,
            ct_in_refs, ct_out_refs):
    ct_out_in, out_first, in_first = firsts
    given = iter(in_refs)
    ins = [zero_past_array(next(given)[...], bm, ids, pf_refs) if r else None
           for bm, r in zip(gm.in_mappings, reads)]
    outs_e, scr_e, pf = _entry_state(gm, rec_refs if recorded else None, ids,
                                     pf_refs, written)
    transposed = residuals.point_transpose(
        F, so, gm, (ids, pf, ins, outs_e, scr_e), saved_refs, in_nz)
    ct_out_now = _ct_outs_now(ct_out_refs, ct_out_in, [
        f for f, keep in zip(out_first, out_f) if keep], ct_out_maps, flows,
        ids, pf_refs)
    ct_scr_now = [r[...] for r in ct_scr_refs]
    ct_tin, ct_tout, ct_tscr = transposed((ct_out_now, ct_scr_now))
    for r, c, kind, first in zip(ct_in_refs, ct_tin, kinds, in_first):
      _accumulate(r, c, kind, first)
    for r, c in zip(ct_out_refs, [c for c, f in zip(ct_tout, flows) if f]):
      r[...] = c.astype(r.dtype)
    for r, c in zip(ct_scr_refs, ct_tscr):
      r[...] = c.astype(r.dtype)

  args, out_shapes, kw = _transpose_io(gm, rev, recorded, state_avals,
                                       pf_avals, ct_in_maps, ct_out_maps,
                                       kinds, flows, so)
  new = derived_spec(spec, body, args, out_shapes, **kw,
                     scratch=ct_scr_avals, suffix="transpose")
  if "staged" in kinds:
    # a cotangent staged whole through every point: cores may not split
    # the grid (their read-modify-writes of it would race)
    new = new.replace(compiler_params=all_arbitrary(new.compiler_params))
  return (new.replace(jaxpr=simplify_closed(restore_reads(new.jaxpr))),
          kinds, flows)


def _first_visits(gm, raw, rev, pf_refs, ct_in_maps, kinds):
  """Whether this step starts a run of visits of each output's block, and
  of each input cotangent's accumulated in place."""
  # An output block is not read in on a TPU: at the first of a run of
  # visits, the cotangent flowing in is the aliased input's block.
  out_first = [None if in_hbm(bm.ref_aval) else
               first_visit(bm, gm.grid, raw, rev, pf_refs)
               for bm in gm.out_mappings]
  in_first = [first_visit(bm, gm.grid, raw, rev, pf_refs) if k == "inplace"
              else None for bm, k in zip(ct_in_maps, kinds)]
  return out_first, in_first


def _ct_outs_now(ct_out_refs, ct_out_in, firsts, maps, flows, ids, pf_refs):
  """The output cotangents flowing into a transposed step: at the first of
  a run of visits the aliased input's block, else what the step before
  wrote into the output (`ct_out_refs`, one per output that `flows`)."""
  outs_now = iter(ct_out_refs)
  return [_garbage_free_at(
      first, (lambda r=next(outs_now): r[...]) if flow else None,
      lambda r_in=r_in: r_in[...], bm, ids, pf_refs)
      for r_in, first, bm, flow in zip(ct_out_in, firsts, maps, flows)]


def _ct_out_flows(spec, rev, out_f) -> tuple[bool, ...]:
  """Per float output, whether the transposed kernel writes the cotangent
  of the state it found there: for an output aliased to an input (the
  cotangent of its initial contents), one in HBM, and one whose blocks
  come back (the cotangent flows through the revisits). An output each
  step of which writes a new block has none to pass on: no stores."""
  gm = spec.grid_mapping
  aliased = {o for _, o in spec.input_output_aliases}
  return tuple(o in aliased or in_hbm(bm.ref_aval)
               or not (not gm.grid or every_step_new(bm, gm.grid, rev))
               for o, (bm, f) in enumerate(zip(gm.out_mappings, out_f)) if f)


def _transpose_io(gm, rev, recorded, state_avals, pf_avals, ct_in_maps,
                  ct_out_maps, kinds, flows, so):
  """The transposed kernel's operands, outputs, their specs and aliases:
  (args, out_shapes, and a dict of grid/in_specs/out_specs/aliases)."""
  grid, n_grid = gm.grid, len(gm.grid)
  in_maps = list(gm.in_mappings)
  if so is not None:      # the inputs it reads, then the saved outputs
    in_maps = ([bm for bm, r in zip(in_maps, so.reads) if r]
               + [gm.out_mappings[o] for o in so.outputs])
  if not recorded:
    state_avals, pf_avals = [], []
  n_rec = len(state_avals) + len(pf_avals)
  n_ct_in, n_ct_out = len(ct_in_maps), len(ct_out_maps)
  spec_of = lambda bm: block_spec_of(bm, n_grid, rev)
  per_point = [k == "per_point" for k in kinds]
  args = ([sds(a.inner_aval) for a in gm.prefetch_avals]
          + [sds(bm.array_aval) for bm in in_maps]
          + [_record_sds(a, grid) for a in state_avals]
          + [prefetch_state.record_sds(a, grid) for a in pf_avals]
          + [sds(bm.array_aval) for bm in ct_out_maps])
  in_specs = ([spec_of(bm) for bm in in_maps]
              + [_record_block_spec(a, n_grid, rev) for a in state_avals]
              + [prefetch_state.record_spec(a, n_grid, rev) for a in pf_avals]
              + [spec_of(bm) for bm in ct_out_maps])
  flowing = [bm for bm, f in zip(ct_out_maps, flows) if f]
  out_shapes = ([per_point_sds(bm.kernel_shape, bm.array_aval.dtype, grid)
                 if pp else sds(bm.array_aval)
                 for bm, pp in zip(ct_in_maps, per_point)]
                + [sds(bm.array_aval) for bm in flowing])
  out_specs = ([per_point_spec(bm.kernel_shape, n_grid, rev) if pp
                else spec_of(bm) for bm, pp in zip(ct_in_maps, per_point)]
               + [spec_of(bm) for bm in flowing])
  first_ct_out = gm.num_scalar_prefetch + len(in_maps) + n_rec
  flowing_at = [j for j, f in enumerate(flows) if f]
  aliases = {first_ct_out + j: n_ct_in + k for k, j in enumerate(flowing_at)}
  return args, out_shapes, dict(grid=grid, in_specs=in_specs,
                                out_specs=out_specs, aliases=aliases)


def pallas_call_transpose(cts, *args, spec: KernelSpec):
  if not spec.meta or spec.meta[0] != "linear":
    raise KernelError(spec.name, "cannot transpose this kernel: reverse mode "
                      "applies to the linear kernels that jax.grad/jax.vjp "
                      "derive", spec.where)
  _, base, in_nz, saved = spec.meta
  gm = base.grid_mapping
  _refuse_dynamic_grid(base)
  n_out = gm.num_outputs
  n_primals = gm.call_layout().only("prefetch", "inputs").total + len(saved)
  primals, tangent_args = args[:n_primals], args[n_primals:]
  primals, saved_outs = (primals[:n_primals - len(saved)],
                         primals[n_primals - len(saved):])
  if any(ad.is_undefined_primal(p) for p in args[:n_primals]):
    raise KernelError(base.name, "reverse mode needs the kernel's primal "
                      "inputs as residuals", base.where)
  out_f = [has_tangent(bm.array_aval.dtype) for bm in gm.out_mappings]
  t_cts = iter(cts[n_out:])
  ct_outs = []
  for bm, f in zip(gm.out_mappings, out_f):
    if f:
      ct = next(t_cts)
      ct_outs.append(ad.instantiate_zeros(ct) if type(ct) is ad.Zero else ct)
  ct_outs = [jnp.asarray(c).astype(bm.array_aval.dtype) for c, bm in
             zip(ct_outs, [bm for bm, f in zip(gm.out_mappings, out_f) if f])]
  if rescaled_reduction.is_linear_base(base):
    return rescaled_reduction.transpose(base, in_nz, args, ct_outs)
  recorded = (residuals.needs_entry_state(base)
              or any(written_prefetch(base)))
  red = None if any(written_prefetch(base)) else reduction_transpose.find(
      base, reads_state=recorded)
  if red is not None:
    ct_ins = reduction_transpose.transpose(base, red, in_nz, primals, ct_outs)
    return [None] * n_primals + [sharded_like(c, getattr(t, "aval", None))
                                 for c, t in zip(ct_ins, tangent_args)]
  rec = []
  if recorded:
    rec_outs = pallas_call_p.bind(*primals, spec=_recording_spec(base))
    rec = list(rec_outs[n_out:])
  so = residuals.saved_outputs(base) if saved else None
  tspec, kinds, flows = _transpose_spec(base, in_nz, recorded, so)
  kept = ([p for p, r in zip(primals[gm.num_scalar_prefetch:], so.reads) if r]
          + list(saved_outs) if so is not None else [])
  outs = pallas_call_p.bind(*(kept or primals), *rec, *ct_outs, spec=tspec)
  n_ct_in = sum(in_nz)
  ct_ins, ct_out_final = list(outs[:n_ct_in]), list(outs[n_ct_in:])
  ct_in_maps = [bm for bm, nz in zip(gm.in_mappings, in_nz) if nz]
  ct_ins = [scatter_contributions(c, bm, gm.grid,
                                  primals[:gm.num_scalar_prefetch])
            if kind == "per_point" else zero_unvisited(c, bm, gm.grid)
            for c, bm, kind in zip(ct_ins, ct_in_maps, kinds)]
  # Aliased inputs also receive the cotangent of the output's initial value.
  floats = [o for o, f in enumerate(out_f) if f]
  final_by_out = dict(zip([o for o, f in zip(floats, flows) if f],
                          ct_out_final))
  pos = {k: j for j, k in enumerate(k for k, nz in enumerate(in_nz) if nz)}
  for i, o in base.input_output_aliases:
    k = i - gm.num_scalar_prefetch     # the aliased input's position
    if k in pos and o in final_by_out:
      ct_ins[pos[k]] = ct_ins[pos[k]] + final_by_out[o]
  # A cotangent has its tangent's type (sharding included, under jit over a
  # mesh with Explicit axes, where the kernel's outputs are replicated).
  tangent_cts = [sharded_like(c, getattr(t, "aval", None))
                 for c, t in zip(ct_ins, tangent_args)]
  return [None] * n_primals + tangent_cts


def _refuse_dynamic_grid(base: KernelSpec):
  """The transposed kernel walks the grid backwards and its per-point
  records and cotangents are sized by the grid: a traced size has no
  reverse mode here."""
  gm = base.grid_mapping
  if not gm.dynamic_dims:
    return
  dim = gm.dynamic_dims[0] - gm.num_hidden_axes
  raise KernelError(
      base.name, f"reverse mode (jax.grad, jax.vjp) cannot differentiate a "
      f"kernel whose grid dim {dim} has a traced size: the backward kernel "
      "is sized by the grid. Give the kernel a hand-written backward pass "
      "with jax.custom_vjp (forward mode, jax.jvp, and jax.vmap work as "
      "they are)", base.where, operand="grid")


ad.primitive_linearizations[pallas_call_p] = pallas_call_linearize
ad.primitive_transposes[pallas_call_p] = pallas_call_transpose
