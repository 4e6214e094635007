"""The execution plan of a grid, which every backend honours.

From the index maps, evaluated on every grid point at trace time, it decides
which grid dimensions are *parallel* (every output block belongs to exactly one
point of those dimensions, so they run as one vectorized computation) and which
are *sequential* (they revisit output blocks, so they run as a loop, in grid
order). It also decides, per operand, how blocks are fetched: as a `view`
(a reshape of the array whose block axes follow grid axes one to one, or,
for an input's `Element` dims whose offsets step with one grid axis, its
windows cut from shifted slices; no gather) or by `gather` (a dynamic
slice per grid point). A grid with a dynamic dim (a traced size) has no
static answer: its dims are sequential and its operands gathered.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings

import numpy as np
from dsl.core.jax_internals import ClosedJaxpr, core, state_types

from dsl.core.blockspec import BlockMapping, Element
from dsl.core.dynamic_grid import is_dynamic
from dsl.core.errors import KernelError, KernelWarning, source_info_frame
from dsl.core.index_maps import blocks_per_dim, varies_along
from dsl.core.operand_layout import eqn_ref_operands


@dataclasses.dataclass(frozen=True)
class OperandPlan:
  mapping: BlockMapping
  mode: str                      # "view" or "gather"
  sources: tuple = ()            # view: per array dim ("grid", d) | ("const", c)
  par_dims: tuple[int, ...] = ()  # view: parallel grid dims it is batched over
  # gather: block indices not known at trace time (read from data, or too
  # many grid points to analyse), so not checked there: every access is
  # kept inside the buffer at run time.
  from_data: bool = False
  # view of an input with `Element` dims: per array dim None, or (start,
  # step) when its (overlapping) windows are the slices
  # padded[start + step * g : start + step * g + block] of the padded
  # array, g the grid coordinate of its source (step 0: one window).
  windows: tuple = ()


@dataclasses.dataclass(frozen=True)
class Plan:
  grid: tuple[int, ...]
  parallel: tuple[int, ...]
  sequential: tuple[int, ...]
  operands: tuple[OperandPlan, ...]   # inputs then outputs


def _owned_by_one_point(idx: np.ndarray, parallel: tuple[int, ...]) -> bool:
  """True when each block is touched by a single point of the parallel dims."""
  grid = idx.shape[:-1]
  par_coord = np.zeros(grid, np.int64)
  for d in parallel:
    par_coord = par_coord * grid[d] + np.indices(grid)[d]
  rows = idx.reshape(-1, idx.shape[-1])
  pairs = np.concatenate([par_coord.reshape(-1, 1), rows], axis=1)
  n_blocks = len(np.unique(rows, axis=0)) if rows.shape[1] else 1
  n_pairs = len(np.unique(pairs, axis=0))
  return n_blocks == n_pairs


def _subsets_largest_first(dims: tuple[int, ...]):
  for size in range(len(dims), 0, -1):
    yield from itertools.combinations(dims, size)


# An `Element` dim whose windows overlap is built from at most this many
# shifted slices (a block of b elements every s: ceil(b / s) slices).
MAX_WINDOW_SLICES = 8


def _element_window(bm: BlockMapping, j: int, col, coords, used):
  """(source, (start, step)) for `Element` dim `j` of an input whose
  element offsets `col` are `start + step * coords[d]` for one grid dim `d`
  not in `used` (step 0: the same window at every point), so its windows
  are slices of the padded array at a fixed stride; None otherwise."""
  dim = bm.block_shape[j]
  flat = col.reshape(-1)
  end = bm.array_aval.shape[j] + sum(dim.padding)
  if flat.size == 0 or flat.min() < 0 or flat.max() >= end:
    return None       # outside the padded array: the gather says so
  start = int(flat[0])
  if np.all(flat == start):
    return ("const", 0), (start, 0)
  for d in range(coords.shape[0]):
    if d in used or col.shape[d] < 2:
      continue
    step = int(np.take(col, 1, axis=d).reshape(-1)[0]) - start
    if (step > 0 and -(-dim.block_size // step) <= MAX_WINDOW_SLICES
        and np.array_equal(col, start + step * coords[d])):
      return ("grid", d), (start, step)
  return None


def _view_sources(bm: BlockMapping, idx, grid, is_input: bool):
  """(sources, windows) of an operand whose blocks are a view, or None.

  Per array dim, `sources` says what picks its block (("grid", d) or
  ("const", index)) and `windows` is None, or (start, step) for an
  `Element` dim of an input whose windows are built from slices."""
  if idx is None or 0 in bm.block_sizes:
    return None
  if bm.has_element_dims and not is_input:
    return None
  coords = np.indices(grid) if grid else np.zeros((0,))
  sources, windows, used = [], [], set()
  for j, nb in enumerate(blocks_per_dim(bm)):
    col = idx[..., j]
    if isinstance(bm.block_shape[j], Element):
      found = _element_window(bm, j, col, coords, used)
      if found is None:
        return None
      sources.append(found[0])
      windows.append(found[1])
      if found[0][0] == "grid":
        used.add(found[0][1])
      continue
    windows.append(None)
    if col.size and col.min() < 0 or col.size and col.max() >= nb:
      return None
    flat = col.reshape(-1)
    if flat.size == 0 or np.all(flat == flat[0]):
      sources.append(("const", int(flat[0]) if flat.size else 0))
      continue
    match = [d for d in range(len(grid)) if d not in used
             and np.array_equal(col, coords[d])]
    if not match:
      return None
    used.add(match[0])
    sources.append(("grid", match[0]))
  return tuple(sources), tuple(windows)


_SEMANTICS = ("parallel", "arbitrary", "core_parallel")


def declared_semantics(compiler_params, grid_rank: int,
                       num_hidden_axes: int = 0) -> tuple[str, ...] | None:
  """`dimension_semantics` per grid dim, lower case, or None when not given
  (`check_semantics` has checked it at trace time).

  Grid axes added by vmap lead the grid and are parallel.
  """
  sem = getattr(compiler_params, "dimension_semantics", None)
  if sem is None:
    return None
  sem = [str(getattr(s, "value", s)).lower() for s in sem]
  if num_hidden_axes and len(sem) == grid_rank - num_hidden_axes:
    sem = ["parallel"] * num_hidden_axes + sem
  return tuple(sem) if len(sem) == grid_rank else None


def all_arbitrary(compiler_params):
  """`compiler_params` with every declared grid dim "arbitrary" (grid axes
  added by vmap stay parallel): for a derived kernel that carries state
  over its whole grid, which no two cores may split. Unchanged when it
  declares no `dimension_semantics`."""
  sem = getattr(compiler_params, "dimension_semantics", None)
  if sem is None:
    return compiler_params
  return dataclasses.replace(compiler_params,
                             dimension_semantics=("arbitrary",) * len(sem))


def check_semantics(kernel: str, compiler_params, grid_rank: int,
                    where: str) -> None:
  """Raises KernelError when `dimension_semantics` does not fit the grid."""
  sem = getattr(compiler_params, "dimension_semantics", None)
  if sem is None:
    return
  sem = [str(getattr(s, "value", s)).lower() for s in sem]
  if len(sem) != grid_rank:
    raise KernelError(kernel, f"dimension_semantics has {len(sem)} entries "
                      f"but the grid has rank {grid_rank}", where,
                      operand="compiler_params")
  for s in sem:
    if s not in _SEMANTICS:
      raise KernelError(kernel, f"dimension_semantics entry {s!r} must be "
                        "'parallel' or 'arbitrary'", where,
                        operand="compiler_params")


def check_parallel_carries(spec, compiler_params, where: str) -> None:
  """A grid dim declared "parallel" may not carry scratch from one step to
  the next: its steps run at once (vectorized on the CPU, as separate
  programs on a GPU, split over cores on a TPU). When a scratch buffer is
  read at a step before it is written, it is carried along every grid dim,
  or, where the kernel writes it whole first whenever a dim `d` starts over
  (`reset_dim`), along `d` and the dims after it. Where one of those that
  take steps runs in order (revisits output blocks or is declared
  "arbitrary"), the carry is taken to go along it (the cores of a chip run
  their shares of the leading parallel dims in order); where none does, the
  carry is along the "parallel" ones: a KernelError where the kernel
  certainly reads it first, a KernelWarning where it may (a read under
  `pl.when` or in a loop before any write)."""
  gm = spec.grid_mapping
  sem = declared_semantics(compiler_params, len(gm.grid), gm.num_hidden_axes)
  if sem is None:
    return
  found = _parallel_carry(spec, sem)
  if found is None:
    return
  k, eqn, certain, dims = found
  name = spec.ref_labels()[-len(gm.scratch_avals) + k]
  what = (f"grid dim {dims[0]} is" if len(dims) == 1 else
          f"grid dims {', '.join(map(str, dims))} are")
  reads = "reads" if certain else "may read"
  message = (f"{what} declared \"parallel\", but the kernel {reads} "
             f"{name} at each step before writing it, so {name} would carry "
             "a value from one step to the next, and parallel steps run at "
             "once (vectorized on the CPU, as separate programs on a GPU, "
             "split over cores on a TPU) and do not see each other's "
             "writes. Fix: declare the dim that carries it \"arbitrary\" in "
             f"dimension_semantics, or write all of {name} at each step "
             "before reading it")
  line = source_info_frame(eqn.source_info) or where
  if certain:
    raise KernelError(spec.name, message, line, operand="compiler_params")
  warnings.warn(KernelWarning(spec.name, message, line,
                              operand="compiler_params"), stacklevel=3)


def _parallel_carry(spec, sem):
  """(k, eqn, certain, dims) for the first scratch ref `k` that a grid step
  may read before writing it (`eqn`: its first use; `certain`: see
  `first_read_before_write`) and carries along parallel grid dims only:
  `dims`, numbered as the user's grid; or None."""
  gm = spec.grid_mapping
  rank, hidden, n = len(gm.grid), gm.num_hidden_axes, len(gm.scratch_avals)
  if spec.jaxpr is None or not n:
    return None
  forced = tuple(d for d in range(rank) if sem[d] == "arbitrary")
  sequential = None
  invars = spec.jaxpr.jaxpr.invars
  for k, ref in enumerate(invars[len(invars) - n:]):
    found = first_read_before_write(spec.jaxpr, [ref])
    if found is None:
      continue
    reset = reset_dim(spec.jaxpr, ref, rank)
    carrying = [d for d in range(reset or 0, rank) if _steps(gm.grid[d])]
    if sequential is None:
      sequential = _plan_cached(gm, forced).sequential
    dims = [d - hidden for d in carrying if d >= hidden]
    if dims and not set(carrying) & set(sequential):
      return k, found[1], found[2], dims
  return None


def _steps(size) -> bool:
  """Whether a grid dim of `size` may take more than one step."""
  return is_dynamic(size) or size > 1


_PURE_WRITES = ("swap",)


def full_write(eqn, ref, used: set) -> bool:
  """A store of a whole ref whose old value is not used. (A window of the
  ref's own shape placed at run time is not one: its lanes outside the
  ref are dropped.)"""
  if eqn.primitive.name not in _PURE_WRITES or eqn.invars[0] is not ref:
    return False
  ops = eqn_ref_operands(eqn)
  return (tuple(ops.value.aval.shape) == tuple(ref.aval.inner_aval.shape)
          and all(isinstance(i, core.Literal) for i in ops.leaves)
          and not any(o in used for o in eqn.outvars
                      if isinstance(o, core.Var)))


def carried_scratch(jaxpr: ClosedJaxpr | None, num_scratch: int) -> bool:
  """True when a scratch ref may be read at a grid step before it is written.

  Conservative: only a top-level store of the whole ref counts as a write;
  any other use of the ref (a load, an accumulate, a partial store, a use
  inside `pl.when`, a loop, a DMA) before it counts as a read.
  """
  return first_carried_scratch(jaxpr, num_scratch) is not None


_READS = ("get", "addupdate")


def first_carried_scratch(jaxpr: ClosedJaxpr | None, num_scratch: int):
  """(k, eqn, certain) for the first scratch ref `k` that a grid step may
  read before writing it (see `carried_scratch`), the equation that uses it
  first, and whether that use certainly reads it (a load or accumulate at
  the kernel's top level, not under `pl.when` or in a loop); or None."""
  if jaxpr is None or not num_scratch:
    return None
  invars = jaxpr.jaxpr.invars
  found = first_read_before_write(jaxpr, invars[len(invars) - num_scratch:])
  if found is None:
    return None
  ref, eqn, certain = found
  return list(invars).index(ref) - (len(invars) - num_scratch), eqn, certain


def first_read_before_write(jaxpr: ClosedJaxpr, refs):
  """(ref, eqn, certain) for the first of the kernel refs `refs` that a
  grid step may read before writing it whole, or None (see
  `carried_scratch` for what counts as a write)."""
  j = jaxpr.jaxpr
  pending = set(refs)
  used = {v for e in j.eqns for v in e.invars if isinstance(v, core.Var)}
  used |= {v for v in j.outvars if isinstance(v, core.Var)}
  for eqn in j.eqns:
    for ref in [v for v in eqn.invars
                if isinstance(v, core.Var) and v in pending]:
      pending.discard(ref)
      if not full_write(eqn, ref, used):
        certain = (eqn.invars[0] is ref and eqn.primitive.name in _READS
                   and (eqn.primitive.name == "addupdate"
                        or any(o in used for o in eqn.outvars)))
        return ref, eqn, certain
    if not pending:
      return None
  return None


@functools.lru_cache(maxsize=256)
def _plan_cached(gm, forced: tuple[int, ...]) -> Plan:
  return make_plan_uncached(gm, forced)


def make_plan(gm, compiler_params=None,
              jaxpr: ClosedJaxpr | None = None) -> Plan:
  """The plan of a kernel's grid.

  `compiler_params` and the kernel's `jaxpr` tell which dims carry state
  across steps. An `arbitrary` dim always runs in order. A kernel that reads
  scratch before writing it carries state from step to step, in the order a
  TPU runs the grid (row-major, one step after another): where the kernel
  provably starts the scratch afresh whenever one dim `d` starts over (its
  first use is `pl.when(pl.program_id(d) == 0)` writing all of it, the
  accumulator pattern), the dims before `d` may still run in parallel, and
  `d` and the dims after it run in order; otherwise every dim not declared
  `parallel` runs in order, as on a TPU.
  """
  rank = len(gm.grid)
  sem = declared_semantics(compiler_params, rank, gm.num_hidden_axes)
  forced = tuple(d for d in range(rank) if sem and sem[d] == "arbitrary")
  plan = _plan_cached(gm, forced)
  carried = _carried_refs(jaxpr, gm)
  if not carried:
    return plan
  declared_parallel = {d for d in range(rank)
                       if sem and sem[d] in ("parallel", "core_parallel")}
  resets = [reset_dim(jaxpr, ref, rank) for ref in carried]
  first = (gm.num_hidden_axes if None in resets
           else max(min(resets), gm.num_hidden_axes))
  in_order = tuple(d for d in range(first, rank)
                   if d not in declared_parallel)
  return _plan_cached(gm, tuple(sorted(set(forced) | set(in_order))))


def _carried_refs(jaxpr: ClosedJaxpr | None, gm):
  """The scratch refs a grid step may read before writing them whole, and
  the scalar-prefetch refs it writes and may read first (SMEM keeps what a
  step writes there for the next)."""
  if jaxpr is None:
    return []
  invars = jaxpr.jaxpr.invars
  num_scratch = len(gm.scratch_avals)
  n_grid = len(gm.grid)
  written = written_prefetch(jaxpr, n_grid, gm.num_scalar_prefetch)
  refs = ([v for v, w in zip(invars[n_grid:], written) if w]
          + list(invars[len(invars) - num_scratch:] if num_scratch else []))
  return [ref for ref in refs
          if first_read_before_write(jaxpr, [ref]) is not None]


def written_prefetch(jaxpr: ClosedJaxpr, grid_rank: int,
                     num_prefetch: int) -> tuple[bool, ...]:
  """Which scalar-prefetch refs of the kernel `jaxpr` it writes: state it
  carries from grid step to grid step (SMEM persists over the grid), as it
  does in scratch."""
  j = jaxpr.jaxpr
  # An effect names its ref by the position or the variable of the input.
  written = {j.invars[e.input] if isinstance(e.input, int) else e.input
             for e in j.effects if isinstance(
                 e, (state_types.WriteEffect, state_types.AccumEffect))}
  return tuple(j.invars[grid_rank + k] in written
               for k in range(num_prefetch))


def reset_dim(jaxpr: ClosedJaxpr, ref, grid_rank: int) -> int | None:
  """The grid dim `d` at whose start the kernel writes scratch `ref` whole
  before using it otherwise: its first use of `ref` is
  `pl.when(pl.program_id(d) == 0)` whose body writes all of `ref` before
  reading it. None where that cannot be shown."""
  j = jaxpr.jaxpr
  ids = list(j.invars[:grid_rank])
  defs = {v: e for e in j.eqns for v in e.outvars}
  eqn = next((e for e in j.eqns if ref in e.invars), None)
  if eqn is None or eqn.primitive.name != "cond":
    return None
  branches = eqn.params["branches"]
  d = _zero_test_dim(eqn.invars[0], defs, ids)
  if d is None or len(branches) != 2:
    return None
  body = branches[1]
  inner = body.jaxpr.invars[eqn.invars[1:].index(ref)]
  writes = any(full_write(e, inner, set()) for e in body.jaxpr.eqns)
  if not writes or first_read_before_write(body, [inner]) is not None:
    return None
  return d


def _zero_test_dim(index, defs, ids) -> int | None:
  """`d` when the cond index `index` is `program_id(d) == 0` (as
  `pl.when` builds it: the comparison converted to an int32)."""
  def defining(v):
    return defs.get(v) if isinstance(v, core.Var) else None
  eqn = defining(index)
  while eqn is not None and eqn.primitive.name == "convert_element_type":
    eqn = defining(eqn.invars[0])
  if eqn is None or eqn.primitive.name != "eq":
    return None
  a, b = eqn.invars
  for x, y in ((a, b), (b, a)):
    if (isinstance(y, core.Literal) and np.ndim(y.val) == 0
        and int(y.val) == 0 and x in ids):
      return ids.index(x)
  return None


def make_plan_uncached(gm,
                       forced: tuple[int, ...] = ()) -> Plan:
  grid = gm.grid
  idxs = [gm.block_indices(bm) for bm in gm.block_mappings]
  out_idxs = gm.split_blocks(idxs).outputs
  parallel: tuple[int, ...] = ()
  if all(i is not None for i in out_idxs) and not gm.dynamic_dims:
    cand = tuple(d for d in range(len(grid)) if d not in forced
                 and all(varies_along(i, d) for i in out_idxs))
    if not out_idxs:
      cand = tuple(d for d in range(len(grid)) if d not in forced)
    # The largest subset of the candidates whose points own their blocks.
    for subset in _subsets_largest_first(cand):
      if all(_owned_by_one_point(i, subset) for i in out_idxs):
        parallel = subset
        break
  sequential = tuple(d for d in range(len(grid)) if d not in parallel)
  plans = []
  for k, (bm, idx) in enumerate(zip(gm.block_mappings, idxs)):
    found = _view_sources(bm, idx, grid, k < gm.num_inputs)
    if found is None:
      plans.append(OperandPlan(bm, "gather", from_data=idx is None))
      continue
    sources, windows = found
    par = tuple(d for d in parallel
                if ("grid", d) in sources)
    plans.append(OperandPlan(bm, "view", sources, par,
                             windows=windows if any(windows) else ()))
  # An output in view mode must be batched over every parallel dim.
  for k, p in enumerate(plans[gm.num_inputs:], gm.num_inputs):
    if p.mode == "view" and len(p.par_dims) != len(parallel):
      plans[k] = OperandPlan(p.mapping, "gather", from_data=idxs[k] is None)
  return Plan(grid, parallel, sequential, tuple(plans))
