"""BlockSpec (what users write) and BlockMapping (what backends consume).

A BlockSpec is turned once into a BlockMapping: the block shape is checked
against the array, and the index map is traced to a jaxpr of the grid
indices (and scalar-prefetch refs). Every error names the kernel and the
operand (`in_specs[1]`), the expected and the actual value.
"""
from __future__ import annotations

import dataclasses
import enum
import inspect
import sys
from typing import Any, Callable, Sequence

import jax.numpy as jnp
import numpy as np
from jax import tree_util
from dsl.core.jax_internals import (api_util, close_jaxpr, ClosedJaxpr, core,
                                    linear_util as lu, partial_eval as pe,
                                    state_types)

from dsl.core.errors import (KernelError, KernelTypeError, function_location,
                             in_user_code)
from dsl.core.memory import MemorySpace


class _Squeezed:
  """A block dim of size 1 that the kernel does not see."""

  def __repr__(self):
    return "Squeezed"


Squeezed = squeezed = _Squeezed()


@dataclasses.dataclass(frozen=True)
class Element:
  """A block dim whose index map returns an element offset, not a block index."""
  block_size: int
  padding: tuple[int, int] = (0, 0)


@dataclasses.dataclass(frozen=True)
class Blocked:
  """An explicit blocked dim (the same as a plain int)."""
  block_size: int


BlockDim = Any  # int | _Squeezed | Element


class RevisitMode(enum.Enum):
  """Whether an output block may be revisited at any step (ANY) or only at
  the next one (IMMEDIATE, the default). A hint: every backend here keeps
  the block's contents between visits."""
  IMMEDIATE = "immediate"
  ANY = "any"


@dataclasses.dataclass(frozen=True)
class Buffered:
  """How many buffers a block's pipeline uses (`BlockSpec(pipeline_mode=)`).

  The host backends run blocks one at a time, so the count is a hint there;
  the Mosaic backend marks the window `synchronous` (1) or
  `double_buffered` (2), as a TPU accepts.
  """
  buffer_count: int
  use_lookahead: bool = False
  revisit: RevisitMode | None = None
  prefetched_count: int = 0


@dataclasses.dataclass(frozen=True)
class BlockSpec:
  """How an operand is carved into blocks over the grid."""
  block_shape: Sequence[Any] | None = None
  index_map: Callable[..., Any] | None = None
  memory_space: Any = None
  pipeline_mode: Any = None
  # The user's "file:line" that made this BlockSpec, for errors about it.
  where: str | None = dataclasses.field(default=None, compare=False,
                                        repr=False, kw_only=True)

  def __post_init__(self):
    if self.where is None:
      # skip __post_init__ and the dataclass's generated __init__
      object.__setattr__(self, "where", creation_site(depth=3))
    if (self.block_shape is not None and not callable(self.block_shape)
        and not isinstance(self.block_shape, tuple)):
      # (a callable block shape is the older argument order: reported with
      # the kernel's name in resolve_block_spec)
      object.__setattr__(self, "block_shape", tuple(self.block_shape))


def creation_site(depth: int = 1) -> str | None:
  """'file:line' of the innermost frame outside jax, dsl and the lowerings,
  `depth` frames above this one at least."""
  frame = sys._getframe(depth)
  while frame is not None:
    if in_user_code(frame.f_code.co_filename):
      return f"{frame.f_code.co_filename}:{frame.f_lineno}"
    frame = frame.f_back
  return None


def _dim_size(d: BlockDim) -> int:
  if d is squeezed:
    return 1
  if isinstance(d, Element):
    return d.block_size
  return d


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMapping:
  """A resolved BlockSpec: block dims, traced index map and array aval."""
  origin: str
  array_aval: core.ShapedArray
  block_shape: tuple[BlockDim, ...]
  index_map_jaxpr: ClosedJaxpr
  memory_space: Any = None
  whole_array: bool = False
  pipeline_mode: Buffered | None = None
  # The user's "file:line" of the BlockSpec, for errors about it.
  where: str | None = None

  def to_spec(self, index_map: Callable[..., Any] | None = None,
              lead: int = 0) -> BlockSpec:
    """A BlockSpec giving this mapping again, every option kept (memory
    space, pipeline mode, the user's line): what a derived kernel (vmap,
    jvp, grad, a shard) passes for the same operand. `index_map` replaces
    the traced one (for a derived kernel's own grid) and `lead` squeezed
    dims go first (a batch)."""
    shape = (None,) * lead + tuple(None if d is squeezed else d
                                   for d in self.block_shape)
    if index_map is None:
      jaxpr = self.index_map_jaxpr
      index_map = lambda *args: tuple(core.jaxpr_as_fun(jaxpr)(*args))
    return BlockSpec(shape, index_map, memory_space=self.memory_space,
                     pipeline_mode=self.pipeline_mode, where=self.where)

  @property
  def block_sizes(self) -> tuple[int, ...]:
    """Block extent per array dim (squeezed dims count as 1)."""
    return tuple(_dim_size(d) for d in self.block_shape)

  @property
  def kernel_shape(self) -> tuple[int, ...]:
    """The shape of the ref the kernel sees (squeezed dims dropped)."""
    return tuple(_dim_size(d) for d in self.block_shape if d is not squeezed)

  @property
  def has_element_dims(self) -> bool:
    return any(isinstance(d, Element) for d in self.block_shape)

  @property
  def ref_aval(self) -> state_types.AbstractRef:
    return state_types.AbstractRef(
        core.ShapedArray(self.kernel_shape, self.array_aval.dtype,
                         weak_type=self.array_aval.weak_type),
        memory_space=self.memory_space)

  def element_offsets(self, block_indices):
    """Element offsets of a block from its index map's results."""
    offs = []
    for d, idx in zip(self.block_shape, block_indices):
      if isinstance(d, Element):
        offs.append(idx)
      else:
        offs.append(idx * _dim_size(d))
    return offs


def element_padding(bm: BlockMapping) -> dict[int, tuple[int, int]]:
  """{array dim: (low, high) padding} of the `Element` dims of `bm`."""
  return {d: tuple(dim.padding) for d, dim in enumerate(bm.block_shape)
          if isinstance(dim, Element)}


def _positional_parameters(fn):
  """(positional parameters, whether it takes *args) of `fn`; None when it
  has no signature."""
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    return None
  params = [p for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  var = any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values())
  return params, var


def _quoted_names(names) -> str:
  quoted = [f"'{n}'" for n in names]
  if len(quoted) <= 2:
    return " and ".join(quoted)
  return ", ".join(quoted[:-1]) + ", and " + quoted[-1]


def call_mismatch(fn, n: int, name: str) -> str | None:
  """What Python says when `fn` is called with `n` positional arguments
  (`name() takes 1 positional argument but 2 were given`, `name() missing 2
  required positional arguments: 'i' and 'j'`), or None when it takes
  them (parameters with defaults are optional)."""
  found = _positional_parameters(fn)
  if found is None:
    return None
  params, var = found
  required = [p.name for p in params if p.default is p.empty]
  if n < len(required):
    missing = required[n:]
    plural = "s" if len(missing) > 1 else ""
    return (f"{name}() missing {len(missing)} required positional "
            f"argument{plural}: {_quoted_names(missing)}")
  if not var and n > len(params):
    low, most = len(required), len(params)
    count = str(most) if low == most else f"from {low} to {most}"
    plural = "" if count == "1" else "s"
    were = "was" if n == 1 else "were"
    return (f"{name}() takes {count} positional argument{plural} but {n} "
            f"{were} given")
  return None


def _trace_index_map(kernel: str, origin: str, path: str, fn, grid_rank: int,
                     prefetch_avals, block_shape, where: str,
                     prefetch_tree=None) -> ClosedJaxpr:
  """The index map's jaxpr: grid ids, then the prefetch refs flat; `fn`
  gets the prefetch operands in their pytree (`prefetch_tree`), as the
  kernel does."""
  n_pf = (len(tree_util.tree_unflatten(prefetch_tree, list(prefetch_avals)))
          if prefetch_tree is not None else len(prefetch_avals))
  n_args = grid_rank + n_pf
  loc = function_location(fn)
  fn_name = getattr(fn, "__name__", "index_map")
  mismatch = call_mismatch(fn, n_args, fn_name)
  if mismatch is not None:
    extra = f" and {n_pf} scalar-prefetch operands" if n_pf else ""
    raise KernelTypeError(
        kernel, f"index_map {mismatch}: the grid has rank "
        f"{grid_rank}{extra}, so it is called with {n_args}",
        f"{where} (index_map defined at {loc})", operand=origin)
  in_avals = [core.ShapedArray((), jnp.int32)] * grid_rank + list(prefetch_avals)

  def flat(*args):
    pf = args[grid_rank:]
    if prefetch_tree is not None:
      pf = tree_util.tree_unflatten(prefetch_tree, pf)
    out = fn(*args[:grid_rank], *pf)
    if not isinstance(out, (tuple, list)):
      out = (out,)
    return list(out)

  dbg = api_util.debug_info("index_map", fn, tuple(range(len(in_avals))),
                            {})
  try:
    jaxpr, out_avals, consts = pe.trace_to_jaxpr_dynamic(
        lu.wrap_init(flat, debug_info=dbg), in_avals)
  except KernelError:
    raise
  except Exception as e:  # the user's index_map failed to trace
    cls = KernelTypeError if isinstance(e, TypeError) else KernelError
    raise cls(kernel, f"index_map failed: {type(e).__name__}: {e}",
                      f"{where} (index_map defined at {loc})",
                      operand=origin) from e
  # The wording of Pallas's errors, so code that matches them matches ours.
  head = f"Index map function {fn_name} at {loc} for {path}"
  if len(out_avals) != len(block_shape):
    raise KernelError(
        kernel, f"{head} must return {len(block_shape)} values to match the "
        f"block shape {tuple(block_shape)}. Currently returning "
        f"{len(out_avals)} values", where, operand=origin)
  for i, a in enumerate(out_avals):
    if not (isinstance(a, core.ShapedArray) and a.shape == ()
            and jnp.issubdtype(a.dtype, jnp.integer)):
      raise KernelTypeError(
          kernel, f"{head} must return integer scalars. Output[{i}] has type "
          f"{a.str_short()}", where, operand=origin)
  return close_jaxpr(jaxpr, consts)


def _zeros_index_map(grid_rank: int, n_prefetch: int, rank: int):
  def index_map(*args):
    return (0,) * rank
  return index_map


def resolve_block_spec(kernel: str, origin: str, spec: BlockSpec | None,
                       aval: core.ShapedArray, grid_rank: int, prefetch_avals,
                       where: str, path: str | None = None,
                       prefetch_tree=None) -> BlockMapping:
  """Checks `spec` against the array `aval` and traces its index map
  (which takes the scalar-prefetch operands in their pytree
  `prefetch_tree`; None: flat). `origin` names the spec (`in_specs[1]`),
  `path` the operand in the call's arguments as Pallas names it
  (`args[1]['a']`, `outputs[0]`)."""
  path = path or origin
  if spec is None:
    spec = BlockSpec()
  if not isinstance(spec, BlockSpec):
    raise KernelTypeError(kernel, f"expected a BlockSpec, got {spec!r}", where,
                          operand=origin)
  if spec.where and spec.where != where:
    where = f"{spec.where}; the pallas_call at {where}"
  if callable(spec.block_shape):
    shape = spec.index_map
    raise KernelTypeError(
        kernel, f"BlockSpec(block_shape, index_map) takes the block shape "
        f"first, got the function {getattr(spec.block_shape, '__name__', '')!r}"
        f" as block_shape and {shape!r} as index_map (the argument order of "
        f"older Pallas versions): write pl.BlockSpec({shape!r}, index_map)",
        where, operand=origin)
  rank = len(aval.shape)
  memory_space = spec.memory_space
  whole = spec.block_shape is None or memory_space is MemorySpace.ANY
  if whole:
    block_shape = tuple(aval.shape)
  else:
    block_shape = tuple(squeezed if d is None else d for d in spec.block_shape)
    block_shape = tuple(d.block_size if isinstance(d, Blocked) else d
                        for d in block_shape)
    if len(block_shape) != rank:
      raise KernelError(
          kernel, f"Block shape for {path} (= {tuple(spec.block_shape)}) must "
          f"have the same number of dimensions as the array shape "
          f"{tuple(aval.shape)}: rank {len(block_shape)} vs {rank}", where,
          operand=origin)
    for i, (d, n) in enumerate(zip(block_shape, aval.shape)):
      if d is squeezed:
        continue
      size = _dim_size(d)
      if not isinstance(size, (int, np.integer)) or size <= 0:
        raise KernelError(kernel, f"block dim {i} must be a positive integer, "
                          f"None or Element, got {d!r}", where, operand=origin)
      # A block larger than the array is padded, as in Pallas.
  _check_pipeline_mode(kernel, origin, spec.pipeline_mode, where)
  index_map = spec.index_map
  if whole or index_map is None:
    index_map = _zeros_index_map(grid_rank, len(prefetch_avals), rank)
  jaxpr = _trace_index_map(kernel, origin, path, index_map, grid_rank,
                           prefetch_avals, block_shape, where, prefetch_tree)
  return BlockMapping(origin, core.ShapedArray(aval.shape, aval.dtype,
                                               weak_type=aval.weak_type),
                      block_shape, jaxpr, memory_space, whole,
                      spec.pipeline_mode, spec.where)


def _check_pipeline_mode(kernel, origin, mode, where) -> None:
  if mode is None:
    return
  if not isinstance(mode, Buffered):
    raise KernelTypeError(kernel, f"pipeline_mode must be pl.Buffered(n), got "
                          f"{mode!r}", where, operand=origin)
  n = mode.buffer_count
  if not isinstance(n, (int, np.integer)) or n < 1:
    raise KernelError(kernel, f"Buffered.buffer_count must be a positive "
                      f"integer, got {n!r}", where, operand=origin)
