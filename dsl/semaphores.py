"""Semaphore types of TPU kernels and the barrier semaphore.

A semaphore is a ref of int32 counters whose memory space is a
`SemaphoreSpace` (its `kind` is "dma", "regular" or "barrier");
`SemaphoreType.DMA((2,))` is an array of them as a scratch shape.
"""
from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp
from jax._src import core
from jax._src.state import types as state_types


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
  (`dsl.tpu_primitives`): `handle` is the value of the
  `get_barrier_semaphore` primitive, which the Mosaic lowering emits as
  `tpu.sem_barrier` where it is called; signals, waits and reads of the
  semaphore take it as an operand."""

  shape = ()
  dtype = jnp.dtype(jnp.int32)

  def __init__(self, handle=None):
    self.handle = handle

  def __repr__(self):
    return "BarrierSemaphore()"
