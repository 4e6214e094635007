"""The blocks of a CTA cluster in the warpgroup interpreter: which blocks
an operation along cluster axes reaches, and each block's allocations as
the other blocks of its cluster see them.

A `plgpu.kernel` with `cluster=`/`cluster_names=` runs over blocks
`(*grid, *cluster)` (dsl/mosaic_gpu/kernel.py); the blocks that share the
grid coordinates form a cluster, and every block of the launch runs at the
same time in one `Machine` (dsl/interpret/warpgroups.py), so blocks of a
cluster meet at barriers and write each other's shared memory:

- the group of a block along `collective_axes` is every block of its
  cluster that differs from it along one of those axes (along one axis: the
  blocks of that line of the cluster), in order; its first block (index 0
  along the axes) is the leader;
- an SMEM, TMEM or barrier allocation has the same address in every block:
  `Allocations` keys each one by the `run_scoped` that made it, the block
  (or warpgroup) that entered it and how often it has entered it, so
  `peer(thread, cell, block)` finds the allocation another block made (or
  will make: a block that runs ahead makes it for its peer). Kernel
  operands and `pl.get_global` refs are GMEM, the same in every block.
- a `ClusterBarrier` along `collective_axes` is an mbarrier in each block
  that completes a phase after `num_arrivals` arrivals from every block of
  the group: `barrier_arrive` arrives on the barrier of each block of the
  group (of the leader only, with `leader_tracked=True`).

The rules that use this (collective TMA copies, cluster barriers, the
collective tcgen05 MMA) are in dsl/interpret/plgpu_rules.py and
dsl/interpret/tensor_core.py.
"""
from __future__ import annotations

from typing import Callable

from dsl.core.errors import BackendError
from dsl.interpret.thread_eval import Cell, where
from dsl.mosaic_gpu.kernel import Mesh
from dsl.mosaic_gpu.memory import is_barrier_aval


class Cluster:
  """The cluster geometry of one launch."""

  def __init__(self, kernel: str, mesh: Mesh):
    self.kernel = kernel
    first = len(mesh.grid)
    self.axes = {name: (first + i, size) for i, (name, size)
                 in enumerate(zip(mesh.cluster_names, mesh.cluster))}

  def _axis(self, name, eqn) -> tuple[int, int]:
    if name not in self.axes:
      raise BackendError(
          self.kernel, f"{name!r} is not a cluster axis of this kernel "
          f"(its cluster axes: {tuple(self.axes) or 'none'}; declare them "
          "with plgpu.kernel(cluster=..., cluster_names=...))", where(eqn),
          operand=("collective_axis" if "collective_axis" in eqn.params
                   else "collective_axes"))
    return self.axes[name]

  def group(self, thread, axes, eqn) -> list[tuple[int, ...]]:
    """The blocks of `thread`'s cluster along `axes`, leader first."""
    dims = [self._axis(name, eqn) for name in axes]
    block = thread.block
    others = {block}
    for dim, size in dims:
      others |= {(*block[:dim], i, *block[dim + 1:]) for i in range(size)}
    order = [d for d, _ in dims]
    return sorted(others, key=lambda b: tuple(b[d] for d in order))

  def arrivals(self, aval, eqn) -> int:
    """Arrivals a phase of a barrier of `aval` takes: a ClusterBarrier's
    `num_arrivals` from each block of its group."""
    space = aval.memory_space
    sizes = [self._axis(name, eqn)[1] for name in space.collective_axes]
    return space.num_arrivals * (sum(sizes) - len(sizes) + 1)

  def pair(self, thread, axis, eqn) -> list[tuple[int, ...]]:
    """The pair of blocks of a collective tcgen05 operation along `axis`,
    its leader first; the operation must be issued by the leader."""
    _, size = self._axis(axis, eqn)
    if size != 2:
      raise BackendError(thread.kernel, f"a collective {eqn.primitive.name} "
                         f"runs on a pair of blocks: cluster axis {axis!r} "
                         f"has {size} blocks, not 2", where(eqn),
                         operand="collective_axis")
    blocks = self.group(thread, (axis,), eqn)
    if thread.block != blocks[0]:
      raise BackendError(thread.kernel, f"{thread.name} issues a collective "
                         f"{eqn.primitive.name}, but only the leader of the "
                         f"pair along {axis!r} (index 0) issues it for both "
                         "blocks", where(eqn), operand="collective_axis")
    return blocks


class Allocations:
  """The `run_scoped` allocations of a launch, so that the blocks of a
  cluster find each other's (see the module docstring). `allocate(aval,
  label, key)` makes one (`key`: which one it is, the same on every
  device, where a semaphore has a copy on each)."""

  def __init__(self, allocate: Callable, cluster: Cluster, block_rank: int):
    self.allocate = allocate
    self.cluster = cluster
    self.block_rank = block_rank
    self.entries: dict = {}   # key -> [cells, exits left]
    self.homes: dict = {}     # id(cell) -> (key, position)
    self.scopes: dict = {}    # id(eqn) -> (avals, labels)

  def enter(self, thread, eqn, avals, labels, owners: int) -> tuple:
    """The cells of `thread`'s entry into run_scoped `eqn`, shared by the
    `owners` warpgroups of its block (1: its own, or its warp's inside
    `warp_map`); (key, cells)."""
    count = thread.entries.get(id(eqn), 0)
    thread.entries[id(eqn)] = count + 1
    owner = thread.block if owners > 1 else thread.place
    self.scopes[id(eqn)] = (avals, labels, eqn)
    key = (owner, id(eqn), count)
    entry = self._entry(key)
    entry[1] = owners if entry[1] is None else entry[1]
    return key, entry[0]

  def exit(self, key) -> None:
    entry = self.entries[key]
    entry[1] -= 1
    if entry[1] == 0:
      for cell in entry[0]:
        del self.homes[id(cell)]
      del self.entries[key]

  def _entry(self, key) -> list:
    entry = self.entries.get(key)
    if entry is None:
      avals, labels, eqn = self.scopes[key[1]]
      cells = [self.allocate(a, label, (key, k))
               for k, (a, label) in enumerate(zip(avals, labels))]
      for k, (cell, aval) in enumerate(zip(cells, avals)):
        if is_barrier_aval(aval):
          for b in cell.barriers:
            b.num_arrivals = self.cluster.arrivals(aval, eqn)
        self.homes[id(cell)] = (key, k)
      entry = self.entries[key] = [cells, None]
    return entry

  def peer(self, cell: Cell, block: tuple[int, ...]) -> Cell:
    """`cell` as block `block` holds it (GMEM: `cell` itself)."""
    home = self.homes.get(id(cell))
    if home is None:
      return cell
    (owner, scope, count), k = home
    if owner[:self.block_rank] == block:
      return cell
    key = ((*block, *owner[self.block_rank:]), scope, count)
    return self._entry(key)[0][k]


def peers(thread, cell: Cell, blocks) -> list[Cell]:
  """`cell` as each of `blocks` holds it."""
  allocations = thread.machine.allocations
  return [allocations.peer(cell, b) for b in blocks]
