"""Semaphore types of TPU kernels and the barrier semaphore (its
`get_barrier_semaphore` primitive).

A semaphore is a ref of int32 counters whose memory space is a
`SemaphoreSpace` (its `kind` is "dma", "regular" or "barrier");
`SemaphoreType.DMA((2,))` is an array of them as a scratch shape.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax.numpy as jnp
from dsl.core.jax_internals import core, debugging, mlir, state_types
from jax.extend.core import Primitive

from dsl.core.errors import KernelError, KernelTypeError, user_frame
from dsl.core.jaxpr_walk import sub_jaxprs


@dataclasses.dataclass(frozen=True)
class SemaphoreSpace:
  """The memory space of a semaphore ref; `kind` is dma, regular or barrier."""
  kind: str

  def __str__(self):
    return f"semaphore<{self.kind}>"


def is_semaphore_aval(aval) -> bool:
  return isinstance(getattr(aval, "memory_space", None), SemaphoreSpace)


@dataclasses.dataclass(frozen=True)
class SemaphoreShape:
  """An array of semaphores as a scratch shape: `SemaphoreType.DMA((2,))`."""
  type: "SemaphoreType"
  shape: tuple[int, ...] = ()

  @property
  def dtype(self):
    return jnp.dtype(jnp.int32)

  def get_ref_aval(self) -> state_types.AbstractRef:
    return state_types.AbstractRef(
        core.ShapedArray(tuple(self.shape), jnp.int32),
        memory_space=SemaphoreSpace(self.type.value))


class SemaphoreType(enum.Enum):
  """Semaphore kinds; a member is itself a scalar scratch shape, and called
  with a shape it makes an array of semaphores."""
  REGULAR = "regular"
  DMA = "dma"
  BARRIER = "barrier"

  def __call__(self, shape=()):
    if isinstance(shape, int):
      shape = (shape,)
    return SemaphoreShape(self, tuple(int(d) for d in shape))

  def get_ref_aval(self) -> state_types.AbstractRef:
    return SemaphoreShape(self, ()).get_ref_aval()


class DeviceIdType(enum.Enum):
  """How `device_id` names a device: mesh coordinates or a logical id."""
  MESH = "mesh"
  LOGICAL = "logical"


class BarrierSemaphore:
  """The kernel's barrier semaphore, as `get_barrier_semaphore()` returns it
  (below): `handle` is the value of the
  `get_barrier_semaphore` primitive, which the Mosaic lowering emits as
  `tpu.sem_barrier` where it is called; signals, waits and reads of the
  semaphore take it as an operand."""

  shape = ()
  dtype = jnp.dtype(jnp.int32)

  def __init__(self, handle=None):
    self.handle = handle

  def __repr__(self):
    return "BarrierSemaphore()"


get_barrier_semaphore_p = Primitive("get_barrier_semaphore")


@get_barrier_semaphore_p.def_effectful_abstract_eval
def _get_barrier_abstract_eval(*, tag):
  # effectful, so that a call whose semaphore is unused stays in the kernel
  # (and in its Mosaic module, as in Pallas's)
  return core.ShapedArray((), jnp.int32), {debugging.debug_effect}


get_barrier_semaphore_p.def_impl(lambda *, tag: jnp.int32(0))
mlir.register_lowering(get_barrier_semaphore_p, mlir.lower_fun(
    lambda *, tag: jnp.int32(0), multiple_results=False))


def get_barrier_semaphore(tag=None):
  """The barrier semaphore shared by the devices running this kernel.

  Devices signal each other's barrier semaphore with
  `semaphore_signal(sem, 1, device_id=peer)` and wait on their own.
  `tag` (hashable) names the collective instead of
  `CompilerParams(collective_id=...)`: on a TPU, kernels with the same tag
  get the same barrier semaphore; a kernel has at most one tag.
  """
  try:
    hash(tag)
  except TypeError:
    raise KernelTypeError(None, "get_barrier_semaphore(tag=...) must be "
                          f"hashable, got {type(tag).__name__}",
                          user_frame()) from None
  return BarrierSemaphore(get_barrier_semaphore_p.bind(tag=tag))


def barrier_tag(jaxpr, kernel: str | None = None,
                where: str | None = None) -> Any:
  """The one `get_barrier_semaphore(tag=...)` tag of a kernel jaxpr (None
  without one); several different tags are an error."""
  tags = set()

  def visit(j):
    for eqn in j.eqns:
      if (eqn.primitive is get_barrier_semaphore_p
          and eqn.params["tag"] is not None):
        tags.add(eqn.params["tag"])
      for sub in sub_jaxprs(eqn.params):
        visit(sub)
  visit(jaxpr)
  if len(tags) > 1:
    raise KernelError(kernel, "get_barrier_semaphore is called with "
                      f"different tags {sorted(map(repr, tags))}; a kernel "
                      "has one barrier semaphore, so at most one tag", where)
  return next(iter(tags), None)
