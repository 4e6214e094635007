"""Shape primitives: broadcasts, reshapes, transposes, iota, slices,
concatenation, padding and reversal.

Triton tensors cannot be sliced; every static or dynamic slice of a value is
a `tl.gather` along the sliced axis with a clamped index vector (`take`).
Reshapes keep Triton's `tl.reshape` whenever the padded layout agrees with the
logical one (all dims but the leading one are powers of two, ignoring size-1
dims), and otherwise gather through the flattened value.
"""
from __future__ import annotations

import math

import numpy as np
from jax import lax
from dsl.core.jax_internals import state_primitives

from lowering_triton import triton_dtypes as dtypes
from lowering_triton.codegen import paren
from lowering_triton.kernel_refs import bcast
from lowering_triton.rules import register
from lowering_triton.values import TVal, full_expr, padded, pow2


def clamp(expr: str, lo: int, hi: int, known: tuple[int, int] | None = None
          ) -> str:
  """`expr` clamped to [lo, hi]; `known` is a static range of its values."""
  if known is not None and known[0] >= lo and known[1] <= hi:
    return expr
  if known is not None and known[0] >= lo:
    return f"tl.minimum({expr}, {hi})"
  return f"tl.minimum(tl.maximum({expr}, {lo}), {hi})"


def _gatherable(ctx, x: TVal) -> tuple[str, bool]:
  """Bool tensors gather as int8."""
  if x.dtype == np.bool_:
    return f"{paren(x.expr)}.to(tl.int8)", True
  return x.expr, False


def take(ctx, x: TVal, axis: int, index: str, out_size: int,
         hint: str = "take") -> TVal:
  """`x` gathered along `axis` at the 1-D index vector `index`.

  `index` has `pow2(out_size)` lanes holding valid (clamped) positions.
  """
  rank = len(x.shape)
  new_shape = list(x.shape)
  new_shape[axis] = out_size
  src, was_bool = _gatherable(ctx, x)
  grow = pow2(out_size) // pow2(x.shape[axis])
  if grow > 1:
    # Triton's GPU compiler rejects gathers whose result is longer than the
    # source along the axis: first repeat each lane `grow` times in place
    # (a broadcast and a reshape), then gather from lane `index * grow`.
    p = padded(x.shape)
    expanded = list(p[:axis + 1]) + [grow] + list(p[axis + 1:])
    grown = list(p)
    grown[axis] *= grow
    sel = ", ".join([":"] * (axis + 1) + ["None"] + [":"] * (rank - axis - 1))
    src = ctx.bind_raw(f"tl.reshape(tl.broadcast_to({paren(src)}[{sel}], "
                       f"{tuple(expanded)}), {tuple(grown)})", "repeated")
    index = f"{paren(index)} * {grow}"
  if rank == 1:
    idx = index
  else:
    idx = f"tl.broadcast_to({paren(index)}{bcast(axis, rank)}, {padded(new_shape)})"
  expr = f"tl.gather({src}, {idx}, {axis})"
  if was_bool:
    expr = f"{expr} != 0"
  return ctx.bind(expr, new_shape, x.dtype, hint)


def lanes(n: int) -> str:
  return f"tl.arange(0, {pow2(n)})"


def _literal_full(ctx, x: TVal, shape, hint):
  return ctx.bind(full_expr(shape, x.literal, x.dtype), shape, x.dtype, hint)


# ------------------------------------------------------------- broadcasts

@register(lax.broadcast_in_dim_p)
def _broadcast_in_dim(ctx, x, *dyn, shape, broadcast_dimensions, **params):
  shape = tuple(int(d) for d in shape)
  hint = ctx.hint("broadcast")
  if x.literal is not None:
    return _literal_full(ctx, x, shape, hint)
  if x.shape == shape and tuple(broadcast_dimensions) == tuple(range(len(shape))):
    return x
  if x.shape == ():
    return ctx.bind(f"tl.broadcast_to({x.expr}, {padded(shape)})", shape,
                    x.dtype, hint)
  rank = len(shape)
  bdims = list(broadcast_dimensions)
  expr = x.expr
  if len(bdims) < rank:
    expr = paren(expr) + "[" + ", ".join(
        ":" if d in bdims else "None" for d in range(rank)) + "]"
  expanded = [1] * rank
  for src, d in zip(x.shape, bdims):
    expanded[d] = src
  if padded(expanded) != padded(shape):
    expr = f"tl.broadcast_to({expr}, {padded(shape)})"
  return ctx.bind(expr, shape, x.dtype, hint)


@register(state_primitives.broadcast_to_p)
def _broadcast_to(ctx, x, *, shape, **params):
  """JAX state's broadcast (numpy's rule: leading dims added, unit dims
  stretched), which an indexer with several arrays of indices applies to
  each of them."""
  rank, extra = len(shape), len(shape) - len(x.shape)
  return _broadcast_in_dim(ctx, x, shape=shape,
                           broadcast_dimensions=tuple(range(extra, rank)))


# ------------------------------------------------------------- reshapes

def _layout_compatible(a, b) -> bool:
  a = [d for d in a if d != 1]
  b = [d for d in b if d != 1]
  if a == b:
    return True
  return all(pow2(d) == d for d in a[1:]) and all(pow2(d) == d for d in b[1:])


def _unit_dims_inserted(old, new) -> str | None:
  """The indexing (`[:, None]`) that makes `new` from `old` by inserting
  unit dims, or None when the reshape does more than that."""
  sel, i = [], 0
  for d in new:
    if i < len(old) and d == old[i]:
      sel.append(":")
      i += 1
    elif d == 1:
      sel.append("None")
    else:
      return None
  return "[" + ", ".join(sel) + "]" if i == len(old) else None


def reshape_value(ctx, x: TVal, new_shape, hint: str) -> TVal:
  new_shape = tuple(int(d) for d in new_shape)
  if x.literal is not None:
    return _literal_full(ctx, x, new_shape, hint)
  if new_shape == x.shape:
    return x
  if x.shape == ():
    # Triton reshapes tensors only: a scalar is broadcast to its new shape
    # (of one element).
    return ctx.bind(f"tl.broadcast_to({x.expr}, {padded(new_shape)})",
                    new_shape, x.dtype, hint)
  if new_shape == ():
    return _only_element(ctx, x, hint)
  inserted = _unit_dims_inserted(x.shape, new_shape) if x.shape else None
  if inserted is not None:
    # `x[:, None]` rather than `tl.reshape`: Triton gives a reshaped row
    # vector a layout that every thread holds whole, and a later broadcast
    # to a tile keeps it (a (64, 1024) tile in each thread's registers:
    # hours of LLVM, then spills).
    return ctx.bind(f"{paren(x.expr)}{inserted}", new_shape, x.dtype, hint)
  if _layout_compatible(x.shape, new_shape):
    if padded(new_shape) == padded(x.shape):
      return TVal(x.expr, new_shape, x.dtype)
    return ctx.bind(f"tl.reshape({x.expr}, {padded(new_shape)})", new_shape,
                    x.dtype, hint)
  # General case: gather the logical elements through the flat value.
  in_p, out_p = padded(x.shape), padded(new_shape)
  n_in, n_out = math.prod(in_p), math.prod(out_p)
  src, was_bool = _gatherable(ctx, x)
  flat = ctx.bind_raw(f"tl.reshape({src}, ({n_in},))", "flat")
  k = ctx.bind_raw(f"tl.arange(0, {n_out})", "flat_idx")
  terms = []
  for j in range(len(new_shape)):
    inner_p = math.prod(out_p[j + 1:])
    inner = math.prod(new_shape[j + 1:])
    c = f"({k} // {inner_p}) % {out_p[j]}" if inner_p > 1 else f"{k} % {out_p[j]}"
    terms.append(f"({c}) * {inner}" if inner != 1 else f"({c})")
  linear = ctx.bind_raw(" + ".join(terms) or "0", "linear")
  src_terms = []
  for i in range(len(x.shape)):
    inner = math.prod(x.shape[i + 1:])
    inner_p = math.prod(in_p[i + 1:])
    d = f"({linear} // {inner}) % {x.shape[i]}" if inner > 1 else \
        f"{linear} % {x.shape[i]}"
    src_terms.append(f"({d}) * {inner_p}" if inner_p != 1 else f"({d})")
  index = clamp(" + ".join(src_terms) or "0", 0, n_in - 1)
  expr = f"tl.reshape(tl.gather({flat}, {index}, 0), {out_p})"
  if was_bool:
    expr = f"{expr} != 0"
  return ctx.bind(expr, new_shape, x.dtype, hint)


def _only_element(ctx, x: TVal, hint: str) -> TVal:
  """The scalar a one-element tensor holds: Triton has no reshape to a
  scalar, so it is reduced away (a `tl.reduce` of one element returns it
  unchanged; NaN, -0.0 and integers included)."""
  src, was_bool = _gatherable(ctx, x)
  for axis in reversed(range(len(x.shape))):
    src = f"tl.reduce({src}, {axis}, {_first_combine(ctx)})"
  expr = f"{paren(src)} != 0" if was_bool else src
  return ctx.bind(expr, (), x.dtype, hint)


_FIRST_COMBINE = '''@triton.jit
def _first_combine(a, b):
    return a'''


def _first_combine(ctx) -> str:
  return ctx.host.need_helper("_first_combine", _FIRST_COMBINE)


@register(lax.reshape_p)
def _reshape(ctx, x, *dyn, new_sizes, dimensions=None, **params):
  if dimensions is not None and tuple(dimensions) != tuple(range(len(x.shape))):
    x = _transpose(ctx, x, permutation=dimensions)
  return reshape_value(ctx, x, new_sizes, ctx.hint("reshape"))


@register(lax.squeeze_p)
def _squeeze(ctx, x, dimensions, **params):
  new = [d for i, d in enumerate(x.shape) if i not in dimensions]
  return reshape_value(ctx, x, new, ctx.hint("squeeze"))


@register(lax.transpose_p)
def _transpose(ctx, x, permutation, **params):
  perm = tuple(int(p) for p in permutation)
  if perm == tuple(range(len(perm))):
    return x
  new = tuple(x.shape[p] for p in perm)
  if x.literal is not None:
    return _literal_full(ctx, x, new, "transpose")
  return ctx.bind(f"tl.permute({x.expr}, {perm})", new, x.dtype,
                  ctx.hint("transpose"))


@register(lax.iota_p)
def _iota(ctx, dtype, shape, dimension, **params):
  shape = tuple(int(d) for d in shape)
  rank = len(shape)
  expr = lanes(shape[dimension])
  if rank > 1:
    expr = f"tl.broadcast_to({expr}{bcast(dimension, rank)}, {padded(shape)})"
  dtype = np.dtype(dtype)
  if dtype != np.int32:
    expr = f"{paren(expr)}.to({dtypes.tl_type(dtype)})"
  return ctx.bind(expr, shape, dtype, ctx.hint("iota"))


# ------------------------------------------------------------- slices

@register(lax.slice_p)
def _slice(ctx, x, start_indices, limit_indices, strides=None, **params):
  y = x
  for axis, (s, l) in enumerate(zip(start_indices, limit_indices)):
    st = 1 if strides is None else int(strides[axis])
    n_in = x.shape[axis]
    n_out = max(0, -(-(int(l) - int(s)) // st))
    if int(s) == 0 and st == 1 and pow2(n_out) == pow2(n_in):
      # A prefix of the same padded length: the lanes past it are padding.
      y = TVal(y.expr, y.shape[:axis] + (n_out,) + y.shape[axis + 1:],
               y.dtype, y.literal)
      continue
    idx = lanes(n_out) if st == 1 else f"{lanes(n_out)} * {st}"
    if int(s):
      idx = f"{idx} + {int(s)}"
    known = (int(s), int(s) + st * (pow2(n_out) - 1))
    y = take(ctx, y, axis, clamp(idx, 0, n_in - 1, known), n_out,
             ctx.hint("slice"))
  return y


def _start_expr(ctx, start: TVal, n: int, size: int) -> str:
  """A dynamic start clamped as XLA does, to [0, n - size]."""
  if start.literal is not None:
    return str(min(max(int(start.literal), 0), n - size))
  s = start.expr if start.dtype == np.int32 else f"{paren(start.expr)}.to(tl.int32)"
  return ctx.bind_raw(clamp(s, 0, n - size), "start")


@register(lax.dynamic_slice_p)
def _dynamic_slice(ctx, x, *starts, slice_sizes, **params):
  starts = starts[:len(x.shape)]
  y = x
  for axis, (start, size) in enumerate(zip(starts, slice_sizes)):
    n = x.shape[axis]
    size = int(size)
    s = _start_expr(ctx, start, n, size)
    if s == "0" and size == n:
      continue
    idx = lanes(size) if s == "0" else f"{lanes(size)} + {s}"
    y = take(ctx, y, axis, clamp(idx, 0, n - 1), size, ctx.hint("dyn_slice"))
  return y


@register(lax.dynamic_update_slice_p)
def _dynamic_update_slice(ctx, x, update, *starts, **params):
  return update_window(ctx, x, update, list(starts), ctx.hint("updated"))


def update_window(ctx, x: TVal, update: TVal, starts, hint: str) -> TVal:
  """`x` with the window at `starts` (TVals) replaced by `update`."""
  rank = len(x.shape)
  if rank == 0:
    return update
  expanded = update
  masks = []
  for axis in range(rank):
    n, u = x.shape[axis], update.shape[axis]
    s = _start_expr(ctx, starts[axis], n, u)
    if s == "0" and u == n:
      continue
    ar = lanes(n)
    idx = clamp(f"{ar} - {s}" if s != "0" else ar, 0, u - 1)
    expanded = take(ctx, expanded, axis, idx, n, "spread")
    lo = f"{ar} >= {s}" if s != "0" else None
    hi = f"{ar} < {s} + {u}" if s != "0" else f"{ar} < {u}"
    cond = f"({lo}) & ({hi})" if lo else hi
    masks.append(f"({cond}){bcast(axis, rank)}")
  if not masks:
    return TVal(update.expr, x.shape, x.dtype, update.literal)
  if expanded.literal is not None:
    expanded = ctx.bind(full_expr(x.shape, expanded.literal, x.dtype), x.shape,
                        x.dtype, "spread")
  mask = " & ".join(masks)
  return ctx.bind(f"tl.where({mask}, {expanded.expr}, {x.expr})", x.shape,
                  x.dtype, hint)


@register(lax.rev_p)
def _rev(ctx, x, dimensions, **params):
  y = x
  for axis in dimensions:
    n = x.shape[axis]
    y = take(ctx, y, axis, clamp(f"{n - 1} - {lanes(n)}", 0, n - 1,
                                 (n - pow2(n), n - 1)), n, ctx.hint("reversed"))
  return y


@register(lax.concatenate_p)
def _concatenate(ctx, *xs, dimension, **params):
  dim = int(dimension)
  total = sum(x.shape[dim] for x in xs)
  rank = len(xs[0].shape)
  out_shape = list(xs[0].shape)
  out_shape[dim] = total
  ar = lanes(total)
  result, offset = None, 0
  for x in xs:
    n = x.shape[dim]
    if x.literal is not None:
      x = ctx.bind(full_expr(x.shape, x.literal, x.dtype), x.shape, x.dtype,
                   "part")
    if offset == 0 and pow2(n) == pow2(total):
      # Lanes past n are overwritten by the later parts: no gather needed.
      piece = TVal(x.expr, tuple(out_shape), x.dtype)
    else:
      idx = clamp(f"{ar} - {offset}" if offset else ar, 0, n - 1)
      piece = take(ctx, x, dim, idx, total, "part")
    if result is None:
      result = piece
    else:
      result = ctx.bind(
          f"tl.where(({ar} >= {offset}){bcast(dim, rank)}, {piece.expr}, "
          f"{result.expr})", out_shape, x.dtype, "concat")
    offset += n
  return result


@register(lax.pad_p)
def _pad(ctx, x, padding_value, padding_config, **params):
  """Each padded axis is a gather: output lane `p` reads input lane
  `(p - lo) / (interior + 1)` where that is a whole lane inside the input,
  and takes the padding value elsewhere (interior padding spreads the input
  by a stride, as a strided store does)."""
  y = x
  for axis, (lo, hi, interior) in enumerate(padding_config):
    lo, hi, interior = int(lo), int(hi), int(interior)
    if (lo, hi, interior) == (0, 0, 0):
      continue
    n = y.shape[axis]
    step = interior + 1
    m = lo + hi + n + max(0, n - 1) * interior
    ar = lanes(m)
    pos = ctx.bind_raw(f"{ar} - {lo}" if lo else ar, "pad_src")
    valid = f"({pos} >= 0) & ({pos} < {(n - 1) * step + 1})"
    src = pos
    if step > 1:
      src = ctx.bind_raw(f"{pos} // {step}", "pad_src")
      valid = f"{valid} & ({pos} % {step} == 0)"
    if lo == 0 and step == 1 and pow2(m) == pow2(n):
      # Padding at the end within the padded length: no lane moves.
      piece = TVal(y.expr, y.shape[:axis] + (m,) + y.shape[axis + 1:],
                   y.dtype, y.literal)
    else:
      piece = take(ctx, y, axis, clamp(src, 0, n - 1), m, "padded")
    rank = len(y.shape)
    pv = ctx.value(padding_value)
    y = ctx.bind(f"tl.where(({valid}){bcast(axis, rank)}, {piece.expr}, "
                 f"{pv})", piece.shape, x.dtype, ctx.hint("padded"))
  return y


@register(lax.split_p)
def _split(ctx, x, sizes, axis, **params):
  outs, offset = [], 0
  n_in = x.shape[axis]
  for size in sizes:
    size = int(size)
    idx = lanes(size) if not offset else f"{lanes(size)} + {offset}"
    outs.append(take(ctx, x, axis, clamp(idx, 0, n_in - 1,
                                         (offset, offset + pow2(size) - 1)),
                     size, "split"))
    offset += size
  return outs


@register(lax.stack_p)
def _stack(ctx, *xs, axis, **params):
  axis = int(axis)
  parts = []
  for x in xs:
    shape = list(x.shape)
    shape.insert(axis, 1)
    if x.literal is not None:
      parts.append(ctx.bind(full_expr(shape, x.literal, x.dtype), shape,
                            x.dtype, "part"))
    else:
      parts.append(reshape_value(ctx, x, shape, "part"))
  return _concatenate(ctx, *parts, dimension=axis)


@register(lax.unstack_p)
def _unstack(ctx, x, axis, **params):
  axis = int(axis)
  outs = []
  rest = [d for i, d in enumerate(x.shape) if i != axis]
  for k in range(x.shape[axis]):
    part = take(ctx, x, axis, f"tl.full((1,), {k}, tl.int32)", 1, "part")
    outs.append(reshape_value(ctx, part, rest, "part"))
  return outs


@register(lax.tile_p)
def _tile(ctx, x, reps, **params):
  y = x
  for axis, r in enumerate(reps):
    r = int(r)
    if r == 1:
      continue
    n = y.shape[axis]
    y = take(ctx, y, axis, f"{lanes(n * r)} % {n}", n * r, ctx.hint("tiled"))
  return y


@register(lax.gather_p)
def _gather(ctx, x, indices, dimension_numbers, slice_sizes, mode=None,
            fill_value=None, **params):
  """The `x[idx]` / `x[:, idx]` forms: a take along one axis."""
  dn = dimension_numbers
  rank = len(x.shape)
  collapsed = tuple(dn.collapsed_slice_dims)
  if (len(collapsed) != 1 or tuple(dn.start_index_map) != collapsed or
      getattr(dn, "operand_batching_dims", ()) or
      indices.ndim != 2 or indices.shape[1] != 1):
    raise ctx.error("this form of lax.gather (array indexing) is not "
                    "supported by the Triton backend; only x[idx] along one "
                    "axis with a 1-D index array is")
  (axis,) = collapsed
  out_rank = rank
  if tuple(dn.offset_dims) != tuple(d for d in range(out_rank) if d != axis):
    raise ctx.error("this form of lax.gather is not supported by the Triton "
                    "backend (the gathered axis moves)")
  if any(int(s) != n for i, (s, n) in enumerate(zip(slice_sizes, x.shape))
         if i != axis):
    raise ctx.error("lax.gather of partial slices is not supported by the "
                    "Triton backend")
  n_out = indices.shape[0]
  n = x.shape[axis]
  idx = reshape_value(ctx, indices, (n_out,), "index")
  pos = idx.expr if idx.dtype == np.int32 else f"{paren(idx.expr)}.to(tl.int32)"
  out = take(ctx, x, axis, clamp(pos, 0, n - 1), n_out, ctx.hint("gather"))
  if "FILL" in str(mode):
    fill = fill_value if fill_value is not None else (
        float("nan") if dtypes.is_float(x.dtype) else 0)
    ok = f"(({pos} >= 0) & ({pos} < {n})){bcast(axis, rank)}"
    out = ctx.bind(f"tl.where({ok}, {out.expr}, "
                   f"{full_expr(out.shape, fill, x.dtype)})", out.shape,
                   x.dtype, ctx.hint("gather"))
  return out
