"""GridSpec (what users write) and GridMapping (what backends consume)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
from jax import tree_util
from dsl.core.jax_internals import core, state_types
from dsl.core.jax_internals import tree_util as jax_tree_util

from dsl.core.blockspec import BlockMapping, BlockSpec, resolve_block_spec
from dsl.core.dynamic_grid import is_dynamic
from dsl.core.errors import KernelError, KernelTypeError, user_frame
from dsl.core.index_maps import (evaluate_index_map, reads_prefetch,
                                 varies_along)
from dsl.core.kernel_layout import KernelLayout
from dsl.core.grid_plan import Plan, make_plan
from dsl.core.memory import MemorySpace, scratch_aval
from dsl.core.named_axes import grid_names as names_of


@dataclasses.dataclass(frozen=True)
class GridSpec:
  """The grid, the operands' BlockSpecs and the scratch buffers of a kernel."""
  grid: Any = ()
  in_specs: Any = None
  out_specs: Any = None
  scratch_shapes: Any = ()


@dataclasses.dataclass(frozen=True)
class PrefetchScalarGridSpec(GridSpec):
  """A GridSpec whose first `num_scalar_prefetch` operands go to SMEM first
  and are passed to every index map after the grid indices."""
  num_scalar_prefetch: int = 0

  def __init__(self, num_scalar_prefetch, grid=(), in_specs=None,
               out_specs=None, scratch_shapes=()):
    object.__setattr__(self, "num_scalar_prefetch", num_scalar_prefetch)
    object.__setattr__(self, "grid", grid)
    object.__setattr__(self, "in_specs", in_specs)
    object.__setattr__(self, "out_specs", out_specs)
    object.__setattr__(self, "scratch_shapes", scratch_shapes)


class KernelArgs(NamedTuple):
  """A kernel's operands by role, in the order every backend passes them:
  grid indices (when present), scalar prefetch, inputs, outputs, scratch;
  and, for the pallas_call's operands, the traced sizes of the grid's
  dynamic dims (`split_operands`; they lead those operands)."""
  ids: tuple
  prefetch: tuple
  inputs: tuple
  outputs: tuple
  scratch: tuple
  sizes: tuple = ()


@dataclasses.dataclass(frozen=True, eq=False)
class GridMapping:
  """The resolved grid: one BlockMapping per input then per output. A grid
  dim whose size is traced is `DYNAMIC` (dsl.core.dynamic_grid)."""
  grid: tuple[int, ...]
  block_mappings: tuple[BlockMapping, ...]
  num_inputs: int
  num_outputs: int
  num_scalar_prefetch: int = 0
  prefetch_avals: tuple[state_types.AbstractRef, ...] = ()
  scratch_avals: tuple[state_types.AbstractRef, ...] = ()
  in_tree: Any = None
  out_tree: Any = None
  scratch_tree: Any = None
  # grid axes added by vmap: they are not visible to the kernel's numbering.
  num_hidden_axes: int = 0
  # the axis names of a grid given as (("i", 4), ...): None per unnamed dim,
  # None when no dim is named (dsl.core.named_axes)
  grid_names: tuple | None = None
  # the pytree of the scalar-prefetch operands (None: a flat tuple); a None
  # among them (an optional operand) reaches the kernel as None
  prefetch_tree: Any = None

  def __post_init__(self):
    self.check_invariants()

  def check_invariants(self) -> None:
    """Raises ValueError when the mapping is inconsistent (an internal
    error: user specs are checked, with messages naming the operand, when
    they are resolved)."""
    rank = len(self.grid)
    problems = []
    if any(not is_dynamic(g) and (not isinstance(g, (int, np.integer))
                                  or g < 0) for g in self.grid):
      problems.append(f"grid {self.grid} is not of non-negative ints")
    if any(d < self.num_hidden_axes for d in self.dynamic_dims):
      problems.append(f"grid {self.grid}: an axis added by vmap is dynamic")
    if len(self.block_mappings) != self.block_layout().total:
      problems.append(f"{len(self.block_mappings)} block mappings for "
                      f"{self.num_inputs} inputs and {self.num_outputs} "
                      "outputs")
    if len(self.prefetch_avals) != self.num_scalar_prefetch:
      problems.append(f"{len(self.prefetch_avals)} prefetch avals for "
                      f"{self.num_scalar_prefetch} scalar-prefetch operands")
    if not 0 <= self.num_hidden_axes <= rank:
      problems.append(f"{self.num_hidden_axes} hidden axes in a grid of "
                      f"rank {rank}")
    if self.grid_names is not None and len(self.grid_names) != rank:
      problems.append(f"{len(self.grid_names)} grid names for rank {rank}")
    for bm in self.block_mappings:
      j = bm.index_map_jaxpr.jaxpr
      if len(j.invars) != rank + self.num_scalar_prefetch:
        problems.append(f"{bm.origin}: the index map takes {len(j.invars)} "
                        f"arguments, not {rank} grid ids + "
                        f"{self.num_scalar_prefetch} prefetch refs")
      array_rank = len(bm.array_aval.shape)
      if not len(j.outvars) == len(bm.block_shape) == array_rank:
        problems.append(f"{bm.origin}: {len(j.outvars)} block indices, "
                        f"{len(bm.block_shape)} block dims, array rank "
                        f"{array_rank}")
    if problems:
      raise ValueError("inconsistent GridMapping: " + "; ".join(problems))

  @property
  def dynamic_dims(self) -> tuple[int, ...]:
    """The grid dims whose size is traced (dsl.core.dynamic_grid)."""
    return tuple(d for d, g in enumerate(self.grid) if is_dynamic(g))

  @property
  def in_mappings(self) -> tuple[BlockMapping, ...]:
    return self.split_blocks(self.block_mappings).inputs

  @property
  def out_mappings(self) -> tuple[BlockMapping, ...]:
    return self.split_blocks(self.block_mappings).outputs

  @property
  def out_avals(self) -> tuple[core.ShapedArray, ...]:
    return tuple(bm.array_aval for bm in self.out_mappings)

  @property
  def num_refs(self) -> int:
    """How many refs the kernel takes (grid indices not counted)."""
    return self.ref_layout().total

  @property
  def ref_avals(self) -> tuple[state_types.AbstractRef, ...]:
    """The kernel's refs, in order: prefetch, block refs, scratch."""
    ref_aval = lambda bm: bm.ref_aval
    return tuple(self.per_ref(lambda a: a, ref_aval, ref_aval, lambda a: a))

  @property
  def ref_origins(self) -> tuple[str, ...]:
    """Where each kernel ref comes from, for messages: `scalar prefetch
    0`, `in_specs[1]`, `out_specs[0]`, `scratch_shapes[2]`."""
    return (tuple(f"scalar prefetch {i}"
                  for i in range(self.num_scalar_prefetch))
            + tuple(bm.origin for bm in self.block_mappings)
            + tuple(f"scratch_shapes[{i}]"
                    for i in range(len(self.scratch_avals))))

  def block_indices(self, bm: BlockMapping) -> np.ndarray | None:
    """The block indices of `bm` at every grid point, an int array of shape
    (*grid, rank), read-only; None when its index map reads scalar-prefetch
    data, or the grid has a dynamic dim or is too large to analyse."""
    if self.dynamic_dims:
      return None
    return evaluate_index_map(bm, tuple(int(g) for g in self.grid))

  def reads_prefetch(self, bm: BlockMapping) -> bool:
    """Whether the index map of `bm` reads scalar-prefetch data."""
    return reads_prefetch(bm.index_map_jaxpr, len(self.grid))

  def moves_along(self, bm: BlockMapping, d: int) -> bool | None:
    """Whether the block of `bm` changes along grid dim `d`; None when the
    index map has no static answer."""
    idx = self.block_indices(bm)
    return None if idx is None else varies_along(idx, d)

  def plan(self, compiler_params=None, jaxpr=None) -> Plan:
    """The execution plan: parallel and sequential grid dims, and how each
    operand's blocks are fetched (see `make_plan`)."""
    return make_plan(self, compiler_params, jaxpr)

  def ref_layout(self, ids: bool = False) -> KernelLayout:
    """Where the kernel's refs sit: groups `ids` (one per grid dim with
    `ids`, as the kernel jaxpr's invars; else none), `prefetch`, `inputs`,
    `outputs`, `scratch`; a derived kernel inserts its own groups."""
    return KernelLayout.of(ids=len(self.grid) if ids else 0,
                           prefetch=self.num_scalar_prefetch,
                           inputs=self.num_inputs, outputs=self.num_outputs,
                           scratch=len(self.scratch_avals))

  def block_layout(self) -> KernelLayout:
    """Where the block mappings sit: groups `inputs`, `outputs`."""
    return self.ref_layout().only("inputs", "outputs")

  def call_layout(self) -> KernelLayout:
    """Where the pallas_call's operands sit: groups `sizes` (the traced
    sizes of the dynamic grid dims), `prefetch`, `inputs`."""
    return KernelLayout.of(sizes=len(self.dynamic_dims),
                           prefetch=self.num_scalar_prefetch,
                           inputs=self.num_inputs)

  def aliased_operand(self, operand: int) -> tuple[str, int]:
    """(`"prefetch"` or `"inputs"`, index in that group) of an
    `input_output_aliases` operand index (which counts the scalar
    prefetch and the inputs, not the grid sizes)."""
    return self.call_layout().only("prefetch", "inputs").locate(operand)

  def split(self, seq: Sequence[Any]) -> KernelArgs:
    """`seq` laid out as the kernel's operands, by role. `seq` holds one
    entry per ref, optionally preceded by one per grid dimension (the
    layout of the kernel jaxpr's invars)."""
    n_ids = len(seq) - self.num_refs
    if n_ids not in (0, len(self.grid)):
      raise ValueError(f"{len(seq)} operands for a kernel with a "
                       f"{len(self.grid)}-D grid and {self.num_refs} refs")
    return KernelArgs(*self.ref_layout(ids=n_ids > 0).split(seq))

  def split_blocks(self, seq: Sequence[Any]) -> KernelArgs:
    """`seq`, one entry per block mapping (as `block_mappings`: inputs
    then outputs), by role; `ids`, `prefetch` and `scratch` are empty."""
    layout = self.block_layout()
    if len(seq) != layout.total:
      raise ValueError(f"{len(seq)} entries for {self.num_inputs} inputs "
                       f"and {self.num_outputs} outputs")
    ins, outs = layout.split(seq)
    return KernelArgs((), (), ins, outs, ())

  def per_ref(self, prefetch: Callable, inputs: Callable, outputs: Callable,
              scratch: Callable) -> list:
    """One entry per kernel ref, in order: `prefetch(aval)` of each
    scalar-prefetch ref, `inputs(bm)` and `outputs(bm)` of each block
    mapping, `scratch(aval)` of each scratch ref (the inverse of
    `split`)."""
    return ([prefetch(a) for a in self.prefetch_avals]
            + [inputs(bm) for bm in self.in_mappings]
            + [outputs(bm) for bm in self.out_mappings]
            + [scratch(a) for a in self.scratch_avals])

  def split_operands(self, seq: Sequence[Any]) -> KernelArgs:
    """The pallas_call's operands `seq` (the dynamic dims' sizes, scalar
    prefetch, then inputs) by role; `ids`, `outputs` and `scratch` are
    empty."""
    layout = self.call_layout()
    if len(seq) != layout.total:
      raise ValueError(f"{len(seq)} operands for a kernel with "
                       f"{len(self.dynamic_dims)} dynamic grid dims, "
                       f"{self.num_scalar_prefetch} scalar prefetch and "
                       f"{self.num_inputs} inputs")
    sizes, prefetch, inputs = layout.split(seq)
    return KernelArgs((), prefetch, inputs, (), (), sizes)

  def unflatten_kernel_refs(self, refs: Sequence[Any]) -> list[Any]:
    """The kernel's positional arguments, in the pytree shape of the specs."""
    _, prefetch, ins, outs, scratch, _ = self.split(refs)
    args = (list(tree_util.tree_unflatten(self.prefetch_tree, prefetch))
            if self.prefetch_tree is not None else list(prefetch))
    args += list(tree_util.tree_unflatten(self.in_tree, ins))
    out = tree_util.tree_unflatten(self.out_tree, outs)
    args += list(out) if isinstance(out, (tuple, list)) else [out]
    sc = (tree_util.tree_unflatten(self.scratch_tree, scratch)
          if self.scratch_tree is not None else list(scratch))
    args += list(sc) if isinstance(sc, (tuple, list)) else [sc]
    return args


def _is_spec_leaf(x):
  return x is None or isinstance(x, BlockSpec)


def is_shape_tuple(x) -> bool:
  """A tuple or list of ints: a shape given where a shape and a dtype
  (a ShapeDtypeStruct, a scratch shape) belong."""
  return (isinstance(x, (tuple, list)) and len(x) > 0
          and all(isinstance(d, (int, np.integer)) and not isinstance(d, bool)
                  for d in x))


def _zero_size_text(in_avals, out_avals) -> str:
  """Why a grid may have come out empty: the operands of size zero."""
  found = [f"{kind}[{k}] has shape {tuple(a.shape)}"
           for kind, avals in (("argument", in_avals), ("out_shape", out_avals))
           for k, a in enumerate(avals) if 0 in tuple(a.shape)]
  if not found:
    return ""
  return (f": {'; '.join(found)}, and a grid computed from a zero-size dim "
          "(pl.cdiv(0, 8) == 0) has no steps. Skip the call for empty "
          "inputs (return an empty array of the output's shape), or give the "
          "grid at least one step")


def normalize_grid(kernel: str, grid, where: str,
                   zero_size: str = "") -> tuple[int, ...]:
  """The grid as a tuple of positive ints and DYNAMIC (a traced size,
  lifted out by `dynamic_grid.lift_traced_sizes`)."""
  if grid is None:
    grid = ()
  if isinstance(grid, (int, np.integer)) and not isinstance(grid, bool):
    grid = (grid,)
  if not isinstance(grid, (tuple, list)):
    raise KernelTypeError(kernel, f"grid must be a tuple of positive integers, "
                          f"got {grid!r}", where, operand="grid")
  out = []
  for i, g in enumerate(grid):
    if (isinstance(g, tuple) and len(g) == 2 and isinstance(g[0], str)):
      g = g[1]   # a named grid axis ("i", 4), as Pallas takes it
    if is_dynamic(g):
      out.append(g)
      continue
    if isinstance(g, bool) or not isinstance(g, (int, np.integer)):
      raise KernelTypeError(
          kernel, f"grid[{i}] must be a positive integer or a traced "
          f"integer scalar, got {g!r} ({type(g).__name__})", where,
          operand="grid")
    if g <= 0:
      raise KernelError(kernel, f"grid[{i}] must be a positive integer, got "
                        f"{int(g)}" + (zero_size if g == 0 else ""), where,
                        operand="grid")
    out.append(int(g))
  return tuple(out)


# The names Pallas gives each side of a spec pytree, for its wording.
_TREE_NAMES = {"in_specs": ("`in_specs`", "`inputs`"),
               "out_specs": ("`out_specs`", "`out_shape`")}


def _flatten_specs(kernel, specs, n, what, where, tree_desc, tree=None):
  """One BlockSpec (None: the whole array) per operand leaf.

  `specs` is read as a flat list of per-leaf specs when it has one entry per
  leaf (None included); otherwise it is matched against the operands' pytree
  `tree` as Pallas matches it, where a `None` spec stands for an operand that
  is itself `None` (no array) and for the whole array of one that is not.
  `out_specs` may be one BlockSpec for one output; `in_specs` is a tuple or
  a list (check_in_specs)."""
  if specs is None:
    return [None] * n
  if isinstance(specs, BlockSpec):
    specs = [specs] if n == 1 else specs
  leaves = tree_util.tree_leaves(specs, is_leaf=_is_spec_leaf)
  if isinstance(specs, BlockSpec):
    leaves = [specs]
  if len(leaves) != n and tree is not None:
    aligned = _align_specs(specs, tree_util.tree_unflatten(tree,
                                                           list(range(n))))
    leaves = aligned if aligned is not None else leaves
  if len(leaves) != n:
    counts = f"{what} has {len(leaves)} BlockSpecs but there are {n} {tree_desc}"
    mismatch = _tree_mismatch(what, specs, tree) if tree is not None else None
    raise KernelError(kernel, f"{mismatch} ({counts})" if mismatch else counts,
                      where, operand=what)
  return leaves


def check_in_specs(kernel: str, in_specs) -> None:
  """`in_specs` is a tuple or a list (one entry per input) or None, as in
  Pallas, which checks it when `pallas_call` is called to make the kernel
  function."""
  if in_specs is not None and not isinstance(in_specs, (tuple, list)):
    raise KernelTypeError(
        kernel, f"`in_specs` must be a tuple or a list (one entry per "
        f"input), got {in_specs!r}", user_frame(), operand="in_specs")


def _as_tuples(x):
  if isinstance(x, (list, tuple)):
    return tuple(_as_tuples(v) for v in x)
  if isinstance(x, dict):
    return {k: _as_tuples(v) for k, v in x.items()}
  return x


def _tree_mismatch(what: str, specs, tree) -> str | None:
  """How the pytree of `specs` differs from the operands' `tree`, in
  Pallas's words (`Pytree for `in_specs` and `inputs` do not match ...`)."""
  spec_tree = tree_util.tree_structure(_as_tuples(specs),
                                       is_leaf=_is_spec_leaf)
  errors = list(jax_tree_util.equality_errors_pytreedef(spec_tree, tree))
  if not errors:
    return None
  name1, name2 = _TREE_NAMES[what]
  path, thing1, thing2, explanation = errors[0]
  at = f"at {tree_util.keystr(path)}, " if path else ""
  return (f"Pytree for {name1} and {name2} do not match. There are "
          f"{len(errors)} mismatches, including: {at}{name1} is a {thing1} "
          f"but {name2} is a {thing2}, so {explanation}")


def operand_paths(prefix: str, tree, skip: int = 0) -> list[str]:
  """The name of each leaf of the operands' `tree` as Pallas names it:
  `prefix` and its pytree path (`args[1]['a']`), the first index shifted
  by `skip` (the scalar-prefetch arguments before the inputs)."""
  numbered = tree_util.tree_unflatten(tree, list(range(tree.num_leaves)))
  names = []
  for path, _ in tree_util.tree_flatten_with_path(numbered)[0]:
    if path and isinstance(path[0], tree_util.SequenceKey):
      path = (tree_util.SequenceKey(path[0].idx + skip),) + tuple(path[1:])
    names.append(prefix + tree_util.keystr(path))
  return names


def _align_specs(spec, operands):
  """The per-leaf specs of `spec` laid over `operands` (a pytree of leaf
  numbers), or None where the two do not match."""
  if _is_spec_leaf(spec):
    count = len(tree_util.tree_leaves(operands))
    if spec is None:
      return [None] * count
    return [spec] if count == 1 else None
  if (isinstance(spec, (list, tuple)) and isinstance(operands, (list, tuple))
      and len(spec) == len(operands)):
    pairs = zip(spec, operands)
  elif (isinstance(spec, dict) and isinstance(operands, dict)
        and spec.keys() == operands.keys()):
    pairs = ((spec[k], operands[k]) for k in sorted(operands))
  else:
    return None
  out = []
  for sub_spec, sub_operands in pairs:
    sub = _align_specs(sub_spec, sub_operands)
    if sub is None:
      return None
    out += sub
  return out


def resolve_grid_mapping(kernel: str, *, grid, in_specs, out_specs,
                         scratch_shapes, num_scalar_prefetch: int,
                         prefetch_avals, in_avals, in_tree, out_avals,
                         out_tree, where: str,
                         prefetch_tree=None) -> GridMapping:
  """Checks user specs against the operands and resolves them."""
  names = grid_names(kernel, grid, where)
  grid = normalize_grid(kernel, grid, where,
                        _zero_size_text(list(prefetch_avals) + list(in_avals),
                                        out_avals))
  in_leaves = _flatten_specs(kernel, in_specs, len(in_avals), "in_specs",
                             where, "inputs", in_tree)
  out_leaves = _flatten_specs(kernel, out_specs, len(out_avals), "out_specs",
                              where, "outputs in out_shape", out_tree)
  p_refs = []
  for aval in prefetch_avals:
    p_refs.append(state_types.AbstractRef(
        core.ShapedArray(aval.shape, aval.dtype, weak_type=aval.weak_type),
        memory_space=MemorySpace.SMEM))
  in_paths = (operand_paths("args", in_tree, _top_level_count(prefetch_tree))
              if in_tree is not None else [None] * len(in_avals))
  out_paths = (operand_paths("outputs", out_tree) if out_tree is not None
               else [None] * len(out_avals))
  mappings = []
  for i, (spec, aval) in enumerate(zip(in_leaves, in_avals)):
    mappings.append(resolve_block_spec(kernel, f"in_specs[{i}]", spec, aval,
                                       len(grid), p_refs, where, in_paths[i],
                                       prefetch_tree))
  for i, (spec, aval) in enumerate(zip(out_leaves, out_avals)):
    mappings.append(resolve_block_spec(kernel, f"out_specs[{i}]", spec, aval,
                                       len(grid), p_refs, where, out_paths[i],
                                       prefetch_tree))
  scratch_leaves, scratch_tree = tree_util.tree_flatten(
      list(scratch_shapes or ()),
      is_leaf=lambda x: (hasattr(x, "get_ref_aval") or hasattr(x, "dtype")
                         or is_shape_tuple(x)))
  scratch_avals = tuple(scratch_aval(kernel, i, s)
                        for i, s in enumerate(scratch_leaves))
  return GridMapping(grid, tuple(mappings), len(in_avals), len(out_avals),
                     num_scalar_prefetch, tuple(p_refs), scratch_avals,
                     in_tree, out_tree, scratch_tree, grid_names=names,
                     prefetch_tree=prefetch_tree)


def _top_level_count(tree) -> int:
  """How many arguments the tuple pytree `tree` (None: none) has."""
  return 0 if tree is None else len(tree.children())


def grid_names(kernel: str, grid, where: str) -> tuple | None:
  """The names of a grid's axes (None where a dim has none), or None; a name
  given twice is an error."""
  names = names_of(grid)
  given = [n for n in names or () if n is not None]
  if len(set(given)) != len(given):
    raise KernelError(kernel, f"grid axis names must differ, got {names}",
                      where, operand="grid")
  return names
