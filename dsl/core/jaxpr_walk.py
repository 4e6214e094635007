"""The rule table and the jaxpr walk that every lowering shares.

A lowering is a `RuleTable` (rules keyed by primitive) plus an emitter that
implements `LoweringHost`; `walk_jaxpr` runs the one loop over a jaxpr's
equations: it reads operands, finds the rule, calls it, checks what it
returned and binds the results, wrapping any failure into the host's
`BackendError` naming the kernel, the primitive and the user's line.

    TABLE = RuleTable("Triton")

    @TABLE.register(lax.add_p)
    def _add(ctx, x, y):
      ...

Tables that dispatch on something other than jaxpr primitives (the Mosaic
interpreter and the Promela extractor key MLIR operations by name) use the
same `RuleTable` with string keys.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Sequence

from dsl.core.jax_internals import (ad_checkpoint, ClosedJaxpr, core,
                                    custom_derivatives, pjit, source_info_util)

from dsl.core.errors import BackendError, traceback_frame

# Call-like primitives whose body a lowering inlines: what `jax.jit`,
# `jax.checkpoint`, `custom_jvp`/`custom_vjp` and JAX's own transformations
# (`eval_jaxpr`, which `closed_call` now is) leave in a kernel jaxpr.
CALL_PRIMITIVES = (pjit.jit_p, core.eval_jaxpr_p, ad_checkpoint.remat_p,
                   custom_derivatives.custom_jvp_call_p,
                   custom_derivatives.custom_vjp_call_p)


def call_body(params: dict, args: Sequence[Any]):
  """`(jaxpr, consts, args)` of a call-like equation, for inlining: its
  jaxpr and the operands that feed that jaxpr (the trailing ones)."""
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    if key in params:
      body = params[key]
      break
  else:
    return None
  if isinstance(body, ClosedJaxpr):
    jaxpr, consts = body.jaxpr, body.consts
  else:
    jaxpr, consts = body, ()
  n = len(jaxpr.invars)
  return jaxpr, consts, list(args)[len(args) - n:]


def sub_jaxprs(params: dict) -> Iterator[core.Jaxpr]:
  """The jaxprs among an equation's params (cond branches, loop bodies,
  call bodies), open or closed, alone or in tuples and lists."""
  for value in params.values():
    yield from _jaxprs_in(value)


def _jaxprs_in(value) -> Iterator[core.Jaxpr]:
  if isinstance(value, ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, core.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for v in value:
      yield from _jaxprs_in(v)


class RuleTable:
  """Rules keyed by primitive objects; names only for primitives that are not
  importable in every JAX version, and for tables of MLIR operation names."""

  def __init__(self, owner: str):
    self.owner = owner                  # "the Triton backend", for messages
    self._by_key: dict[Any, Callable] = {}
    self._by_name: dict[str, Callable] = {}
    self._folded: set = set()

  def register(self, *keys, fold: bool = False):
    """Decorator: `rule` handles every key (a primitive, or a name; None is
    skipped so optional primitives can be listed as `getattr(m, "x", None)`).
    `fold`: an equation whose operands are all constants is evaluated at
    lowering time (by the host's `fold`) instead of calling the rule."""
    def decorate(rule):
      for key in keys:
        if key is None:
          continue
        if isinstance(key, str):
          self._by_name[key] = rule
        else:
          self._by_key[key] = rule
        if fold:
          self._folded.add(key)
      return rule
    return decorate

  def folds(self, key) -> bool:
    """Whether equations of `key` with constant operands are folded."""
    return key in self._folded or getattr(key, "name", None) in self._folded

  def lookup(self, key) -> Callable | None:
    rule = self._by_key.get(key) if not isinstance(key, str) else None
    if rule is None:
      rule = self._by_name.get(key if isinstance(key, str) else
                               getattr(key, "name", None))
    return rule

  def __contains__(self, key) -> bool:
    return self.lookup(key) is not None

  def names(self) -> list[str]:
    """The names of every key, sorted (for messages and docs)."""
    return sorted({getattr(k, "name", str(k)) for k in self._by_key} |
                  set(self._by_name))


class RuleContextBase:
  """What every backend's lowering rule asks of its equation, by the same
  names on every backend: `eqn`, `primitive`, `avals_in`, `avals_out`,
  `out_aval` (the first result's), `out_used(i)` (whether the kernel uses
  result i), `error(message)` (a
  BackendError naming the primitive, the kernel and the user's line) and
  `lower(jaxpr, consts, args)` (a sub-jaxpr lowered at the current point,
  e.g. a loop body) and `lower_closed(closed, args)` (the same of a
  ClosedJaxpr). Each backend's `RuleContext` derives from it and adds
  what its rules emit with."""

  eqn: Any

  @property
  def primitive(self) -> str:
    return self.eqn.primitive.name

  @property
  def avals_in(self) -> list:
    return [v.aval for v in self.eqn.invars]

  @property
  def avals_out(self) -> list:
    return [v.aval for v in self.eqn.outvars]

  @property
  def out_aval(self):
    return self.eqn.outvars[0].aval

  def out_used(self, i: int = 0) -> bool:
    raise NotImplementedError

  def error(self, message: str) -> BackendError:
    raise NotImplementedError

  def lower(self, jaxpr: core.Jaxpr, consts, args) -> list:
    raise NotImplementedError

  def lower_closed(self, closed, args) -> list:
    """`lower` of a ClosedJaxpr (or of a Jaxpr without consts)."""
    if isinstance(closed, ClosedJaxpr):
      return self.lower(closed.jaxpr, closed.consts, args)
    return self.lower(closed, (), args)


class LoweringHost:
  """What `walk_jaxpr` needs from a lowering. Subclasses override these."""

  rules: RuleTable

  def literal(self, atom: core.Literal) -> Any:
    """The lowered value of a literal operand."""
    raise NotImplementedError

  def constvar(self, var: core.Var, value: Any) -> Any:
    """The lowered value of a jaxpr constant."""
    raise NotImplementedError

  def rule_context(self, eqn, used: set, position: tuple) -> Any:
    """The first argument a rule gets; `position` is (jaxpr, index)."""
    raise NotImplementedError

  def error(self, message: str, eqn=None) -> BackendError:
    """A BackendError naming the kernel and `eqn`'s user line."""
    raise NotImplementedError

  def fold(self, ctx: Any, eqn, invals: Sequence[Any]) -> Any | None:
    """The lowered value of `eqn` evaluated at lowering time, or None when
    its operands are not all constants (only for primitives registered with
    `fold=True`)."""
    return None

  @contextlib.contextmanager
  def lowering_eqn(self, eqn) -> Iterator[None]:
    """Wraps the lowering of `eqn`, its literal operands included
    (locations, comments, equation stack)."""
    yield

  def unsupported(self, eqn) -> BackendError:
    return self.error(
        f"primitive '{eqn.primitive.name}' is not supported by "
        f"{self.rules.owner} (it has no lowering rule there); run this kernel "
        "with backend='interpret' or rewrite it with supported operations",
        eqn)


def read_atom(host: LoweringHost, env: dict, atom) -> Any:
  if isinstance(atom, core.Literal):
    return host.literal(atom)
  return env[atom]


def used_vars(jaxpr: core.Jaxpr) -> set:
  """The variables some equation or the jaxpr's outputs read."""
  used = {v for e in jaxpr.eqns for v in e.invars if isinstance(v, core.Var)}
  used |= {v for v in jaxpr.outvars if isinstance(v, core.Var)}
  return used


def walk_jaxpr(host: LoweringHost, jaxpr: core.Jaxpr, consts: Sequence[Any],
               args: Sequence[Any]) -> list:
  """Lowers `jaxpr` through `host.rules`; returns the lowered outputs."""
  if len(args) != len(jaxpr.invars):
    raise host.error(f"internal error: {len(args)} arguments for a jaxpr "
                     f"with {len(jaxpr.invars)} inputs")
  env: dict = {}
  for v, c in zip(jaxpr.constvars, consts):
    env[v] = host.constvar(v, c)
  env.update(zip(jaxpr.invars, args))
  used = used_vars(jaxpr)
  for i, eqn in enumerate(jaxpr.eqns):
    rule = host.rules.lookup(eqn.primitive)
    if rule is None:
      raise host.unsupported(eqn)
    ctx = host.rule_context(eqn, used, (jaxpr, i))
    with host.lowering_eqn(eqn):
      invals = [read_atom(host, env, v) for v in eqn.invars]
      try:
        outs = (host.fold(ctx, eqn, invals)
                if host.rules.folds(eqn.primitive) else None)
        if outs is None:
          outs = rule(ctx, *invals, **eqn.params)
      except BackendError:
        raise
      except Exception as e:  # a bug or an unforeseen case in a rule
        raise host.error(
            f"{host.rules.owner} failed to lower primitive "
            f"'{eqn.primitive.name}': {type(e).__name__}: {e}", eqn) from e
    if not eqn.primitive.multiple_results and not isinstance(outs,
                                                             (list, tuple)):
      outs = [outs]
    outs = list(outs)
    if len(outs) != len(eqn.outvars):
      raise host.error(f"internal error: rule for '{eqn.primitive.name}' "
                       f"returned {len(outs)} values for "
                       f"{len(eqn.outvars)} outputs", eqn)
    for v, o in zip(eqn.outvars, outs):
      if not isinstance(v, core.DropVar):
        env[v] = o
  return [read_atom(host, env, v) for v in jaxpr.outvars]


# While `retrace` evaluates an equation: the traceback it runs under, and
# whether it is (inside) a call's body.
_RETRACING = contextvars.ContextVar("retracing", default=(None, False))


def equation_traceback(eqn, holder_traceback, in_call: bool):
  """The traceback an equation's rewrite or lowering is located by: its
  own; for an equation of an inner jaxpr, that of the equation holding it
  (`holder_traceback`) where its own names no user frame (a jnp function's
  equations) or where it is (inside) a call's body (`in_call`): a call's
  jaxpr is JAX's cached trace of the function, whose tracebacks belong to
  the call site that traced it first, maybe another kernel's."""
  own = eqn.source_info.traceback
  if holder_traceback is not None and (in_call or traceback_frame(own) is None):
    return holder_traceback
  return own


def retrace(jaxpr: core.Jaxpr, consts: Sequence[Any], args: Sequence[Any],
            eval_eqn: Callable[[Any, list], Any]) -> list:
  """Evaluates `jaxpr` on `args` in the current trace, equation by equation:
  `eval_eqn(eqn, invals)` gives each equation's outputs (a value, or a list
  for a primitive with several results). Each runs under the equation's
  source line and name stack, so a jaxpr rewritten this way keeps the
  user's lines (`equation_traceback`: an inlined call's equations keep the
  call's). The jaxpr rewrites (normalization, random state threading) share
  this loop."""
  env: dict = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))

  def read(v):
    return v.val if isinstance(v, core.Literal) else env[v]

  holder_traceback, in_call = _RETRACING.get()
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    name_stack = (source_info_util.current_name_stack()
                  + eqn.source_info.name_stack)
    traceback = equation_traceback(eqn, holder_traceback, in_call)
    token = _RETRACING.set(
        (traceback, in_call or eqn.primitive in CALL_PRIMITIVES))
    try:
      with (source_info_util.user_context(traceback, name_stack=name_stack),
            eqn.ctx.manager):
        outs = eval_eqn(eqn, invals)
    finally:
      _RETRACING.reset(token)
    if not eqn.primitive.multiple_results:
      outs = [outs]
    for v, o in zip(eqn.outvars, outs):
      if not isinstance(v, core.DropVar):
        env[v] = o
  return [read(v) for v in jaxpr.outvars]
