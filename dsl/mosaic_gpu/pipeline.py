"""Pipelines over a grid of blocks inside a `plgpu` kernel, built from its
TMA copies and mbarriers (no primitive of their own), with Pallas's
schedules.

- `emit_pipeline(body, grid=, in_specs=, out_specs=, max_concurrent_steps=)`:
  one warpgroup walks the grid in order over `max_concurrent_steps` SMEM
  slots per operand and one barrier per slot (every input's copy arrives on
  it). A prologue fetches the first steps; step `s` waits for its slot,
  runs `body`, copies out the output blocks that move (those that stay,
  once after the last step) and fetches step `s + slots - delay_release`
  into the slot it frees. The body waits for the WGMMAs that read a slot
  before it returns.
- `emit_pipeline_warp_specialized(...)`: a memory warpgroup (the last,
  `memory_thread_idx == num_compute_wgs`; `setmaxnreg` down to
  `memory_registers`) fetches the first `max_concurrent_steps` steps, then
  each later step once the compute warpgroups released its slot (one
  `consumed` barrier; with `manual_consumed_barriers`, one per input, and
  each input's copy waits only for its own),
  and at the end waits for the last slots' release, which leaves the
  barriers quiet for the next pipeline on the same allocations. The compute
  warpgroups (`setmaxnreg` up) wait for the slot's `produced` barrier, run
  `body` and release the slot. `get_allocations(*gmem_refs)` gives the
  scratch types, for a `pl.run_scoped(..., collective_axes=wg_axis)` that
  several pipelines share; without `allocations=`, each call allocates its
  own.

What these pipelines leave out of Pallas's: `collective_axes` of a
BlockSpec (each block of a cluster loads its own copy), `pipeline_state`,
outputs of a warp-specialized pipeline, and grids whose size is known only
at run time for the warp-specialized one.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax, tree_util

from dsl.core import refs
from dsl.core.blockspec import squeezed
from dsl.core.errors import KernelError, user_frame
from dsl.core.jax_internals import core, state_types
from dsl.core.primitives import loop, run_scoped
from dsl.mosaic_gpu.compute import set_max_registers
from dsl.mosaic_gpu.helpers import unravel as _unravel
from dsl.mosaic_gpu.memory import SMEM, Barrier, BlockSpec
from dsl.mosaic_gpu.primitives import (barrier_arrive, barrier_wait,
                                       commit_smem, commit_smem_to_gmem_group,
                                       copy_gmem_to_smem, copy_smem_to_gmem,
                                       wait_smem_to_gmem)


def _block_dims(spec, ref) -> list:
  """Per dim of `ref`: the block size, or None for a squeezed dim."""
  shape = spec.block_shape
  if shape is None:
    return list(ref.shape)
  if len(shape) != len(ref.shape):
    raise KernelError(None, f"block shape {tuple(shape)} has rank "
                      f"{len(shape)} but the ref has shape {tuple(ref.shape)}",
                      user_frame(), operand="in_specs")
  return [None if d is None or d is squeezed else int(d) for d in shape]


def _smem_type(spec, ref):
  dims = [d for d in _block_dims(spec, ref) if d is not None]
  transforms = getattr(spec, "transforms", ()) or ()
  return SMEM(dims, ref.dtype, transforms=transforms)


def _block_view(spec, ref, indices):
  """The block of GMEM ref `ref` at `spec.index_map(*indices)`."""
  dims = _block_dims(spec, ref)
  if spec.index_map is None:
    idx = [0] * len(dims)
  else:
    idx = spec.index_map(*indices)
    idx = list(idx) if isinstance(idx, (tuple, list)) else [idx]
  window = tuple(i if d is None else refs.ds(i * d, d)
                 for i, d in zip(idx, dims))
  return ref.at[window]


def _is_ref(x) -> bool:
  return isinstance(x, state_types.TransformedRef) or isinstance(
      core.typeof(x), state_types.AbstractRef)


def _specs(specs) -> tuple:
  if isinstance(specs, BlockSpec) or not isinstance(specs, (list, tuple)):
    specs = (specs,)
  return tuple(specs)


def _uses_indices(spec, rank: int) -> bool:
  """Whether `spec`'s index map reads the grid indices (a block that does
  not moves once)."""
  if spec.index_map is None or rank == 0:
    return False
  jaxpr = jax.make_jaxpr(spec.index_map)(*([jnp.int32(0)] * rank)).jaxpr
  used = {v for e in jaxpr.eqns for v in e.invars if isinstance(v, core.Var)}
  used |= {v for v in jaxpr.outvars if isinstance(v, core.Var)}
  return any(v in used for v in jaxpr.invars)


def emit_pipeline(body: Callable, *, grid: Sequence[Any], in_specs=(),
                  out_specs=(), max_concurrent_steps: int = 1,
                  init_carry=None) -> Callable:
  """A function of GMEM refs that runs `body(indices, *in_smem, *out_smem)`
  (`body(..., carry)` -> carry with `init_carry`) once per point of `grid`,
  in order, on SMEM copies of the blocks (see the module docstring)."""
  in_specs, out_specs = _specs(in_specs), _specs(out_specs)
  where = user_frame()
  if any(isinstance(g, int) and g <= 0 for g in grid):
    raise KernelError(None, f"emit_pipeline: every grid dim must be positive, "
                      f"got grid={tuple(grid)}", where, operand="grid")
  delays = sorted({int(getattr(s, "delay_release", 0) or 0)
                   for s in in_specs} or {0})
  if max_concurrent_steps <= delays[0]:
    raise KernelError(None, "max_concurrent_steps must be greater than every "
                      f"delay_release, got {max_concurrent_steps} and "
                      f"{delays}", where, operand="max_concurrent_steps")
  num_steps = math.prod(grid)
  static = isinstance(num_steps, int)
  if static:
    max_concurrent_steps = min(max_concurrent_steps, num_steps)
  schedule = _Schedule(body, tuple(jnp.asarray(g, jnp.int32) for g in grid),
                       in_specs, out_specs, max_concurrent_steps, init_carry,
                       tuple(delays), num_steps)

  def pipeline(*gmem_refs):
    if len(gmem_refs) != len(in_specs) + len(out_specs):
      raise KernelError(None, f"the pipeline has {len(in_specs)} in_specs and "
                        f"{len(out_specs)} out_specs but got {len(gmem_refs)} "
                        "refs", user_frame(), operand="in_specs")
    slots = max_concurrent_steps
    types = [SMEM((slots, *_smem_type(s, r).shape), r.dtype,
                  transforms=getattr(s, "transforms", ()) or ())
             for s, r in zip(in_specs + out_specs, gmem_refs)]
    barrier = (Barrier(num_arrivals=len(in_specs), num_barriers=slots)
               if in_specs else None)
    n_in = len(in_specs)
    return run_scoped(
        lambda bufs, bar: schedule.run(gmem_refs[:n_in], gmem_refs[n_in:],
                                       bufs[:n_in], bufs[n_in:], bar),
        types, barrier)
  return pipeline


@dataclasses.dataclass(frozen=True)
class _Schedule:
  """One warpgroup's pipeline over `grid`: a prologue fetches the first
  `slots` steps' input blocks; step `s` waits for its slot's barrier, runs
  `body`, copies its output blocks out (where they move) and fetches step
  `s + slots - delay_release` into the slot it frees."""
  body: Callable
  grid: tuple
  in_specs: tuple
  out_specs: tuple
  slots: int
  init_carry: Any
  delays: tuple
  num_steps: Any

  def run(self, ins, outs, in_bufs, out_bufs, barrier):
    slots, grid = self.slots, self.grid
    zeros = (jnp.asarray(0, jnp.int32),) * len(grid)
    prologue_steps = (slots if isinstance(self.num_steps, int) else
                      lax.min(jnp.asarray(slots, jnp.int32), self.num_steps))

    def prologue(step, indices):
      for spec, ref, buf in zip(self.in_specs, ins, in_bufs):
        copy_gmem_to_smem(_block_view(spec, ref, indices), buf.at[step],
                          barrier.at[step])
      return next_indices(indices, grid)
    lax.fori_loop(0, prologue_steps, prologue, zeros,
                  unroll=isinstance(self.num_steps, int))
    moving = [_uses_indices(s, len(grid)) for s in self.out_specs]
    fetch_levels = []
    for delay in self.delays:
      fetch = zeros
      for _ in range(slots - delay):
        fetch = next_indices(fetch, grid)
      fetch_levels.append(fetch)
    last_stores = [(jnp.array(-1),) * len(s.block_shape) if m else None
                   for s, m in zip(self.out_specs, moving)]
    step = functools.partial(self._step, ins, outs, in_bufs, out_bufs,
                             barrier, moving)
    last, _, _, carry = lax.fori_loop(
        0, self.num_steps, step,
        (zeros, fetch_levels, last_stores, self.init_carry))
    self._epilogue(outs, out_bufs, moving, last)
    return carry

  def _step(self, ins, outs, in_bufs, out_bufs, barrier, moving, step,
            carry):
    indices, fetch_levels, last_stores, body_carry = carry
    slots = self.slots
    slot = lax.rem(step, jnp.asarray(slots, step.dtype))
    if barrier is not None:
      barrier_wait(barrier.at[slot])
    copies_out = any(moving)
    if copies_out:
      wait_smem_to_gmem(slots - 1, wait_read_only=True)
    args = [b.at[slot] for b in (*in_bufs, *out_bufs)]
    if self.init_carry is not None:
      args.append(body_carry)
    body_carry = self.body(indices, *args)
    if copies_out:
      commit_smem()
    new_stores = list(last_stores)
    for k, (spec, ref, buf) in enumerate(zip(self.out_specs, outs,
                                             out_bufs)):
      if not moving[k]:
        continue
      new_stores[k] = spec.index_map(*indices)
      same = functools.reduce(lax.bitwise_and, [
          old == new for old, new in zip(last_stores[k], new_stores[k])])
      copy_smem_to_gmem(buf.at[slot], _block_view(spec, ref, indices),
                        predicate=lax.bitwise_or(lax.bitwise_not(same),
                                                 step == self.num_steps - 1),
                        commit_group=False)
    if copies_out:
      commit_smem_to_gmem_group()
    for delay, fetch in zip(self.delays, fetch_levels):
      fetch_step = step + (slots - delay)
      fetch_slot = lax.rem(fetch_step, jnp.asarray(slots, fetch_step.dtype))

      def do_fetch(delay=delay, fetch=fetch, fetch_slot=fetch_slot):
        for spec, ref, buf in zip(self.in_specs, ins, in_bufs):
          if int(getattr(spec, "delay_release", 0) or 0) == delay:
            copy_gmem_to_smem(_block_view(spec, ref, fetch), buf.at[fetch_slot],
                              barrier.at[fetch_slot])
      lax.cond(lax.bitwise_and(step >= delay, fetch_step < self.num_steps),
               do_fetch, lambda: None)
    return (next_indices(indices, self.grid),
            [next_indices(f, self.grid) for f in fetch_levels], new_stores,
            body_carry if self.init_carry is not None else None)

  def _epilogue(self, outs, out_bufs, moving, last):
    """Blocks that never move are copied out once, after the last step;
    then every copy out is waited for."""
    still = [k for k, m in enumerate(moving) if not m]
    if still:
      if all(not m for m in moving):
        commit_smem()
      last_slot = lax.rem(jnp.asarray(self.num_steps - 1), self.slots)
      for k in still:
        copy_smem_to_gmem(out_bufs[k].at[last_slot],
                          _block_view(self.out_specs[k], outs[k], last),
                          commit_group=False)
      commit_smem_to_gmem_group()
    if self.out_specs:
      wait_smem_to_gmem(0)


@dataclasses.dataclass(frozen=True)
class _Ring:
  """The scratch of a warp-specialized pipeline: the `consumed` barriers
  (one, or one per input with manual consumed barriers), per input its
  SMEM slots, and the `produced` barrier every input's copy arrives on."""
  consumed: tuple
  slots: tuple
  produced: tuple


tree_util.register_pytree_node(
    _Ring, lambda r: ((r.consumed, r.slots, r.produced), None),
    lambda _, c: _Ring(*c))


def next_indices(indices: tuple, grid) -> tuple:
  """The grid point after `indices` in row-major order (the last wraps
  around to zeros)."""
  out, carry = [], True
  for idx, size in zip(reversed(indices), reversed(tuple(grid))):
    bumped = lax.select(carry, idx + 1, idx)
    carry = bumped == size
    out.append(lax.select(carry, jnp.zeros_like(idx), bumped))
  return tuple(out[::-1])


def compute_registers(memory_registers: int, num_compute_wgs: int) -> int:
  """Registers per thread of a compute warpgroup: the 512 a lone warpgroup
  could hold, less the memory warpgroup's, shared out (at most 256, a
  multiple of 8)."""
  per_wg = min(256.0, (512 - memory_registers) / num_compute_wgs)
  return int(per_wg // 8) * 8


@dataclasses.dataclass(frozen=True)
class WarpSpecializedPipeline:
  """`pipeline(*gmem_refs, allocations=None)` runs it in every warpgroup
  of the kernel; `get_allocations(*gmem_refs)` gives its scratch types."""
  body: Callable
  grid: tuple
  in_specs: tuple
  max_concurrent_steps: int
  wg_axis: str
  num_compute_wgs: int
  memory_registers: int
  manual_consumed_barriers: bool
  compute_context: Callable | None
  delay_release: int

  @property
  def num_steps(self) -> int:
    return math.prod(self.grid)

  def get_allocations(self, *gmem_refs) -> _Ring:
    slots = self.max_concurrent_steps
    consumed = Barrier(num_arrivals=self.num_compute_wgs, num_barriers=slots)
    n_consumed = len(gmem_refs) if self.manual_consumed_barriers else 1
    return _Ring(
        (consumed,) * n_consumed,
        tuple(SMEM((slots, *_smem_type(s, r).shape), r.dtype,
                   transforms=getattr(s, "transforms", ()) or ())
              for s, r in zip(self.in_specs, gmem_refs)),
        (Barrier(num_arrivals=len(gmem_refs), num_barriers=slots),))

  def __call__(self, *gmem_refs, allocations=None):
    if len(gmem_refs) != len(self.in_specs):
      raise KernelError(None, f"the pipeline has {len(self.in_specs)} "
                        f"in_specs but got {len(gmem_refs)} refs",
                        user_frame(), operand="in_specs")
    if allocations is None:
      return run_scoped(lambda ring: self._run(gmem_refs, ring),
                        self.get_allocations(*gmem_refs),
                        collective_axes=self.wg_axis)
    return self._run(gmem_refs, allocations)

  def _run(self, gmem_refs, ring: _Ring):
    wg = lax.axis_index(self.wg_axis)
    lax.cond(wg != self.num_compute_wgs, lambda: self._compute(ring),
             lambda: self._memory(gmem_refs, ring))

  def _copy_in(self, gmem_refs, ring: _Ring, slot, indices, consumed=None):
    """The copies of step `indices`' input blocks into `slot`; with
    `consumed` (one barrier per input), each input's copy first waits for
    the compute warpgroups to release that input's slot."""
    (produced,) = ring.produced
    for k, (spec, ref, buf) in enumerate(zip(self.in_specs, gmem_refs,
                                             ring.slots)):
      if consumed is not None:
        barrier_wait(consumed[k].at[slot])
      copy_gmem_to_smem(_block_view(spec, ref, indices), buf.at[slot],
                        produced.at[slot],
                        collective_axes=getattr(spec, "collective_axes",
                                                None) or None)

  def _memory(self, gmem_refs, ring: _Ring):
    """Prologue: the first `max_concurrent_steps` steps' copies; steady
    state: each later step's copies once the compute warpgroups are done
    with its slot; then the wait for the last steps' slots, which leaves
    the barriers quiet for the next pipeline on the same allocations."""
    set_max_registers(self.memory_registers, action="decrease")
    slots, n = self.max_concurrent_steps, self.num_steps
    zeros = (jnp.asarray(0, jnp.int32),) * len(self.grid)

    def prologue(step, indices):
      self._copy_in(gmem_refs, ring, step, indices)
      return next_indices(indices, self.grid)
    indices = lax.fori_loop(0, slots, prologue, zeros, unroll=True)

    def steady(step, carry):
      (indices,) = carry
      slot = lax.rem(step, slots)
      if self.manual_consumed_barriers:
        self._copy_in(gmem_refs, ring, slot, indices, ring.consumed)
      else:
        barrier_wait(ring.consumed[0].at[slot])
        self._copy_in(gmem_refs, ring, slot, indices)
      return (next_indices(indices, self.grid),)
    lax.fori_loop(0, n - slots, steady, (indices,))

    @loop(n - slots, n - self.delay_release, unroll=True)
    def _(step):
      slot = lax.rem(step, slots)
      for consumed in ring.consumed:
        barrier_wait(consumed.at[slot])

  def _compute(self, ring: _Ring):
    set_max_registers(compute_registers(self.memory_registers,
                                        self.num_compute_wgs),
                      action="increase")
    slots, delay = self.max_concurrent_steps, self.delay_release
    (produced,) = ring.produced

    def step(k, carry):
      indices, last_stores, body_carry = carry
      slot = lax.rem(k, slots)
      consumed_slot = lax.rem(k - delay, slots)
      barrier_wait(produced.at[slot])
      args = [b.at[slot] for b in ring.slots]
      if self.manual_consumed_barriers:
        args += [b.at[consumed_slot] for b in ring.consumed]
      if self.compute_context is not None:
        args.append(body_carry)
      body_carry = self.body(indices, *args)
      if not self.manual_consumed_barriers:
        arrive = lambda: barrier_arrive(ring.consumed[0].at[consumed_slot])
        if delay:
          lax.cond(k < delay, lambda: None, arrive)
        else:
          arrive()
      commit_smem_to_gmem_group()
      return next_indices(indices, self.grid), last_stores, body_carry

    zeros = (jnp.asarray(0, jnp.int32),) * len(self.grid)
    if self.compute_context is None:
      lax.fori_loop(0, self.num_steps, step, (zeros, [], None))
      return
    ran = []

    def run(init_carry):
      if ran:
        raise KernelError(None, "the pipeline runs once per compute_context",
                          user_frame(), operand="compute_context")
      ran.append(True)
      # Refs in the carry (an accumulator) stay the same refs: only the
      # values go around the loop.
      leaves, tree = tree_util.tree_flatten(init_carry)
      is_ref = [_is_ref(x) for x in leaves]

      def with_refs(values):
        it = iter(values)
        return tree_util.tree_unflatten(
            tree, [x if r else next(it) for x, r in zip(leaves, is_ref)])

      def values_step(k, carry):
        indices, stores, values = step(k, carry[:2] + (with_refs(carry[2]),))
        out = tree_util.tree_leaves(values)
        return indices, stores, [x for x, r in zip(out, is_ref) if not r]
      values = [x for x, r in zip(leaves, is_ref) if not r]
      return with_refs(lax.fori_loop(0, self.num_steps, values_step,
                                     (zeros, [], values))[2])
    self.compute_context(run)
    if not ran:
      raise KernelError(None, "compute_context did not run the pipeline",
                        user_frame(), operand="compute_context")


def emit_pipeline_warp_specialized(
    body: Callable, *, grid: Sequence[int], memory_registers: int,
    in_specs=(), out_specs=(), max_concurrent_steps: int = 2, wg_axis: str,
    num_compute_wgs: int, pipeline_state=None,
    manual_produced_barriers: bool = False,
    manual_consumed_barriers: bool = False, compute_context=None,
    memory_thread_idx: int | None = None) -> WarpSpecializedPipeline:
  """A pipeline whose last warpgroup copies the input blocks while the
  `num_compute_wgs` others run `body(indices, *in_smem[, *consumed
  barriers][, carry])` on them (see the module docstring)."""
  del pipeline_state
  where = user_frame()
  refuse = [(out_specs not in ((), []), "out_specs"),
            (manual_produced_barriers, "manual_produced_barriers"),
            (memory_thread_idx not in (None, num_compute_wgs),
             "a memory thread other than the last")]
  for bad, what in refuse:
    if bad:
      raise KernelError(None, f"emit_pipeline_warp_specialized: {what} is "
                        "not supported yet", where, operand=what)
  if not all(isinstance(g, int) and g > 0 for g in grid):
    raise KernelError(None, f"emit_pipeline_warp_specialized: the grid must "
                      f"be positive ints, got {tuple(grid)}", where,
                      operand="grid")
  in_specs = _specs(in_specs)
  delays = {int(getattr(spec, "delay_release", 0) or 0) for spec in in_specs}
  if len(delays) > 1:
    raise KernelError(None, "every input of the pipeline must have the same "
                      f"delay_release, got {sorted(delays)}", where,
                      operand="in_specs")
  delay_release = delays.pop() if delays else 0
  if max_concurrent_steps <= delay_release:
    raise KernelError(None, "max_concurrent_steps must be greater than "
                      f"delay_release, got {max_concurrent_steps} and "
                      f"{delay_release}", where,
                      operand="max_concurrent_steps")
  # No more slots than steps.
  max_concurrent_steps = min(int(max_concurrent_steps), math.prod(grid))
  return WarpSpecializedPipeline(
      body, tuple(grid), in_specs, max_concurrent_steps, wg_axis,
      int(num_compute_wgs), int(memory_registers),
      bool(manual_consumed_barriers), compute_context, delay_release)
