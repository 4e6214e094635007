"""Blackwell's tensor-core primitives of `plgpu`: the tcgen05 MMA, which
accumulates in tensor memory (`plgpu.TMEM`), and the loads, stores and
copies that move data in and out of that memory.

Meaning (the hardware's, which the interpret backend's warpgroup
interpreter follows, dsl/interpret/tensor_core.py):

- `tcgen05_mma(acc, a, b, barrier, accumulate=)`: `acc = acc + a @ b` (or
  `a @ b` when `accumulate` is False), issued to the tensor core and run
  asynchronously: `acc` in TMEM, `a` in SMEM or TMEM, `b` in SMEM. With a
  `barrier`, the MMA's completion (and that of every earlier tcgen05
  operation of the issuing thread) arrives on it; until a thread has
  waited for that phase, the MMA may still read `a` and `b` and write
  `acc`.
- `tcgen05_commit_arrive(barrier)`: arrives on `barrier` when every
  tcgen05 operation this thread issued before has completed.
- `async_load_tmem(src)`: the value of `src` (TMEM) in registers; the read
  of TMEM finishes at the next `wait_load_tmem()` of the thread.
- `async_store_tmem(ref, value)`: writes `value` into `ref` (TMEM),
  visible to loads and MMAs after the thread's next `commit_tmem()`.
- `async_copy_smem_to_tmem(src, dst)`: a tensor-core copy of `src` (SMEM)
  into `dst` (TMEM), ordered with the MMAs; `tcgen05_commit_arrive` tracks
  its completion.

Each is a JAX primitive whose abstract eval names the refs it reads and
writes, with refs and their transforms packed as for the Hopper copies
(`dsl.core.operand_layout.pack`).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive

from dsl.core.errors import KernelError, KernelTypeError, user_frame
from dsl.core.jax_internals import core
from dsl.core.operand_layout import pack, ref_and_transforms as ref_parts
from dsl.mosaic_gpu.memory import SMEM, TMEM, space_of
from dsl.mosaic_gpu.compute import layout_cast
from dsl.mosaic_gpu.primitives import (barrier_parts, no_ref_primitive,
                                       predicate_operands, ref_effects,
                                       view_aval)

_ACC_DTYPES = (jnp.float32, jnp.float16, jnp.int32)


def _ref(what, ref, spaces, words):
  """(ref, transforms, view aval) of a ref operand in one of `spaces`."""
  ref, transforms = ref_parts(what, ref)
  space = space_of(core.typeof(ref))
  if space not in spaces:
    raise KernelTypeError(None, f"{what} must be a ref in {words}, got one "
                          f"in {space}", user_frame(), operand=what)
  return ref, transforms, view_aval(ref, transforms)


def _tensor_core_barrier(what, barrier):
  ref, transforms = barrier_parts(what, barrier)
  if not core.typeof(ref).memory_space.orders_tensor_core:
    raise KernelError(None, f"{what} must be a plgpu.Barrier with "
                      "orders_tensor_core=True: the tensor core arrives on "
                      "it", user_frame(), operand=what)
  return ref, transforms


# ------------------------------------------------------------------- MMA

tcgen05_mma_p = Primitive("tcgen05_mma")
tcgen05_mma_p.multiple_results = True


@tcgen05_mma_p.def_effectful_abstract_eval
def _tcgen05_mma_abstract_eval(*avals, layout, collective_axis):
  return [], ref_effects(layout, reads=("acc", "a", "b"),
                         writes=("acc", "barrier"))


def _check_mma_shapes(acc, a, b, collective_axis):
  (m, n), (m2, k), (k2, n2) = acc.shape, a.shape, b.shape
  wide = 2 if collective_axis is not None else 1
  if m != m2 or k != k2 or n != n2 * wide:
    want = "(m, 2n) += (m, k) @ (k, n)" if wide == 2 else (
        "(m, n) += (m, k) @ (k, n)")
    raise KernelError(None, f"tcgen05_mma: acc {acc.str_short()} += a "
                      f"{a.str_short()} @ b {b.str_short()}: the shapes must "
                      f"be {want}", user_frame(), operand="b")
  if a.dtype != b.dtype:
    raise KernelTypeError(None, f"tcgen05_mma: a is {a.dtype} but b is "
                          f"{b.dtype}; they must have the same dtype",
                          user_frame(), operand="b")
  if acc.dtype not in map(jnp.dtype, _ACC_DTYPES):
    raise KernelTypeError(None, f"tcgen05_mma accumulates in float32, "
                          f"float16 or int32, not {acc.dtype}", user_frame(),
                          operand="acc")


def tcgen05_mma(acc, a, b, barrier=None, *, a_scale=None, b_scale=None,
                a_sparse_metadata=None, accumulate=True,
                collective_axis: str | None = None) -> None:
  """Issues `acc (+)= a @ b` to the tensor core (asynchronous): `acc` in
  TMEM, `a` in SMEM or TMEM, `b` in SMEM; `accumulate` False overwrites
  `acc`. Its completion arrives on `barrier` (orders_tensor_core=True), or
  on the barrier of a later `tcgen05_commit_arrive`."""
  for name, extra in (("a_scale", a_scale), ("b_scale", b_scale),
                      ("a_sparse_metadata", a_sparse_metadata)):
    if extra is not None:
      raise KernelError(None, "block-scaled and sparse tcgen05 MMAs "
                        f"({name}=) are not supported yet", user_frame(),
                        operand=name)
  acc, acc_t, acc_aval = _ref("acc", acc, (TMEM,), "TMEM")
  a, a_t, a_aval = _ref("a", a, (SMEM, TMEM), "SMEM or TMEM")
  b, b_t, b_aval = _ref("b", b, (SMEM,), "SMEM")
  _check_mma_shapes(acc_aval, a_aval, b_aval, collective_axis)
  bar, bar_t = ((), ()) if barrier is None else _tensor_core_barrier(
      "barrier", barrier)
  flat, layout = pack(acc=acc, acc_t=acc_t, a=a, a_t=a_t, b=b, b_t=b_t,
                      accumulate=jnp.asarray(accumulate, jnp.bool_),
                      barrier=bar, barrier_t=bar_t)
  tcgen05_mma_p.bind(*flat, layout=layout, collective_axis=collective_axis)


tcgen05_commit_arrive_p = Primitive("tcgen05_commit_arrive")
tcgen05_commit_arrive_p.multiple_results = True


@tcgen05_commit_arrive_p.def_effectful_abstract_eval
def _commit_arrive_abstract_eval(*avals, layout, collective_axis):
  return [], ref_effects(layout, reads=("barrier",), writes=("barrier",))


def tcgen05_commit_arrive(barrier, collective_axis: str | None = None, *,
                          predicate=None) -> None:
  """Arrives on `barrier` (orders_tensor_core=True) once every tcgen05
  operation this thread issued so far has completed; `predicate` False
  skips it."""
  bar, bar_t = _tensor_core_barrier("barrier", barrier)
  flat, layout = pack(barrier=bar, barrier_t=bar_t,
                      predicate=predicate_operands(predicate))
  tcgen05_commit_arrive_p.bind(*flat, layout=layout,
                               collective_axis=collective_axis)


# ------------------------------------------------------ loads and stores

async_load_tmem_p = Primitive("async_load_tmem")


@async_load_tmem_p.def_effectful_abstract_eval
def _async_load_tmem_abstract_eval(*avals, layout, shape, dtype):
  return core.ShapedArray(shape, dtype), ref_effects(layout, reads=("src",))


def async_load_tmem(src, *, layout=None, reduce=None):
  """The value of `src` (TMEM), read asynchronously: usable at once, but
  the read of TMEM finishes only at the thread's next `wait_load_tmem()`
  (wait for it before anything overwrites `src`)."""
  if reduce is not None:
    raise KernelError(None, f"async_load_tmem(reduce={reduce!r}) is not "
                      "supported yet", user_frame(), operand="reduce")
  ref, transforms, aval = _ref("src", src, (TMEM,), "TMEM")
  flat, packed = pack(src=ref, src_t=transforms)
  out = async_load_tmem_p.bind(*flat, layout=packed, shape=tuple(aval.shape),
                               dtype=aval.dtype)
  return out if layout is None else layout_cast(out, layout)


async_store_tmem_p = Primitive("async_store_tmem")
async_store_tmem_p.multiple_results = True


@async_store_tmem_p.def_effectful_abstract_eval
def _async_store_tmem_abstract_eval(*avals, layout):
  return [], ref_effects(layout, writes=("ref",))


def async_store_tmem(ref, value) -> None:
  """Writes `value` into `ref` (TMEM); loads and MMAs see it after this
  thread's next `commit_tmem()`."""
  ref, transforms, aval = _ref("ref", ref, (TMEM,), "TMEM")
  value = jnp.asarray(value)
  if value.shape != aval.shape:
    raise KernelError(None, f"async_store_tmem: the value is "
                      f"{value.shape} but the ref is {aval.str_short()}",
                      user_frame(), operand="value")
  flat, layout = pack(ref=ref, ref_t=transforms,
                      value=value.astype(aval.dtype))
  async_store_tmem_p.bind(*flat, layout=layout)


async_copy_smem_to_tmem_p = Primitive("async_copy_smem_to_tmem")
async_copy_smem_to_tmem_p.multiple_results = True


@async_copy_smem_to_tmem_p.def_effectful_abstract_eval
def _copy_smem_to_tmem_abstract_eval(*avals, layout, collective_axis):
  return [], ref_effects(layout, reads=("src",), writes=("dst",))


def async_copy_smem_to_tmem(src, dst, *, collective_axis=None) -> None:
  """Copies `src` (SMEM) into `dst` (TMEM) on the tensor core, in order
  with its MMAs; `tcgen05_commit_arrive` tracks its completion."""
  src, src_t, s = _ref("src", src, (SMEM,), "SMEM")
  dst, dst_t, d = _ref("dst", dst, (TMEM,), "TMEM")
  if s.shape != d.shape or s.dtype != d.dtype:
    raise KernelTypeError(None, f"the copy's source is {s.str_short()} but "
                          f"its destination is {d.str_short()}; they must "
                          "have the same shape and dtype", user_frame(),
                          operand="dst")
  flat, layout = pack(src=src, src_t=src_t, dst=dst, dst_t=dst_t)
  async_copy_smem_to_tmem_p.bind(*flat, layout=layout,
                                 collective_axis=collective_axis)


wait_load_tmem_p = no_ref_primitive("wait_load_tmem")
commit_tmem_p = no_ref_primitive("commit_tmem")


def wait_load_tmem() -> None:
  """Waits until this thread's TMEM loads have read their TMEM."""
  wait_load_tmem_p.bind()


def commit_tmem() -> None:
  """Makes this thread's TMEM stores visible to loads and MMAs."""
  commit_tmem_p.bind()
