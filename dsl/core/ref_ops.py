"""Ref primitives with masks and atomics: masked load/store, atomic RMW/CAS.

Each has an abstract eval and a discharge rule (the interpret backend's
meaning); the lowerings give them their hardware meaning. Masked loads and
stores also have jvp rules: the tangent is the same masked access of the
tangent ref (so jvp and, through discharge, grad of kernels using them work),
and print in a jaxpr as JAX prints ref reads and writes (`y <- x[i]`,
`x[i] <- v`).
"""
from __future__ import annotations

import enum

import jax.numpy as jnp
from jax import tree_util
from dsl.core.jax_internals import (ad, ad_util, core, get_ref_and_transforms,
                                    pp_ref_transforms, source_info_util,
                                    state_discharge, state_types)
from dsl.core.jax_internals import pretty_printer as pp
from jax.extend.core import Primitive

from dsl.core import windows
from dsl.core.errors import KernelError, KernelTypeError, user_frame
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


@masked_load_p.def_effectful_abstract_eval
def _load_abstract_eval(ref_aval, *args, tree, has_mask, has_other, out_aval,
                        **_):
  return out_aval, _ref_effects(ref_aval, False)


def _split_args(args, tree, n_extra):
  n_idx = tree.num_leaves
  idx, extra = args[:n_idx], args[n_idx:]
  return tree_util.tree_unflatten(tree, idx), extra


@state_discharge.register_discharge_rule(masked_load_p)
def _load_discharge(ctx, x, *args, tree, has_mask, has_other, out_aval, **_):
  transforms, extra = _split_args(args, tree, has_mask + has_other)
  y = windows.read(x, transforms)
  extra = list(extra)
  mask = extra.pop(0) if has_mask else None
  other = extra.pop(0) if has_other else None
  if mask is not None:
    # Masked-off lanes without `other` read poison: the memory there is
    # unspecified (dsl/core/poison.py).
    fill = (poison_full(y.shape, y.dtype) if other is None else
            jnp.broadcast_to(jnp.asarray(other, y.dtype), y.shape))
    y = jnp.where(mask, y, fill)
  return (None,) * (1 + len(args)), y


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
  flat, tree = tree_util.tree_flatten(transforms)
  extra = []
  if mask is not None:
    extra.append(_check_mask("load", mask, shape))
  if other is not None:
    extra.append(jnp.broadcast_to(jnp.asarray(other, dtype), shape))
  return masked_load_p.bind(
      ref, *flat, *extra, tree=tree, has_mask=mask is not None,
      has_other=other is not None, out_aval=core.ShapedArray(shape, dtype),
      cache_modifier=cache_modifier, eviction_policy=eviction_policy,
      volatile=volatile)


# ------------------------------------------------------------------- store

masked_store_p = Primitive("masked_store")
masked_store_p.multiple_results = True


@masked_store_p.def_effectful_abstract_eval
def _store_abstract_eval(ref_aval, *args, tree, has_mask, **_):
  return [], _ref_effects(ref_aval, True)


@state_discharge.register_discharge_rule(masked_store_p)
def _store_discharge(ctx, x, *args, tree, has_mask, **_):
  transforms, extra = _split_args(args, tree, 1 + has_mask)
  val = extra[0]
  if not has_mask:
    x_new, _ = _masked_swap(x, transforms, lambda old: val)
    return (x_new,) + (None,) * len(args), []
  x_new, _ = _masked_swap(x, transforms,
                          lambda old: jnp.where(extra[1], val, old))
  return (x_new,) + (None,) * len(args), []


def _instantiate(t, like):
  return (jnp.zeros(like.shape, like.dtype) if isinstance(t, ad_util.Zero)
          else t)


def _load_jvp(primals, tangents, *, tree, has_mask, has_other, out_aval,
              **params):
  ref, *args = primals
  out = masked_load_p.bind(ref, *primals[1:], tree=tree, has_mask=has_mask,
                           has_other=has_other, out_aval=out_aval, **params)
  if isinstance(tangents[0], ad_util.Zero):
    return out, ad_util.Zero(core.typeof(out).to_tangent_aval())
  n_idx = tree.num_leaves
  extra = list(args[n_idx:n_idx + has_mask])
  # Masked-off lanes take `other`, so their tangent is `other`'s.
  extra.append(_instantiate(tangents[-1], out) if has_other
               else jnp.zeros(out.shape, out.dtype))
  t = masked_load_p.bind(tangents[0], *args[:n_idx], *extra, tree=tree,
                         has_mask=has_mask, has_other=True, out_aval=out_aval,
                         **params)
  return out, t


def _store_jvp(primals, tangents, *, tree, has_mask, **params):
  ref, *args = primals
  masked_store_p.bind(ref, *args, tree=tree, has_mask=has_mask, **params)
  if not isinstance(tangents[0], ad_util.Zero):
    n_idx = tree.num_leaves
    val = args[n_idx]
    t_args = list(args)
    t_args[n_idx] = _instantiate(tangents[1 + n_idx], val)
    masked_store_p.bind(tangents[0], *t_args, tree=tree, has_mask=has_mask,
                        **params)
  return [], []


ad.primitive_jvps[masked_load_p] = _load_jvp
ad.primitive_jvps[masked_store_p] = _store_jvp


def _pp_arrow(eqn, settings):
  annotation = (source_info_util.summarize(eqn.source_info)
                if settings.source_info else None)
  return pp.text(" <- ", annotation=annotation)


def _pp_named(context, names, values):
  """` mask=m other=o` for the extra operands present."""
  docs = []
  for name, value in zip(names, values):
    docs += [pp.text(f" {name}="), core.pp_var(value, context)]
  return docs


def _load_pp(eqn, context, settings):
  """`y = masked_load x i` prints as `y <- x[i]` (then `mask=`, `other=`)."""
  ref, *args = eqn.invars
  p = eqn.params
  transforms, extra = _split_args(args, p["tree"], 0)
  names = ["mask"] * p["has_mask"] + ["other"] * p["has_other"]
  lhs = core.pp_vars(eqn.outvars, context, print_shapes=settings.print_shapes)
  return pp.concat([lhs, _pp_arrow(eqn, settings),
                    pp_ref_transforms(context, ref, transforms),
                    *_pp_named(context, names, extra)])


def _store_pp(eqn, context, settings):
  """`masked_store x i v` prints as `x[i] <- v` (then `mask=`)."""
  ref, *args = eqn.invars
  transforms, (val, *mask) = _split_args(args, eqn.params["tree"], 0)
  return pp.concat([pp_ref_transforms(context, ref, transforms),
                    _pp_arrow(eqn, settings), core.pp_var(val, context),
                    *_pp_named(context, ["mask"], mask)])


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
  flat, tree = tree_util.tree_flatten(transforms)
  extra = [val]
  if mask is not None:
    extra.append(_check_mask("store", mask, shape))
  masked_store_p.bind(ref, *flat, *extra, tree=tree, has_mask=mask is not None,
                      eviction_policy=eviction_policy)


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


@atomic_rmw_p.def_effectful_abstract_eval
def _atomic_abstract_eval(ref_aval, *args, tree, has_mask, op, out_aval):
  return out_aval, _ref_effects(ref_aval, True)


@state_discharge.register_discharge_rule(atomic_rmw_p)
def _atomic_discharge(ctx, x, *args, tree, has_mask, op, out_aval):
  transforms, extra = _split_args(args, tree, 1 + has_mask)
  old, x_new = windows.atomic_update(x, transforms, _ATOMIC_COMBINE[op],
                                     extra[0], extra[1] if has_mask else None)
  return (x_new,) + (None,) * len(args), old


def _atomic(op: AtomicOp):
  def atomic(ref, idx, val, *, mask=None):
    ref, transforms, shape, dtype = _indexed_aval(ref, idx)
    val = _check_value(f"atomic_{op.value}", val, shape, dtype)
    flat, tree = tree_util.tree_flatten(transforms)
    extra = [val] + ([_check_mask("atomic", mask, shape)] if mask is not None
                     else [])
    return atomic_rmw_p.bind(ref, *flat, *extra, tree=tree,
                             has_mask=mask is not None, op=op,
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


@atomic_cas_p.def_effectful_abstract_eval
def _cas_abstract_eval(ref_aval, *args, tree, out_aval):
  return out_aval, _ref_effects(ref_aval, True)


@state_discharge.register_discharge_rule(atomic_cas_p)
def _cas_discharge(ctx, x, *args, tree, out_aval):
  transforms, (cmp, val) = _split_args(args, tree, 2)
  old = state_discharge.transform_array(x, transforms)
  new = jnp.where(old == cmp, val, old)
  _, x_new = state_discharge.transform_swap_array(x, transforms, new)
  return (x_new,) + (None,) * len(args), old


def atomic_cas(ref, cmp, val):
  """Atomically sets `ref` to `val` where it equals `cmp`; returns the old value."""
  ref, transforms, shape, dtype = _indexed_aval(ref, None)
  cmp = _check_value("atomic_cas", cmp, shape, dtype)
  val = _check_value("atomic_cas", val, shape, dtype)
  flat, tree = tree_util.tree_flatten(transforms)
  return atomic_cas_p.bind(ref, *flat, cmp, val, tree=tree,
                           out_aval=core.ShapedArray(shape, dtype))
