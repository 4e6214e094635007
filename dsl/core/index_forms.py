"""Gathers and scatters rewritten into the forms the compiled lowerings
handle: a gather along one axis at a vector of indices (`x[idx]`,
`x[:, idx]`), element-wise arithmetic, compares, selects and reductions.

Array indexing of a ref (`x_ref[idx, :, :]`, `x_ref.at[cols]` under a
mask), once discharged to values (the interpret backend and the per-point
functions that reverse mode transposes do that), is a gather whose index
array is a concatenation of broadcast vectors, one per array dim (the
"point" form: every dim collapsed, slices of size 1). Its transpose is a
scatter-add of the same form, and a masked store's discharge a scatter
that tells which lane writes last. Neither Triton nor Mosaic has a scatter
of values in registers, and Triton gathers along one axis only, so before a
compiled lowering (`dsl.core.normalize`):

- a point gather whose index components each vary along their own dim
  becomes one gather per dim along that dim (dims indexed by `arange` over
  the whole dim, as a sliced dim is, are left alone);
- a scatter or scatter-add along one axis (or a point one whose components
  are `arange` on all dims but one) becomes, where its indices are known at
  trace time (computed from `iota` and constants, as a masked row access's
  are), a few gathers from the updates along runs of indices with a
  constant step (a run that repeats one index adds a reduction); otherwise
  a compare of every target row with every index (`onehot`), summed
  (scatter-add) or, for a scatter, reduced to the last update that writes
  each row, then gathered.

For a lowering without a gather rule (Mosaic), only the forms without a
gather are made (a scatter-add by the onehot compare, summed); gathers and
scatters that would need one stay as they are, and that lowering refuses
them by their own names.

The structure of an index array comes from the jaxpr that computes it:
`Scope` holds the producer of each variable of the jaxpr being retraced and
the values the retrace gave them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax import lax

from dsl.core.jax_internals import core

# Index vectors longer than this are not evaluated at trace time.
_STATIC_LIMIT = 1 << 16
# Runs of constant step beyond this: the onehot form instead.
_MAX_RUNS = 8


@dataclasses.dataclass(frozen=True)
class Component:
  """One column of a point index array: `root` (a variable or literal)
  reshaped to a vector that varies along batch dim `dim` (None: a constant
  broadcast everywhere)."""
  root: Any
  dim: int | None


class Scope:
  """The equations of one jaxpr by the variables they define, and the
  values a retrace gave its variables so far (`record`)."""

  def __init__(self, jaxpr: core.Jaxpr, consts=(), args=()):
    self.producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    self.values: dict = dict(zip(jaxpr.constvars, consts))
    self.values.update(zip(jaxpr.invars, args))
    self._static: dict = {}

  def record(self, eqn, outs) -> None:
    outs = outs if eqn.primitive.multiple_results else [outs]
    self.values.update(zip(eqn.outvars, outs))

  def value(self, atom):
    return atom.val if isinstance(atom, core.Literal) else self.values[atom]

  def static(self, atom) -> np.ndarray | None:
    """The value of `atom` when it is computed from literals and `iota`
    alone, by equations without effects (calls too), with at most
    `_STATIC_LIMIT` elements; else None."""
    if isinstance(atom, core.Literal):
      return np.asarray(atom.val)
    if atom not in self._static:
      self._static[atom] = self._evaluate(atom)
    return self._static[atom]

  def _evaluate(self, var) -> np.ndarray | None:
    eqn = self.producers.get(var)
    if (eqn is None or eqn.effects
        or np.prod(var.aval.shape, dtype=int) > _STATIC_LIMIT):
      return None
    ins = [self.static(v) for v in eqn.invars]
    if any(x is None for x in ins):
      return None
    try:
      with jax.ensure_compile_time_eval():
        outs = eqn.primitive.bind(*ins, **eqn.params)
    except Exception:     # a primitive with no eager rule: not static
      return None
    outs = outs if eqn.primitive.multiple_results else [outs]
    return np.asarray(outs[list(eqn.outvars).index(var)])


# -- the structure of index arrays ------------------------------------------

def _vector_root(scope: Scope, atom, dims: list) -> Component | None:
  """Follows `atom` back through broadcasts and reshapes that add or drop
  unit dims; `dims[i]`: the batch dim of the index array dim `i` of `atom`
  (None: a dim the index array broadcasts)."""
  shape = tuple(atom.aval.shape)
  eqn = None if isinstance(atom, core.Literal) else scope.producers.get(atom)
  if eqn is not None and eqn.primitive is lax.broadcast_in_dim_p:
    src = eqn.invars[0]
    bd = eqn.params["broadcast_dimensions"]
    src_dims = [dims[d] if n > 1 else None
                for d, n in zip(bd, src.aval.shape)]
    return _vector_root(scope, src, src_dims)
  if eqn is not None and eqn.primitive in (lax.reshape_p, lax.squeeze_p):
    src = eqn.invars[0]
    big = [d for d, n in zip(dims, shape) if n > 1]
    src_big = [n for n in src.aval.shape if n > 1]
    if [n for n in shape if n > 1] == src_big:
      it = iter(big)
      return _vector_root(scope, src, [next(it) if n > 1 else None
                                       for n in src.aval.shape])
  varying = {d for d, n in zip(dims, shape) if n > 1 and d is not None}
  if len(varying) > 1 or sum(n > 1 for n in shape) > 1:
    return None
  return Component(atom, varying.pop() if varying else None)


def point_components(scope: Scope, indices) -> list[Component] | None:
  """The columns of a point index array `[*batch, r]`, each a vector along
  one batch dim, or None when it is not built that way."""
  *batch, r = indices.aval.shape
  eqn = (None if isinstance(indices, core.Literal)
         else scope.producers.get(indices))
  parts = [indices]
  if (r > 1 and eqn is not None and eqn.primitive is lax.concatenate_p
      and eqn.params["dimension"] == len(batch)):
    parts = list(eqn.invars)
  if len(parts) != r or any(p.aval.shape[-1] != 1 for p in parts):
    return None
  comps = [_vector_root(scope, p, list(range(len(batch))) + [None])
           for p in parts]
  return None if any(c is None for c in comps) else comps


def _is_arange(scope: Scope, comp: Component, n: int) -> bool:
  v = scope.static(comp.root)
  return (v is not None and v.size == n
          and np.array_equal(v.reshape(-1), np.arange(n)))


def _vector(scope: Scope, comp: Component, n: int):
  """The component as an int32 vector of `n` lanes."""
  v = lax.convert_element_type(scope.value(comp.root), np.int32)
  v = lax.reshape(v, (int(np.prod(np.shape(v), dtype=int)),))
  return v if v.shape[0] == n else lax.broadcast_in_dim(v, (n,), (0,))


def _static_vector(scope: Scope, comp: Component, n: int):
  v = scope.static(comp.root)
  return None if v is None else np.broadcast_to(
      v.reshape(-1).astype(np.int64), (n,))


def _others(rank: int, axis: int) -> tuple[int, ...]:
  return tuple(d for d in range(rank) if d != axis)


def _parts(dn) -> tuple[tuple[int, ...], ...]:
  """(window dims, collapsed dims, index map) of a gather's or a scatter's
  dimension numbers."""
  names = (("offset_dims", "collapsed_slice_dims", "start_index_map")
           if hasattr(dn, "offset_dims") else
           ("update_window_dims", "inserted_window_dims",
            "scatter_dims_to_operand_dims"))
  return tuple(tuple(getattr(dn, n)) for n in names)


def _point_dnums(dn, rank: int) -> bool:
  """Every operand dim collapsed (inserted) with slices of size 1, in
  order, and no batching dims."""
  window, collapsed, index_map = _parts(dn)
  return (not window and collapsed == index_map == tuple(range(rank))
          and not getattr(dn, "operand_batching_dims", ()))


def one_axis(dn, rank: int, indices_shape) -> int | None:
  """The axis of an `x[idx]` / `x.at[:, idx]` form: indices `[n, 1]`, one
  collapsed dim, the window dims all the others in order."""
  window, collapsed, index_map = _parts(dn)
  if (len(collapsed) != 1 or index_map != collapsed
      or getattr(dn, "operand_batching_dims", ()) or
      len(indices_shape) != 2 or indices_shape[1] != 1):
    return None
  axis = collapsed[0]
  return axis if window == _others(rank, axis) else None


# -- gathers -----------------------------------------------------------------

def take(x, axis: int, index, mode=None, fill_value=None):
  """`x` gathered along `axis` at the int vector `index` (the one-axis form
  every lowering with gathers handles)."""
  rank = x.ndim
  dn = lax.GatherDimensionNumbers(offset_dims=_others(rank, axis),
                                  collapsed_slice_dims=(axis,),
                                  start_index_map=(axis,))
  sizes = tuple(1 if d == axis else n for d, n in enumerate(x.shape))
  return lax.gather(x, index[:, None], dn, sizes, mode=mode,
                    fill_value=fill_value)


def _gather_form(scope: Scope, eqn, gathers: bool) -> list[Component] | None:
  x, indices = eqn.invars
  if not gathers:
    return None
  rank = len(x.aval.shape)
  dn = eqn.params["dimension_numbers"]
  if (rank < 2 or not _point_dnums(dn, rank)
      or len(indices.aval.shape) != rank + 1):
    return None
  comps = point_components(scope, indices)
  if comps is None or any(c.dim not in (k, None)
                          for k, c in enumerate(comps)):
    return None
  return comps


def _gather(scope: Scope, eqn, comps, x, indices):
  batch = indices.shape[:-1]
  y = x
  for k, comp in enumerate(comps):
    n = batch[k]
    if comp.dim is not None and _is_arange(scope, comp, y.shape[k]):
      continue
    y = take(y, k, _vector(scope, comp, 1 if comp.dim is None else n),
             eqn.params["mode"], eqn.params.get("fill_value"))
    if comp.dim is None and n != 1:
      y = lax.broadcast_in_dim(y, y.shape[:k] + (n,) + y.shape[k + 1:],
                               tuple(range(y.ndim)))
  return y


# -- scatters ----------------------------------------------------------------

def _scatter_form(scope: Scope, eqn,
                  gathers: bool) -> tuple[int, Component, bool] | None:
  """(axis, its index component, `gathers`) of a scatter along one axis;
  without gathers, only a scatter-add has a form."""
  if not gathers and eqn.primitive is not lax.scatter_add_p:
    return None
  operand, indices, _ = eqn.invars
  shape = tuple(operand.aval.shape)
  dn = eqn.params["dimension_numbers"]
  axis = one_axis(dn, len(shape), indices.aval.shape)
  if axis is not None:
    return axis, Component(indices, 0), gathers
  if (not shape or not _point_dnums(dn, len(shape))
      or len(indices.aval.shape) != len(shape) + 1):
    return None
  comps = point_components(scope, indices)
  if comps is None or any(c.dim not in (k, None)
                          for k, c in enumerate(comps)):
    return None
  batch = indices.aval.shape[:-1]
  moving = [k for k, c in enumerate(comps)
            if not (c.dim == k and batch[k] == shape[k]
                    and _is_arange(scope, c, shape[k]))]
  if len(moving) > 1:
    return None
  axis = moving[0] if moving else 0
  return axis, comps[axis], gathers


def _runs(values: np.ndarray, keep: np.ndarray):
  """Maximal runs of kept lanes whose values step by a constant:
  (first lane, length, first value, step), or None past `_MAX_RUNS`."""
  runs, i, n = [], 0, len(values)
  while i < n:
    if not keep[i]:
      i += 1
      continue
    j = i + 1
    step = int(values[j] - values[i]) if j < n and keep[j] else 0
    while j < n and keep[j] and values[j] - values[j - 1] == step:
      j += 1
    runs.append((i, j - i, int(values[i]), step))
    if len(runs) > _MAX_RUNS:
      return None
    i = j
  return runs


def _along(vector, shape, axis: int):
  return lax.broadcast_in_dim(vector, tuple(shape), (axis,))


def _iota(n: int):
  return lax.iota(np.int32, n)


def _i32(k: int):
  return np.int32(k)


def _placed(updates, axis: int, m: int, first: int, step: int,
            src_first: int, src_step: int, count: int):
  """`updates` lanes `src_first + src_step * q` (q < count) placed at
  target lanes `first + step * q` of a length-`m` axis: (value, mask of the
  lanes placed, or None when that is every lane). A shift is a `pad` (which
  trims where negative), anything else a gather."""
  n = updates.shape[axis]
  rel = np.arange(m) - first
  q = rel // step
  ok = (rel % step == 0) & (q >= 0) & (q < count)
  lane = lax.sub(_iota(m), _i32(first))
  q_t = lax.div(lane, _i32(step))
  if step == 1 and src_step == 1:
    shift = src_first - first
    config = [(0, 0, 0)] * updates.ndim
    config[axis] = (-shift, m - n + shift, 0)
    piece = (updates if not any(config[axis]) else
             lax.pad(updates, lax.full((), 0, updates.dtype), config))
  else:
    src = lax.clamp(_i32(0), lax.add(lax.mul(q_t, _i32(src_step)),
                                     _i32(src_first)), _i32(n - 1))
    piece = take(updates, axis, src)
  if ok.all():
    return piece, None
  ok_t = lax.bitwise_and(lax.ge(q_t, _i32(0)), lax.lt(q_t, _i32(count)))
  if abs(step) > 1:
    ok_t = lax.bitwise_and(ok_t, lax.eq(lax.rem(lane, _i32(step)), _i32(0)))
  return piece, _along(ok_t, piece.shape, axis)


def _add_runs(operand, updates, axis: int, runs):
  m = operand.shape[axis]
  zeros = lax.full_like(operand, 0)
  acc = operand
  for lane, count, first, step in runs:
    if step == 0 or count == 1:
      src = _along(_iota(updates.shape[axis]), updates.shape, axis)
      inside = lax.bitwise_and(lax.ge(src, _i32(lane)),
                               lax.lt(src, _i32(lane + count)))
      total = lax.reduce_sum(lax.select(inside, updates,
                                        lax.full_like(updates, 0)), (axis,))
      total = lax.broadcast_in_dim(total, operand.shape,
                                   _others(operand.ndim, axis))
      at = _along(lax.eq(_iota(m), _i32(first)), operand.shape, axis)
      piece = lax.select(at, total, zeros)
    else:
      piece, ok = _placed(updates, axis, m, first, step, lane, 1, count)
      if ok is not None:
        piece = lax.select(ok, piece, zeros)
    acc = lax.add(acc, piece)
  return acc


def _set_runs(operand, updates, axis: int, runs):
  m = operand.shape[axis]
  acc = operand
  for lane, count, first, step in runs:
    piece, ok = _placed(updates, axis, m, lane, 1, first, step, count)
    acc = piece if ok is None else lax.select(ok, piece, acc)
  return acc


def _hits(m: int, index):
  """[m, n]: target row `j` is index `i`."""
  n = index.shape[0]
  return lax.eq(_along(_iota(m), (m, n), 0), _along(index, (m, n), 1))


def _add_onehot(operand, updates, axis: int, index):
  m, n, rank = operand.shape[axis], index.shape[0], operand.ndim
  wide = operand.shape[:axis] + (m, n) + operand.shape[axis + 1:]
  hit = lax.broadcast_in_dim(_hits(m, index), wide, (axis, axis + 1))
  upd = lax.broadcast_in_dim(updates, wide, tuple(
      d if d < axis else d + 1 for d in range(rank)))
  summed = lax.reduce_sum(lax.select(hit, upd, lax.full_like(upd, 0)),
                          (axis + 1,))
  return lax.add(operand, summed)


def _set_onehot(operand, updates, axis: int, index):
  m, n = operand.shape[axis], index.shape[0]
  lanes = _along(_iota(n), (m, n), 1)
  last = lax.reduce_max(lax.select(_hits(m, index), lanes,
                                   lax.full_like(lanes, -1)), (1,))
  piece = take(updates, axis, lax.clamp(_i32(0), last, _i32(n - 1)))
  written = _along(lax.ge(last, _i32(0)), operand.shape, axis)
  return lax.select(written, piece, operand)


def _scatter(scope: Scope, eqn, form, operand, indices, updates):
  axis, comp, gathers = form
  m, n = operand.shape[axis], updates.shape[axis]
  index = _vector(scope, comp, n)
  # Runs place updates by gathers and pads: without gathers, the onehot form.
  static = _static_vector(scope, comp, n) if gathers else None
  clip = (lax.GatherScatterMode.from_any(eqn.params["mode"])
          == lax.GatherScatterMode.CLIP)
  if clip:
    index = lax.clamp(_i32(0), index, _i32(m - 1))
    static = None if static is None else np.clip(static, 0, m - 1)
  add = eqn.primitive is lax.scatter_add_p
  if static is not None:
    valid = (static >= 0) & (static < m)
    if add:
      runs = _runs(static, valid)
    else:
      last = np.full(m, -1)
      for i in np.nonzero(valid)[0]:      # the last write wins
        last[static[i]] = i
      runs = _runs(last, last >= 0)
    if runs is not None:
      return (_add_runs if add else _set_runs)(operand, updates, axis, runs)
  return (_add_onehot if add else _set_onehot)(operand, updates, axis, index)


# primitive -> (form(scope, eqn, gathers): what the rewrite needs, or None
# where it does not apply; rewrite(scope, eqn, form, *operands)).
REWRITES = {
    lax.gather_p: (_gather_form, _gather),
    lax.scatter_p: (_scatter_form, _scatter),
    lax.scatter_add_p: (_scatter_form, _scatter),
}


def form(scope: Scope, eqn, gathers: bool = True):
  """What rewriting `eqn` needs, or None when it stays as it is;
  `gathers`: whether the lowering has a gather rule."""
  entry = REWRITES.get(eqn.primitive)
  return None if entry is None else entry[0](scope, eqn, gathers)


def rewrite(scope: Scope, eqn, form_, invals: Sequence):
  return REWRITES[eqn.primitive][1](scope, eqn, form_, *invals)
