"""How the interpret backend runs a `plgpu.kernel`: every warpgroup of every
block at once, on the host.

A `plgpu.kernel` is a pallas_call whose compiler params carry its `Mesh`
(dsl/mosaic_gpu/kernel.py); its last grid dim numbers the warpgroups of a
block, and they wait for each other at mbarriers, which the vectorized grid
run of `dsl.interpret.execute` cannot express. So such a kernel runs in a
host callback (`dsl.core.host_failures.call_host`): each warpgroup is a
coroutine over the kernel jaxpr (dsl/interpret/thread_eval.py) and a
scheduler resumes them in turn, each until it waits for something that has
not happened (round robin over blocks and warpgroups, in grid order, so a
run is deterministic). When every warpgroup that has not finished waits,
the kernel is deadlocked: a `KernelDeadlockError` names each wait and its
line. Inside `plgpu.warp_map`, the 4 warps of a warpgroup are threads of
their own, run in turn the same way while the warpgroup waits for them.

Memory: the kernel's operands are GMEM, shared by every block; outputs start
as poison (as on every host backend), or as the aliased input. A
`run_scoped` allocation belongs to its warpgroup, or, with
`collective_axes=thread axis`, to its block: the k-th time each warpgroup
of a block enters that `run_scoped` they share one allocation
(dsl/interpret/cluster.py keeps them, so that the blocks of a CTA cluster,
which run together, find each other's). Fresh
allocations hold poison under `jax_pallas_poison_buffers`, zeros otherwise;
accumulators (`plgpu.ACC`) start at zero. `pl.get_global` gives one ref per
call site for the whole launch.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from dsl.core import config
from dsl.core.errors import BackendError, KernelDeadlockError
from dsl.core.jaxpr_walk import sub_jaxprs
from dsl.core.poison import poison_value
from dsl.core.primitives import run_scoped_p
from dsl.core.semaphores import is_semaphore_aval
from dsl.core.state_scopes import get_global_p
from dsl.interpret import cluster, devices, plgpu_rules, semaphores  # noqa: F401 -- their rules
from dsl.interpret.devices import DeviceMesh, GlobalMemory
from dsl.interpret.tensor_core import TensorCore
from dsl.interpret.thread_eval import TABLE, Blocked, Cell, eval_jaxpr, where
from dsl.mosaic_gpu.kernel import Mesh
from dsl.mosaic_gpu.scheduling import WARPS_PER_WARPGROUP, warp_map_p
from dsl.mosaic_gpu.memory import (BarrierSpace, is_accumulator_aval,
                                   is_barrier_aval)


def mesh_of(spec) -> Mesh | None:
  """The Mesh of a `plgpu.kernel`'s spec, None for other kernels."""
  return getattr(spec.compiler_params, "mesh", None)


def allocate(aval, label: str) -> Cell:
  """A fresh ref of `aval` (see the module docstring for what it holds)."""
  inner = aval.inner_aval
  shape, dtype = tuple(inner.shape), np.dtype(inner.dtype)
  if is_barrier_aval(aval):
    space: BarrierSpace = aval.memory_space
    n = math.prod(shape)
    return Cell(np.arange(n, dtype=np.int32).reshape(shape), label,
                [plgpu_rules.BarrierState(space.num_arrivals, space)
                 for _ in range(n)])
  poison = (config.poison_buffers() and not is_accumulator_aval(aval)
            and not is_semaphore_aval(aval))
  fill = poison_value(dtype) if poison else 0
  return Cell(np.full(shape, fill, dtype), label)


class Thread:
  """One warpgroup: its coordinates, its coroutine, the mbarrier phases it
  has waited for, how often it entered each shared `run_scoped`."""

  def __init__(self, machine: "Machine", coords: tuple[int, ...]):
    self.machine = machine
    self.kernel = machine.kernel
    self.coords = self.place = coords
    self.block = coords[:machine.block_rank]
    self.name = (f"warpgroup {coords[machine.block_rank:] or (0,)} of block "
                 f"{self.block}{machine.on_device}")
    self.tid = self.clock = None     # dsl/interpret/device_races.py
    self.waits: dict = {}
    self.entries: dict = {}
    self.blocked = None
    self.done = False
    self.routine = None

  def step(self) -> bool:
    """Runs until the warpgroup waits or ends; whether it moved."""
    if self.done or (self.blocked is not None and not self.blocked.ready()):
      return False
    self.blocked = None
    try:
      self.blocked = next(self.routine)
    except StopIteration:
      self.done = True
    return True


class Warp(Thread):
  """One warp of a warpgroup inside `warp_map`: a thread of its own that
  starts with the phases its warpgroup has waited for."""

  def __init__(self, group: Thread, index: int, jaxpr, invals):
    self.machine, self.kernel = group.machine, group.kernel
    self.coords, self.block = group.coords, group.block
    self.place = (*group.coords, index)
    self.name = f"warp {index} of {group.name}"
    self.tid, self.clock = group.tid, group.clock
    self.waits = dict(group.waits)
    self.entries: dict = {}
    self.blocked = None
    self.done = False
    self.routine = eval_jaxpr(self, jaxpr, (), [*invals, np.int32(index)])


@TABLE.register(warp_map_p)
def _warp_map(thread: Thread, eqn, invals):
  """Runs the warps in turn, each until it waits, as the scheduler runs
  warpgroups; the warpgroup waits while every unfinished warp does, and
  then has waited for every phase one of its warps waited for."""
  warps = [Warp(thread, i, eqn.params["jaxpr"], invals)
           for i in range(WARPS_PER_WARPGROUP)]
  while not all(w.done for w in warps):
    if not any([w.step() for w in warps]):
      waiting = [w for w in warps if not w.done]
      what = "; ".join(f"{w.name} {w.blocked.what} (at {where(w.blocked.eqn)})"
                       for w in waiting)
      yield Blocked(lambda: any(w.blocked.ready() for w in waiting),
                    f"in warp_map: {what}", waiting[0].blocked.eqn)
  for w in warps:
    for b, n in w.waits.items():
      thread.waits[b] = max(thread.waits.get(b, 0), n)
  return []


class Machine:
  """One device's part of a launch of a `plgpu.kernel`: its shared memory
  and warpgroups; `memory`, the global memory of every device."""

  def __init__(self, spec, mesh: Mesh, memory: GlobalMemory | None = None,
               device: int = 0):
    self.spec = spec
    self.kernel = spec.name
    self.mesh = mesh
    self.memory = memory or GlobalMemory(DeviceMesh(), spec.name)
    self.device = device
    self.on_device = (f" on device {device}" if self.memory.mesh.size > 1
                      else "")
    self.block_rank = mesh.block_rank
    self.threads_per_block = mesh.num_threads or 1
    self.thread_axes = (() if mesh.thread_name is None
                        else (mesh.thread_name,))
    self.cluster = cluster.Cluster(self.kernel, mesh)
    self.allocations = cluster.Allocations(self.allocate, self.cluster,
                                           self.block_rank)
    self.tensor_core = TensorCore()

  def allocate(self, aval, label: str, key) -> Cell:
    """A fresh ref of `aval`; a semaphore lies in global memory, with a
    copy on every device (`key`: which allocation it is, on each)."""
    if is_semaphore_aval(aval):
      return self.memory.cell(key, self.device,
                              lambda: allocate(aval, label))
    return allocate(aval, label)

  def start(self, ins: list[Cell], outs: list[Cell]) -> list[Thread]:
    """The warpgroups of this device, on its operands in global memory."""
    spec, gm = self.spec, self.spec.grid_mapping
    labels = gm.split(spec.ref_labels())
    jaxpr = spec.jaxpr
    threads, scratch = [], {}
    for coords in itertools.product(*(range(n) for n in gm.grid)):
      th = Thread(self, coords)
      if self.memory.races is not None:
        self.memory.races.enter(th)
      if th.block not in scratch:
        scratch[th.block] = [
            self.allocate(a, label, ("scratch", th.block, k))
            for k, (a, label) in enumerate(zip(gm.scratch_avals,
                                               labels.scratch))]
      ids = [np.int32(c) for c in coords]
      th.routine = eval_jaxpr(th, jaxpr.jaxpr, jaxpr.consts,
                              [*ids, *ins, *outs, *scratch[th.block]])
      threads.append(th)
    return threads

  def schedule(self, threads: list[Thread]) -> None:
    """Runs `threads` (of every device) in turn until all end."""
    while True:
      moved = False
      for th in threads:
        moved |= th.step()
      waiting = [th for th in threads if not th.done]
      if not waiting:
        return
      if not moved:
        raise self._deadlock(waiting)

  def _deadlock(self, waiting: list[Thread]) -> KernelDeadlockError:
    first = waiting[0].blocked
    lines = [f"{th.name} {th.blocked.what} (at {where(th.blocked.eqn)})"
             for th in waiting]
    return KernelDeadlockError(
        self.kernel, f"deadlock: every unfinished warpgroup waits; "
        f"{waiting[0].name} {first.what}", where(first.eqn),
        detail="\n".join(lines))


def _scoped_labels(eqn, count: int) -> list[str]:
  """Names of a `run_scoped`'s allocations: the parameters they are passed
  as, else the scope's line (none for a kernel's scratch) and position."""
  names = [""] * count + list(eqn.params["jaxpr"].debug_info.arg_names or ())
  line = where(eqn)
  scope = f"run_scoped at {line}" if line else "scratch"
  return [name or f"{scope} [{i}]"
          for i, name in enumerate(names[len(names) - count:])]


@TABLE.register(run_scoped_p)
def _run_scoped(thread: Thread, eqn, invals):
  jaxpr = eqn.params["jaxpr"]
  axes = tuple(eqn.params.get("collective_axes", ()))
  machine = thread.machine
  avals = [v.aval for v in jaxpr.invars[eqn.params["num_consts"]:]]
  labels = _scoped_labels(eqn, len(avals))
  if axes and axes != machine.thread_axes:
    raise BackendError(thread.kernel, f"run_scoped(collective_axes={axes}): "
                       "the interpret backend shares allocations along the "
                       f"thread axis {machine.thread_axes} only", where(eqn),
                       operand="collective_axes")
  owners = machine.threads_per_block if axes else 1
  key, cells = machine.allocations.enter(thread, eqn, avals, labels, owners)
  outs = yield from eval_jaxpr(thread, jaxpr, (), [*invals, *cells])
  machine.allocations.exit(key)
  return outs


@TABLE.register(get_global_p)
def _get_global(thread: Thread, eqn, invals):
  machine = thread.machine
  return [machine.memory.cell(
      ("global", id(eqn)), machine.device,
      lambda: allocate(eqn.params["what"], f"get_global at {where(eqn)}"))]


def check_runnable(spec) -> None:
  """A `plgpu.kernel` as the warpgroup interpreter runs it: its refs whole
  arrays, its grid the mesh's (a kernel derived by `jax.vmap`, `jax.jvp`
  or `jax.grad` is not)."""
  gm = spec.grid_mapping
  if gm.num_hidden_axes or not all(bm.whole_array
                                   for bm in gm.block_mappings):
    raise BackendError(spec.name, "a plgpu.kernel derived by jax.vmap, "
                       "jax.jvp or jax.grad does not run on the interpret "
                       "backend yet", spec.where)


def talks_to_devices(spec) -> bool:
  """Whether a `plgpu.kernel` runs with every device of its shard_map
  (it reads its device's index or reaches another device)."""
  return devices.talks_to_devices(spec.jaxpr.jaxpr, set(mesh_of(spec).shape))


def check_single_programs(spec) -> None:
  """A kernel that runs one grid point at a time (not a `plgpu.kernel`)
  cannot use what only the warpgroup interpreter gives: `pl.get_global`."""
  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive is get_global_p:
        raise BackendError(spec.name, "pl.get_global runs in plgpu.kernels "
                           "only (the interpret backend's warpgroup "
                           "interpreter)", where(eqn), operand="get_global")
      for sub in sub_jaxprs(eqn.params):
        visit(sub)
  visit(spec.jaxpr.jaxpr)


def run_devices(spec, device_axes, per_device) -> list[list[np.ndarray]]:
  """Runs the `plgpu.kernel` of `spec` on every device of the mesh
  `device_axes` ((name, size), ...) together; `per_device`: each
  device's numpy operands. Each device's outputs."""
  gm = spec.grid_mapping
  memory = GlobalMemory(DeviceMesh(device_axes), spec.name)
  n = memory.mesh.size
  labels = gm.split(spec.ref_labels())
  aliases = dict((o, i) for i, o in spec.input_output_aliases)
  ins = [memory.share([Cell(np.array(ops[k]), label) for ops in per_device])
         for k, label in enumerate(labels.inputs)]
  outs = []
  for k, aval in enumerate(gm.out_avals):
    outs.append(memory.share([
        Cell(np.array(per_device[d][aliases[k]]) if k in aliases else
             np.full(aval.shape, poison_value(aval.dtype), aval.dtype),
             labels.outputs[k]) for d in range(n)]))
  machines = [Machine(spec, mesh_of(spec), memory, d) for d in range(n)]
  threads = [th for d, m in enumerate(machines)
             for th in m.start([c[d] for c in ins], [c[d] for c in outs])]
  machines[0].schedule(threads)
  if memory.races is not None:
    memory.races.finish()
  return [[c[d].array for c in outs] for d in range(n)]


def run_kernel(spec, *arrays) -> list[np.ndarray]:
  """Runs the `plgpu.kernel` of `spec` on numpy operands; its outputs."""
  (outs,) = run_devices(spec, (), [[np.asarray(a) for a in arrays]])
  return outs
