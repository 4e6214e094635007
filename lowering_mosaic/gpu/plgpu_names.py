"""Names for the protocol model of a `plgpu.kernel` (plgpu_skeleton.py):
its allocations (`Buffer`), their SMEM cells and mbarriers (`Names`), and
the parameter names of the functions that allocated them, read from the
kernel jaxpr's tracebacks."""
from __future__ import annotations

import dataclasses

import numpy as np

from dsl.core.jax_internals import core
from dsl.core.jaxpr_walk import sub_jaxprs
from dsl.core.primitives import run_scoped_p


@dataclasses.dataclass
class Buffer:
  """An allocation: SMEM cells `base .. base+count-1`, or mbarriers
  `base .. base+count-1` (kind "barrier"), or something the protocol does
  not watch (kind "acc" for accumulators, "other")."""
  name: str
  kind: str
  shape: tuple
  base: int = 0
  count: int = 1
  num_arrivals: int = 1


class Names:
  """Names of cells and mbarriers, from `self.buffers`."""
  buffers: list

  def _owner(self, kind: str, index: int) -> tuple[Buffer, int]:
    for b in self.buffers:
      if b.kind == kind and b.base <= index < b.base + b.count:
        return b, index - b.base
    raise IndexError(index)

  def cell_name(self, cell: int) -> str:
    b, k = self._owner("smem", cell)
    if b.count == 1:
      return b.name
    rows = b.shape[0]
    lo, hi = -(-k * rows // b.count), -(-(k + 1) * rows // b.count)
    return f"{b.name}[{lo}]" if hi - lo == 1 else f"{b.name}[{lo}:{hi}]"

  def cells_name(self, cells) -> str:
    """`name` for every cell of a buffer, else its cells' names."""
    cells, parts = set(cells), []
    for b in self.buffers:
      mine = sorted(c for c in cells if b.kind == "smem"
                    and b.base <= c < b.base + b.count)
      if mine and len(mine) == b.count:
        parts.append(b.name)
      else:
        parts += [self.cell_name(c) for c in mine]
    return ", ".join(parts)

  def barrier_name(self, barrier: int) -> str:
    b, k = self._owner("barrier", barrier)
    if not b.shape:
      return b.name
    return f"{b.name}[{', '.join(map(str, np.unravel_index(k, b.shape)))}]"

  def num_arrivals(self, barrier: int) -> int:
    return self._owner("barrier", barrier)[0].num_arrivals


def _scope_params(jaxpr: core.Jaxpr) -> tuple[str, ...]:
  """The parameter names of the function a `run_scoped` traced, read from
  the tracebacks of its equations: the frame that dsl's run_scoped called
  (a `plgpu.kernel`'s body: its operands', then its scratch's)."""
  for eqn in _eqns(jaxpr):
    tb = getattr(eqn.source_info, "traceback", None)
    codes = tb.raw_frames()[0] if tb is not None else ()
    for callee, caller in zip(codes, codes[1:]):
      if caller.co_name == "flat_f" and caller.co_filename.endswith(
          "dsl/core/primitives.py"):
        return tuple(callee.co_varnames[:callee.co_argcount])
  return ()


def _eqns(jaxpr: core.Jaxpr):
  """`jaxpr`'s equations, then those of its sub-jaxprs (not of nested
  scopes, whose frames are their own)."""
  yield from jaxpr.eqns
  for eqn in jaxpr.eqns:
    if eqn.primitive is not run_scoped_p:
      for sub in sub_jaxprs(eqn.params):
        yield from _eqns(sub)


def scope_names(jaxpr: core.Jaxpr, n: int) -> list[str] | None:
  """The names of a `run_scoped`'s `n` allocations: its last parameters,
  or `p[k]` for the leaves of one parameter `p` that holds a pytree."""
  names = _scope_params(jaxpr)
  if n and len(names) >= n:
    return list(names[-n:])
  if n and len(names) == 1:
    return [f"{names[0]}[{k}]" for k in range(n)]
  return None


def operand_names(spec, n: int) -> list[str]:
  """The kernel's operand names: its body's first `n` parameters (the body
  is called in the scope of its scratch), else the spec's labels."""
  labels = spec.ref_labels()[:n]
  for eqn in spec.jaxpr.jaxpr.eqns:
    if eqn.primitive is run_scoped_p:
      names = _scope_params(eqn.params["jaxpr"])
      if len(names) >= n and all(names[:n]):
        return list(names[:n])
  return labels


__all__ = ["Buffer", "Names", "operand_names", "scope_names"]
