"""Memory spaces and scratch-buffer shapes."""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax.numpy as jnp
from dsl.core.jax_internals import core, state_types
from dsl.core.errors import KernelError, KernelTypeError, user_frame


class MemorySpace(enum.Enum):
  """Where a ref lives. ANY leaves an operand unblocked (in HBM on TPU)."""
  ANY = "any"
  VMEM = "vmem"
  SMEM = "smem"
  HBM = "hbm"
  SEMAPHORE = "semaphore"
  GLOBAL = "global"

  def __str__(self):
    return self.value

  def __call__(self, shape, dtype):
    return MemoryRef(tuple(shape), jnp.dtype(dtype), self)


ANY = MemorySpace.ANY


@dataclasses.dataclass(frozen=True)
class MemoryRef:
  """A scratch buffer: shape, dtype and memory space (e.g. `tpu.VMEM((8, 128), f32)`)."""
  shape: tuple[int, ...]
  dtype: Any
  memory_space: Any = None

  def get_ref_aval(self) -> state_types.AbstractRef:
    return state_types.AbstractRef(
        core.ShapedArray(tuple(self.shape), jnp.dtype(self.dtype)),
        memory_space=self.memory_space)


def scratch_aval(kernel: str, index: int, shape: Any) -> state_types.AbstractRef:
  """The ref aval of `scratch_shapes[index]`."""
  if hasattr(shape, "get_ref_aval"):
    return shape.get_ref_aval()
  if isinstance(shape, state_types.AbstractRef):
    return shape
  if hasattr(shape, "shape") and hasattr(shape, "dtype"):
    return state_types.AbstractRef(
        core.ShapedArray(tuple(shape.shape), jnp.dtype(shape.dtype)))
  if isinstance(shape, (tuple, list)) and all(
      isinstance(d, int) for d in shape):
    raise KernelTypeError(
        kernel, f"a scratch buffer needs a memory space and a dtype besides "
        f"its shape: got the shape {tuple(shape)} alone; write "
        f"tpu.VMEM({tuple(shape)}, jnp.float32) (or the dtype it holds)",
        user_frame(), operand=f"scratch_shapes[{index}]")
  raise KernelError(kernel, f"expected a scratch shape such as "
                    f"tpu.VMEM((8, 128), jnp.float32), got {shape!r}",
                    user_frame(), operand=f"scratch_shapes[{index}]")
