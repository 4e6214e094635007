"""What the families share: drawing blocked operands over a grid, TPU tile
sizes, tolerances, loading (and masking) the inputs of a body, and the
scalar predicates of `cond` and `when`."""
from __future__ import annotations

import numpy as np

from tests.pallas.fuzz.expr import Expr
from tests.pallas.fuzz.spec import (Dim, Operand, grid_points, is_float,
                                    np_valid, sanitize, valid_mask,
                                    fill_value)

EPS = {"float32": 1e-6, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


class Draw:
  """A seeded random source with the few draws the generators need."""

  def __init__(self, seed: int, index: int):
    self.rng = np.random.default_rng([seed, index])

  def chance(self, p: float) -> bool:
    return bool(self.rng.random() < p)

  def int(self, lo: int, hi: int) -> int:
    """An int in [lo, hi]."""
    return int(self.rng.integers(lo, hi + 1))

  def pick(self, seq):
    seq = list(seq)
    return seq[int(self.rng.integers(len(seq)))]


def sublane(dtype: str) -> int:
  """The TPU's second-minor tile for `dtype`."""
  return {"float32": 8, "int32": 8, "bfloat16": 16, "float16": 16}.get(dtype, 32)


def tpu_block(d: Draw, krank: int, dtypes) -> tuple[int, ...]:
  """A kernel block shape that passes the TPU tiling rule for `dtypes`."""
  tile = max(sublane(t) for t in dtypes)
  last = 128 * d.pick([1, 1, 2])
  if krank == 1:
    return (last,)
  return tuple(d.int(1, 2) for _ in range(krank - 2)) + (
      tile * d.pick([1, 1, 2]), last)


def small_block(d: Draw, krank: int) -> tuple[int, ...]:
  return tuple(d.pick([1, 2, 3, 4, 5, 8]) for _ in range(krank))


def extent(d: Draw, count: int, size: int, exact: bool = False) -> int:
  """An array dim cut into `count` blocks of `size`, the last one maybe
  partial (a cdiv grid)."""
  if exact or size == 1 or count == 1 or d.chance(0.4):
    return count * size
  return count * size - d.int(1, size - 1)


def output_dims(d: Draw, grid, kshape, tpu: bool, pf: bool,
                spare: int = 0) -> tuple[tuple[Dim, ...], tuple[int, ...]]:
  """Dims and shape of an output that every grid point writes once: each
  grid axis picks one array dim (squeezed or blocked); the other dims are
  whole. `spare` extra blocks per axis stay unvisited (aliased outputs)."""
  krank = len(kshape)
  rank = max(krank, len(grid))
  rank = min(3, rank + (1 if d.chance(0.2) else 0))
  n_sq = rank - krank
  # squeezed dims go before the last kernel dim (TPU: before the last two)
  lead = max(0, rank - (2 if tpu and krank >= 2 else 1))
  sq_pos = set(d.rng.choice(lead, n_sq, replace=False).tolist())
  axes = list(d.rng.permutation(len(grid)))
  positions = list(d.rng.permutation(rank))[:len(grid)]
  owner = dict(zip(positions, axes))
  dims, shape, k = [], [], 0
  for p in range(rank):
    squeezed = p in sq_pos
    size = 1 if squeezed else kshape[k]
    k += 0 if squeezed else 1
    if p in owner:
      a = int(owner[p])
      src = "pf" if pf and a == 0 and d.chance(0.6) else d.pick(
          ["axis", "axis", "rev"])
      count = grid[a] + spare
      n = count if squeezed else extent(d, count, size)
    else:
      a, src, n = 0, "const", size
    dims.append(Dim("squeezed" if squeezed else "blocked", size, src, a))
    shape.append(n)
  return tuple(dims), tuple(shape)


def input_dims(d: Draw, grid, kshape, tpu: bool, pf: bool):
  """Dims and shape of an input block of kernel shape `kshape`: each dim
  follows any grid axis (reusing and reversing them), a prefetched table,
  or a constant block; some dims are squeezed or `Element` windows."""
  krank = len(kshape)
  n_sq = d.int(0, 3 - krank) if d.chance(0.3) else 0
  rank = krank + n_sq
  lead = max(0, rank - (2 if tpu and krank >= 2 else 1))
  n_sq = min(n_sq, lead)
  rank = krank + n_sq
  sq_pos = set(d.rng.choice(lead, n_sq, replace=False).tolist()) if n_sq \
      else set()
  dims, shape, k = [], [], 0
  for p in range(rank):
    squeezed = p in sq_pos
    size = 1 if squeezed else kshape[k]
    last_two = p >= rank - 2
    k += 0 if squeezed else 1
    if grid and d.chance(0.85):
      a = d.int(0, len(grid) - 1)
      src = "pf" if pf and a == 0 and d.chance(0.5) else d.pick(
          ["axis", "axis", "axis", "rev"])
      count = grid[a]
    else:
      a, src, count = d.int(0, 1), "const", None
    top = (count - 1) if src != "const" else a
    kind = "squeezed" if squeezed else "blocked"
    step = 0
    if not squeezed and not (tpu and last_two) and d.chance(0.15):
      kind, step = "element", d.int(1, size)
      n = top * step + size + d.int(0, 2)
    elif squeezed:
      n = top + 1 + d.int(0, 1)
    elif src == "const":
      n = max(size, a * size + d.int(1, size + 2))
    else:
      n = extent(d, count, size) + (size * d.int(0, 1) if d.chance(0.2)
                                    else 0)
    dims.append(Dim(kind, size, src, a, step))
    shape.append(n)
  return tuple(dims), tuple(shape)


def bias_shape(d: Draw, kshape) -> tuple[int, ...]:
  """A whole-array operand that broadcasts against the kernel block."""
  shape = [n if d.chance(0.5) else 1 for n in kshape]
  drop = d.int(0, len(shape) - 1) if shape else 0
  return tuple(shape[drop:])


def needs_mask(op: Operand, outs, grid, pf) -> bool:
  """Whether some grid point sees padding of `op` where an output block is
  inside its array (so the padding would reach a defined result)."""
  for ids in grid_points(grid):
    bad = ~np_valid(op, ids, grid, pf)
    if not bad.any():
      continue
    for out in outs:
      if (bad & np.broadcast_to(np_valid(out, ids, grid, pf), bad.shape)).any():
        return True
  return False


def is_partial(op: Operand, grid, pf) -> bool:
  return any(not np_valid(op, ids, grid, pf).all() for ids in grid_points(grid))


def load_inputs(case, ctx, masks: dict[int, str], fill=None) -> dict:
  """Leaves of the body's expressions: the input blocks ("x0", ...), masked
  past the array as `masks` says ("where" or "masked_load"), the program
  ids ("pid0", ...) and the prefetched entry ("pf")."""
  env = {f"pid{a}": ctx.pid(a) for a in range(len(case.grid))}
  if case.prefetch is not None:
    env["pf"] = ctx.prefetched(ctx.pid(0))
  for k, op in enumerate(case.inputs):
    if op.space == "any":
      continue
    how = masks.get(k)
    f = fill_value(op.dtype) if fill is None else fill
    if how == "masked_load":
      mask = valid_mask(op, ctx.ids, case.grid, ctx.pf, ctx.xp)
      env[f"x{k}"] = ctx.load_masked(k, mask, f)
    else:
      v = ctx.load(k)
      env[f"x{k}"] = sanitize(v, op, ctx.ids, case.grid, ctx.pf, f, ctx.xp) \
          if how == "where" else v
  return env


def predicate(ctx, env, pred):
  """A scalar bool: ("pid", axis, modulus, rest) on a program id, or
  ("data", name) when the (masked) integer block `name` sums above 0."""
  if pred[0] == "pid":
    _, a, m, r = pred
    return ctx.pid(a) % m == r
  x = env[pred[1]]
  return ctx.xp.sum(x.astype(np.int32), dtype=np.int32) > 0


def loop_leaves(grid, loops=(), extra=()) -> set[str]:
  """Leaf names of the program ids of the grid dims `loops` (and of size 1
  when also in `loops`) and of `extra` loop indices."""
  return {f"pid{a}" for a in range(len(grid)) if a in loops} | set(extra)


def unit_leaves(grid) -> set[str]:
  """Leaf names of the program ids of size-1 grid dims (which a backend may
  fold to constants)."""
  return {f"pid{a}" for a in range(len(grid)) if grid[a] == 1}


def tolerance(exprs, out_dtype: str) -> float:
  """Relative tolerance of an output computed by `exprs`."""
  ops = [d for e in exprs if isinstance(e, Expr) for d in e.inexact_ops()
         if d in EPS]
  if not ops:
    return EPS[out_dtype] if is_float(out_dtype) else 0.0
  eps = max([EPS[d] for d in ops] + ([EPS[out_dtype]] if is_float(out_dtype)
                                     else []))
  return min(0.25, eps * 8 * (1 + len(ops)))
