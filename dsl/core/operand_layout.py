"""The operands of a primitive that takes named pytrees (the TPU's DMAs and
semaphore operations): `pack(src=..., dst=..., sem=...)` flattens them into
the primitive's operands and a hashable layout (its `layout` param),
`unpack(flat, layout)` gives the pytrees back, `position(layout, name)` the
flat index of one part."""
from __future__ import annotations

from typing import Any

from jax import tree_util


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
