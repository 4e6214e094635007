"""Shared memory laid out by plgpu's tiling and swizzle transforms
(`plgpu.SMEM(shape, dtype, transforms=(TilingTransform((8, 64)),
SwizzleTransform(128)))`).

Such an allocation is sliced from the kernel's shared memory in its tiled
shape (a `(2, 64, 128)` buffer tiled `(8, 64)` is a `(2, 8, 2, 8, 64)`
memref); every op that uses it sees the logical shape, with the layout
attached (`mosaic_gpu.reinterpret_cast` to the logical shape, then
`mosaic_gpu.with_transforms`), built afresh at each use, as Pallas does, so
windows of it (`x.at[i]`) are subviews of the logical view that the
library's transform inference follows. Swizzling permutes bytes within
rows and never changes a shape.
"""
from __future__ import annotations

import dataclasses

from dsl.core.jax_internals import ir, mosaic_gpu_dialect as mgpu
from dsl.mosaic_gpu.memory import SwizzleTransform, TilingTransform


def tiled_shape(shape, transforms) -> tuple[int, ...]:
  """The shape of the memref that holds a buffer of logical `shape` laid
  out by `transforms`: each tiling splits the minor dims into (tiles,
  tile)."""
  shape = tuple(int(d) for d in shape)
  for t in transforms:
    if isinstance(t, TilingTransform):
      k = len(t.tiling)
      lead, minor = shape[:-k], shape[-k:]
      shape = (*lead, *(d // s for d, s in zip(minor, t.tiling)), *t.tiling)
  return shape


def _attr(t) -> ir.Attribute:
  if isinstance(t, TilingTransform):
    return mgpu.TileTransformAttr.get(list(t.tiling))
  if isinstance(t, SwizzleTransform):
    return mgpu.SwizzleTransformAttr.get(t.swizzle)
  raise NotImplementedError(f"the SMEM transform {t}")


@dataclasses.dataclass(frozen=True)
class LaidOutSmem:
  """A shared-memory allocation with transforms: the memref of its tiled
  shape (`raw`), its logical shape and its transforms."""
  raw: ir.Value
  shape: tuple[int, ...]
  transforms: tuple

  def view(self) -> ir.Value:
    """The logical view of the buffer, its layout attached."""
    raw_type = ir.MemRefType(self.raw.type)
    ty = ir.MemRefType.get(list(self.shape), raw_type.element_type,
                           memory_space=raw_type.memory_space)
    cast = mgpu.reinterpret_cast(ty, self.raw)
    return mgpu.with_transforms(
        cast, ir.ArrayAttr.get([_attr(t) for t in self.transforms]))


def memref_of(ref):
  """The memref an op reads or writes for the kernel's ref `ref`."""
  return ref.view() if isinstance(ref, LaidOutSmem) else ref
