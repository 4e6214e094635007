"""The operands of a primitive that takes named pytrees (the TPU's DMAs and
semaphore operations, plgpu's copies and barriers): `pack(src=..., dst=...,
sem=...)` flattens them into the primitive's operands and a hashable layout
(its `layout` param), `unpack(flat, layout)` gives the pytrees back,
`position(layout, name)` the flat index of one part, `effects(layout,
reads=, writes=)` the primitive's effects on the refs among them.
`ref_and_transforms(what, ref)` splits a ref argument (`x.at[i]`) into the
ref and its transforms, the two parts such a primitive packs."""
from __future__ import annotations

from typing import Any

from jax import tree_util

from dsl.core.errors import KernelTypeError, user_frame
from dsl.core.jax_internals import core, state_types


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
