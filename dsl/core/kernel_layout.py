"""Where a kernel's operands sit: consecutive named groups of operands.

A kernel's refs are, in order, its grid ids (in the kernel jaxpr's
invars), scalar prefetch, inputs, outputs and scratch
(`GridMapping.ref_layout`); a pallas_call's operands are the traced sizes
of the grid's dynamic dims, scalar prefetch and inputs
(`GridMapping.call_layout`). A derived kernel adds groups of its own
(`insert`: a tangent per input, an error output per check), and what reads
the counts from elsewhere (a Mosaic module's attributes) builds a layout
from them (`KernelLayout.of(prefetch=1, inputs=2, outputs=None)`; one
group may be None: it holds whatever the others leave).

`split(seq)` gives `seq` by group (a named tuple, one tuple per group),
`locate(i)` the group and the index within it of position `i`,
`start(name)` and `positions(name)` where a group lies. Every module
decodes kernel operands through a layout rather than slicing by counts.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Sequence


@functools.lru_cache(maxsize=None)
def _parts_type(names: tuple[str, ...]):
  """The named tuple of a layout's groups."""
  return collections.namedtuple("KernelParts", names)


@dataclasses.dataclass(frozen=True)
class KernelLayout:
  """Consecutive groups of operands: (name, count) in order; a count of
  None is the group of the rest (at most one)."""
  groups: tuple[tuple[str, int | None], ...]

  def __post_init__(self):
    names = self.names
    if len(set(names)) != len(names):
      raise ValueError(f"a kernel layout names a group twice: {names}")
    if any(n is not None and n < 0 for _, n in self.groups):
      raise ValueError(f"{self}: a group of negative size")
    if sum(n is None for _, n in self.groups) > 1:
      raise ValueError(f"{self}: more than one group of the rest")

  @classmethod
  def of(cls, **counts: int | None) -> KernelLayout:
    """The layout of the given groups, in the order given."""
    return cls(tuple((name, None if n is None else int(n))
                     for name, n in counts.items()))

  def __repr__(self):
    return "KernelLayout(" + ", ".join(
        f"{name}={'rest' if n is None else n}" for name, n in self.groups) + ")"

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(name for name, _ in self.groups)

  @property
  def total(self) -> int:
    """How many operands the layout holds (it has no group of the rest)."""
    return sum(self.sizes())

  def sizes(self, total: int | None = None) -> tuple[int, ...]:
    """The size of each group, for `total` operands (needed, and only
    then, when a group holds the rest)."""
    known = sum(n for _, n in self.groups if n is not None)
    rest = [name for name, n in self.groups if n is None]
    if rest and (total is None or total < known):
      raise ValueError(f"{total} operands for {self}")
    if not rest and total is not None and total != known:
      raise ValueError(f"{total} operands for {self}")
    return tuple((total - known) if n is None else n for _, n in self.groups)

  def positions(self, name: str, total: int | None = None) -> range:
    """The positions of group `name`."""
    start = 0
    for (group, _), n in zip(self.groups, self.sizes(total)):
      if group == name:
        return range(start, start + n)
      start += n
    raise KeyError(f"{self} has no group {name!r}")

  def start(self, name: str, total: int | None = None) -> int:
    """Where group `name` starts."""
    return self.positions(name, total).start

  def locate(self, index: int, total: int | None = None) -> tuple[str, int]:
    """(group, index within it) of position `index`."""
    start = 0
    for (group, _), n in zip(self.groups, self.sizes(total)):
      if start <= index < start + n:
        return group, index - start
      start += n
    raise IndexError(f"operand {index} is outside {self}")

  def split(self, seq: Sequence[Any]):
    """`seq` by group: a named tuple with one tuple per group."""
    parts, start = [], 0
    for n in self.sizes(len(seq)):
      parts.append(tuple(seq[start:start + n]))
      start += n
    return _parts_type(self.names)(*parts)

  def insert(self, after: str, **counts: int | None) -> KernelLayout:
    """This layout with the groups `counts` after group `after`."""
    k = self.names.index(after) + 1
    new = KernelLayout.of(**counts).groups
    return KernelLayout(self.groups[:k] + new + self.groups[k:])

  def only(self, *names: str) -> KernelLayout:
    """The layout of the groups `names` alone, in this layout's order."""
    missing = set(names) - set(self.names)
    if missing:
      raise KeyError(f"{self} has no group {sorted(missing)}")
    return KernelLayout(tuple(g for g in self.groups if g[0] in names))
