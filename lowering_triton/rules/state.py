"""Refs: JAX state `get`/`swap`/`addupdate`, dsl masked loads and stores,
atomics and `run_scoped`.

On a `MemRef` (an operand block in global memory) these become `tl.load`,
`tl.store` and `tl.atomic_*` on pointer tensors; on a `ValueRef` (a scratch
buffer in registers) reads gather the indexed window and writes merge it
back with `tl.where`.
"""
from __future__ import annotations

import numpy as np
from dsl.core.jax_internals import state_indexing as indexing, state_primitives

from dsl.core import checks, config
from dsl.core import primitives as dsl_primitives
from dsl.core import ref_ops
from dsl.core.access import INDEX, INDICES, SLICE
from dsl.core.poison import poison_value
from dsl.core.errors import source_info_frame
from dsl.core.operand_layout import ref_operands
from lowering_triton import triton_dtypes as dtypes
from lowering_triton import tma
from lowering_triton.check_values import check_values_comment
from lowering_triton.codegen import paren
from lowering_triton.kernel_refs import (MemRef, UnsupportedIndex, ValueRef,
                                         apply_indexer, as_sym, bcast,
                                         emit_address, has_padding_or_bounds,
                                         index_sym, ref_windows,
                                         run_time_dims, with_proofs,
                                         without_proven_wraps)
from lowering_triton.rules import register
from lowering_triton.rules.shapes import clamp, lanes, reshape_value, take
from lowering_triton.values import TVal, full_expr, padded, py_literal


def _operands(ctx, args, params):
  """The ref primitive's operands by role (dsl.core.operand_layout), its
  transforms read (an error naming the kernel where they cannot be)."""
  ops = ref_operands(ctx.eqn.primitive, args, params)
  try:
    return ops, ops.transforms
  except ValueError as e:
    raise ctx.error(str(e)) from e


def _view(ctx, ref: MemRef, transforms, multiples=None,
          gather: bool = False) -> MemRef:
  """`ref` through `transforms`; `gather`: a read (arrays of indices clamp
  as JAX's gather clamps them)."""
  try:
    for k, t in enumerate(transforms):
      ref = apply_indexer(ref, t, multiples[k] if multiples else None,
                          gather)
  except UnsupportedIndex as e:
    raise ctx.error(str(e))
  return _with_proven(ctx, ref)


def _with_proven(ctx, view: MemRef) -> MemRef:
  """`view` with the bounds of its run-time coordinates that the range
  analysis proves (no mask, no check there)."""
  access = ctx.host.ranges.access(ctx.eqn) if view.dynamic else None
  if access is None or access.array_shape != view.array_shape:
    return view
  view = without_proven_wraps(view, access.index_inside)
  return with_proofs(view, access.proven, access.in_block)


def _address(ctx, view: MemRef, verb: str, extra_mask: str | None = None,
             transforms=()):
  """`emit_address` of `view`; with jax_pallas_enable_runtime_assert on, a
  lane whose coordinate, computed at run time, leaves the ref fails a
  check worded as on every backend (dsl/core/checks.py)."""
  check = comment = None
  if view.unproven and config.enable_runtime_assert():
    check, comment = _window_check(ctx, view.origin or view.base, verb,
                                   transforms, view.block)
  return emit_address(ctx, view, extra_mask=extra_mask, check=check,
                      comment=comment)


def _window_text(indexer, values: list) -> str:
  """The window of `indexer` in numpy notation, `{}` for the values
  computed at run time (their source appended to `values`)."""
  parts = []
  for w, n in zip(ref_windows(indexer, indexer.shape), indexer.shape):
    if w.kind == SLICE:
      size, stride = w.size, w.stride
      stop = (size - 1) * stride + 1
      step = "" if stride == 1 else f":{stride}"
      start = as_sym(w.start)
      if isinstance(start, int):
        parts.append(":" if (start, stop) == (0, n) else
                     f"{start}:{start + stop}{step}")
      else:
        values += [start, f"{paren(start)} + {stop}"]
        parts.append("{}:{}" + step)
    elif w.kind == INDICES:
      values += [f"tl.min({w.start.expr})", f"tl.max({w.start.expr})"]
      parts.append("indices {} to {}")
    else:                     # a window of one, as the Mosaic backend sees
      sym = as_sym(w.start)
      if isinstance(sym, int):
        parts.append(f"{sym}:{sym + 1}")
      else:
        values += [sym, f"{paren(sym)} + 1"]
        parts.append("{}:{}")
  return ", ".join(parts)


def _window_check(ctx, name: str, verb: str, transforms, block):
  """(message, comment) of the check of a window placed at run time."""
  indexer = next((t for t in transforms
                  if isinstance(t, indexing.NDIndexer)), None)
  values: list = []
  window = _window_text(indexer, values) if indexer is not None else "..."
  shape = indexer.shape if indexer is not None else ()
  access = checks.window_access(verb, name, window, shape)
  message = checks.window_message(access, "{block}" if block else None,
                                  "{point}")
  where = source_info_frame(ctx.eqn.source_info) or ctx.host.where
  ctx.host.uses_asserts = True
  ctx.host.has_side_effects = True
  return (checks.check_text(message, where),
          check_values_comment(ctx.host, values, block))


def poison(dtype) -> str:
  """The value masked-off lanes of a load read (see poison_value)."""
  return py_literal(poison_value(dtype), dtype)


def _load(ctx, view: MemRef, ptr: str, mask: str | None, hint: str,
          other: str | None = None, extra: str = "") -> TVal:
  """A load of `view`: lanes outside the array (or masked off) read `other`;
  when it is None, whatever the memory there holds (no `other`, so that
  Triton may copy the tile straight to shared memory; the host backends'
  loads give poison there: lowering_triton.interpret_memory)."""
  ctx.host.before_read(view.ptr)
  args = [ptr]
  if mask is not None:
    args.append(f"mask={mask}")
    if other is not None:
      args.append(f"other={other}")
  if extra:
    args.append(extra)
  return ctx.bind(f"tl.load({', '.join(args)})", view.shape, view.dtype, hint,
                  pure="volatile" not in extra)


def _store(ctx, ptr: str, value: str, mask: str | None, extra: str = "",
           base: str | None = None):
  ctx.host.wrote(base or ptr.split(" ")[0])
  args = [ptr, value]
  if mask is not None:
    args.append(f"mask={mask}")
  if extra:
    args.append(extra)
  ctx.emit(f"tl.store({', '.join(args)})")


def _shared_ptr(ctx, ptr: str, view: MemRef) -> str:
  """Names a pointer expression that is used more than once."""
  if ptr.isidentifier():
    return ptr
  return ctx.bind_raw(ptr, f"{view.base}_ptrs")


# ------------------------------------------------------------- value refs

def _is_full(indexer, shape) -> bool:
  return all(w.kind == SLICE and (as_sym(w.start), w.size, w.stride) ==
             (0, n, 1) for w, n in zip(ref_windows(indexer, shape), shape))


def _current(vref: ValueRef) -> TVal:
  return TVal(vref.var, tuple(vref.shape), np.dtype(vref.dtype))


def _index_value(ctx, x: TVal, indexer, hint: str) -> TVal:
  """`x[indexer]` for a value (gathers along the sliced axes); lanes of a
  window placed at run time outside the ref read poison."""
  if not isinstance(indexer, indexing.NDIndexer):
    raise ctx.error(f"ref transform {type(indexer).__name__} is not supported "
                    "by the Triton backend")
  if _is_full(indexer, x.shape):
    return x
  drop = []
  at_run_time = run_time_dims(indexer, x.shape)
  for axis, w in enumerate(ref_windows(indexer, x.shape)):
    n = x.shape[axis]
    if w.kind == SLICE:
      s, size, st = as_sym(w.start), w.size, w.stride
      if s == 0 and size == n and st == 1:
        continue
      pos = lanes(size) if st == 1 else f"{lanes(size)} * {st}"
      if s != 0:
        pos = f"{pos} + {paren(s)}"
      if axis in at_run_time:
        pos = ctx.bind_raw(pos, f"{hint}_pos")
      x = take(ctx, x, axis, clamp(pos, 0, n - 1), size, hint)
      if axis in at_run_time:
        x = _poison_outside(ctx, x, f"({pos} >= 0) & ({pos} < {n})",
                            bcast(axis, len(x.shape)), hint)
    elif w.kind == INDEX:
      s = index_sym(w.start, n)
      x = take(ctx, x, axis, clamp(f"tl.full((1,), {s}, tl.int32)", 0, n - 1),
               1, hint)
      if axis in at_run_time:
        x = _poison_outside(ctx, x, f"({paren(s)} >= 0) & ({paren(s)} < {n})",
                            "", hint)
      drop.append(axis)
    else:
      raise ctx.error("indexing a scratch ref with an array of indices is not "
                      "supported by the Triton backend")
  if drop:
    x = reshape_value(ctx, x, [d for i, d in enumerate(x.shape)
                               if i not in drop], hint)
  return x


def _poison_outside(ctx, x: TVal, inside: str, b: str, hint: str) -> TVal:
  """`x` with poison where `inside` (lanes along one axis, placed by `b`)
  is false."""
  return ctx.bind(f"tl.where(({inside}){b}, {x.expr}, {poison(x.dtype)})",
                  x.shape, x.dtype, hint)


def _check_value_window(ctx, vref: ValueRef, verb: str, transforms) -> None:
  """With jax_pallas_enable_runtime_assert on, a window of a scratch ref
  placed at run time that leaves it fails a check (as on every backend)."""
  indexer = next(iter(transforms), None)
  if (not config.enable_runtime_assert()
      or not isinstance(indexer, indexing.NDIndexer)):
    return
  inside = []
  at_run_time = run_time_dims(indexer, vref.shape)
  windows = ref_windows(indexer, vref.shape)
  for axis, (w, n) in enumerate(zip(windows, vref.shape)):
    if axis not in at_run_time:
      continue
    if w.kind == SLICE:
      s = as_sym(w.start)
      last = (w.size - 1) * w.stride
      inside.append(f"({paren(s)} >= 0) & ({paren(s)} + {last} < {n})")
    else:
      s = paren(index_sym(w.start, n))
      inside.append(f"({s} >= 0) & ({s} < {n})")
  if inside:
    check, comment = _window_check(ctx, vref.origin or vref.var, verb,
                                   [indexer], ())
    ctx.emit(f"tl.device_assert({' & '.join(inside)}, {check!r})  {comment}")


def value_read(ctx, vref: ValueRef, transforms, hint: str) -> TVal:
  _check_value_window(ctx, vref, "load from", transforms)
  x = _current(vref)
  for t in transforms:
    x = _index_value(ctx, x, t, hint)
  return x


def _spread(ctx, vref: ValueRef, indexer, v: TVal, fill_mask: bool):
  """`v` (shaped like `vref[indexer]`) spread to the ref's shape, and the
  mask of the window it covers."""
  shape = tuple(vref.shape)
  rank = len(shape)
  conds = []
  # Re-insert the integer-indexed axes as size-1 axes.
  full_rank_shape, k = [], 0
  windows = ref_windows(indexer, shape)
  for w in windows:
    if w.kind == SLICE:
      full_rank_shape.append(v.shape[k])
      k += 1
    else:
      full_rank_shape.append(1)
  x = reshape_value(ctx, v, full_rank_shape, "spread") if v.shape else v
  if x.literal is not None or x.shape == ():
    x = ctx.bind(f"tl.broadcast_to({x.expr}, {padded(full_rank_shape)})"
                 if x.literal is None else
                 full_expr(full_rank_shape, x.literal, x.dtype),
                 full_rank_shape, x.dtype, "spread")
  for axis, (w, n) in enumerate(zip(windows, shape)):
    ar = lanes(n)
    if w.kind == SLICE:
      s, size, st = as_sym(w.start), w.size, w.stride
      if s == 0 and size == n and st == 1:
        continue
      rel = f"{ar} - {paren(s)}" if s != 0 else ar
      if st == 1:
        src = clamp(rel, 0, size - 1)
        cond = f"({rel} >= 0) & ({rel} < {size})"
      else:
        src = clamp(f"({rel}) // {st}", 0, size - 1)
        cond = f"({rel} >= 0) & ({rel} < {size * st}) & (({rel}) % {st} == 0)"
      x = take(ctx, x, axis, src, n, "spread")
    else:
      s = index_sym(w.start, n)
      new_shape = list(x.shape)
      new_shape[axis] = n
      x = ctx.bind(f"tl.broadcast_to({x.expr}, {padded(new_shape)})",
                   new_shape, x.dtype, "spread")
      cond = f"{ar} == {paren(s)}"
    conds.append(f"({cond}){bcast(axis, rank)}")
  return x, conds


def value_write(ctx, vref: ValueRef, transforms, v: TVal,
                mask: TVal | None = None) -> None:
  if len(transforms) > 1:
    raise ctx.error("writing a scratch ref through more than one indexer "
                    "(x.at[...][...]) is not supported by the Triton backend")
  indexer = transforms[0] if transforms else None
  if indexer is not None and not isinstance(indexer, indexing.NDIndexer):
    raise ctx.error(f"ref transform {type(indexer).__name__} is not supported "
                    "by the Triton backend")
  _check_value_window(ctx, vref, "store to", transforms)
  cur = _current(vref)
  if indexer is None or _is_full(indexer, cur.shape):
    new = v.expr
    if mask is not None:
      new = f"tl.where({mask.expr}, {v.expr}, {cur.expr})"
    elif v.literal is not None or v.shape != cur.shape:
      new = full_expr(cur.shape, v.literal, cur.dtype) if v.literal is not None \
          else f"tl.broadcast_to({v.expr}, {padded(cur.shape)})"
    ctx.emit(f"{vref.var} = {new}")
    return
  spread, conds = _spread(ctx, vref, indexer, v, False)
  if mask is not None:
    mspread, _ = _spread(ctx, vref, indexer, mask, False)
    conds.append(mspread.expr)
  cond = " & ".join(conds) if conds else "True"
  ctx.emit(f"{vref.var} = tl.where({cond}, {spread.expr}, {cur.expr})")


# ------------------------------------------------------------- JAX state

@register(state_primitives.get_p)
def _get(ctx, *args, **params):
  ops, transforms = _operands(ctx, args, params)
  ref = ops.ref
  if isinstance(ref, ValueRef):
    return value_read(ctx, ref, transforms, ctx.hint(ref.var))
  view = _view(ctx, ref, transforms, tma.index_multiples(ctx), gather=True)
  loaded = tma.load(ctx, view, ctx.hint(view.base))
  if loaded is not None:
    return loaded
  ptr, mask = _address(ctx, view, "load from", transforms=transforms)
  return _load(ctx, view, ptr, mask, ctx.hint(view.base))


@register(state_primitives.swap_p)
def _swap(ctx, *args, **params):
  ops, transforms = _operands(ctx, args, params)
  ref, val = ops.ref, ops.value
  if isinstance(ref, ValueRef):
    old = value_read(ctx, ref, transforms, "old") if ctx.out_used(0) else None
    value_write(ctx, ref, transforms, val)
    return old
  view = _view(ctx, ref, transforms)
  ptr, mask = _address(ctx, view, "store to", transforms=transforms)
  old = None
  if ctx.out_used(0):
    ptr = _shared_ptr(ctx, ptr, view)
    old = _load(ctx, view, ptr, mask, "old")
  _store(ctx, ptr, ctx.value(val), mask, base=view.ptr)
  return old


@register(state_primitives.addupdate_p)
def _addupdate(ctx, *args, **params):
  ops, transforms = _operands(ctx, args, params)
  ref, val = ops.ref, ops.value
  cd = dtypes.compute_dtype(val.dtype)
  if isinstance(ref, ValueRef):
    cur = value_read(ctx, ref, transforms, "cur")
    new = ctx.finish(f"{ctx.compute(cur)} + {paren(ctx.compute(val))}",
                     cur.shape, cur.dtype, cd, hint="updated")
    value_write(ctx, ref, transforms, new)
    return []
  view = _view(ctx, ref, transforms)
  ptr, mask = _address(ctx, view, "update of", transforms=transforms)
  ptr = _shared_ptr(ctx, ptr, view)
  cur = _load(ctx, view, ptr, mask, "cur")
  new = ctx.finish(f"{ctx.compute(cur)} + {paren(ctx.compute(val))}",
                   cur.shape, cur.dtype, cd, hint="updated")
  _store(ctx, ptr, new.expr, mask, base=view.ptr)
  return []


# ------------------------------------------------------------- dsl ref ops

def _hints(cache_modifier=None, eviction_policy=None, volatile=False) -> str:
  parts = []
  if cache_modifier:
    parts.append(f"cache_modifier={cache_modifier!r}")
  if eviction_policy:
    parts.append(f"eviction_policy={eviction_policy!r}")
  if volatile:
    parts.append("volatile=True")
  return ", ".join(parts)


@register(ref_ops.masked_load_p)
def _masked_load(ctx, *args, cache_modifier=None, eviction_policy=None,
                 volatile=False, **params):
  ops, transforms = _operands(ctx, args, params)
  ref, mask, other = ops.ref, ops.mask, ops.other
  if isinstance(ref, ValueRef):
    val = value_read(ctx, ref, transforms, ctx.hint("load"))
    if mask is None or other is None:   # masked-off lanes read the buffer
      return val
    return ctx.bind(f"tl.where({mask.expr}, {val.expr}, {other.expr})",
                    val.shape, val.dtype, ctx.hint("load"))
  view = _view(ctx, ref, transforms, gather=True)
  ptr, m = _address(ctx, view, "load from", mask.expr if mask is not None
                    else None, transforms)
  fill = None
  if other is not None and mask is not None:
    fill = other.expr
    if m != mask.expr:
      # Lanes the mask keeps but the array does not have read poison.
      fill = f"tl.where({mask.expr}, {poison(view.dtype)}, {other.expr})"
  return _load(ctx, view, ptr, m, ctx.hint(view.base), other=fill,
               extra=_hints(cache_modifier, eviction_policy, volatile))


@register(ref_ops.masked_store_p)
def _masked_store(ctx, *args, eviction_policy=None, **params):
  ops, transforms = _operands(ctx, args, params)
  ref, val, mask = ops.ref, ops.value, ops.mask
  if isinstance(ref, ValueRef):
    value_write(ctx, ref, transforms, val, mask)
    return []
  view = _view(ctx, ref, transforms)
  ptr, m = _address(ctx, view, "store to", mask.expr if mask is not None
                    else None, transforms)
  _store(ctx, ptr, ctx.value(val), m, _hints(eviction_policy=eviction_policy),
         base=view.ptr)
  return []


_ATOMIC_NAMES = {
    ref_ops.AtomicOp.ADD: "atomic_add", ref_ops.AtomicOp.MAX: "atomic_max",
    ref_ops.AtomicOp.MIN: "atomic_min", ref_ops.AtomicOp.AND: "atomic_and",
    ref_ops.AtomicOp.OR: "atomic_or", ref_ops.AtomicOp.XOR: "atomic_xor",
    ref_ops.AtomicOp.XCHG: "atomic_xchg",
}

_ATOMIC_EXPR = {
    ref_ops.AtomicOp.ADD: "{old} + {val}",
    ref_ops.AtomicOp.MAX: "tl.maximum({old}, {val})",
    ref_ops.AtomicOp.MIN: "tl.minimum({old}, {val})",
    ref_ops.AtomicOp.AND: "{old} & {val}",
    ref_ops.AtomicOp.OR: "{old} | {val}",
    ref_ops.AtomicOp.XOR: "{old} ^ {val}",
    ref_ops.AtomicOp.XCHG: "{val}",
}


@register(ref_ops.atomic_rmw_p)
def _atomic_rmw(ctx, *args, op, **params):
  ops, transforms = _operands(ctx, args, params)
  ref, val, mask = ops.ref, ops.value, ops.mask
  ctx.host.has_side_effects = True
  if isinstance(ref, ValueRef):
    # A scratch ref is private to the program: no atomicity is needed.
    old = value_read(ctx, ref, transforms, "old")
    new = ctx.bind(_ATOMIC_EXPR[op].format(old=old.expr, val=ctx.value(val)),
                   old.shape, old.dtype, "new")
    value_write(ctx, ref, transforms, new, mask)
    return old
  view = _view(ctx, ref, transforms)
  ptr, m = _address(ctx, view, "atomic update of",
                    mask.expr if mask is not None else None, transforms)
  ctx.host.before_read(view.ptr)
  ctx.host.wrote(view.ptr)
  call = f"tl.{_ATOMIC_NAMES[op]}({ptr}, {ctx.value(val)}"
  call += f", mask={m})" if m is not None else ")"
  if ctx.out_used(0):
    return ctx.bind(call, view.shape, view.dtype, ctx.hint("old"), pure=False)
  ctx.emit(call)
  return None


@register(ref_ops.atomic_cas_p)
def _atomic_cas(ctx, *args, **params):
  ops, transforms = _operands(ctx, args, params)
  ref, cmp, val = ops.ref, ops.cmp, ops.value
  ctx.host.has_side_effects = True
  if isinstance(ref, ValueRef):
    old = value_read(ctx, ref, transforms, "old")
    new = ctx.bind(f"tl.where({old.expr} == {ctx.value(cmp)}, {ctx.value(val)}"
                   f", {old.expr})", old.shape, old.dtype, "new")
    value_write(ctx, ref, transforms, new)
    return old
  view = _view(ctx, ref, transforms)
  if has_padding_or_bounds(view):
    raise ctx.error("atomic_cas on a window that needs masking (padded or "
                    "partial block, or a start computed at run time that "
                    "is not proven inside the array) is not supported: "
                    "Triton's atomic_cas takes no mask")
  ptr, _ = emit_address(ctx, view)
  ctx.host.before_read(view.ptr)
  ctx.host.wrote(view.ptr)
  return ctx.bind(f"tl.atomic_cas({ptr}, {ctx.value(cmp)}, {ctx.value(val)})",
                  view.shape, view.dtype, ctx.hint("old"), pure=False)


# ------------------------------------------------------------- run_scoped

def new_value_ref(ctx, aval, hint: str, origin: str = "") -> ValueRef:
  inner = getattr(aval, "inner_aval", aval)
  shape = tuple(int(d) for d in inner.shape)
  dtype = np.dtype(inner.dtype)
  if str(getattr(aval, "memory_space", "")).startswith("semaphore"):
    raise ctx.error("semaphores are not supported by the Triton backend")
  name = ctx.fresh(hint)
  ctx.emit(f"{name} = {fresh_buffer(shape, dtype)}")
  return ValueRef(name, shape, dtype, origin)


def fresh_buffer(shape, dtype) -> str:
  """The initial value of a scratch buffer or run_scoped allocation."""
  fill = poison_value(dtype) if config.poison_buffers() else 0
  return full_expr(shape, fill, dtype)


@register(dsl_primitives.run_scoped_p)
def _run_scoped(ctx, *consts, jaxpr, num_consts, **params):
  refs = [new_value_ref(ctx, v.aval, "scoped", f"run_scoped buffer {k}")
          for k, v in enumerate(jaxpr.invars[num_consts:])]
  return ctx.lower_closed(jaxpr, list(consts) + refs)

