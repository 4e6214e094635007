"""The operands of a primitive that takes named pytrees (the TPU's DMAs and
semaphore operations, plgpu's copies and barriers): `pack(src=..., dst=...,
sem=...)` flattens them into the primitive's operands and a hashable layout
(its `layout` param), `unpack(flat, layout)` gives the pytrees back,
`position(layout, name)` the flat index of one part, `effects(layout,
reads=, writes=)` the primitive's effects on the refs among them.
`ref_and_transforms(what, ref)` splits a ref argument (`x.at[i]`) into the
ref and its transforms, the two parts such a primitive packs.

The operands of a ref primitive (JAX's `get`, `swap`, `addupdate`, dsl's
masked loads and stores, atomics): the ref, the leaves of its transforms
(flattened by the `tree` param) and the values around them, by name.
`ref_operands(primitive, operands, params)` decodes them (from rule
arguments or an equation's invars alike) into a `RefOperands`; each
primitive's `RefLayout` (registered with `register_ref_layout`) says where
its parts sit and builds the operands for `bind` (`RefLayout.flatten`)."""
from __future__ import annotations

import dataclasses
from typing import Any

from jax import tree_util

from dsl.core.errors import KernelTypeError, user_frame
from dsl.core.jax_internals import core, state_primitives, state_types


class OperandLayout(tuple):
  """(offsets, trees) of packed operands; prints as its part names."""

  def __repr__(self):
    return "(" + ", ".join(n for n, _, c in self[0] if c) + ")"


def pack(**parts):
  """Flattens named pytrees; returns (flat, layout) with layout hashable."""
  flat, offsets = [], []
  trees = []
  for name, part in parts.items():
    leaves, tree = tree_util.tree_flatten(part)
    offsets.append((name, len(flat), len(leaves)))
    trees.append(tree)
    flat += leaves
  return flat, OperandLayout((tuple(offsets), tuple(trees)))


def unpack(flat, layout) -> dict[str, Any]:
  """Inverse of `pack`: name -> pytree of the flat values (or avals)."""
  offsets, trees = layout
  out = {}
  for (name, start, n), tree in zip(offsets, trees):
    out[name] = tree_util.tree_unflatten(tree, list(flat[start:start + n]))
  return out


def position(layout, name) -> int | None:
  """Flat index of the first leaf of part `name` (None if it is empty)."""
  for n, start, count in layout[0]:
    if n == name:
      return start if count else None
  return None


def effects(layout, reads=(), writes=()) -> set:
  """Read and write effects on the packed parts named in `reads` and
  `writes` (each a ref)."""
  out = set()
  for name in reads:
    pos = position(layout, name)
    if pos is not None:
      out.add(state_types.ReadEffect(pos))
  for name in writes:
    pos = position(layout, name)
    if pos is not None:
      out.add(state_types.WriteEffect(pos))
  return out


def ref_and_transforms(what: str, ref):
  """(ref, transforms) of a ref argument; a KernelTypeError naming `what`
  for anything else."""
  if isinstance(ref, state_types.TransformedRef):
    return ref.ref, tuple(ref.transforms)
  aval = core.typeof(ref)
  if not isinstance(aval, state_types.AbstractRef):
    raise KernelTypeError(None, f"{what} must be a ref, got "
                          f"{getattr(aval, 'str_short', lambda: aval)()}",
                          user_frame())
  return ref, ()


# ------------------------------------------------------- ref primitives

@dataclasses.dataclass(frozen=True)
class RefOperands:
  """A ref primitive's operands by role. `leaves` are the flat leaves of
  the ref's transforms, at `first_leaf` among the operands; the values a
  primitive does not take are None."""
  ref: Any
  leaves: tuple
  tree: Any
  first_leaf: int
  value: Any = None      # what is stored or combined (swap, stores, atomics)
  mask: Any = None
  other: Any = None      # what masked-off lanes of a load read
  cmp: Any = None        # atomic_cas's comparand

  @property
  def transforms(self) -> tuple:
    """The ref's transforms (indexers, ...) with the leaves in place."""
    return self.transforms_of(self.leaves)

  def transforms_of(self, leaves) -> tuple:
    """The transforms with `leaves` in place of the operands' own (the
    range analysis puts intervals there)."""
    try:
      return tuple(tree_util.tree_unflatten(self.tree, list(leaves)))
    except Exception as e:  # noqa: BLE001 - said with the cause
      raise ValueError(f"cannot read the ref indexers: {e}") from e


@dataclasses.dataclass(frozen=True)
class RefLayout:
  """Where a ref primitive keeps its operands: the ref (unless `has_ref`
  is False: a primitive about an access, not making it), the values named
  in `before`, the transforms' leaves, then the values named in `after`
  that are there (`flags`: (name, the bool param saying it is there))."""
  before: tuple[str, ...] = ()
  after: tuple[str, ...] = ()
  flags: tuple[tuple[str, str], ...] = ()
  has_ref: bool = True

  def present(self, params) -> tuple[str, ...]:
    """The names of `after` that the primitive's `params` say are there."""
    flag = dict(self.flags)
    return tuple(n for n in self.after
                 if n not in flag or params[flag[n]])

  def decode(self, operands, params) -> RefOperands:
    tree = params["tree"]
    n_ref = int(self.has_ref)
    first = n_ref + len(self.before)
    end = first + tree.num_leaves
    named = dict(zip(self.before, operands[n_ref:first]))
    named.update(zip(self.present(params), operands[end:]))
    return RefOperands(operands[0] if n_ref else None,
                       tuple(operands[first:end]), tree, first, **named)

  def flatten(self, ref, transforms=(), leaves=None, tree=None,
              **values) -> tuple[list, dict]:
    """(operands, params) for `bind`: `ref`, its `transforms` (or their
    flat `leaves` and `tree`) and the named values (None: not there)."""
    if leaves is None:
      leaves, tree = tree_util.tree_flatten(tuple(transforms))
    flag = dict(self.flags)
    params = {"tree": tree}
    params.update({flag[n]: values.get(n) is not None for n in flag})
    flat = [ref] if self.has_ref else []
    flat += [*(values[n] for n in self.before), *leaves]
    flat += [values[n] for n in self.after if values.get(n) is not None]
    return flat, params


REF_LAYOUTS: dict[Any, RefLayout] = {
    state_primitives.get_p: RefLayout(),
    state_primitives.swap_p: RefLayout(before=("value",)),
    state_primitives.addupdate_p: RefLayout(before=("value",)),
}


def register_ref_layout(primitive, layout: RefLayout) -> None:
  """Declares where `primitive`, a ref primitive, keeps its operands."""
  REF_LAYOUTS[primitive] = layout


def ref_operands(primitive, operands, params) -> RefOperands:
  """The operands of a ref primitive (rule arguments or an equation's
  invars) by role."""
  return REF_LAYOUTS[primitive].decode(list(operands), params)


def eqn_ref_operands(eqn) -> RefOperands:
  """`ref_operands` of a ref equation's invars."""
  return ref_operands(eqn.primitive, eqn.invars, eqn.params)


def flat_ref_operands(primitive, ops: RefOperands) -> tuple[list, dict]:
  """The inverse of `ref_operands`: (operands, the layout's params) to
  bind `primitive` with (e.g. `dataclasses.replace(ops, ref=t)`)."""
  values = {f.name: getattr(ops, f.name) for f in dataclasses.fields(ops)
            if f.name not in ("ref", "leaves", "tree", "first_leaf")}
  return REF_LAYOUTS[primitive].flatten(ops.ref, leaves=ops.leaves,
                                        tree=ops.tree, **values)
