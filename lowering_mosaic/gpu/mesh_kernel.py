"""A `plgpu.kernel` (a kernel over a mesh of CUDA blocks and warpgroups) as
a Mosaic GPU module.

Such a kernel chooses its own schedule: its refs are whole arrays in global
memory, its scratch is `run_scoped` allocations (shared memory, mbarriers,
WGMMA accumulators), and its body issues the TMA copies, waits and WGMMAs
itself. So nothing is planned here beyond the launch:

  - the CUDA grid is the mesh's grid (minor dim first, as CUDA prefers
    column-major block order) times its cluster; a block has 128 threads per
    warpgroup;
  - shared memory is one byte buffer that `run_scoped` allocations slice in
    stack order (each on a 1024-byte boundary), and one mbarrier group per
    `plgpu.Barrier` allocation, sized by `MeshResources` from the kernel
    jaxpr before the module is built (allocations that follow one another
    reuse the bytes; nested ones add up);
  - the program ids (the mesh's axis indices) are computed once, at the top
    of the block: block ids, cluster block ids, the warpgroup index.

The body is lowered with the backend's one rule table (rules/), with
Warpgroup semantics (the `mosaic_gpu` dialect and its layout inference);
the rules of the plgpu primitives are in rules/plgpu.py.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math

import jax
import numpy as np
from jax.experimental.mosaic import gpu as mgpu_lib
from jax.experimental.mosaic.gpu import core as mgpu_core
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from dsl.core.errors import BackendError, source_info_frame
from dsl.core.jax_internals import (ClosedJaxpr, arith, core, gpu, ir,
                                    mosaic_gpu_dialect as mgpu, vector)
from dsl.core.jaxpr_walk import walk_jaxpr
from dsl.core.primitives import run_scoped_p
from dsl.core.semaphores import is_semaphore_aval
from dsl.core.state_scopes import get_global_p
from dsl.mosaic_gpu.compiler_params import LoweringSemantics
from dsl.mosaic_gpu import tensor_memory as tm
from dsl.mosaic_gpu.memory import (SMEM, BarrierSpace, TransformedSpace,
                                   is_accumulator_aval, is_tmem_aval,
                                   space_of)
from lowering_mosaic.gpu.host import (TRITON_HINT, GpuHost, ir_type,
                                      scalar_constant)
from lowering_mosaic.gpu.mesh_accumulators import (accumulator_body,
                                                   fenced, written_first)
from lowering_mosaic.gpu import gmem_semaphores as gsem
from lowering_mosaic.gpu.kernel import GpuModule
from lowering_mosaic.gpu.rules import TABLE
from lowering_mosaic.gpu.smem_layout import LaidOutSmem, tiled_shape

SMEM_ALIGN = 1024      # every allocation starts on a swizzle-atom boundary


def _align(n: int) -> int:
  return -(-n // SMEM_ALIGN) * SMEM_ALIGN


def is_mesh_kernel(spec) -> bool:
  return getattr(spec.compiler_params, "mesh", None) is not None


def _barrier_type(aval):
  space = aval.memory_space
  if space.collective_axes:
    raise NotImplementedError("cluster barriers")
  return mgpu_core.Barrier(space.num_arrivals, math.prod(aval.shape),
                           space.orders_tensor_core)


# ------------------------------------------------------------- resources

@dataclasses.dataclass(frozen=True)
class MeshResources:
  """Shared memory bytes, mbarrier groups (in the order the kernel first
  allocates them) and global-memory semaphores (per scope:
  gmem_semaphores.py) a kernel allocates at most at once."""
  smem_bytes: int = 0
  barriers: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  semaphores: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)

  def nested(self, other: "MeshResources") -> "MeshResources":
    """Both held at once."""
    return MeshResources(self.smem_bytes + other.smem_bytes,
                         self.barriers + other.barriers,
                         self.semaphores + other.semaphores)

  def either(self, other: "MeshResources") -> "MeshResources":
    """One after the other (or one of two branches)."""
    return MeshResources(max(self.smem_bytes, other.smem_bytes),
                         self.barriers | other.barriers,
                         gsem.either(self.semaphores, other.semaphores))


def _semaphores(aval, scope) -> MeshResources:
  if aval.memory_space.kind != "regular":
    raise NotImplementedError(f"allocations in {aval.memory_space}")
  return MeshResources(semaphores=collections.Counter(
      {scope: math.prod(aval.shape)}))


def _allocation(aval) -> MeshResources:
  if is_semaphore_aval(aval):
    return _semaphores(aval, gsem.BLOCK)
  if isinstance(aval.memory_space, BarrierSpace):
    return MeshResources(barriers=collections.Counter([_barrier_type(aval)]))
  if is_accumulator_aval(aval):
    return MeshResources()
  if space_of(aval) is not SMEM:
    raise NotImplementedError(f"allocations in {aval.memory_space}")
  size = math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
  return MeshResources(_align(size))


def _sub_jaxprs(params):
  for v in params.values():
    for x in (v if isinstance(v, (tuple, list)) else (v,)):
      if isinstance(x, ClosedJaxpr):
        yield x.jaxpr
      elif isinstance(x, core.Jaxpr):
        yield x


def estimate(jaxpr, reduction_bytes: int) -> MeshResources:
  """What `jaxpr` allocates at most at once."""
  total = MeshResources()
  for eqn in jaxpr.eqns:
    rs = MeshResources()
    if eqn.primitive is run_scoped_p:
      for v in eqn.params["jaxpr"].invars[eqn.params["num_consts"]:]:
        rs = rs.nested(_allocation(v.aval))
      rs = rs.nested(estimate(eqn.params["jaxpr"], reduction_bytes))
    elif eqn.primitive is get_global_p:
      if not is_semaphore_aval(eqn.params["what"]):
        raise NotImplementedError("pl.get_global of anything but semaphores")
      rs = _semaphores(eqn.params["what"], gsem.GLOBAL)
    elif eqn.primitive.name.startswith("reduce_"):
      rs = MeshResources(_align(reduction_bytes))
    else:
      for sub in _sub_jaxprs(eqn.params):
        rs = rs.either(estimate(sub, reduction_bytes))
    total = total.either(rs)
  return total


# ------------------------------------------------------------------ host

class MeshHost(GpuHost):
  """The host of a mesh kernel: `run_scoped` slices its allocations from
  the kernel's shared memory and barrier groups."""

  def __init__(self, kernel, where, rules, smem_bytes, barriers,
               jax_mesh=None):
    super().__init__(kernel, where, rules)
    self.smem_bytes = smem_bytes
    self.smem_used = 0
    self.alias_ids = 0
    self.barriers = barriers   # Barrier type -> its free barrier groups
    self.semaphores = gsem.SemaphorePool()
    self.thread_axis = None
    self.jax_mesh = jax_mesh   # the device mesh of shard_map, if any
    self.literals = []      # the constants made for literal operands

  def literal(self, atom):
    value = super().literal(atom)
    self.literals.append(value)
    return value

  def drop_unused_literals(self):
    """Erases the constants of literals that no op uses (rules fold
    integer literals into the ops they build, as static values)."""
    for value in reversed(self.literals):
      if isinstance(value, ir.Value) and not list(value.uses):
        value.owner.erase()

  @contextlib.contextmanager
  def _smem(self, aval):
    offset = self.smem_used
    space = aval.memory_space
    transforms = (space.transforms if isinstance(space, TransformedSpace)
                  else ())
    ty = ir.MemRefType.get(list(tiled_shape(aval.shape, transforms)),
                           ir_type(aval.dtype), memory_space=mgpu_utils.smem())
    self.alias_ids += 1
    view = mgpu.slice_smem(ty, offset, alias_id=self.alias_ids)
    if transforms:
      view = LaidOutSmem(view, tuple(aval.shape), transforms)
    size = math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
    self.smem_used = offset + _align(size)
    try:
      yield view
    finally:
      self.smem_used = offset

  @contextlib.contextmanager
  def _barrier(self, aval):
    free = self.barriers[_barrier_type(aval)]
    ref = free.pop()
    try:
      yield ref
    finally:
      free.append(ref)

  @contextlib.contextmanager
  def scope(self, ctx, jaxpr, num_consts, collective_axes):
    threads = self.thread_axis
    if threads is not None and tuple(collective_axes) == (threads,):
      gpu.barrier()    # every warpgroup has left the previous allocations
    with contextlib.ExitStack() as stack:
      refs = []
      for v in jaxpr.invars[num_consts:]:
        aval = v.aval
        if is_semaphore_aval(aval):
          if tuple(collective_axes) != (() if threads is None
                                        else (threads,)):
            raise ctx.error("semaphores in run_scoped are shared by a "
                            "block's warpgroups (collective_axes="
                            f"{threads!r}); pl.get_global makes those of "
                            "the whole launch")
          refs.append(stack.enter_context(self.semaphores.scoped(
              gsem.BLOCK, aval.shape)))
        elif isinstance(aval.memory_space, BarrierSpace):
          refs.append(stack.enter_context(self._barrier(aval)))
        elif is_accumulator_aval(aval):
          refs.append(_fresh_accumulator(ctx, aval, collective_axes,
                                         written_first(jaxpr, v)))
        else:
          refs.append(stack.enter_context(self._smem(aval)))
      yield refs

  def scope_body(self, jaxpr, num_consts):
    try:
      return accumulator_body(jaxpr, num_consts)
    except NotImplementedError as e:
      raise self.error(f"{e} do not lower yet" + TRITON_HINT) from None


def _fresh_accumulator(ctx, aval, collective_axes, written: bool):
  """A fresh accumulator's value: zeros that no WGMMA reads before they
  are written (an optimization barrier, then `wgmma.fence`); for one the
  scope writes before anything else (`pl.run_state` of `ACC.init(x)`),
  zeros that nothing uses (the write fences its value)."""
  if collective_axes:
    raise ctx.error("plgpu.ACC accumulators are allocated by one warpgroup "
                    "(run_scoped without collective_axes)")
  zero = vector.broadcast(ir.VectorType.get(list(aval.shape),
                                            ir_type(aval.dtype)),
                          scalar_constant(0, aval.dtype))
  if written:
    return zero
  return fenced(zero)


# ---------------------------------------------------------------- launch

@dataclasses.dataclass(frozen=True)
class MeshPlan:
  """The launch of a mesh kernel: CUDA grid, cluster and block (minor dim
  first), shared memory bytes of its allocations and its barrier groups."""
  cuda_grid: tuple[int, int, int]
  cluster: tuple[int, int, int]
  block: tuple[int, int, int]
  smem_bytes: int
  barriers: tuple
  gmem_scratch: tuple = ()   # semaphore buffers: aliased, zeroed operands

  def summary(self) -> str:
    sems = [s.shape[0] for s in self.gmem_scratch]
    return (f"plgpu.kernel: CUDA grid {self.cuda_grid}, cluster "
            f"{self.cluster}, block {self.block}, {self.smem_bytes} bytes of "
            f"shared memory for allocations, {len(self.barriers)} barrier "
            "groups" + (f", semaphore buffers in global memory of {sems} "
                        "int32" if sems else ""))


def _cuda_launch(mesh):
  """(CUDA grid, cluster, block) of `mesh`: its dims minor first."""
  grid = tuple(mesh.grid)
  if len(grid) > 3:
    raise NotImplementedError("meshes of more than 3 grid dims")
  grid = ((1,) * (3 - len(grid)) + grid)[::-1]
  cluster = ((1,) * (3 - len(mesh.cluster)) + tuple(mesh.cluster))[::-1]
  block = (128 * (mesh.num_threads or 1), 1, 1)
  return tuple(g * c for g, c in zip(grid, cluster)), cluster, block


def _program_ids(mesh) -> list:
  """The mesh's axis indices, in the kernel's program-id order."""
  i32 = ir.IntegerType.get_signless(32)
  ids = []
  n = len(mesh.grid)
  for axis in range(n):
    dim = gpu.Dimension(n - 1 - axis)
    ids.append(arith.index_cast(i32, gpu.block_id(dim)))
  m = len(mesh.cluster)
  for axis in range(m):
    dim = gpu.Dimension(m - 1 - axis)
    ids.append(arith.index_cast(i32, gpu.cluster_block_id(dim)))
  if mesh.num_threads is not None:
    ids.append(mgpu_utils.warpgroup_idx(sync=True))
  return ids


def _check(spec, params):
  if params.lowering_semantics is not LoweringSemantics.Warpgroup:
    raise BackendError(spec.name, "plgpu kernels lower with Warpgroup "
                       "semantics (plgpu.CompilerParams(lowering_semantics="
                       "plgpu.LoweringSemantics.Warpgroup), the default); "
                       "Lane semantics do not lower yet" + TRITON_HINT,
                       spec.where)


_TENSOR_MEMORY = (tm.tcgen05_mma_p, tm.tcgen05_commit_arrive_p,
                  tm.async_load_tmem_p, tm.async_store_tmem_p,
                  tm.async_copy_smem_to_tmem_p, tm.wait_load_tmem_p,
                  tm.commit_tmem_p)


def _refuse_tensor_memory(spec, jaxpr) -> None:
  """TMEM and the tcgen05 instructions do not lower yet: refused at the
  first allocation or use, with its line."""
  for eqn in jaxpr.eqns:
    allocs = (eqn.params["jaxpr"].invars[eqn.params["num_consts"]:]
              if eqn.primitive is run_scoped_p else ())
    if eqn.primitive in _TENSOR_MEMORY or any(
        is_tmem_aval(v.aval) for v in allocs):
      raise BackendError(
          spec.name, "TMEM (tensor memory) and the tcgen05 MMA that "
          "accumulates in it are Blackwell's (sm_100): the Mosaic GPU "
          "backend does not lower them yet (tcgen05.alloc, tcgen05.mma, "
          "tcgen05.commit, tcgen05.ld); the interpret backend runs them",
          source_info_frame(eqn.source_info) or spec.where,
          operand=eqn.primitive.name)
    for sub in _sub_jaxprs(eqn.params):
      _refuse_tensor_memory(spec, sub)


def build_mesh_module(spec, jax_mesh=None):
  """The Mosaic GPU module of `spec`, a `plgpu.kernel`; must run inside an
  MLIR context made by `jax.interpreters.mlir.make_ir_context()`.
  `jax_mesh`: the device mesh of the `shard_map` the kernel runs in (the
  collectives' device ids and peers)."""
  params = spec.compiler_params
  mesh = params.mesh
  _check(spec, params)
  jaxpr = spec.jaxpr.jaxpr
  _refuse_tensor_memory(spec, jaxpr)
  try:
    rs = estimate(jaxpr, params.reduction_scratch_bytes)
    grid, cluster, block = _cuda_launch(mesh)
  except NotImplementedError as e:
    raise BackendError(spec.name, f"{e} do not lower yet" + TRITON_HINT,
                       spec.where) from None
  gm = spec.grid_mapping
  sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
  avals = [bm.array_aval for bm in gm.block_mappings]
  sems = gsem.buffer_shapes(gsem.merged(rs.semaphores, mesh), mesh,
                            math.prod(grid))
  ins = tuple(sds(a) for a in avals[:gm.num_inputs]) + sems
  outs = tuple(sds(a) for a in avals[gm.num_inputs:]) + sems
  barrier_types = list(rs.barriers.elements())
  scratch = [jax.ShapeDtypeStruct((rs.smem_bytes,), np.int8),
             barrier_types, None]
  name = spec.name
  host = MeshHost(name, spec.where, TABLE, rs.smem_bytes, None, jax_mesh)
  host.thread_axis = mesh.thread_name
  host.approx_math = bool(params.approx_math)
  host.auto_barriers = not params.unsafe_no_auto_barriers

  def body(launch_ctx, *buffers):
    *gmem, (_, barrier_refs, _) = buffers
    n_in = len(ins) - len(sems)
    gmem_sems = gmem[len(gmem) - len(sems):]
    gmem = gmem[:n_in] + gmem[len(ins):len(gmem) - len(sems)]
    groups = collections.defaultdict(list)
    for ty, ref in zip(barrier_types, barrier_refs):
      groups[ty].append(ref)
    host.barriers = groups
    host.launch_ctx = launch_ctx
    host.semaphores.slice_buffers(rs.semaphores, mesh, gmem_sems)
    # Pallas computes these predicates for every kernel; layout inference
    # drops them where nothing uses them.
    host.lane_predicate = mgpu_utils.single_thread_predicate(
        scope=mgpu_utils.ThreadSubset.WARPGROUP)
    mgpu_utils.single_thread_predicate(scope=mgpu_utils.ThreadSubset.WARP)
    walk_jaxpr(host, jaxpr, spec.jaxpr.consts, _program_ids(mesh) + gmem)
    host.drop_unused_literals()

  semantics = mgpu_lib.LoweringSemantics.Warpgroup
  try:
    module, out_shapes, _, launch_ctx = mgpu_core._lower_as_gpu_kernel(
        body, grid, cluster, block, ins, outs, (), scratch, semantics,
        module_name=name, kernel_name=name, jax_mesh=jax_mesh)
  except BackendError:
    raise
  except Exception as e:
    raise BackendError(name, "the Mosaic GPU library rejected the kernel "
                       "while it was built" + TRITON_HINT + ": "
                       f"{type(e).__name__}: {e}", spec.where) from e
  text = str(module)
  try:
    mgpu_core.lower_mgpu_module(module, launch_ctx, semantics,
                                auto_barriers=not params.unsafe_no_auto_barriers)
  except Exception as e:
    raise BackendError(name, "the Mosaic GPU library could not infer layouts "
                       "for or lower the kernel" + TRITON_HINT + ": "
                       f"{type(e).__name__}: {e}", spec.where) from e
  plan = MeshPlan(grid, cluster, block, rs.smem_bytes, tuple(barrier_types),
                  sems)
  return GpuModule(module, text, plan, tuple(out_shapes))
