"""What a kernel needs from the GPU before any code is emitted: the CUDA
grid, which operands stay in shared memory across sequential steps, the
schedule (schedule.py), the shared-memory budget and the TMA alignment
rules. Every failure here is a BackendError at lowering time naming the
operand."""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from dsl.core.jax_internals import core, state_primitives

from dsl.core.blockspec import BlockMapping, Element, squeezed
from dsl.core.errors import BackendError
from dsl.core.index_maps import varies_along
from dsl.core.jaxpr_walk import sub_jaxprs
from dsl.core.kernel_layout import KernelLayout
from dsl.core.primitives import run_scoped_p
from lowering_mosaic.gpu import accumulators as A
from lowering_mosaic.gpu import schedule as S, turns as T
from lowering_mosaic.gpu.initial_values import hoist_initialization
from lowering_mosaic.gpu.host import TRITON_HINT
from lowering_mosaic.gpu.rules import shapes as shape_rules

WARPGROUP = S.WARPGROUP
SMEM_LIMIT = 227 * 1024         # bytes of shared memory per CTA (sm_90)
MBARRIER_BYTES = 8
PIPELINE_DEPTH = 2              # slots of the one-warpgroup double buffer
TMA_MAX_RANK = 5
TMA_MAX_BOX = 256               # elements per dim of one TMA copy
SMEM_ALIGN = 1024               # buffer alignment (128-byte swizzle atoms)
SWIZZLE = 128                   # bytes: the swizzle of tiled (wide) blocks
REDUCTION_SCRATCH = 4096        # bytes for reductions across warps


@dataclasses.dataclass(frozen=True)
class Block:
  """One input or output block: where it lives and when it moves."""
  mapping: BlockMapping
  is_output: bool
  kernel_shape: tuple[int, ...]     # the shared-memory buffer's shape
  slice_lengths: tuple[int, ...]    # TMA box per array dim (-1 = squeezed)
  moves: bool                       # its block changes along sequential dims
  slots: int = 1                    # ring slots in shared memory
  in_gmem: bool = False             # the kernel reads/writes it in place
  grid_dims: frozenset = frozenset()  # grid dims its index map reads
  replicas: int = 1                 # one buffer per consumer warpgroup
  # (rows, cols) tiles of a block wider than one TMA box: its buffer is
  # tiled and 128-byte swizzled, and one tiled TMA copy moves it.
  tiling: tuple[int, int] | None = None
  # grid dims whose next point's block is the next along array_split_dim
  neighbour_dims: frozenset = frozenset()
  stacked: bool = False             # one TMA copy moves all its replicas

  @property
  def split_dim(self) -> int:
    """The buffer dim a block longer than a TMA box is cut along: its first
    dim that is not 1 (the runs along it are contiguous in the buffer)."""
    return next((i for i, n in enumerate(self.kernel_shape) if n != 1), 0)

  def copies(self) -> list[tuple[int, int]]:
    """(start, length) along `split_dim` of each TMA copy: a block longer
    than a TMA box there moves in several copies, each a contiguous run of
    the buffer."""
    if not self.kernel_shape:
      return [(0, 1)]
    n = self.kernel_shape[self.split_dim]
    if self.tiling or n <= TMA_MAX_BOX:
      return [(0, n)]
    return [(a, min(TMA_MAX_BOX, n - a)) for a in range(0, n, TMA_MAX_BOX)]

  @property
  def array_split_dim(self) -> int:
    """The array dim of `split_dim`."""
    kept = [i for i, n in enumerate(self.slice_lengths) if n != -1]
    return kept[self.split_dim]

  @property
  def transfers(self) -> int:
    """TMA copies that move the block (all its replicas)."""
    return 1 if self.stacked else len(self.copies()) * self.replicas

  @property
  def stacked_shape(self) -> tuple[int, ...]:
    """The array as a stacked block's copy reads it: `array_split_dim`
    cut into (blocks, block length)."""
    shape, a = list(self.mapping.array_aval.shape), self.array_split_dim
    n = self.slice_lengths[a]
    return tuple(shape[:a] + [shape[a] // n, n] + shape[a + 1:])

  def can_stack(self, d: int, replicas: int) -> bool:
    """Whether the replicas along grid dim `d` can move in one copy (of
    `stacked_shape`): they are neighbours, stack outermost (as in the
    buffer), and the array splits into whole blocks there."""
    a = self.array_split_dim
    lengths = self.slice_lengths
    return (replicas > 1 and d in self.neighbour_dims
            and not self.tiling and len(self.copies()) == 1
            and all(n == -1 for n in lengths[:a])
            and self.mapping.array_aval.shape[a] % lengths[a] == 0
            # the stacked view's rank, plus the two a tiled box splits into
            and len(lengths) + 3 <= TMA_MAX_RANK and replicas <= TMA_MAX_BOX)

  @property
  def nbytes(self) -> int:
    """Bytes of one block (what one TMA copy moves)."""
    return math.prod(self.kernel_shape) * self.mapping.array_aval.dtype.itemsize

  @property
  def buffer_shape(self) -> tuple[int, ...]:
    return (((self.slots,) if self.slots > 1 else ())
            + ((self.replicas,) if self.replicas > 1 else ())
            + self.kernel_shape)

  @property
  def dtype(self):
    return self.mapping.array_aval.dtype


@dataclasses.dataclass(frozen=True)
class GpuPlan:
  grid: tuple[int, ...]
  parallel: tuple[int, ...]         # grid dims flattened into the CUDA grid
  sequential: tuple[int, ...]       # grid dims looped over inside one CTA
  blocks: tuple[Block, ...]         # inputs then outputs
  scratch: tuple[tuple[tuple[int, ...], np.dtype], ...]
  smem_bytes: int
  prefetch: tuple = ()              # avals of the scalar-prefetch operands
  # run_scoped buffers: (id of the equation, ((shape, dtype), ...)) each
  scoped: tuple = ()
  schedule: S.Schedule = S.single(1, 1)
  reduction_bytes: int = 0          # scratch of reductions across warps
  body: A.Body | None = None        # the jaxpr each step runs (carries)

  @property
  def cuda_grid(self) -> int:
    return S.cta_count(self.grid, self.parallel, self.schedule.split_dim,
                       self.schedule.consumers)

  @property
  def steps(self) -> int:
    return math.prod(self.grid[d] for d in self.sequential)

  def summary(self) -> str:
    return (f"grid {self.grid}: parallel dims {self.parallel} -> CUDA grid "
            f"{self.cuda_grid}, sequential dims {self.sequential} -> "
            f"{self.steps} steps per CTA, {self.smem_bytes} bytes of shared "
            "memory")

  @property
  def ref_layout(self) -> KernelLayout:
    """Where the kernel's refs sit: groups `prefetch`, `blocks` (inputs
    then outputs), `scratch`."""
    return KernelLayout.of(prefetch=len(self.prefetch),
                           blocks=len(self.blocks), scratch=len(self.scratch))

  @property
  def carried(self) -> tuple[int, ...]:
    """Positions, among the kernel's refs (prefetch, blocks, scratch), of
    the refs the loop carries in registers."""
    return self.body.carried if self.body else ()

  def smem_scratch(self) -> list[int]:
    """Indices of the scratch buffers in shared memory (not carried)."""
    return smem_scratch(self.scratch, self.carried,
                        self.ref_layout.start("scratch"))

  def smem_buffers(self) -> list[tuple[tuple[int, ...], np.dtype]]:
    scratch = [self.scratch[i] for i in self.smem_scratch()]
    return smem_buffers(self.blocks, scratch, self.scoped,
                        self.schedule.consumers, self.reduction_bytes)


def smem_scratch(scratch, carried, first: int) -> list[int]:
  """Indices of the scratch buffers that are not carried in registers
  (`first`: the position of the first scratch ref among the kernel's)."""
  return [i for i in range(len(scratch)) if first + i not in carried]


def smem_buffers(blocks, scratch, scoped, consumers, reduction_bytes):
  """(shape, dtype) of every shared-memory buffer, in the order of the
  CTA's shared-memory tree: blocks, scratch in shared memory, run_scoped
  buffers (one copy per consumer warpgroup), the reduction scratch."""
  rep = (consumers,) if consumers > 1 else ()
  out = [(b.buffer_shape, np.dtype(b.dtype)) for b in blocks if not b.in_gmem]
  out += [(rep + tuple(s), d) for s, d in scratch]
  out += [(rep + tuple(s), d) for _, bufs in scoped for s, d in bufs]
  if reduction_bytes:
    out.append(((reduction_bytes,), np.dtype(np.uint8)))
  return out


def barrier_bytes(schedule: S.Schedule) -> int:
  if schedule.warp_specialized:      # full, empty per slot; fixed; turns
    return (2 * schedule.depth + 1 + schedule.turns) * MBARRIER_BYTES
  return 3 * MBARRIER_BYTES          # two slots, fixed blocks


def smem_total(buffers, schedule) -> int:
  sizes = [math.prod(s) * np.dtype(d).itemsize for s, d in buffers]
  return S.total(sizes, SMEM_ALIGN) + barrier_bytes(schedule)


def _err(spec, message, operand=None):
  return BackendError(spec.name, message + TRITON_HINT, spec.where,
                      operand=operand)


def tiling_of(kernel_shape, dtype) -> tuple[int, int] | None:
  """The SMEM tiling of a 2-D block (of more than one row) wider than a TMA
  box (None: none needed): (8, one 128-byte swizzle span) tiles."""
  if (len(kernel_shape) != 2 or kernel_shape[0] == 1
      or kernel_shape[-1] <= TMA_MAX_BOX):
    return None
  return (8, SWIZZLE // np.dtype(dtype).itemsize)


def _check_tma(spec, bm: BlockMapping, lengths):
  aval = bm.array_aval
  itemsize = aval.dtype.itemsize
  if len(aval.shape) > TMA_MAX_RANK:
    raise _err(spec, f"TMA copies arrays of rank at most {TMA_MAX_RANK}, "
               f"this one has rank {len(aval.shape)}", bm.origin)
  if not aval.shape:
    raise _err(spec, "0-d operands cannot be copied by TMA", bm.origin)
  stride = itemsize
  for n in reversed(aval.shape[1:]):
    stride *= n
    if stride % 16:
      raise _err(spec, f"TMA needs every array stride but the last to be a "
                 f"multiple of 16 bytes; array {aval.str_short()} has a "
                 f"stride of {stride} bytes (unaligned TMA box)", bm.origin)
  kept = [n for n in lengths if n != -1]
  tiling = tiling_of(tuple(kept), aval.dtype)
  if tiling is not None:
    if kept[0] % tiling[0] or kept[1] % tiling[1] or \
        kept[0] // tiling[0] > TMA_MAX_BOX:
      raise _err(spec, f"a block wider than {TMA_MAX_BOX} elements moves as "
                 f"{tiling} tiles (128-byte swizzle), so its shape "
                 f"{tuple(kept)} must be a multiple of {tiling} with at most "
                 f"{TMA_MAX_BOX * tiling[0]} rows", bm.origin)
  elif any(n > TMA_MAX_BOX for i, n in enumerate(kept)
           if i != next((j for j, m in enumerate(kept) if m != 1), 0)):
    raise _err(spec, f"a TMA copy spans at most {TMA_MAX_BOX} elements per "
               f"dimension; only the first dim (past unit ones) of a block "
               f"is split into several copies and only 2-D blocks are "
               f"tiled; the block "
               f"{tuple(bm.block_sizes)} is too long elsewhere (make that dim "
               f"at most {TMA_MAX_BOX} and cover the rest with the grid)",
               bm.origin)
  last = lengths[-1]
  if last == -1 or (last * itemsize) % 16:
    width = itemsize if last == -1 else last * itemsize
    raise _err(spec, f"the block's last dimension spans {width} bytes; TMA "
               "boxes must span a multiple of 16 bytes along the last "
               "dimension (unaligned TMA box)", bm.origin)


def _scratch_of(spec, aval, what):
  inner = getattr(aval, "inner_aval", aval)
  try:
    dtype = np.dtype(getattr(inner, "dtype", None))
  except TypeError:
    raise _err(spec, f"scratch of type {inner} (semaphores) is not "
               "supported by the Mosaic GPU lowering", what) from None
  return tuple(inner.shape), dtype


def _read_from_ref(var, producers) -> bool:
  """Whether `var` is read from shared memory: a read of a ref, or a
  transpose (rules/shapes.py re-reads a tile through a transposed view,
  staging it in shared memory first if it was computed in registers)."""
  eqn = producers.get(var)
  return eqn is not None and eqn.primitive in (state_primitives.get_p,
                                               lax.transpose_p)


def _staged_transpose(eqn, producers) -> bool:
  """Whether a transpose stages its operand in shared memory: a 16-bit
  tile computed in registers (a float32 one can only be a dot's result,
  which rules/shapes.py transposes by multiplying the transposed
  operands)."""
  x = eqn.invars[0]
  return (isinstance(x, core.Var) and not _read_from_ref(x, producers)
          and np.dtype(x.aval.dtype).itemsize <= 2)


def dot_staging(eqn, producers):
  """(shape, dtype) of the shared-memory buffers a dot stages operands
  through (wgmma reads its right operand, and a transposed left one, from
  shared memory, in its input type): its right operand's, then its left
  one's, when they are computed in registers or have another type; the
  input type is the one rules/dot.py picks."""
  (lc, _), _ = eqn.params["dimension_numbers"]
  a, b = eqn.invars[:2]          # dot_general, dot_accumulate (+ acc)
  narrow = [np.dtype(v.aval.dtype) for v in (a, b)
            if np.dtype(v.aval.dtype).itemsize <= 2]
  b_in_ref = isinstance(b, core.Var) and _read_from_ref(b, producers)
  dtype = narrow[0] if narrow else (
      np.dtype(np.float32) if b_in_ref else np.dtype(jnp.bfloat16))
  out = []
  for v, read_from_smem in ((b, True), (a, tuple(lc) == (0,))):
    in_ref = isinstance(v, core.Var) and _read_from_ref(v, producers)
    if read_from_smem and not (in_ref and np.dtype(v.aval.dtype) == dtype):
      out.append((tuple(v.aval.shape), dtype))
  return tuple(out)


def scoped_allocations(spec, jaxpr) -> list:
  """(id(eqn), buffers) of every equation of `jaxpr` (nested ones
  included) that needs shared memory of its own: run_scoped buffers, and
  the staging buffers of dot operands computed in registers (see
  `dot_staging`; the right operand's buffer, then the left one's)."""
  out = []
  producers = {v: e for e in jaxpr.eqns for v in e.outvars}
  for eqn in jaxpr.eqns:
    if eqn.primitive is run_scoped_p:
      body, n = eqn.params["jaxpr"], eqn.params["num_consts"]
      out.append((id(eqn), tuple(_scratch_of(spec, v.aval, "run_scoped")
                                 for v in body.invars[n:])))
    elif eqn.primitive in (lax.dot_general_p, A.dot_accumulate_p):
      staged = dot_staging(eqn, producers)
      if staged:
        out.append((id(eqn), staged))
    elif eqn.primitive is lax.transpose_p and _staged_transpose(
        eqn, producers):
      aval = eqn.invars[0].aval
      out.append((id(eqn), ((tuple(aval.shape), np.dtype(aval.dtype)),)))
    for sub in sub_jaxprs(eqn.params):
      out += scoped_allocations(spec, sub)
  return out


def crosses_warps(jaxpr: core.Jaxpr) -> bool:
  """Whether a reduction of the kernel crosses the warps of a warpgroup
  (all but row reductions of 64-row tiles): those use shared scratch."""
  for eqn in jaxpr.eqns:
    if eqn.primitive in shape_rules.REDUCTIONS and shape_rules.crosses_warps(
        eqn.invars[0].aval.shape, eqn.params["axes"]):
      return True
    if any(crosses_warps(j) for j in sub_jaxprs(eqn.params)):
      return True
  return False


def index_map_dims(bm: BlockMapping, grid_rank: int) -> frozenset:
  """The grid dims the index map's results depend on (by data flow)."""
  jaxpr = bm.index_map_jaxpr.jaxpr
  tainted = {v: {i} for i, v in enumerate(jaxpr.invars[:grid_rank])}
  for v in jaxpr.invars[grid_rank:]:
    tainted[v] = set(range(grid_rank))     # scalar prefetch: anything
  for eqn in jaxpr.eqns:
    deps = set()
    for v in eqn.invars:
      if isinstance(v, core.Var):
        deps |= tainted.get(v, set())
    for v in eqn.outvars:
      tainted[v] = deps
  out = set()
  for v in jaxpr.outvars:
    if isinstance(v, core.Var):
      out |= tainted.get(v, set())
  return frozenset(out)


def _tma_can_copy(spec, bm) -> bool:
  lengths = tuple(int(n) for n in bm.block_sizes)
  try:
    _check_tma(spec, bm, lengths)
  except BackendError:
    return False
  return True


def _block(spec, bm, is_output, idx, sequential, grid_rank) -> Block:
  dims = index_map_dims(bm, grid_rank)
  if bm.whole_array and (bm.memory_space is not None
                         or not _tma_can_copy(spec, bm)):
    # pl.ANY / SMEM-space arrays, and whole arrays TMA cannot copy (0-d,
    # unaligned): the kernel's ref is the array in global memory.
    return Block(bm, is_output, tuple(bm.array_aval.shape),
                 tuple(bm.array_aval.shape), False, in_gmem=True,
                 grid_dims=dims)
  if any(isinstance(d, Element) for d in bm.block_shape):
    raise _err(spec, "Element block dims (element offsets) are not "
               "supported by the Mosaic GPU lowering", bm.origin)
  lengths = tuple(-1 if d is squeezed else int(n)
                  for d, n in zip(bm.block_shape, bm.block_sizes))
  _check_tma(spec, bm, lengths)
  if idx is None:
    moves = bool(sequential) and bool(dims & set(sequential))
  else:
    moves = any(varies_along(idx, d) for d in sequential)
  kernel_shape = tuple(bm.kernel_shape)
  block = Block(bm, is_output, kernel_shape, lengths, moves, grid_dims=dims,
                tiling=tiling_of(kernel_shape, bm.array_aval.dtype))
  if idx is None or not kernel_shape:
    return block
  return dataclasses.replace(block, neighbour_dims=frozenset(
      d for d in dims if _neighbours(idx, d, block.array_split_dim)))


def _neighbours(idx: np.ndarray, d: int, a: int) -> bool:
  """Whether, at every grid point, the next one along grid dim `d` has the
  block index `idx` (shape (*grid, rank)) one more along dim `a`, the
  same along the others."""
  step = np.diff(idx, axis=d)
  want = np.zeros(idx.shape[-1], idx.dtype)
  want[a] = 1
  return step.size > 0 and bool((step == want).all())


# ------------------------------------------------------------ the schedule

def _params(spec):
  """The schedule overrides of the kernel's compiler params, checked."""
  cp = spec.compiler_params
  ws = getattr(cp, "warp_specialize", None)
  depth = getattr(cp, "pipeline_depth", None)
  consumers = getattr(cp, "num_consumers", None)
  if depth is not None and not (isinstance(depth, int) and depth >= 1):
    raise _err(spec, f"pipeline_depth must be a positive int, got {depth!r}",
               "compiler_params")
  if consumers is not None and not (
      isinstance(consumers, int) and 1 <= consumers <= S.MAX_CONSUMERS):
    raise _err(spec, f"num_consumers must be an int from 1 to "
               f"{S.MAX_CONSUMERS}, got {consumers!r}", "compiler_params")
  return ws, _ring_depth(spec, depth), consumers


def _ring_depth(spec, depth: int | None) -> int | None:
  """The ring depth the kernel asks for: `pipeline_depth` of its compiler
  params, or the `pipeline_mode=pl.Buffered(n)` of its input BlockSpecs
  (one ring serves every moving input block, so they must agree). An
  output block is written back once per step, through no ring: its
  pipeline_mode has nothing to set (a derived kernel's cotangent output
  keeps its input's)."""
  gm = spec.grid_mapping
  asked = {bm.origin: bm.pipeline_mode.buffer_count
           for bm in gm.in_mappings if bm.pipeline_mode is not None}
  counts = set(asked.values())
  if len(counts) > 1:
    raise _err(spec, "one ring of slots serves every moving input block, "
               "so their pipeline_mode=pl.Buffered(n) must agree; got " +
               ", ".join(f"{o}: {n}" for o, n in asked.items()),
               next(iter(asked)))
  if counts and depth is not None and counts != {depth}:
    raise _err(spec, f"pipeline_mode=pl.Buffered({counts.pop()}) and "
               f"compiler_params pipeline_depth={depth} disagree: give "
               f"one", "compiler_params")
  return depth if depth is not None else (counts.pop() if counts else None)


def _split_dims(plan: GpuPlan, blocks, consumers: int) -> list[int]:
  """Parallel dims `consumers` warpgroups can share, the best first: the
  dim's extent splits evenly and every output block depends on it; ranked
  by the bytes of moving input blocks that do not depend on it (copied
  once for all consumers)."""
  outs = [b for b in blocks if b.is_output and not b.in_gmem]
  piped = [b for b in blocks if b.moves and not b.is_output and not b.in_gmem]
  cands = [d for d in plan.parallel
           if plan.grid[d] % consumers == 0 and plan.grid[d] >= consumers
           and all(d in b.grid_dims for b in outs)]
  shared = lambda d: sum(b.nbytes for b in piped if d not in b.grid_dims)
  return sorted(cands, key=lambda d: (-shared(d), d))


def _laid_out(blocks, depth, consumers, split):
  """`blocks` with their ring slots and per-consumer replicas."""
  out = []
  for b in blocks:
    if b.in_gmem:
      out.append(b)
      continue
    piped = b.moves and not b.is_output
    reps = consumers if split is not None and split in b.grid_dims else 1
    out.append(dataclasses.replace(
        b, slots=depth if piped else 1, replicas=reps,
        stacked=piped and b.can_stack(split, reps)))
  return out


def _fits(plan, blocks, sched) -> bool:
  scratch = [plan.scratch[i] for i in plan.smem_scratch()]
  buffers = smem_buffers(blocks, scratch, plan.scoped, sched.consumers,
                         plan.reduction_bytes)
  return smem_total(buffers, sched) <= SMEM_LIMIT


def _specialized(plan, depth, consumers, steps, auto_consumers):
  """The warp-specialized schedule with the most consumers (from `consumers`
  down, or exactly as many if the params say so) whose ring fits, or None:
  the deepest, at most MAX_DEPTH and at least 2, unless `depth` is given."""
  has_fixed = not all(b.moves or b.is_output or b.in_gmem for b in plan.blocks)
  two_phases = T.phases(plan.body) is not None      # turns.py
  counts = range(consumers, 0, -1) if auto_consumers else (consumers,)
  for c in counts:
    splits = _split_dims(plan, plan.blocks, c) if c > 1 else [None]
    if not splits:
      continue
    split = splits[0]
    depths = [depth] if depth else range(min(S.MAX_DEPTH, steps),
                                         min(2, steps) - 1, -1)
    for d in depths:
      sched = S.specialized(d, c, split, steps, has_fixed,
                            two_phases=two_phases)
      blocks = _laid_out(plan.blocks, d, c, split)
      if _fits(plan, blocks, sched):
        return sched, blocks
  return None


def choose_schedule(spec, plan: GpuPlan):
  """The schedule (schedule.py) and the blocks laid out for it: warp-
  specialized when input blocks move along sequential dims (unless the
  compiler params say otherwise), else one warpgroup."""
  ws, depth, consumers = _params(spec)
  steps = plan.steps
  moving = any(b.moves and not b.is_output and not b.in_gmem
               for b in plan.blocks) and steps > 1
  if ws and not moving:
    raise _err(spec, "warp_specialize=True needs input blocks that move "
               "along a sequential grid dim (a producer warpgroup copies "
               "them); this kernel has none", "compiler_params")
  if plan.reduction_bytes and consumers and consumers > 1:
    raise _err(spec, "a reduction across the warps of a warpgroup (over "
               "a tile's rows, or to a scalar) uses one shared scratch: "
               "num_consumers must be 1", "compiler_params")
  if moving and ws is not False:
    most = consumers or (1 if plan.reduction_bytes else S.DEFAULT_CONSUMERS)
    found = _specialized(plan, depth, most, steps, consumers is None)
    if found is not None:
      return found
    if ws or (depth or 0) > PIPELINE_DEPTH or (consumers or 0) > 1:
      raise _err(spec, f"no warp-specialized schedule of "
                 f"{depth or 'any'} slots and {consumers or 'any'} consumers "
                 f"fits in {SMEM_LIMIT} bytes of shared memory (or, for "
                 "several consumers, has a parallel grid dim that splits "
                 "evenly among them and that every output block depends "
                 "on); use smaller blocks or other params",
                 "compiler_params")
  if consumers and consumers > 1:
    raise _err(spec, "num_consumers applies to warp-specialized kernels; "
               "this one runs on one warpgroup", "compiler_params")
  if not moving:
    return S.single(1, steps), _laid_out(plan.blocks, 1, 1, None)
  if depth is not None and depth > PIPELINE_DEPTH:
    raise _err(spec, f"one warpgroup double-buffers (pipeline_depth at most "
               f"{PIPELINE_DEPTH}); deeper rings need warp_specialize",
               "compiler_params")
  for d in ([depth] if depth else (PIPELINE_DEPTH, 1)):
    sched = S.single(d, steps, "" if d > 1 else "one slot fits")
    blocks = _laid_out(plan.blocks, d, 1, None)
    if _fits(plan, blocks, sched):
      return sched, blocks
  return sched, blocks        # too big: make_gpu_plan says so


# Registers per consumer thread the carried accumulators may take.
CARRY_REGISTERS = A.CARRY_REGISTERS


def make_gpu_plan(spec) -> GpuPlan:
  gm = spec.grid_mapping
  plan = gm.plan(spec.compiler_params, spec.jaxpr)
  grid = tuple(int(g) for g in gm.grid)
  aliased = {gm.aliased_operand(i) for i, _ in spec.input_output_aliases}
  blocks = []
  for k, bm in enumerate(gm.block_mappings):
    b = _block(spec, bm, k >= gm.num_inputs, gm.block_indices(bm),
               plan.sequential, len(grid))
    blocks.append(dataclasses.replace(b, neighbour_dims=frozenset())
                  if ("inputs", k) in aliased else b)  # keeps its shape
  scratch = tuple(_scratch_of(spec, ref, f"scratch_shapes[{i}]")
                  for i, ref in enumerate(gm.scratch_avals))
  prefetch = tuple(getattr(r, "inner_aval", r) for r in gm.prefetch_avals)
  steps = math.prod(grid[d] for d in plan.sequential)
  body = hoist_initialization(
      A.carried_refs_body(spec, blocks, scratch, len(prefetch), steps), grid,
      plan.sequential)
  scoped = tuple(scoped_allocations(spec, body.jaxpr.jaxpr))
  reduction = REDUCTION_SCRATCH if crosses_warps(body.jaxpr.jaxpr) else 0
  if math.prod(grid[d] for d in plan.parallel) >= 2 ** 31:
    raise _err(spec, "the parallel grid has more than 2**31 - 1 points")
  base = GpuPlan(grid, tuple(plan.parallel), tuple(plan.sequential),
                 tuple(blocks), scratch, 0, prefetch, scoped,
                 reduction_bytes=reduction, body=body)
  sched, blocks = choose_schedule(spec, base)
  out = dataclasses.replace(base, blocks=tuple(blocks), schedule=sched)
  smem = smem_total(out.smem_buffers(), sched)
  if smem > SMEM_LIMIT:
    parts = ", ".join(f"{b.mapping.origin} {b.slots * b.replicas} x "
                      f"{b.nbytes}" for b in blocks)
    raise _err(spec, f"the kernel needs {smem} bytes of shared memory "
               f"(blocks: {parts}; plus scratch and barriers), more than the "
               f"{SMEM_LIMIT} bytes a CTA can have; use smaller blocks")
  return dataclasses.replace(out, smem_bytes=smem)
