"""The asynchronous-copy and synchronization primitives of `plgpu`: TMA
copies between global and shared memory, mbarriers, and the fences and
waits around them.

Each is a JAX primitive with an abstract eval whose effects name the refs it
reads and writes; refs with transforms (`x.at[i]`, `x.transpose(...)`) are
passed as flat leaves with their pytree (`dsl.core.operand_layout.pack`).
Primitives that touch no ref carry `GPUEffect`, so that they stay where the
kernel put them.

Meaning (the hardware's, which the interpret backend's warpgroup
interpreter, dsl/interpret/warpgroups.py, follows):

- `copy_gmem_to_smem(src, dst, barrier)`: a TMA load; the data lands in
  `dst` and the copy makes one arrival on `barrier` (with its bytes), so a
  `barrier_wait` on it returns once the data is there.
- `copy_smem_to_gmem(src, dst)`: a TMA store, committed to a bulk group;
  `wait_smem_to_gmem(n)` waits until at most `n` groups are in flight (with
  `wait_read_only`, until their reads of SMEM are done).
- `commit_smem()`: makes the thread's SMEM writes visible to the TMA unit
  (before a `copy_smem_to_gmem` of them).
- `barrier_arrive(b)`: one arrival on `b`; `barrier_wait(b)`: waits for the
  next phase of `b` this thread has not waited for yet.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive

from dsl.core.errors import KernelError, KernelTypeError, user_frame
from dsl.core.primitives import allowed_everywhere
from dsl.core.jax_internals import core, effects, state_types
from dsl.core.operand_layout import (effects as ref_effects, pack,
                                     ref_and_transforms as ref_parts)
from dsl.core.memory import MemorySpace as CoreMemorySpace
from dsl.mosaic_gpu.memory import (GMEM, SMEM, CopyPartition, is_barrier_aval,
                                   space_of)


@allowed_everywhere
class GPUEffect(effects.Effect):
  """The effect of a `plgpu` primitive that touches no ref of the kernel
  (a fence, a wait, a register budget): it keeps its place."""

  def __str__(self):
    return "GPU"


gpu_effect = GPUEffect()


def view_aval(ref, transforms):
  """The aval (shape, dtype) that `ref` with `transforms` reads."""
  if transforms:
    t = state_types.TransformedRef(ref, transforms)
    return core.ShapedArray(tuple(t.shape), t.dtype)
  return core.typeof(ref).inner_aval


def _space(ref):
  return space_of(core.typeof(ref))


def _check_space(what, ref, allowed, words):
  space = _space(ref)
  if space not in allowed:
    raise KernelTypeError(None, f"{what} must be a ref in {words}, got one "
                          f"in {space}", user_frame(), operand=what)


_GLOBAL = (GMEM, CoreMemorySpace.ANY, None)


def _check_copy(src, src_t, dst, dst_t):
  s, d = view_aval(src, src_t), view_aval(dst, dst_t)
  if s.shape != d.shape or s.dtype != d.dtype:
    raise KernelTypeError(
        None, f"the copy's source is {s.str_short()} but its destination is "
        f"{d.str_short()}; they must have the same shape and dtype",
        user_frame(), operand="dst")


def barrier_parts(what: str, barrier):
  """(ref, transforms) of one mbarrier (`barriers.at[i]`)."""
  ref, transforms = ref_parts(what, barrier)
  if not is_barrier_aval(core.typeof(ref)):
    raise KernelTypeError(None, f"{what} must be a plgpu.Barrier, got a ref "
                          f"in {core.typeof(ref).memory_space}", user_frame(),
                          operand=what)
  shape = view_aval(ref, transforms).shape
  if shape != ():
    raise KernelError(None, f"{what} must select one barrier, but it selects "
                      f"an array of shape {shape}; index it, e.g. "
                      "barriers.at[slot]", user_frame(), operand=what)
  return ref, transforms


def predicate_operands(predicate):
  return () if predicate is None else (jnp.asarray(predicate, jnp.bool_),)


# ------------------------------------------------------------- TMA copies

copy_gmem_to_smem_p = Primitive("copy_gmem_to_smem")
copy_gmem_to_smem_p.multiple_results = True


@copy_gmem_to_smem_p.def_effectful_abstract_eval
def _copy_gmem_to_smem_abstract_eval(*avals, layout, collective_axes,
                                     leader_tracked, oob_mode):
  return [], ref_effects(layout, reads=("src",), writes=("dst", "barrier"))


def copy_gmem_to_smem(src, dst, barrier=None, *, collective_axes=None,
                      leader_tracked=None, oob_mode=None, predicate=None):
  """Starts a TMA copy of `src` (GMEM) into `dst` (SMEM) that arrives on
  `barrier` when the data has landed (`barrier_wait(barrier)` waits for it).
  `predicate` False skips both the copy and the arrival."""
  src, src_t = ref_parts("src", src)
  dst, dst_t = ref_parts("dst", dst)
  _check_space("src", src, _GLOBAL, "GMEM")
  _check_space("dst", dst, (SMEM,), "SMEM")
  if not isinstance(leader_tracked, CopyPartition.PARTITIONED):
    # (a partitioned copy's dst holds this block's part of src)
    _check_copy(src, src_t, dst, dst_t)
  if barrier is None:
    raise KernelError(None, "copy_gmem_to_smem needs a barrier on Hopper: "
                      "the TMA copy arrives on it when its data has landed",
                      user_frame(), operand="barrier")
  bar, bar_t = barrier_parts("barrier", barrier)
  if isinstance(collective_axes, str):
    collective_axes = (collective_axes,)
  flat, layout = pack(src=src, src_t=src_t, dst=dst, dst_t=dst_t,
                      barrier=bar, barrier_t=bar_t,
                      predicate=predicate_operands(predicate))
  copy_gmem_to_smem_p.bind(
      *flat, layout=layout,
      collective_axes=None if collective_axes is None else tuple(
          collective_axes),
      leader_tracked=leader_tracked, oob_mode=oob_mode)


copy_smem_to_gmem_p = Primitive("copy_smem_to_gmem")
copy_smem_to_gmem_p.multiple_results = True


@copy_smem_to_gmem_p.def_effectful_abstract_eval
def _copy_smem_to_gmem_abstract_eval(*avals, layout, commit_group,
                                     reduction_op):
  reads = ("src", "dst") if reduction_op is not None else ("src",)
  return [], ref_effects(layout, reads=reads, writes=("dst",)) | {gpu_effect}


def copy_smem_to_gmem(src, dst, predicate=None, *, commit_group: bool = True,
                      reduction_op=None):
  """Starts a TMA copy of `src` (SMEM) into `dst` (GMEM); with
  `commit_group` it closes a bulk group that `wait_smem_to_gmem` counts.
  `reduction_op` ("add", "max", ...) combines with what `dst` holds."""
  src, src_t = ref_parts("src", src)
  dst, dst_t = ref_parts("dst", dst)
  _check_space("src", src, (SMEM,), "SMEM")
  _check_space("dst", dst, _GLOBAL, "GMEM")
  _check_copy(src, src_t, dst, dst_t)
  flat, layout = pack(src=src, src_t=src_t, dst=dst, dst_t=dst_t,
                      predicate=predicate_operands(predicate))
  copy_smem_to_gmem_p.bind(*flat, layout=layout,
                           commit_group=bool(commit_group),
                           reduction_op=reduction_op)


def no_ref_primitive(name: str) -> Primitive:
  prim = Primitive(name)
  prim.multiple_results = True
  prim.def_effectful_abstract_eval(lambda **_: ([], {gpu_effect}))
  return prim


wait_smem_to_gmem_p = no_ref_primitive("wait_smem_to_gmem")
commit_group_p = no_ref_primitive("commit_smem_to_gmem_group")
commit_smem_p = no_ref_primitive("commit_smem")


def wait_smem_to_gmem(n: int, wait_read_only: bool = False) -> None:
  """Waits until at most `n` bulk groups of SMEM -> GMEM copies are in
  flight (`wait_read_only`: until they have read their SMEM)."""
  wait_smem_to_gmem_p.bind(n=int(n), wait_read_only=bool(wait_read_only))


def commit_smem_to_gmem_group() -> None:
  """Closes a bulk group of the SMEM -> GMEM copies started without one."""
  commit_group_p.bind()


def commit_smem() -> None:
  """Makes this thread's SMEM writes visible to the TMA unit."""
  commit_smem_p.bind()


# ------------------------------------------------------------------ barriers

barrier_arrive_p = Primitive("barrier_arrive")
barrier_arrive_p.multiple_results = True
barrier_wait_p = Primitive("barrier_wait")
barrier_wait_p.multiple_results = True


def _barrier_abstract_eval(*avals, layout):
  return [], ref_effects(layout, reads=("barrier",), writes=("barrier",))


barrier_arrive_p.def_effectful_abstract_eval(_barrier_abstract_eval)
barrier_wait_p.def_effectful_abstract_eval(_barrier_abstract_eval)


def barrier_arrive(barrier) -> None:
  """One arrival on `barrier` (one mbarrier: `barriers.at[i]`)."""
  ref, transforms = barrier_parts("barrier", barrier)
  flat, layout = pack(barrier=ref, barrier_t=transforms)
  barrier_arrive_p.bind(*flat, layout=layout)


def barrier_wait(barrier) -> None:
  """Waits for the next phase of `barrier` that this thread has not waited
  for (mbarriers track phases by parity: a thread must wait for each phase
  before the barrier completes the one after it)."""
  ref, transforms = barrier_parts("barrier", barrier)
  flat, layout = pack(barrier=ref, barrier_t=transforms)
  barrier_wait_p.bind(*flat, layout=layout)


def barrier_arrive_and_wait(barrier) -> None:
  """One arrival on `barrier`, then a wait for the phase it completes."""
  barrier_arrive(barrier)
  barrier_wait(barrier)
