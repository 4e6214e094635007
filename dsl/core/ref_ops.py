"""Ref primitives with masks and atomics: masked load/store, atomic RMW/CAS.

Each has an abstract eval and a discharge rule (the interpret backend's
meaning); the lowerings give them their hardware meaning. Masked loads and
stores also have jvp rules: the tangent is the same masked access of the
tangent ref (so jvp and, through discharge, grad of kernels using them work),
and print in a jaxpr as JAX prints ref reads and writes (`y <- x[i]`,
`x[i] <- v`).
"""
from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp
from dsl.core.jax_internals import (ad, ad_util, core, get_ref_and_transforms,
                                    pp_ref_transforms, source_info_util,
                                    state_discharge, state_types)
from dsl.core.jax_internals import pretty_printer as pp
from jax.extend.core import Primitive

from dsl.core import windows
from dsl.core.errors import KernelError, KernelTypeError, user_frame
from dsl.core.operand_layout import (RefLayout, eqn_ref_operands,
                                     flat_ref_operands, ref_operands,
                                     register_ref_layout)
from dsl.core.poison import poison_full, poison_value


def _ref_effects(ref_aval, write: bool):
  effs = {state_types.ReadEffect(0)}
  if write:
    effs.add(state_types.WriteEffect(0))
  return effs


def _indexed_aval(ref_or_view, idx):
  ref, transforms = get_ref_and_transforms(ref_or_view, idx, "load")
  view = state_types.TransformedRef(ref, transforms) if transforms else ref
  return ref, transforms, tuple(view.shape), view.dtype


def _masked_swap(x, transforms, new_of_old):
  """Writes `new_of_old(old)` through `transforms`; returns (x_new, old).
  Lanes of the window outside `x` read poison and are not written."""
  old, x_new = windows.update(x, transforms, new_of_old)
  return x_new, old


# ------------------------------------------------------------------- load

masked_load_p = Primitive("masked_load")
_LOAD = RefLayout(after=("mask", "other"),
                  flags=(("mask", "has_mask"), ("other", "has_other")))
register_ref_layout(masked_load_p, _LOAD)


@masked_load_p.def_effectful_abstract_eval
def _load_abstract_eval(ref_aval, *args, tree, has_mask, has_other, out_aval,
                        **_):
  return out_aval, _ref_effects(ref_aval, False)


@state_discharge.register_discharge_rule(masked_load_p)
def _load_discharge(ctx, *args, **params):
  ops = ref_operands(masked_load_p, args, params)
  y = windows.read(ops.ref, ops.transforms)
  if ops.mask is not None:
    # Masked-off lanes without `other` read poison: the memory there is
    # unspecified (dsl/core/poison.py).
    fill = (poison_full(y.shape, y.dtype) if ops.other is None else
            jnp.broadcast_to(jnp.asarray(ops.other, y.dtype), y.shape))
    y = jnp.where(ops.mask, y, fill)
  return (None,) * len(args), y


def _check_mask(name, mask, shape):
  mask = jnp.asarray(mask)
  if mask.dtype != jnp.bool_:
    raise KernelTypeError(None, f"{name} mask must be bool, got "
                          f"{mask.dtype}", user_frame())
  try:
    return jnp.broadcast_to(mask, shape)
  except ValueError:
    raise KernelError(None, f"{name} mask of shape {mask.shape} does not "
                      f"broadcast to the indexed shape {shape}", user_frame())


def load(ref, idx=None, *, mask=None, other=None, cache_modifier=None,
         eviction_policy=None, volatile=False):
  """Reads `ref[idx]`; where `mask` is False the result is `other` (poison
  without it: the memory there is unspecified)."""
  ref, transforms, shape, dtype = _indexed_aval(ref, idx)
  if mask is not None:
    mask = _check_mask("load", mask, shape)
  if other is not None:
    other = jnp.broadcast_to(jnp.asarray(other, dtype), shape)
  flat, layout = _LOAD.flatten(ref, transforms, mask=mask, other=other)
  return masked_load_p.bind(
      *flat, **layout, out_aval=core.ShapedArray(shape, dtype),
      cache_modifier=cache_modifier, eviction_policy=eviction_policy,
      volatile=volatile)


# ------------------------------------------------------------------- store

masked_store_p = Primitive("masked_store")
masked_store_p.multiple_results = True
_STORE = RefLayout(after=("value", "mask"), flags=(("mask", "has_mask"),))
register_ref_layout(masked_store_p, _STORE)


@masked_store_p.def_effectful_abstract_eval
def _store_abstract_eval(ref_aval, *args, tree, has_mask, **_):
  return [], _ref_effects(ref_aval, True)


@state_discharge.register_discharge_rule(masked_store_p)
def _store_discharge(ctx, *args, **params):
  ops = ref_operands(masked_store_p, args, params)
  new = ((lambda old: ops.value) if ops.mask is None else
         (lambda old: jnp.where(ops.mask, ops.value, old)))
  x_new, _ = _masked_swap(ops.ref, ops.transforms, new)
  return (x_new,) + (None,) * (len(args) - 1), []


def _instantiate(t, like):
  return (jnp.zeros(like.shape, like.dtype) if isinstance(t, ad_util.Zero)
          else t)


def _load_jvp(primals, tangents, **params):
  out = masked_load_p.bind(*primals, **params)
  if isinstance(tangents[0], ad_util.Zero):
    return out, ad_util.Zero(core.typeof(out).to_tangent_aval())
  ops = ref_operands(masked_load_p, primals, params)
  # Masked-off lanes take `other`, so their tangent is `other`'s.
  other = (_instantiate(tangents[-1], out) if ops.other is not None
           else jnp.zeros(out.shape, out.dtype))
  flat, layout = flat_ref_operands(masked_load_p, dataclasses.replace(
      ops, ref=tangents[0], other=other))
  return out, masked_load_p.bind(*flat, **{**params, **layout})


def _store_jvp(primals, tangents, **params):
  masked_store_p.bind(*primals, **params)
  if not isinstance(tangents[0], ad_util.Zero):
    ops = ref_operands(masked_store_p, primals, params)
    t_value = ref_operands(masked_store_p, tangents, params).value
    flat, layout = flat_ref_operands(masked_store_p, dataclasses.replace(
        ops, ref=tangents[0], value=_instantiate(t_value, ops.value)))
    masked_store_p.bind(*flat, **{**params, **layout})
  return [], []


ad.primitive_jvps[masked_load_p] = _load_jvp
ad.primitive_jvps[masked_store_p] = _store_jvp


def _pp_arrow(eqn, settings):
  annotation = (source_info_util.summarize(eqn.source_info)
                if settings.source_info else None)
  return pp.text(" <- ", annotation=annotation)


def _pp_named(context, ops, names):
  """` mask=m other=o` for the values of `ops` named and present."""
  docs = []
  for name in names:
    value = getattr(ops, name)
    if value is not None:
      docs += [pp.text(f" {name}="), core.pp_var(value, context)]
  return docs


def _load_pp(eqn, context, settings):
  """`y = masked_load x i` prints as `y <- x[i]` (then `mask=`, `other=`)."""
  ops = eqn_ref_operands(eqn)
  lhs = core.pp_vars(eqn.outvars, context, print_shapes=settings.print_shapes)
  return pp.concat([lhs, _pp_arrow(eqn, settings),
                    pp_ref_transforms(context, ops.ref, ops.transforms),
                    *_pp_named(context, ops, ("mask", "other"))])


def _store_pp(eqn, context, settings):
  """`masked_store x i v` prints as `x[i] <- v` (then `mask=`)."""
  ops = eqn_ref_operands(eqn)
  return pp.concat([pp_ref_transforms(context, ops.ref, ops.transforms),
                    _pp_arrow(eqn, settings), core.pp_var(ops.value, context),
                    *_pp_named(context, ops, ("mask",))])


core.pp_eqn_rules[masked_load_p] = _load_pp
core.pp_eqn_rules[masked_store_p] = _store_pp


def _check_value(name, val, shape, dtype):
  val = jnp.asarray(val)
  if val.dtype != dtype:
    raise KernelTypeError(None, f"{name} value has dtype {val.dtype} but "
                          f"the ref has dtype {dtype}", user_frame())
  if val.shape != shape:
    try:
      val = jnp.broadcast_to(val, shape)
    except ValueError:
      raise KernelError(None, f"{name} value of shape {val.shape} does "
                        f"not match the indexed shape {shape}", user_frame())
  return val


def store(ref, idx=None, val=None, *, mask=None, eviction_policy=None):
  """Writes `val` to `ref[idx]` where `mask` is True.

  Called as `store(ref, val, mask=...)` (ref views) or
  `store(ref, idx, val, mask=...)`.
  """
  if val is None:
    idx, val = None, idx
  ref, transforms, shape, dtype = _indexed_aval(ref, idx)
  val = _check_value("store", val, shape, dtype)
  if mask is not None:
    mask = _check_mask("store", mask, shape)
  flat, layout = _STORE.flatten(ref, transforms, value=val, mask=mask)
  masked_store_p.bind(*flat, **layout, eviction_policy=eviction_policy)


# ------------------------------------------------------------------- atomics

class AtomicOp(enum.Enum):
  ADD = "add"
  MAX = "max"
  MIN = "min"
  AND = "and"
  OR = "or"
  XOR = "xor"
  XCHG = "xchg"


_ATOMIC_COMBINE = {
    AtomicOp.ADD: lambda old, v: old + v,
    AtomicOp.MAX: jnp.maximum,
    AtomicOp.MIN: jnp.minimum,
    AtomicOp.AND: lambda old, v: old & v,
    AtomicOp.OR: lambda old, v: old | v,
    AtomicOp.XOR: lambda old, v: old ^ v,
    AtomicOp.XCHG: lambda old, v: v,
}

atomic_rmw_p = Primitive("atomic_rmw")
register_ref_layout(atomic_rmw_p, _STORE)


@atomic_rmw_p.def_effectful_abstract_eval
def _atomic_abstract_eval(ref_aval, *args, tree, has_mask, op, out_aval):
  return out_aval, _ref_effects(ref_aval, True)


@state_discharge.register_discharge_rule(atomic_rmw_p)
def _atomic_discharge(ctx, *args, op, **params):
  ops = ref_operands(atomic_rmw_p, args, params)
  old, x_new = windows.atomic_update(ops.ref, ops.transforms,
                                     _ATOMIC_COMBINE[op], ops.value, ops.mask)
  return (x_new,) + (None,) * (len(args) - 1), old


def _atomic(op: AtomicOp):
  def atomic(ref, idx, val, *, mask=None):
    ref, transforms, shape, dtype = _indexed_aval(ref, idx)
    val = _check_value(f"atomic_{op.value}", val, shape, dtype)
    if mask is not None:
      mask = _check_mask("atomic", mask, shape)
    flat, layout = _STORE.flatten(ref, transforms, value=val, mask=mask)
    return atomic_rmw_p.bind(*flat, **layout, op=op,
                             out_aval=core.ShapedArray(shape, dtype))
  atomic.__name__ = f"atomic_{op.value}"
  atomic.__doc__ = (f"Atomically applies `{op.value}` of `val` to `ref[idx]`; "
                    "returns the old value.")
  return atomic


atomic_add = _atomic(AtomicOp.ADD)
atomic_max = _atomic(AtomicOp.MAX)
atomic_min = _atomic(AtomicOp.MIN)
atomic_and = _atomic(AtomicOp.AND)
atomic_or = _atomic(AtomicOp.OR)
atomic_xor = _atomic(AtomicOp.XOR)
atomic_xchg = _atomic(AtomicOp.XCHG)

atomic_cas_p = Primitive("atomic_cas")
_CAS = RefLayout(after=("cmp", "value"))
register_ref_layout(atomic_cas_p, _CAS)


@atomic_cas_p.def_effectful_abstract_eval
def _cas_abstract_eval(ref_aval, *args, tree, out_aval):
  return out_aval, _ref_effects(ref_aval, True)


@state_discharge.register_discharge_rule(atomic_cas_p)
def _cas_discharge(ctx, *args, **params):
  ops = ref_operands(atomic_cas_p, args, params)
  old = state_discharge.transform_array(ops.ref, ops.transforms)
  new = jnp.where(old == ops.cmp, ops.value, old)
  _, x_new = state_discharge.transform_swap_array(ops.ref, ops.transforms,
                                                  new)
  return (x_new,) + (None,) * (len(args) - 1), old


def atomic_cas(ref, cmp, val):
  """Atomically sets `ref` to `val` where it equals `cmp`; returns the old value."""
  ref, transforms, shape, dtype = _indexed_aval(ref, None)
  cmp = _check_value("atomic_cas", cmp, shape, dtype)
  val = _check_value("atomic_cas", val, shape, dtype)
  flat, layout = _CAS.flatten(ref, transforms, cmp=cmp, value=val)
  return atomic_cas_p.bind(*flat, **layout,
                           out_aval=core.ShapedArray(shape, dtype))
