"""Tiles of its own for a derived kernel that sums contractions.

The accumulating kernel of a reduction's transpose (`reduction_transpose`)
steps through the forward kernel's blocks: a matmul `x @ y` over (bm, bn,
bk) tiles gives `dx = c @ y.T` over x's (bm, bk) blocks, summed over the
forward's bn-wide column blocks, so each step's dot is (bm, bn) x (bn, bk):
an N of bk where the forward's was bn. A person writing that backward
kernel takes the forward's tile for the transposed problem instead: dx in
(bm, bn) blocks, summed over bk-wide steps.

This module does that when a step's contribution to an input's cotangent
is a contraction of whole blocks: every block dim of the operands it reads
walks one grid dim (its block index *is* that grid id) or spans its array,
and the step is built from shape-free operations (dot_general, transpose,
conversions, elementwise arithmetic) whose dims can be followed, so the
same step computes the same sum on blocks of any size. Each grid dim is
then a *label* of array dims: the contribution's output dims keep their
labels (they become the new kernel's parallel grid), its contracted dims
are summed (its reduction). The labels that change role trade their
tiles: the forward's reduced dim, now kept, takes the tile of the dim now
reduced, and that one takes the forward's reduction step. Blocks stay at
least as aligned in their last two dims as the forward's were, and a
reduced dim must divide into whole steps (its padding would reach the
sum); otherwise the kernel keeps the forward's blocks.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dsl.core.blockspec import BlockMapping, BlockSpec
from dsl.core.jax_internals import core
from dsl.core.kernel_layout import KernelLayout
from dsl.core.memory import MemorySpace
from dsl.core.pallas_call import KernelSpec, pallas_call_p
from dsl.core.primitives import when
from dsl.core.tracing import program_id
from dsl.transforms.common import derived_spec, sds, with_semantics


# --------------------------------------------------- labels of array dims

def labels(gm, bm: BlockMapping) -> tuple[int | None, ...] | None:
  """Per array dim of `bm`: the grid dim its block index is (an int), or
  None where the block spans the array; None when some dim is neither."""
  idx = gm.block_indices(bm)
  if idx is None:
    return None
  grid = tuple(int(g) for g in gm.grid)
  out = []
  for a, (d, n) in enumerate(zip(bm.block_shape, bm.array_aval.shape)):
    if not isinstance(d, int) or isinstance(d, bool):
      return None                  # squeezed or Element dims
    if d >= n and not np.any(idx[..., a]):
      out.append(None)
      continue
    found = [g for g, size in enumerate(grid) if size > 1 and np.array_equal(
        idx[..., a], np.broadcast_to(np.arange(size).reshape(
            [size if e == g else 1 for e in range(len(grid))]), grid))]
    if len(found) != 1 or -(-n // d) != grid[found[0]]:
      return None
    out.append(found[0])
  walked = [l for l in out if l is not None]
  # Two dims on one grid dim (diagonal blocks) cover other elements at
  # other tiles.
  return tuple(out) if len(set(walked)) == len(walked) else None


@dataclasses.dataclass(frozen=True)
class _Dims:
  """A value of the step: the label of each of its dims and the grid dims
  it has summed over (contracted)."""
  labels: tuple[int | None, ...]
  summed: frozenset = frozenset()


def _same(eqn, dims):
  return dims[0]


def _blocks(dims):
  """The operands that are blocks (a scalar broadcasts over any block)."""
  found = [d for d in dims if d.labels]
  return found or dims[:1]


def _elementwise(eqn, dims):
  if any(d.summed != dims[0].summed for d in dims):
    return None      # sum(u_g + v) is not sum(u_g) + v
  dims = _blocks(dims)
  if any(d.labels != dims[0].labels for d in dims):
    return None
  return dims[0]


def _product(eqn, dims):
  summed = [d.summed for d in dims if d.summed]
  dims = _blocks(dims)
  if any(d.labels != dims[0].labels for d in dims):
    return None
  if len(summed) > 1:
    return None      # a product of two sums is no sum of products
  return _Dims(dims[0].labels, summed[0] if summed else frozenset())


def _transpose(eqn, dims):
  perm = eqn.params["permutation"]
  return _Dims(tuple(dims[0].labels[p] for p in perm), dims[0].summed)


def _dot_general(eqn, dims):
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = dims
  if lhs.summed or rhs.summed:
    return None
  pairs = list(zip(lc, rc)) + list(zip(lb, rb))
  if any(lhs.labels[a] != rhs.labels[b] for a, b in pairs):
    return None
  free = lambda d, skip: [l for a, l in enumerate(d.labels) if a not in skip]
  out = ([lhs.labels[a] for a in lb] + free(lhs, set(lc) | set(lb))
         + free(rhs, set(rc) | set(rb)))
  summed = {lhs.labels[a] for a in lc} - {None}
  return _Dims(tuple(out), frozenset(summed))


# The shape-free primitives a retiled step may hold: how each one's
# result dims follow from its operands'.
DIM_RULES = {
    "convert_element_type": _same, "neg": _same, "copy": _same,
    "reduce_precision": _same,
    "add": _elementwise, "add_any": _elementwise, "sub": _elementwise,
    "mul": _product,
    "transpose": _transpose,
    "dot_general": _dot_general,
}


def _follow(jx, in_dims) -> _Dims | None:
  """The dims of `jx`'s single result, or None when some equation it
  needs is not shape-free or mixes dims."""
  needed = _needed(jx)
  env = dict(zip(jx.invars, in_dims))
  for eqn in jx.eqns:
    if id(eqn) not in needed:
      continue
    rule = DIM_RULES.get(eqn.primitive.name)
    dims = [_SCALAR if _scalar_literal(v) else env.get(v)
            if isinstance(v, core.Var) else None for v in eqn.invars]
    if rule is None or eqn.effects or any(d is None for d in dims):
      return None
    got = rule(eqn, dims)
    if got is None:
      return None
    env[eqn.outvars[0]] = got
  out = jx.outvars[0]
  return env.get(out) if isinstance(out, core.Var) else None


_SCALAR = _Dims(())


def _scalar_literal(v) -> bool:
  return isinstance(v, core.Literal) and not np.shape(v.val)


def _needed(jx) -> set:
  """The ids of the equations the results of `jx` need."""
  used = {v for v in jx.outvars if isinstance(v, core.Var)}
  found = set()
  for eqn in reversed(jx.eqns):
    if any(v in used for v in eqn.outvars):
      found.add(id(eqn))
      used |= {v for v in eqn.invars if isinstance(v, core.Var)}
  return found


def _used_invars(jx) -> list[int]:
  needed = _needed(jx)
  used = {v for e in jx.eqns if id(e) in needed for v in e.invars
          if isinstance(v, core.Var)} | set(jx.outvars)
  return [p for p, v in enumerate(jx.invars) if v in used]


# ----------------------------------------------------------- the tiling

@dataclasses.dataclass(frozen=True)
class Tiling:
  """A retiled accumulating kernel: its operands (positions among the
  step's inputs, with the forward's mapping of each), the grid dims it
  keeps (in the order of its output's dims) and sums, and a tile per
  grid dim of the forward."""
  operands: tuple[tuple[int, BlockMapping], ...]
  kept: tuple[int, ...]
  summed: tuple[int, ...]
  tiles: dict
  extents: dict


def _extents(gm, maps) -> tuple[dict, dict] | None:
  """(tile, extent) per grid dim, as the forward's blocks have them, or
  None when two operands disagree."""
  tiles, extents = {}, {}
  for bm, labs in maps:
    for l, b, n in zip(labs, bm.block_sizes, bm.array_aval.shape):
      if l is None:
        continue
      if tiles.setdefault(l, b) != b or extents.setdefault(l, n) != n:
        return None
  return tiles, extents


def _alignment(size: int) -> int:
  return size & -size


def _least_alignments(shapes) -> list[float]:
  """Per one of the last two dims: the least alignment (largest power of
  two dividing it) of a block dim there that does not span its array."""
  least = [np.inf, np.inf]
  for block, array in shapes:
    for pos in (-1, -2):
      if len(block) >= -pos and block[pos] < array[pos]:
        least[pos] = min(least[pos], _alignment(block[pos]))
  return least


def _as_aligned(old_shapes, new_shapes) -> bool:
  """Whether the new blocks are no less aligned in their last two dims
  than the forward's (so a tiling rule the forward's blocks meet, such
  as a TPU's (8, 128), the new ones meet too)."""
  least = _least_alignments(old_shapes)
  return all(block[pos] >= array[pos] or _alignment(block[pos]) >= least[pos]
             for block, array in new_shapes for pos in (-1, -2)
             if len(block) >= -pos)


def plan(spec: KernelSpec, d: int, step, maps, out_bm) -> Tiling | None:
  """The tiling of the accumulating kernel whose step is `step` (a closed
  jaxpr: the grid ids, then operands -> an input's cotangent block), for
  the forward `spec` reducing along grid dim `d`; `maps[p]` is the
  forward's mapping of step operand p (None: none the forward has, such
  as a per-point array), `out_bm` the cotangent's. None when the step is
  not a contraction of whole blocks, or its tiles would be the forward's."""
  gm = spec.grid_mapping
  jx, n_ids = step.jaxpr, len(gm.grid)
  used = _used_invars(jx)
  if any(p < n_ids or maps[p - n_ids] is None for p in used):
    return None                    # reads the grid ids or a per-point array
  operands = [(p - n_ids, maps[p - n_ids]) for p in used]
  labelled = [(bm, labels(gm, bm)) for _, bm in operands]
  out_labels = labels(gm, out_bm)
  if out_labels is None or any(l is None for _, l in labelled):
    return None
  env = [None] * len(jx.invars)
  for p, (_, l) in zip(used, labelled):
    env[p] = _Dims(l)
  dims = _follow(jx, env)
  if dims is None or dims.labels != out_labels:
    return None
  kept = tuple(l for l in out_labels if l is not None)
  summed = tuple(sorted(dims.summed))
  moving = {g for g, size in enumerate(gm.grid) if int(size) > 1}
  if set(kept) & set(summed) or set(kept) | set(summed) != moving:
    return None
  found = _extents(gm, labelled + [(out_bm, out_labels)])
  if found is None:
    return None
  tiles, extents = found
  newly = [g for g in summed if g != d]
  if d not in kept or len(newly) != 1:
    return None
  g = newly[0]
  new = dict(tiles)
  new[d], new[g] = tiles[g], tiles[d]
  new = {l: min(t, extents[l]) for l, t in new.items()}
  if new == tiles or any(extents[l] % new[l] for l in summed):
    return None
  tiling = Tiling(tuple(operands), kept, summed, new, extents)
  every = [bm for bm, _ in labelled] + [out_bm]
  old = [(bm.block_sizes, bm.array_aval.shape) for bm in every]
  fresh = [(_block(tiling, bm, labels(gm, bm)), bm.array_aval.shape)
           for bm in every]
  return tiling if _as_aligned(old, fresh) else None


def _block(tiling, bm, labs) -> tuple[int, ...]:
  return tuple(n if l is None else tiling.tiles[l]
               for l, n in zip(labs, bm.array_aval.shape))


# ------------------------------------------------------------ the kernel

def accumulate_over(raw, inner, grid, acc_refs, out_refs, contributions):
  """Adds `contributions` into the scratch accumulators, zeroed at the
  first step of the `inner` grid dims and written out at their last."""
  # `program_id(p) == 0` as such: the grid plan reads it as the reset of
  # an accumulator, so the outer dims stay parallel.
  @when(_all(raw[p] == 0 for p in inner))
  def _():
    for a in acc_refs:
      a[...] = jnp.zeros(a.shape, a.dtype)
  for a, c in zip(acc_refs, contributions):
    a[...] += c.reshape(a.shape).astype(a.dtype)

  # The condition computed after the sum, beside its `pl.when`: the
  # Triton lowering then peels the store out of the loop.
  @when(_all(raw[p] == grid[p] - 1 for p in inner))
  def _():
    for r, a in zip(out_refs, acc_refs):
      r[...] = a[...].astype(r.dtype)


def _all(conditions):
  conditions = iter(conditions)
  out = next(conditions)
  for c in conditions:
    out = out & c
  return out


def _evaluate(jx, consts, used, values):
  """`jx`'s result from the values of its inputs at positions `used`,
  binding only the equations it needs (all shape-free: they take blocks
  of any size)."""
  needed = _needed(jx)
  env = dict(zip(jx.constvars, consts))
  env.update((jx.invars[p], x) for p, x in zip(used, values))
  read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
  for eqn in jx.eqns:
    if id(eqn) in needed:
      params = eqn.primitive.get_bind_params(eqn.params)
      out = eqn.primitive.bind(*map(read, eqn.invars), **params)
      env[eqn.outvars[0]] = out
  return env[jx.outvars[0]]


def retiled(spec: KernelSpec, tiling: Tiling, step, out_bm, args):
  """The cotangent of `out_bm`'s array: the sum of `step` over every
  combination of blocks, by a kernel over `tiling`'s grid (its kept dims
  parallel, its summed dims innermost, accumulated in float32 scratch).
  `args`: the arrays of the step's operands, in `tiling.operands`' order."""
  gm = spec.grid_mapping
  order = tiling.kept + tiling.summed
  grid = tuple(-(-tiling.extents[l] // tiling.tiles[l]) for l in order)
  used = _used_invars(step.jaxpr)
  out_dtype = out_bm.array_aval.dtype
  acc_dtype = jnp.promote_types(out_dtype, jnp.float32)
  inner = list(range(len(tiling.kept), len(order)))

  def spec_of(bm):
    labs = labels(gm, bm)
    pos = [None if l is None else order.index(l) for l in labs]
    return BlockSpec(_block(tiling, bm, labs),
                     lambda *ids: tuple(0 if p is None else ids[p]
                                        for p in pos),
                     memory_space=bm.memory_space, where=bm.where)

  def body(*refs):
    ins, outs, accs = KernelLayout.of(operands=len(used), outputs=1,
                                      accumulators=1).split(refs)
    raw = [program_id(p) for p in range(len(order))]
    c = _evaluate(step.jaxpr, step.consts, used, [r[...] for r in ins])
    accumulate_over(raw, inner, grid, accs, outs, [c])

  out_block = _block(tiling, out_bm, labels(gm, out_bm))
  semantics = (["parallel"] * len(tiling.kept)
               + ["arbitrary"] * len(tiling.summed))
  kernel = derived_spec(
      spec, body, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args],
      [sds(out_bm.array_aval)], grid=grid,
      in_specs=[spec_of(bm) for _, bm in tiling.operands],
      out_specs=[spec_of(out_bm)],
      scratch=[MemorySpace.VMEM(out_block, acc_dtype)], suffix="transpose",
      compiler_params=with_semantics(spec, semantics))
  (out,) = pallas_call_p.bind(*args, spec=kernel)
  return out
