"""Kernel-language primitives that are not about refs: hints, prints, checks,
control flow helpers and scoped allocation."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, tree_util
from dsl.core.jax_internals import (ad, api_util, batching, core, debugging,
                                    effects, linear_util as lu, mlir,
                                    partial_eval as pe, state_discharge,
                                    state_types)
from jax.extend.core import Primitive

from dsl.core.errors import KernelError, user_frame
from dsl.core import config
from dsl.core.poison import fresh_buffer


def cdiv(a, b):
  """Ceiling division of a >= 0 by b > 0, for Python ints and JAX arrays
  (for arrays one truncating `lax.div`, as in Pallas)."""
  if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
    return -(-int(a) // int(b))
  return lax.div(a + (b - 1), b)


# ---------------------------------------------------------------- hints

def allowed_everywhere(effect_type: type) -> type:
  """Lets an effect of `effect_type` (a state a primitive keeps outside the
  kernel's refs: the TPU's random state, a GPU fence) stand inside control
  flow, custom derivatives and remat; returns `effect_type`."""
  effects.control_flow_allowed_effects.add_type(effect_type)
  effects.custom_derivatives_allowed_effects.add_type(effect_type)
  effects.remat_allowed_effects.add_type(effect_type)
  return effect_type


def _identity_primitive(name: str) -> Primitive:
  prim = Primitive(name)
  prim.def_impl(lambda x, **_: x)
  prim.def_abstract_eval(lambda aval, **_: aval)
  mlir.register_lowering(prim, lambda ctx, x, **_: [x])
  batching.primitive_batchers[prim] = (
      lambda args, dims, **p: (prim.bind(args[0], **p), dims[0]))
  ad.deflinear2(prim, lambda ct, x, **p: [ct])
  return prim


multiple_of_p = _identity_primitive("multiple_of")
max_contiguous_p = _identity_primitive("max_contiguous")


def _as_tuple(values):
  return tuple(values) if isinstance(values, (tuple, list)) else (int(values),)


def multiple_of(x, values):
  """Tells the compiler that `x` is a multiple of `values`; returns `x`."""
  return multiple_of_p.bind(x, values=_as_tuple(values))


def max_contiguous(x, values):
  """Tells the compiler that runs of `values` elements of `x` are contiguous."""
  return max_contiguous_p.bind(x, values=_as_tuple(values))


# ---------------------------------------------------------------- debug_print

debug_print_p = Primitive("debug_print")
debug_print_p.multiple_results = True


@debug_print_p.def_effectful_abstract_eval
def _debug_print_abstract_eval(*avals, fmt):
  return [], {debugging.debug_effect}


def _debug_print_impl(*args, fmt):
  jax.debug.print(fmt, *args)
  return []


mlir.register_lowering(debug_print_p,
                       mlir.lower_fun(_debug_print_impl, multiple_results=True))


def _debug_print_batch(args, dims, *, fmt):
  """Prints once per batch element, as the unbatched program would."""
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  args = [batching.moveaxis(a, d, 0) if d is not None else a
          for a, d in zip(args, dims)]
  for i in range(size):
    debug_print_p.bind(*[a[i] if d is not None else a
                         for a, d in zip(args, dims)], fmt=fmt)
  return [], []


batching.primitive_batchers[debug_print_p] = _debug_print_batch


def debug_print(fmt: str, *args):
  """Prints from inside a kernel: `fmt` uses `{}` placeholders for `args`."""
  debug_print_p.bind(*args, fmt=fmt)


# ---------------------------------------------------------------- when / loop

def when(condition):
  """Decorator: runs the decorated body only when `condition` holds."""
  def decorate(body: Callable[[], None]):
    if isinstance(condition, (bool, np.bool_)):
      if condition:
        body()
      return body
    lax.cond(condition, lambda: (body(), None)[1], lambda: None)
    return body
  return decorate


def loop(lower, upper, *, step: int = 1, unroll: int | bool | None = None):
  """Decorator: runs `body(i)` for i in range(lower, upper, step)."""
  def decorate(body: Callable[[Any], None]):
    n = cdiv(upper - lower, step)

    def fori_body(k, carry):
      body(lower + k * step)
      return carry

    lax.fori_loop(0, n, fori_body, None,
                  **({} if unroll is None else {"unroll": unroll}))
    return body
  return decorate


# ---------------------------------------------------------------- run_scoped

run_scoped_p = Primitive("run_scoped")
run_scoped_p.multiple_results = True


def scoped_effects(jaxpr: core.Jaxpr, num_consts: int):
  """The effects of a body on the refs its first `num_consts` inputs pass
  in from outside (the others are its own), and its other effects."""
  out = set()
  positions = {v: i for i, v in enumerate(jaxpr.invars)}
  for eff in jaxpr.effects:
    if isinstance(eff, effects.JaxprInputEffect):
      pos = eff.input if isinstance(eff.input, int) else positions.get(eff.input)
      if pos is not None and pos < num_consts:
        out.add(type(eff)(pos))
    else:
      out.add(eff)
  return out


@run_scoped_p.def_effectful_abstract_eval
def _run_scoped_abstract_eval(*avals, jaxpr, num_consts, collective_axes=()):
  return ([v.aval for v in jaxpr.outvars],
          scoped_effects(jaxpr, num_consts))


def _jaxpr_consts(j):
  return list(getattr(j, "consts", ()) or ())


def _fresh(aval):
  """A run_scoped allocation: zeros, or poison with jax_pallas_poison_buffers."""
  return fresh_buffer(aval, config.poison_buffers())


@state_discharge.register_discharge_rule(run_scoped_p)
def _run_scoped_discharge(ctx, *args, jaxpr, num_consts, collective_axes=()):
  # One program per grid point: an allocation shared along `collective_axes`
  # is this program's own (the warpgroups of a `plgpu.kernel` share theirs
  # on the interpret backend, dsl/interpret/warpgroups.py).
  # A ref the outer discharge keeps (scalar prefetch in a derived kernel)
  # arrives as a ref: it stays one inside too.
  kept = [isinstance(jax.typeof(a), state_types.AbstractRef) for a in args]
  is_ref = [isinstance(v.aval, state_types.AbstractRef) and not k
            for v, k in zip(jaxpr.invars,
                            kept + [False] * (len(jaxpr.invars) - len(kept)))]
  scoped = [_fresh(v.aval) for v in jaxpr.invars[num_consts:]]
  dj = state_discharge.discharge_state(
      jaxpr, should_discharge=is_ref,
      strip_memory_space=getattr(ctx, "strip_memory_space", False))
  res = core.eval_jaxpr(dj, _jaxpr_consts(dj), *args, *scoped)
  n_out = len(jaxpr.outvars)
  outs, finals = res[:n_out], iter(res[n_out:])
  new_invals = [next(finals) if r else None for r in is_ref[:num_consts]]
  return new_invals, outs


def _run_scoped_of_values(*args, jaxpr, num_consts, collective_axes=()):
  """A run_scoped whose body touches no ref of the kernel (`pl.run_state`
  of values): JAX's discharge leaves it, having no ref to discharge, so it
  reaches lowering, where its own refs are discharged."""
  return _run_scoped_discharge(None, *args, jaxpr=jaxpr,
                               num_consts=num_consts)[1]


mlir.register_lowering(run_scoped_p, mlir.lower_fun(_run_scoped_of_values,
                                                    multiple_results=True))


def run_scoped(f: Callable[..., Any], *types, collective_axes=(),
               **kw_types):
  """Calls `f` with fresh scratch refs of `types` that live only inside it.

  With `collective_axes` (a grid axis name or a tuple of them), the programs
  that differ only along those axes share one allocation (the warpgroups of
  a `plgpu.kernel` along its thread axis); the primitive then carries them
  as its `collective_axes` param."""
  if not isinstance(collective_axes, (tuple, list)):
    collective_axes = (collective_axes,)
  collective_axes = tuple(collective_axes)
  flat_types, in_tree = tree_util.tree_flatten((types, kw_types))
  avals = []
  for t in flat_types:
    if hasattr(t, "get_ref_aval"):
      avals.append(t.get_ref_aval())
    elif isinstance(t, state_types.AbstractRef):
      avals.append(t)
    else:
      raise KernelError(None, f"expected scratch types such as "
                        f"tpu.VMEM(shape, dtype), got {t!r}", user_frame())
  out_tree_box = []

  def flat_f(*refs):
    a, kw = tree_util.tree_unflatten(in_tree, refs)
    out = f(*a, **kw)
    leaves, out_tree = tree_util.tree_flatten(out)
    out_tree_box.append(out_tree)
    return leaves

  # (the allocations' names: the parameters or keywords they are passed as)
  dbg = api_util.debug_info("run_scoped", f, *tree_util.tree_unflatten(
      in_tree, list(range(len(avals)))))
  outs = bind_run_scoped(flat_f, avals, dbg, collective_axes)
  return tree_util.tree_unflatten(out_tree_box[0], outs)


def bind_run_scoped(flat_f, avals, debug_info, collective_axes=()):
  """`run_scoped_p` of a flat body (refs in, a list of values out) over
  fresh allocations of `avals`; `debug_info` names them. Its outputs."""
  jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(
      lu.wrap_init(flat_f, debug_info=debug_info), avals)
  jaxpr = pe.convert_constvars_jaxpr(jaxpr)
  extra = {"collective_axes": collective_axes} if collective_axes else {}
  return run_scoped_p.bind(*consts, jaxpr=jaxpr, num_consts=len(consts),
                           **extra)
