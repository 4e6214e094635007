"""Runs a KernelSpec with plain JAX ops (the interpret backend).

The kernel jaxpr is discharged (refs become values), then run once per step
of the sequential grid dims, vectorized with `jax.vmap` over the parallel
dims. Blocks come from views (reshapes) of the padded operands, or of the
overlapping windows of an input's `Element` dims cut from shifted slices,
or from per-point dynamic slices; output blocks are written back in place.
A grid dim whose size is traced (dsl.core.dynamic_grid) is sequential: the
loop over the steps has a traced trip count, and the kernel's
`num_programs` of that dim is its size.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from dsl.core.jax_internals import ClosedJaxpr, core

from dsl.core import config
from dsl.core.blockspec import BlockMapping, Element
from dsl.core.dynamic_grid import full_grid, sizes_as_inputs
from dsl.core.grid_plan import OperandPlan, Plan
from dsl.core.index_maps import block_offsets
from dsl.core.poison import fresh_buffer, poison_full, poison_value
from dsl.interpret import element_windows
from dsl.interpret.vectorize import vectorizable
from dsl.transforms.common import written_prefetch
from dsl.transforms.discharge import discharged_kernel


def _consts(j):
  return list(getattr(j, "consts", ()) or ())


def _eval(jaxpr, *args):
  if isinstance(jaxpr, ClosedJaxpr):
    return core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *args)
  return core.eval_jaxpr(jaxpr, _consts(jaxpr), *args)


# ------------------------------------------------------------ operand layout

def _padding(bm: BlockMapping):
  pads = []
  for d, n, b in zip(bm.block_shape, bm.array_aval.shape, bm.block_sizes):
    if isinstance(d, Element):
      lo, hi = d.padding
      pads.append((lo, hi + b))
    else:
      pads.append((0, (-n) % b if b else 0))   # b == 0: an empty array
  return pads


def pad(x, bm: BlockMapping):
  """`x` padded to whole blocks (and by `Element` padding) with poison: the
  part of a block past its array reads poison, as on every host backend."""
  pads = _padding(bm)
  if all(p == (0, 0) for p in pads):
    return x
  return jnp.pad(x, pads, constant_values=poison_value(x.dtype))


def unpad(x, bm: BlockMapping):
  pads = _padding(bm)
  if all(p == (0, 0) for p in pads):
    return x
  return x[tuple(slice(lo, lo + n) for (lo, _), n in
                 zip(pads, bm.array_aval.shape))]


def to_view(x, bm: BlockMapping):
  """(n0*b0, n1*b1, ...) -> (n0, b0, n1, b1, ...): a free reshape."""
  if x.ndim == 0:
    return x
  shape = []
  for n, b in zip(x.shape, bm.block_sizes):
    shape += [n // b, b]
  return x.reshape(shape)


def from_view(v, bm: BlockMapping):
  r = len(bm.block_sizes)
  if r == 0:
    return v
  return v.reshape([v.shape[2 * j] * v.shape[2 * j + 1] for j in range(r)])


def _kernel_perm(op: OperandPlan):
  """Axes of a view (s0, b0, s1, b1, ...) in the order (parallel dims'
  count axes in canonical order, the other count axes, the block axes): a
  step's window is then a slice of the middle axes, its blocks contiguous."""
  r = len(op.sources)
  par_axis = {val: 2 * j for j, (kind, val) in enumerate(op.sources)
              if kind == "grid" and val in op.par_dims}
  first = [par_axis[d] for d in op.par_dims]
  rest = [2 * j for j in range(r) if 2 * j not in first]
  return first, rest, [2 * j + 1 for j in range(r)]


def state_perm(op: OperandPlan, plan: Plan) -> list[int]:
  """The layout an operand is carried in over the grid run, as a
  permutation of its view's axes: the view itself where a step's window is
  a reshape of a slice of it (its axes longer than 1 come in kernel order),
  else the kernel layout (`_kernel_perm`), transposed once before the run
  instead of once per step."""
  first, rest, blocks = _kernel_perm(op)
  extent = {2 * j + 1: b for j, b in enumerate(op.mapping.block_sizes)}
  extent.update({2 * j: plan.grid[val] for j, (kind, val)
                 in enumerate(op.sources) if kind == "grid"})
  moved = [a for a in first + blocks if extent.get(a, 1) != 1]
  if moved == sorted(moved):
    return list(range(2 * len(op.sources)))
  return first + rest + blocks


def to_state(x, op: OperandPlan, plan: Plan):
  """An operand (not padded) in the layout it is carried in
  (`state_perm`): its view, transposed where that layout asks."""
  v = (element_windows.input_view(x, op, plan.grid) if op.windows
       else to_view(pad(x, op.mapping), op.mapping))
  perm = state_perm(op, plan) if op.sources else []
  return v.transpose(perm) if perm != sorted(perm) else v


def from_state(s, op: OperandPlan, plan: Plan):
  """An output's carried state back in the array's layout. The transpose
  out of the kernel layout is a copy of its own: on XLA's CPU, the
  kernel's last computation writing its result transposed runs several
  times slower than the computation and the copy apart."""
  perm = state_perm(op, plan) if op.sources else []
  if perm != sorted(perm):
    s = lax.optimization_barrier(s).transpose(np.argsort(perm))
  return from_view(s, op.mapping)


def _state_window(op: OperandPlan, plan: Plan, seq_coords):
  """Start indices and sizes of the step's window in an operand's state."""
  starts, sizes = [], []
  for j, (kind, val) in enumerate(op.sources):
    if kind == "const":
      starts.append(val)
      sizes.append(1)
    elif val in op.par_dims:
      starts.append(0)
      sizes.append(plan.grid[val])
    else:
      starts.append(seq_coords[val])
      sizes.append(1)
    starts.append(0)
    sizes.append(op.mapping.block_sizes[j])
  perm = state_perm(op, plan)
  starts = [starts[a] for a in perm]
  sizes = [sizes[a] for a in perm]
  return starts, sizes


def read_state_block(state, op: OperandPlan, plan: Plan, seq_coords):
  """The step's blocks of an operand, (parallel points..., kernel_shape)."""
  bm = op.mapping
  if not op.sources:
    return state
  starts, sizes = _state_window(op, plan, seq_coords)
  if list(sizes) == list(state.shape):
    w = state
  else:
    w = lax.dynamic_slice(state, [jnp.asarray(s, jnp.int32) for s in starts],
                          sizes, allow_negative_indices=False)
  return w.reshape(tuple(plan.grid[d] for d in op.par_dims) + bm.kernel_shape)


def write_state_block(state, block, op: OperandPlan, plan: Plan, seq_coords):
  if not op.sources:
    return block.astype(state.dtype)
  starts, sizes = _state_window(op, plan, seq_coords)
  block = block.astype(state.dtype).reshape(sizes)
  if list(sizes) == list(state.shape):   # the step writes the whole operand
    return block
  return lax.dynamic_update_slice(
      state, block, [jnp.asarray(s, jnp.int32) for s in starts],
      allow_negative_indices=False)


def _window_inside(full, bm: BlockMapping, offsets):
  """Whether the block at `offsets` lies inside the padded array `full`."""
  ok = jnp.bool_(True)
  for o, b, n in zip(offsets, bm.block_sizes, full.shape):
    ok = ok & (o >= 0) & (o + b <= n)
  return ok


def _positions(full, bm: BlockMapping, offsets, outside: bool):
  """Per dim, the positions the block covers (those outside `full` moved to
  0, or past the end with `outside`) and which lie inside."""
  pos, valid = [], []
  for o, b, n in zip(offsets, bm.block_sizes, full.shape):
    p = o + jnp.arange(b, dtype=jnp.int32)
    v = (p >= 0) & (p < n)
    pos.append(jnp.where(v, p, n if outside else 0))
    valid.append(v)
  return pos, valid


def _outer_and(valid):
  mask = jnp.bool_(True)
  for d, v in enumerate(valid):
    shape = [1] * len(valid)
    shape[d] = v.shape[0]
    mask = mask & v.reshape(shape)
  return mask


def _read_unchecked_block(full, bm: BlockMapping, offsets):
  """A block whose indices were not checked at trace time: what lies
  outside the padded array reads poison (nothing is read outside it)."""
  poison = poison_value(full.dtype)
  if not bm.has_element_dims:   # a block lies wholly inside or outside
    blk = lax.dynamic_slice(full, offsets, bm.block_sizes)
    return jnp.where(_window_inside(full, bm, offsets), blk, poison)
  pos, valid = _positions(full, bm, offsets, outside=False)
  return jnp.where(_outer_and(valid), full[jnp.ix_(*pos)], poison)


def _write_unchecked_block(full, blk, bm: BlockMapping, offsets):
  """Writes a block whose indices were not checked at trace time; what
  lies outside the padded array is dropped."""
  if not bm.has_element_dims:
    cur = lax.dynamic_slice(full, offsets, bm.block_sizes)
    new = jnp.where(_window_inside(full, bm, offsets), blk, cur)
    return lax.dynamic_update_slice(full, new, offsets)
  pos, _ = _positions(full, bm, offsets, outside=True)
  return full.at[jnp.ix_(*pos)].set(blk, mode="drop")


def read_gather_block(full, bm: BlockMapping, offsets, unchecked=False):
  if full.ndim == 0:
    return full
  if unchecked:
    blk = _read_unchecked_block(full, bm, offsets)
  else:
    blk = lax.dynamic_slice(full, offsets, bm.block_sizes)
  return blk.reshape(bm.kernel_shape)


def scatter_blocks(full, blocks, offsets, bm: BlockMapping, n_par: int,
                   unchecked: bool = False):
  """Writes per-point blocks (P..., kernel_shape) at offsets (P..., rank).

  `unchecked`: the offsets were not checked at trace time (then the grid
  has no parallel dims: an output's blocks from data are not analysed)."""
  r = full.ndim
  blocks = blocks.astype(full.dtype)
  if r == 0:
    return blocks.reshape(blocks.shape[n_par:]) if n_par == 0 else blocks.reshape(-1)[-1]
  if n_par == 0 and unchecked:
    return _write_unchecked_block(full, blocks.reshape(bm.block_sizes), bm,
                                  list(offsets))
  if n_par == 0:
    return lax.dynamic_update_slice(full, blocks.reshape(bm.block_sizes),
                                    list(offsets))
  n = math.prod(blocks.shape[:n_par])
  upd = blocks.reshape((n,) + bm.block_sizes)
  idx = jnp.stack([o.reshape(n) for o in offsets], axis=1)
  dnums = lax.ScatterDimensionNumbers(
      update_window_dims=tuple(range(1, r + 1)), inserted_window_dims=(),
      scatter_dims_to_operand_dims=tuple(range(r)))
  return lax.scatter(full, idx, upd, dnums, indices_are_sorted=False,
                     unique_indices=False, mode=lax.GatherScatterMode.CLIP)


# ------------------------------------------------------------ the grid run

def _nested_vmap(fn, plan: Plan, arg_dims: list[tuple[int, ...]]):
  """vmaps `fn` over each parallel dim; arg k is batched over arg_dims[k]."""
  for p in reversed(plan.parallel):
    in_axes = tuple(0 if p in dims else None for dims in arg_dims)
    fn = jax.vmap(fn, in_axes=in_axes, out_axes=0)
  return fn


def _initial_states(operands, spec, plan: Plan):
  """The prefetch values and the carried states of inputs, outputs and
  scratch (`operands`: the pallas_call's, by role): views for view
  operands, padded arrays otherwise. The carried scratch ends with the
  scalar-prefetch refs the kernel writes (SMEM keeps what a step writes
  there for the next), one copy per parallel point."""
  gm = spec.grid_mapping
  prefetch = list(operands.prefetch)
  # what input_output_aliases number: scalar prefetch, then inputs
  aliased = operands.prefetch + operands.inputs
  plans = gm.split_blocks(plan.operands)
  in_states = []
  for x, op in zip(operands.inputs, plans.inputs):
    x = jnp.asarray(x)
    in_states.append(to_state(x, op, plan) if op.mode == "view"
                     else pad(x, op.mapping))
  aliases = dict(spec.input_output_aliases)
  out_states = []
  for k, op in enumerate(plans.outputs):
    bm = op.mapping
    src = next((i for i, o in aliases.items() if o == k), None)
    # Output memory the kernel never writes is poison, as on hardware
    # (uninitialized); an aliased output starts from its input.
    init = (jnp.asarray(aliased[src]).astype(bm.array_aval.dtype)
            if src is not None
            else poison_full(bm.array_aval.shape, bm.array_aval.dtype))
    out_states.append(to_state(init, op, plan) if op.mode == "view"
                      else pad(init, bm))
  par_shape = tuple(gm.grid[d] for d in plan.parallel)
  poison = config.poison_buffers()
  scratch = [fresh_buffer(a, poison, par_shape) for a in gm.scratch_avals]
  scratch += [jnp.broadcast_to(jnp.asarray(p), par_shape + jnp.shape(p))
              for p, w in zip(prefetch, written_prefetch(spec)) if w]
  return prefetch, in_states, out_states, scratch


def _point_fn(spec, plan: Plan, sizes):
  """The kernel at one grid point, vmapped over the parallel dims: takes
  (*ids, *prefetch, *inputs, *outputs, *scratch) and returns the new output
  blocks, the new scratch (then the prefetch refs it writes) and the offsets
  of the gathered output blocks. `sizes`: the traced sizes of the grid's
  dynamic dims."""
  gm = spec.grid_mapping
  written = written_prefetch(spec)
  jaxpr, n_lead = spec.jaxpr, len(gm.grid)
  if gm.dynamic_dims:      # their sizes first, then the ids
    jaxpr = sizes_as_inputs(jaxpr, gm.dynamic_dims)
    n_lead += len(gm.dynamic_dims)
  dj = vectorizable(discharged_kernel(jaxpr, n_lead))
  _, _, in_plans, out_plans, _, _ = gm.split_blocks(plan.operands)

  def point(*flat):
    ids, pf, in_args, out_args, sc, _ = gm.split(flat)
    in_blocks = [a if op.mode == "view" else
                 read_gather_block(a, op.mapping,
                                   block_offsets(op.mapping, ids, pf),
                                   op.from_data)
                 for a, op in zip(in_args, in_plans)]
    out_blocks, out_offs = [], []
    for a, op in zip(out_args, out_plans):
      if op.mode == "view":
        out_blocks.append(a)
      else:
        offs = block_offsets(op.mapping, ids, pf)
        out_offs.append(jnp.stack(offs) if offs else jnp.zeros((0,), jnp.int32))
        out_blocks.append(read_gather_block(a, op.mapping, offs,
                                            op.from_data))
    finals = gm.split(_eval(dj, *sizes, *ids, *pf, *in_blocks, *out_blocks,
                            *sc))
    pf_finals = [p for p, w in zip(finals.prefetch, written) if w]
    return list(finals.outputs), list(finals.scratch) + pf_finals, out_offs

  dims = lambda ops: [op.par_dims if op.mode == "view" else () for op in ops]
  arg_dims = ([(d,) if d in plan.parallel else () for d in range(len(gm.grid))]
              + [plan.parallel if w else () for w in written]
              + dims(in_plans)
              + dims(out_plans) + [plan.parallel] * len(gm.scratch_avals))
  return _nested_vmap(point, plan, arg_dims)


def _step_fn(spec, plan: Plan, prefetch, in_states, sizes):
  """One step of the sequential grid dims: (coords, outputs, scratch) ->
  (outputs, scratch) with every parallel point of the step applied."""
  gm = spec.grid_mapping
  _, _, in_plans, out_plans, _, _ = gm.split_blocks(plan.operands)
  vpoint = _point_fn(spec, plan, sizes)
  written = written_prefetch(spec)
  n_scr = len(gm.scratch_avals)

  def step(seq_coords, out_states, scratch):
    states = iter(scratch[n_scr:])
    pf = [next(states) if w else p for p, w in zip(prefetch, written)]
    ids = [jnp.arange(gm.grid[d], dtype=jnp.int32) if d in plan.parallel
           else jnp.asarray(seq_coords[d], jnp.int32)
           for d in range(len(gm.grid))]
    in_args = [read_state_block(s, op, plan, seq_coords) if op.mode == "view"
               else s for s, op in zip(in_states, in_plans)]
    out_args = [read_state_block(s, op, plan, seq_coords) if op.mode == "view"
                else s for s, op in zip(out_states, out_plans)]
    new_outs, new_scratch, offs = vpoint(*ids, *pf, *in_args, *out_args,
                                         *scratch[:n_scr])
    offs = iter(offs)
    updated = []
    for s, blk, op in zip(out_states, new_outs, out_plans):
      if op.mode == "view":
        updated.append(write_state_block(s, blk, op, plan, seq_coords))
      else:
        o = next(offs)
        updated.append(scatter_blocks(s, blk, [o[..., j] for j in
                                               range(o.shape[-1])],
                                      op.mapping, len(plan.parallel),
                                      op.from_data))
    return updated, list(new_scratch)

  return step


def _run_sequential(step, grid, seq, out_states, scratch):
  """Runs `step` once per point of the sequential dims `seq`, in row-major
  order, carrying the output and scratch states. A traced size makes the
  number of steps traced."""
  seq_sizes = [grid[d] for d in seq]
  n_steps = math.prod(seq_sizes)

  def coords_of(s):
    """The coordinates of step `s`: a dim of size 1 is at 0, and the
    first dim that may be longer (often the only one) at what is left of
    `s` once the later ones took theirs."""
    coords, rem = {d: 0 for d in seq}, s
    longer = [(d, size) for d, size in zip(seq, seq_sizes)
              if not isinstance(size, int) or size > 1]   # or traced
    for d, size in reversed(longer[1:]):
      coords[d] = rem % size
      rem = rem // size
    if longer:
      coords[longer[0][0]] = rem
    return coords

  if isinstance(n_steps, int) and n_steps == 1:
    return step({d: 0 for d in seq}, out_states, scratch)

  def body(s, carry):
    outs, sc = carry
    return tuple(step(coords_of(s), list(outs), list(sc)))
  return lax.fori_loop(0, n_steps, body, (out_states, scratch))


def run(*args, spec):
  """Evaluates the pallas_call described by `spec` on `args`."""
  gm = spec.grid_mapping
  plan = gm.plan(spec.compiler_params, spec.jaxpr)
  operands = gm.split_operands(args)
  prefetch, in_states, out_states, scratch = _initial_states(
      operands, spec, plan)
  step = _step_fn(spec, plan, prefetch, in_states, operands.sizes)
  out_states, _ = _run_sequential(step, full_grid(gm.grid, operands.sizes),
                                  plan.sequential, out_states, scratch)
  results = []
  for s, op in zip(out_states, gm.split_blocks(plan.operands).outputs):
    full = from_state(s, op, plan) if op.mode == "view" else s
    results.append(unpad(full, op.mapping))
  return results
