"""What the mask of a masked load or store says of its arrays of indices.

A Triton-style kernel reads a row through an array of indices and masks the
lanes past the row's end: `cols = i * block + arange(block)`,
`plgpu.load(x_ref.at[cols], mask=cols < n)`. Only the lanes the mask keeps
touch memory, and there `cols < n` holds, whatever the interval of `cols`
over all lanes is. `bounds_under_mask` finds such facts by following the
jaxpr: the mask is a conjunction (`and`) of comparisons of a value with a
constant, each broadcast to the mask's shape; an index lies under a fact
when it is the same value broadcast the same way, lane for lane.

Lanes are followed through `broadcast_in_dim`, JAX state's `broadcast_to`
(which indexers apply to arrays of indices) and the size-1 broadcasting of
binary operations; a value is described by its *root* (the variable it
broadcasts) and, per axis of the root, the axis of the value it runs along
(None: a unit axis, the same element on every lane).
"""
from __future__ import annotations

import numpy as np
from dsl.core.jax_internals import core, state_primitives
from jax import lax

from dsl.core.intervals import Interval

_BROADCASTS = (lax.broadcast_in_dim_p, state_primitives.broadcast_to_p)
# comparison -> the bound on its first operand given a constant second one
_BOUNDS = {
    "lt": lambda c: Interval(_MIN, c - 1), "le": lambda c: Interval(_MIN, c),
    "gt": lambda c: Interval(c + 1, _MAX), "ge": lambda c: Interval(c, _MAX),
}
_FLIPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}
_MIN, _MAX = -(1 << 63), (1 << 63) - 1


def _shape(atom) -> tuple[int, ...]:
  return tuple(getattr(atom.aval, "shape", ()))


def _axes_after(eqn, axes: tuple) -> tuple:
  """`axes` (of the root, in the broadcast operand) after broadcast
  equation `eqn`."""
  src, out = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
  if eqn.primitive is lax.broadcast_in_dim_p:
    dims = tuple(eqn.params["broadcast_dimensions"])
  else:
    dims = tuple(range(len(out) - len(src), len(out)))
  return tuple(None if a is None or src[a] != out[dims[a]] else dims[a]
               for a in axes)


def lanes(var, producers: dict) -> tuple:
  """(root, axes) of `var`: the variable it broadcasts, and per axis of
  the root the axis of `var` it runs along (None: a unit axis)."""
  chain = []
  while isinstance(var, core.Var):
    eqn = producers.get(var)
    if eqn is None or eqn.primitive not in _BROADCASTS:
      break
    chain.append(eqn)
    var = eqn.invars[0]
  shape = _shape(var)
  axes = tuple(None if n == 1 else k for k, n in enumerate(shape))
  for eqn in reversed(chain):
    axes = _axes_after(eqn, axes)
  return var, axes


def _constant(atom, producers: dict) -> int | None:
  """The integer every element of `atom` holds, when it is a literal
  (possibly broadcast)."""
  root, _ = lanes(atom, producers) if isinstance(atom, core.Var) else (atom,
                                                                       ())
  if isinstance(root, core.Literal) and np.ndim(root.val) == 0:
    value = np.asarray(root.val)
    if np.issubdtype(value.dtype, np.integer):
      return int(value)
  return None


def _facts(mask, producers: dict, out: list) -> None:
  """Appends ((root, axes), interval) for each comparison the mask `mask`
  is a conjunction of."""
  root, axes = lanes(mask, producers) if isinstance(mask, core.Var) else (
      None, ())
  eqn = producers.get(root) if isinstance(root, core.Var) else None
  if eqn is None:
    return
  same = lambda a: _shape(a) == _shape(eqn.outvars[0])
  if eqn.primitive is lax.and_p:
    for operand in eqn.invars:
      if isinstance(operand, core.Var):
        _facts_through(operand, eqn, axes, producers, out)
    return
  name = eqn.primitive.name
  if name not in _BOUNDS or len(eqn.invars) != 2:
    return
  a, b = eqn.invars
  for x, c, op in ((a, b, name), (b, a, _FLIPPED[name])):
    bound = _constant(c, producers)
    if bound is not None and isinstance(x, core.Var) and same(x):
      x_root, x_axes = lanes(x, producers)
      out.append(((x_root, _compose(x_axes, axes)), _BOUNDS[op](bound)))
      return


def _compose(inner: tuple, outer: tuple) -> tuple:
  """Root axes that run along axes `inner` of a value whose own axes run
  along `outer` of the mask (None for a unit axis)."""
  return tuple(None if a is None else outer[a] for a in inner)


def _facts_through(operand, eqn, axes: tuple, producers: dict,
                   out: list) -> None:
  """The facts of one operand of a conjunction `eqn` (size-1 axes of the
  operand broadcast), mapped to the mask's lanes through `axes`."""
  found: list = []
  _facts(operand, producers, found)
  src, dst = _shape(operand), _shape(eqn.outvars[0])
  for (root, inner), interval in found:
    kept = tuple(None if a is None or src[a] != dst[a] else a for a in inner)
    out.append(((root, _compose(kept, axes)), interval))


def bounds_under_mask(index, mask, producers: dict) -> Interval | None:
  """An interval holding every element of the array of indices `index` on
  the lanes where `mask` (of the same shape) is true, or None when the
  mask says nothing of it."""
  if _shape(index) != _shape(mask) or not isinstance(index, core.Var):
    return None
  found: list = []
  _facts(mask, producers, found)
  key = lanes(index, producers)
  lo, hi = _MIN, _MAX
  for (root, axes), interval in found:
    if root is key[0] and axes == key[1]:
      lo, hi = max(lo, interval.lo), min(hi, interval.hi)
  if (lo, hi) == (_MIN, _MAX):
    return None
  return Interval(lo, max(lo, hi))    # (empty: no lane is kept)
