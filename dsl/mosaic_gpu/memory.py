"""What the refs of a `plgpu` kernel are: memory spaces (GMEM, SMEM, TMEM,
registers), shared-memory layouts (tiling and swizzle transforms), mbarriers,
WGMMA accumulators, register layouts and the GPU BlockSpec.

A ref's memory space is in its aval (`AbstractRef.memory_space`):

- `GMEM` for the kernel's operands, `SMEM` for shared memory; an SMEM
  allocation with transforms has a `TransformedSpace(SMEM, transforms)`
  (`space_of(aval)` gives SMEM back). Tiling and swizzling change where the
  bytes lie in shared memory, never what a ref reads: the kernel indexes the
  logical (untiled) shape, and the interpret backend keeps it so.
- `BarrierSpace(num_arrivals, ...)` for an array of mbarriers (int32 slots
  that the interpreter pairs with its barrier states), as dsl's semaphores
  have a `SemaphoreSpace`.
- `REGS` for a WGMMA accumulator (`plgpu.ACC`): registers that `wgmma`
  accumulates into, zero when allocated.
- `TMEM` for tensor memory (Blackwell): a block's 128 rows of 512 32-bit
  columns that `tcgen05_mma` accumulates into and `async_load_tmem` reads.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Hashable, Sequence

import jax.numpy as jnp

from dsl.core.blockspec import BlockSpec as BaseBlockSpec
from dsl.core.errors import KernelError, user_frame
from dsl.core.jax_internals import core, state_types


class MemorySpace(enum.Enum):
  """Where a GPU ref lives; a member called with (shape, dtype) is a
  scratch type (`plgpu.SMEM((2, 64, 64), jnp.float16, transforms=...)`)."""
  GMEM = "gmem"
  SMEM = "smem"
  TMEM = "tmem"
  REGS = "regs"

  def __str__(self):
    return self.value

  def __call__(self, shape, dtype, *, transforms=(), packed=None,
               collective=None, layout=None):
    shape, dtype = tuple(int(d) for d in shape), jnp.dtype(dtype)
    if self is MemorySpace.TMEM:
      return tmem_ref(shape, dtype, transforms, packed, collective, layout)
    if packed is not None or collective is not None or layout is not None:
      raise KernelError(None, "packed, collective and layout are arguments "
                        f"of plgpu.TMEM only, not of {self.name}",
                        user_frame(), operand="memory_space")
    return GPUMemoryRef(shape, dtype, self, tuple(transforms))

  def like(self, shape_dtype):
    return self(shape_dtype.shape, shape_dtype.dtype)


GMEM = MemorySpace.GMEM
SMEM = MemorySpace.SMEM
TMEM = MemorySpace.TMEM
REGS = MemorySpace.REGS


@dataclasses.dataclass(frozen=True)
class TilingTransform:
  """Shared memory holds the minor dims in tiles of `tiling` (a (M, N)
  array tiled (X, Y) is stored as (M // X, N // Y, X, Y))."""
  tiling: tuple[int, ...]

  def __post_init__(self):
    tiling = tuple(self.tiling)
    if not tiling or any(not isinstance(t, int) or t <= 0 for t in tiling):
      raise ValueError(f"TilingTransform takes positive ints, got {tiling}")
    object.__setattr__(self, "tiling", tiling)

  def check(self, shape, dtype) -> str | None:
    tiled = tuple(shape)[-len(self.tiling):]
    if len(tiled) < len(self.tiling) or any(
        d % t for d, t in zip(tiled, self.tiling)):
      return f"the tiling {self.tiling} does not divide the shape {shape}"
    return None

  def __str__(self):
    return f"tile{self.tiling}"


@dataclasses.dataclass(frozen=True)
class SwizzleTransform:
  """Rows of `swizzle` bytes are stored with their 16-byte chunks permuted
  (what WGMMA and TMA read without bank conflicts)."""
  swizzle: int

  def __post_init__(self):
    if self.swizzle not in (32, 64, 128):
      raise ValueError(f"Swizzle {self.swizzle} is not supported: 32, 64 and "
                       "128 (bytes) are")

  def check(self, shape, dtype) -> str | None:
    elems = self.swizzle // jnp.dtype(dtype).itemsize
    if not shape or shape[-1] % elems:
      return (f"a swizzle of {self.swizzle} bytes needs the minor dim to be "
              f"a multiple of {elems} {jnp.dtype(dtype).name} elements, got "
              f"the shape {shape}")
    return None

  def __str__(self):
    return f"swizzle({self.swizzle})"


@dataclasses.dataclass(frozen=True)
class TransformedSpace:
  """The memory space of an allocation laid out by `transforms`."""
  space: MemorySpace
  transforms: tuple[Any, ...]

  def __str__(self):
    return f"{self.space}{{{','.join(map(str, self.transforms))}}}"


def space_of(aval) -> Any:
  """The memory space of a ref aval, without its layout."""
  space = getattr(aval, "memory_space", None)
  return space.space if isinstance(space, TransformedSpace) else space


@dataclasses.dataclass(frozen=True)
class GPUMemoryRef:
  """A scratch type in GPU memory: shape, dtype, space and layout."""
  shape: tuple[int, ...]
  dtype: Any
  memory_space: MemorySpace
  transforms: tuple[Any, ...] = ()
  collective: bool = False     # TMEM: a collective (2-block) allocation
  packed: bool = False         # TMEM: two 16-bit values per 32-bit column

  def get_ref_aval(self) -> state_types.AbstractRef:
    for t in self.transforms:
      problem = t.check(self.shape, self.dtype) if hasattr(t, "check") else (
          f"{t!r} is not a plgpu.TilingTransform or SwizzleTransform")
      if problem:
        raise KernelError(None, f"{self.memory_space}{self.shape}: {problem}",
                          user_frame(), operand="transforms")
    space = (TransformedSpace(self.memory_space, self.transforms)
             if self.transforms else self.memory_space)
    return state_types.AbstractRef(
        core.ShapedArray(self.shape, jnp.dtype(self.dtype)),
        memory_space=space)


# --------------------------------------------------------- tensor memory

TMEM_ROWS = 128       # lanes of a block's tensor memory
TMEM_COLUMNS = 512    # 32-bit columns of a block's tensor memory


def tmem_ref(shape, dtype, transforms, packed, collective, layout
             ) -> GPUMemoryRef:
  """`plgpu.TMEM(shape, dtype)`: tensor memory, Blackwell's per-block
  store of `tcgen05_mma` accumulators (`packed` 16-bit values share a
  32-bit column; `layout`, a TMEM layout, is kept by the hardware only)."""
  def refuse(message):
    raise KernelError(None, f"plgpu.TMEM{shape}: {message}", user_frame(),
                      operand="memory_space")
  if transforms:
    refuse("transforms are not supported for TMEM")
  bits = dtype.itemsize * 8
  if layout is None and packed is None and bits != 32:
    refuse(f"a {dtype.name} dtype (narrower than 32 bits) needs packed= "
           "or an explicit TMEM layout")
  if layout is not None and packed is not None:
    refuse("packed cannot be given with a layout")
  if len(shape) != 2:
    refuse("TMEM refs are 2D (rows, columns) here")
  per_column = 32 // bits if packed and bits < 32 else 1
  columns = -(-shape[1] // per_column) * max(bits // 32, 1)
  if shape[0] > TMEM_ROWS or columns > TMEM_COLUMNS:
    refuse(f"a block's tensor memory holds {TMEM_ROWS} rows of "
           f"{TMEM_COLUMNS} 32-bit columns; this ref needs {shape[0]} rows "
           f"of {columns}")
  return GPUMemoryRef(shape, dtype, MemorySpace.TMEM, (),
                      collective=bool(collective), packed=bool(packed))


def is_tmem_aval(aval) -> bool:
  return space_of(aval) is MemorySpace.TMEM


# ------------------------------------------------------------------ barriers

@dataclasses.dataclass(frozen=True)
class BarrierSpace:
  """The memory space of an array of mbarriers: a phase of each completes
  when `num_arrivals` arrivals (a `barrier_arrive`, or a TMA copy that
  names it) have been made; with `collective_axes`, the arrivals come from
  the blocks of a cluster (`leader_tracked`: they all arrive on the
  leader's)."""
  num_arrivals: int
  orders_tensor_core: bool = False
  collective_axes: tuple[Hashable, ...] = ()
  leader_tracked: bool = False

  def __str__(self):
    return "barrier"


def is_barrier_aval(aval) -> bool:
  return isinstance(getattr(aval, "memory_space", None), BarrierSpace)


def _check_barriers(barrier) -> None:
  """Checks a barrier type's arrivals; makes its `num_barriers` a shape."""
  if barrier.num_arrivals < 1:
    raise ValueError(f"Num arrivals must be at least 1, but got "
                     f"{barrier.num_arrivals}")
  n = barrier.num_barriers
  object.__setattr__(barrier, "num_barriers", (n,) if isinstance(n, int)
                     else tuple(int(d) for d in n))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Barrier:
  """A scratch type: `num_barriers` mbarriers (a scalar one by default),
  each completing a phase after `num_arrivals` arrivals."""
  num_arrivals: int = 1
  num_barriers: int | Sequence[int] = ()
  orders_tensor_core: bool = False

  def __post_init__(self):
    _check_barriers(self)

  def get_ref_aval(self) -> state_types.AbstractRef:
    return state_types.AbstractRef(
        core.ShapedArray(self.num_barriers, jnp.int32),
        memory_space=BarrierSpace(self.num_arrivals, self.orders_tensor_core))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterBarrier:
  """A Barrier whose arrivals come from every block of the cluster along
  `collective_axes`."""
  collective_axes: tuple[Hashable, ...]
  num_barriers: int | Sequence[int] = ()
  num_arrivals: int = 1
  orders_tensor_core: bool = False
  leader_tracked: bool = False

  def __post_init__(self):
    _check_barriers(self)
    axes = self.collective_axes
    object.__setattr__(self, "collective_axes",
                       tuple(axes) if isinstance(axes, (tuple, list))
                       else (axes,))

  def get_ref_aval(self) -> state_types.AbstractRef:
    return state_types.AbstractRef(
        core.ShapedArray(self.num_barriers, jnp.int32),
        memory_space=BarrierSpace(self.num_arrivals, self.orders_tensor_core,
                                  self.collective_axes, self.leader_tracked))


# ------------------------------------------------------------- accumulators

@dataclasses.dataclass(frozen=True)
class _InitializedAccumulator:
  """`ACC.init(x)`: an accumulator that starts at `x`, for `pl.run_state`."""
  shape: tuple[int, ...]
  dtype: Any
  value: Any

  def ref_aval(self) -> state_types.AbstractRef:
    return WGMMAAccumulatorRef(self.shape, self.dtype).get_ref_aval()

  def get_ref_aval(self):
    raise KernelError(None, "an initialized accumulator (plgpu.ACC.init(x)) "
                      "is for pl.run_state; pl.run_scoped allocates "
                      "plgpu.ACC(shape), which starts at zero", user_frame())


@dataclasses.dataclass(frozen=True)
class WGMMAAccumulatorRef:
  """A scratch type: a WGMMA accumulator in registers (`plgpu.ACC`), zero
  when allocated; `wgmma(acc, a, b)` adds `a @ b` to it."""
  shape: tuple[int, ...]
  dtype: Any = jnp.float32

  def get_ref_aval(self) -> state_types.AbstractRef:
    return state_types.AbstractRef(
        core.ShapedArray(tuple(self.shape), jnp.dtype(self.dtype)),
        memory_space=MemorySpace.REGS)

  @staticmethod
  def init(array) -> _InitializedAccumulator:
    return _InitializedAccumulator(tuple(array.shape), array.dtype, array)


ACC = WGMMAAccumulatorRef


def is_accumulator_aval(aval) -> bool:
  return getattr(aval, "memory_space", None) is MemorySpace.REGS


# ------------------------------------------------------------------ layouts

class SomeLayout:
  """A register layout: where the elements of an array live among the
  threads of a warpgroup. `reduce(axes)` is the layout of a reduction."""

  def reduce(self, axes) -> "ReducedLayout":
    return ReducedLayout(self, (axes,) if isinstance(axes, int)
                         else tuple(axes))


@dataclasses.dataclass(frozen=True)
class ParameterizedLayout(SomeLayout):
  """A layout that takes arguments (`Layout.WG_SPLAT(shape=...)`)."""
  layout: "Layout"
  args: tuple[Any, ...]
  kwargs: tuple[tuple[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class ReducedLayout(SomeLayout):
  """`layout` with `axes` reduced away."""
  layout: SomeLayout
  axes: tuple[int, ...]


class Layout(SomeLayout, enum.Enum):
  """Register layouts of Mosaic GPU (WGMMA: an (m, n) matrix as WGMMA
  reads and writes it, m % 64 == 0 == n % 8)."""
  WGMMA = enum.auto()
  WGMMA_8BIT = enum.auto()
  WGMMA_UPCAST_2X = enum.auto()
  WGMMA_UPCAST_4X = enum.auto()
  WGMMA_TRANSPOSED = enum.auto()
  WG_SPLAT = enum.auto()
  WG_STRIDED = enum.auto()
  TILED = enum.auto()
  TCGEN05 = enum.auto()
  TCGEN05_TRANSPOSED = enum.auto()
  TCGEN05_M64_COLLECTIVE = enum.auto()
  TCGEN05_TMEM_NATIVE = enum.auto()
  TCGEN05_M64_COLLECTIVE_NATIVE = enum.auto()
  SMEM_GMEM_COPY = enum.auto()
  TMA_INDICES = enum.auto()
  TMA_INDICES_4 = enum.auto()
  MMA_LHS = enum.auto()
  MMA_RHS = enum.auto()
  MMA_ACC = enum.auto()

  def __call__(self, *args, **kwargs) -> ParameterizedLayout:
    return ParameterizedLayout(self, tuple(args), tuple(sorted(kwargs.items())))


def check_layout(layout) -> SomeLayout:
  if not isinstance(layout, SomeLayout):
    raise KernelError(None, f"expected a plgpu.Layout, got {layout!r}",
                      user_frame(), operand="layout")
  return layout


# ---------------------------------------------------------------- BlockSpec

class OOBFillMode(enum.IntEnum):
  """What a TMA load reads past its array: anything, nothing (the kernel
  promises), or zeros."""
  UNDEFINED = 0
  PROMISE_IN_BOUNDS = 1
  ZEROS = 2


class CopyPartition:
  """How a collective TMA copy (`collective_axes=`) splits among the blocks
  of a cluster: `PARTITIONED(axis)`, each block loads its part along
  `axis`; `REPLICATED`, each block loads it all."""
  PARTITIONED: Any
  REPLICATED: Any


@dataclasses.dataclass(frozen=True)
class _Partitioned(CopyPartition):
  axis: int


@dataclasses.dataclass(frozen=True)
class _Replicated(CopyPartition):
  pass


CopyPartition.PARTITIONED = _Partitioned
CopyPartition.REPLICATED = _Replicated()


@dataclasses.dataclass(frozen=True)
class BlockSpec(BaseBlockSpec):
  """A BlockSpec with the GPU's options: the SMEM layout of its blocks
  (`transforms`), how many steps a pipeline keeps a slot after using it
  (`delay_release`), the cluster axes whose blocks load it together
  (`collective_axes`) and what reads past the array see (`oob_fill_mode`)."""
  transforms: Sequence[Any] = ()
  delay_release: int = 0
  collective_axes: tuple[Hashable, ...] | None = None
  oob_fill_mode: Any = None

  def __post_init__(self):
    super().__post_init__()
    object.__setattr__(self, "transforms", tuple(self.transforms))
