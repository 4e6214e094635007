"""Named grid axes: `grid=(("i", 4), ("j", 2))` binds `i` and `j` for the body.

A kernel body is traced with the names of its grid axes in JAX's axis
environment (`bind_grid_axes`), so `lax.axis_index("i")`, `lax.axis_size("i")`
and `lax.psum(x, "i")` trace as they do under `shard_map`. The traced kernel
jaxpr is then rewritten once (`rewrite`, called by dsl.core.tracing before any
backend or transformation sees the kernel), so that no backend meets a grid
axis name:

- `axis_index[i]` becomes the program id of grid dim `i`;
- `psum` over `i` of a value that is the same at every grid point along `i`
  becomes the value times the axis size (`lax.psum(1, "i")` is the axis size);
  `pmax`/`pmin` of such a value is the value itself. Axes of an enclosing
  `shard_map` stay in the collective.

A collective over a grid axis of a value that differs along it has no meaning
in a grid that runs its points one after another: that is a KernelError at
trace time naming the kernel, the axis and the user's line.

Which values differ along an axis is a conservative data-flow fact: a value
differs along `i` if it is computed from `axis_index(i)`, from the program id
of `i`, or from a ref whose contents may differ along `i` (an input block whose
index map reads `i`; every output, scratch and scoped ref). Control flow
counts every operand of a loop or branch for every value inside it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
from jax import lax
from dsl.core.jax_internals import (close_jaxpr, ClosedJaxpr, core,
                                    lax_control_flow as cf, lax_parallel,
                                    partial_eval as pe, state_types)
import jax.extend.linear_util as lu

from dsl.core.errors import KernelError, source_info_frame
from dsl.core.jaxpr_walk import CALL_PRIMITIVES, call_body, retrace, sub_jaxprs
from dsl.core.normalize import scan_layout
from dsl.core.primitives import bind_run_scoped, run_scoped_p


def grid_names(grid) -> tuple | None:
  """The axis names of a grid given as `(("i", 4), ...)`, None per unnamed
  dim; None if no dim is named."""
  if isinstance(grid, (int, np.integer)) or not isinstance(grid, (tuple, list)):
    return None
  names = tuple(g[0] if isinstance(g, tuple) and len(g) == 2
                and isinstance(g[0], str) else None for g in grid)
  return names if any(n is not None for n in names) else None


def bind_grid_axes(gm):
  """The axis environment a body with named grid axes is traced in."""
  return core.extend_axis_env_nd(
      [(n, int(s)) for n, s in zip(gm.grid_names or (), gm.grid)
       if n is not None])


def check_not_shadowing(kernel: str, grid, where: str) -> None:
  """A grid axis name that the enclosing shard_map's mesh has too is an
  error (checked at every call: a traced kernel is cached)."""
  outer = core.get_axis_env().axis_sizes
  for n in grid_names(grid) or ():
    if n is not None and n in outer:
      raise KernelError(kernel, f"the grid axis name {n!r} is also an axis "
                        "of the enclosing mesh (shard_map); name it "
                        "differently", where, operand="grid")


@dataclasses.dataclass
class _Ctx:
  kernel: str
  index: dict            # axis name -> its program id (a tracer)
  size: dict             # axis name -> grid size
  every: frozenset       # all named axes


def _names(params) -> tuple:
  for key in ("axes", "axis_name"):
    if key in params:
      v = params[key]
      return tuple(v) if isinstance(v, (tuple, list)) else (v,)
  return ()


def uses_grid_axes(jaxpr: core.Jaxpr, names: frozenset) -> frozenset:
  """The grid axis names that `jaxpr` (or a jaxpr inside it) refers to."""
  found = set()
  for eqn in jaxpr.eqns:
    found.update(n for n in _names(eqn.params) if n in names)
    for sub in sub_jaxprs(eqn.params):
      found |= uses_grid_axes(sub, names)
  return frozenset(found)


def rewrite(closed: ClosedJaxpr, kernel: str, gm) -> ClosedJaxpr:
  """The kernel jaxpr `closed` (grid ids first, then refs) of the grid
  mapping `gm`, without grid axis names."""
  names, sizes = gm.grid_names or (), gm.grid
  every = frozenset(n for n in names if n is not None)
  if not every or not uses_grid_axes(closed.jaxpr, every):
    return closed
  ref_axes = _ref_axes(gm)

  def fn(*args):
    ctx = _Ctx(kernel, {n: a for n, a in zip(names, args) if n is not None},
               dict((n, s) for n, s in zip(names, sizes) if n is not None),
               every)
    axes = ([frozenset([n]) if n is not None else frozenset() for n in names]
            + list(ref_axes))
    return _eval(ctx, closed.jaxpr, closed.consts, args, axes)[0]

  jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(
      lu.wrap_init(fn, debug_info=closed.jaxpr.debug_info),
      [v.aval for v in closed.jaxpr.invars])
  return close_jaxpr(jaxpr, consts)


def _ref_axes(gm) -> list[frozenset]:
  """Per kernel ref, the named grid axes its contents may differ along: an
  input block's, those its index map reads; every output's and scratch's,
  all of them (they carry values from one grid point to the next)."""
  names = gm.grid_names or ()
  every = frozenset(n for n in names if n is not None)
  if not every:
    return [frozenset()] * gm.num_refs

  def input_axes(bm):
    read = _inputs_read(bm.index_map_jaxpr.jaxpr)
    return frozenset(n for k, n in enumerate(names)
                     if n is not None and k in read)
  return gm.per_ref(lambda a: frozenset(), input_axes, lambda bm: every,
                    lambda a: every)


def _inputs_read(jaxpr: core.Jaxpr) -> set[int]:
  """The positions of the invars that `jaxpr`'s outputs are computed from."""
  deps = {v: {k} for k, v in enumerate(jaxpr.invars)}
  for eqn in jaxpr.eqns:
    d = set().union(*(deps.get(v, set()) for v in eqn.invars
                      if not isinstance(v, core.Literal)))
    for v in eqn.outvars:
      deps[v] = d
  return set().union(*(deps.get(v, set()) for v in jaxpr.outvars
                       if not isinstance(v, core.Literal)))


def _eval(ctx: _Ctx, jaxpr: core.Jaxpr, consts, args, in_axes):
  """Evaluates `jaxpr` on `args` (tracers), rewriting grid-axis primitives;
  returns (outputs, the axes each output differs along)."""
  axes: dict = dict(zip(jaxpr.invars, in_axes))

  def axes_of(v):
    return frozenset() if isinstance(v, core.Literal) else axes.get(v, frozenset())

  def eval_eqn(eqn, invals):
    in_ax = [axes_of(v) for v in eqn.invars]
    outs, out_ax = _eval_eqn(ctx, eqn, invals, in_ax)
    for v in eqn.outvars:
      axes[v] = out_ax
    # A ref written here may now hold values that differ along more axes.
    for k in _written(eqn):
      v = eqn.invars[k]
      if not isinstance(v, core.Literal):
        axes[v] = axes_of(v) | out_ax | frozenset().union(*in_ax)
    return outs

  outs = retrace(jaxpr, consts, args, eval_eqn)
  return outs, [axes_of(v) for v in jaxpr.outvars]


def _written(eqn) -> list[int]:
  """The positions of the refs that `eqn` writes."""
  return [e.input for e in eqn.effects
          if isinstance(e, (state_types.WriteEffect, state_types.AccumEffect))
          and isinstance(e.input, int) and e.input < len(eqn.invars)]


def _eval_eqn(ctx: _Ctx, eqn, invals, in_ax):
  union = frozenset().union(*in_ax)
  named = [n for n in _names(eqn.params) if n in ctx.every]
  if named:
    rule = COLLECTIVES.get(eqn.primitive)
    if rule is None:
      raise _error(ctx, eqn, f"{eqn.primitive.name} over the grid axis "
                   f"{named[0]!r} is not supported inside a kernel; only "
                   "axis_index, axis_size, psum, pmax and pmin are")
    return rule(ctx, eqn, invals, in_ax, named)
  subs = list(sub_jaxprs(eqn.params))
  inner = frozenset().union(*(uses_grid_axes(j, ctx.every) for j in subs))
  if not inner:
    return eqn.primitive.bind(*invals, **eqn.params), union
  body_axes = union | inner
  if eqn.primitive in CALL_PRIMITIVES:
    jaxpr, consts, args = call_body(eqn.params, invals)
    n = len(jaxpr.invars)
    outs, out_ax = _eval(ctx, jaxpr, consts, args, in_ax[len(in_ax) - n:])
    return outs, frozenset().union(body_axes, *out_ax)
  rebind = _control_flow().get(eqn.primitive)
  if rebind is None:
    raise _error(ctx, eqn, f"a grid axis name ({sorted(inner)[0]!r}) is used "
                 f"inside {eqn.primitive.name}, which cannot carry it; use "
                 "pl.program_id outside it")
  return rebind(ctx, eqn, invals, body_axes), body_axes


def _error(ctx: _Ctx, eqn, message: str) -> KernelError:
  return KernelError(ctx.kernel, message, source_info_frame(eqn.source_info))


# ----------------------------------------------------------------- collectives

def _axis_index(ctx, eqn, invals, in_ax, named):
  name = named[0]
  return ctx.index[name], frozenset([name])


def _reduction(combine: Callable):
  def rule(ctx, eqn, invals, in_ax, named):
    rest = tuple(n for n in _names(eqn.params) if n not in ctx.every)
    outs = []
    for x, ax in zip(invals, in_ax):
      differs = [n for n in named if n in ax]
      if differs:
        raise _error(
            ctx, eqn, f"{eqn.primitive.name} over the grid axis "
            f"{differs[0]!r} of a value that differs along it: grid points "
            "run one after another, not side by side, so there is nothing "
            "to combine; accumulate into an output block that every point "
            "along the axis revisits (an index map that ignores the axis) "
            "instead")
      count = int(np.prod([ctx.size[n] for n in named]))
      outs.append(combine(x, count))
    if rest:
      params = dict(eqn.params, axes=rest)
      outs = eqn.primitive.bind(*outs, **params)
      return outs, frozenset().union(*in_ax)
    if not eqn.primitive.multiple_results:
      outs = outs[0]
    return outs, frozenset().union(*in_ax)
  return rule


def _times(x, count):
  return x * lax.convert_element_type(count, lax.dtype(x))


COLLECTIVES: dict[Any, Callable] = {
    lax_parallel.axis_index_p: _axis_index,
    lax_parallel.psum_p: _reduction(_times),
    lax_parallel.psum_invariant_p: _reduction(_times),
    lax_parallel.pmax_p: _reduction(lambda x, n: x),
    lax_parallel.pmin_p: _reduction(lambda x, n: x),
    lax_parallel.pbroadcast_p: _reduction(lambda x, n: x),
}
if hasattr(core, "pvary_p"):
  COLLECTIVES[core.pvary_p] = _reduction(lambda x, n: x)


# ---------------------------------------------------------------- control flow
# An equation whose inner jaxprs name grid axes is bound again through the
# public API, whose tracing closes over the program ids.

def _fun(ctx, closed, axes):
  def f(*args):
    return _eval(ctx, closed.jaxpr, closed.consts, args,
                 [axes] * len(args))[0]
  return f


def _cond(ctx, eqn, invals, axes):
  """`cond` bound again as it was (no index clamp as `lax.switch` adds),
  with what the rewritten branches close over as leading operands."""
  index, *ops = invals
  avals = [core.typeof(o) for o in ops]
  traced = [pe.trace_to_jaxpr_dynamic(
      lu.wrap_init(_fun(ctx, b, axes), debug_info=b.jaxpr.debug_info), avals)
      for b in eqn.params["branches"]]
  shared = [c for _, _, consts in traced for c in consts]
  shared_avals = [core.typeof(c) for c in shared]
  branches, start = [], 0
  for jaxpr, _, consts in traced:
    def closed(*args, jaxpr=jaxpr, lo=start, hi=start + len(consts)):
      return core.eval_jaxpr(jaxpr, args[lo:hi], *args[len(shared):])
    start += len(consts)
    j, _, c = pe.trace_to_jaxpr_dynamic(
        lu.wrap_init(closed, debug_info=jaxpr.debug_info),
        [*shared_avals, *avals])
    branches.append(close_jaxpr(j, c))
  params = dict(eqn.params, branches=tuple(branches))
  return cf.cond_p.bind(index, *shared, *ops, **params)


def _while(ctx, eqn, invals, axes):
  p = eqn.params
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  cconsts, bconsts, init = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]
  cond_f, body_f = _fun(ctx, p["cond_jaxpr"], axes), _fun(ctx, p["body_jaxpr"], axes)
  out = lax.while_loop(lambda c: cond_f(*cconsts, *c)[0],
                       lambda c: tuple(body_f(*bconsts, *c)), tuple(init))
  return list(out)


def _scan(ctx, eqn, invals, axes):
  p = eqn.params
  n_consts, n_carry, n_xs, _ = scan_layout(p)
  consts = invals[:n_consts]
  init = invals[n_consts:n_consts + n_carry]
  xs = invals[n_consts + n_carry:]
  body = _fun(ctx, p["jaxpr"], axes)

  def step(carry, x):
    outs = body(*consts, *carry, *x)
    return tuple(outs[:n_carry]), tuple(outs[n_carry:])

  carry, ys = lax.scan(step, tuple(init), tuple(xs), length=p["length"],
                       reverse=p["reverse"], unroll=p.get("unroll", 1))
  return list(carry) + list(ys)


def _run_scoped(ctx, eqn, invals, axes):
  jaxpr = eqn.params["jaxpr"]
  n = eqn.params["num_consts"]
  scoped = [v.aval for v in jaxpr.invars[n:]]
  closed = close_jaxpr(jaxpr, ())
  body_axes = [axes] * n + [ctx.every] * len(scoped)

  def f(*refs):
    return _eval(ctx, closed.jaxpr, (), [*invals, *refs], body_axes)[0]
  dbg = jaxpr.debug_info
  names = ([""] * len(scoped) + list(dbg.arg_names or ()))[-len(scoped):]
  return bind_run_scoped(f, scoped, dbg._replace(arg_names=tuple(names)),
                         eqn.params.get("collective_axes", ()))


# Primitives of front ends whose body (params `jaxpr`, `num_consts`) takes
# its operands, then values it makes itself (a warp's id): primitive ->
# `bind(f, eqn)`, which binds it again with the flat body `f(*own values)`.
_OWN_BODIES: dict = {}


def register_body_primitive(primitive, bind) -> None:
  """Lets grid axis names be used inside `primitive`'s body (see
  `_OWN_BODIES`)."""
  _OWN_BODIES[primitive] = bind


def _own_body(ctx, eqn, invals, axes):
  jaxpr, n = eqn.params["jaxpr"], eqn.params["num_consts"]
  closed = close_jaxpr(jaxpr, ())

  def f(*own):
    return _eval(ctx, closed.jaxpr, (), [*invals, *own],
                 [axes] * n + [frozenset()] * len(own))[0]
  return _OWN_BODIES[eqn.primitive](f, eqn)


def _control_flow() -> dict:
  return {cf.cond_p: _cond, cf.while_p: _while, cf.scan_p: _scan,
          run_scoped_p: _run_scoped,
          **{p: _own_body for p in _OWN_BODIES}}
