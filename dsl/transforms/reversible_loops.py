"""Loops with a trip count known only at run time, made reversible.

JAX transposes a `fori_loop` with static bounds (a `scan`) but not a
`while_loop`, nor a `fori_loop` whose bounds are traced values (which
becomes one): the number of iterations, and so the carries to save, is
unknown when the backward pass is built. The transposed kernel needs the
transpose of a grid point's tangent map, so before it linearizes the
point's function, `reversible_loops` replaces each `while_loop` that carries
tangents with a `jax.custom_vjp` of the same loop whose backward pass
recomputes instead of saving: it counts the iterations `n` going forward
and, for k = n-1 down to 0, runs the body k times from the loop's initial
carry to find the carry at iteration k and pulls the cotangent back through
that iteration. That is n(n+1)/2 evaluations of the body for n iterations,
and no memory beyond one carry.

The function rewritten here is a discharged per-point function: its only
refs are scalar-prefetch refs, read without effects (`prefetch_reads`),
which the loop takes as operands without cotangents.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from dsl.core.dtypes import has_tangent
from dsl.core.jax_internals import ClosedJaxpr, core
from dsl.core.normalize import rewrite_closed


def _floats(xs):
  return [has_tangent(core.typeof(x).dtype) for x in xs]


def _merge(values, floats, mask):
  """`values` with the entries that `mask` marks replaced by `floats`."""
  it = iter(floats)
  return [next(it) if m else v for v, m in zip(values, mask)]


def _pick(values, mask):
  return [v for v, m in zip(values, mask) if m]


def _rewrite(closed: ClosedJaxpr) -> ClosedJaxpr:
  return rewrite_closed(closed, {lax.while_p: _reversible_while})


def _reversible_while(*args, cond_jaxpr, body_jaxpr, cond_nconsts,
                      body_nconsts):
  cc, bc = args[:cond_nconsts], args[cond_nconsts:cond_nconsts + body_nconsts]
  init = list(args[cond_nconsts + body_nconsts:])
  body_jaxpr = _rewrite(body_jaxpr)     # loops nested in the body
  if not any(_floats(bc) + _floats(init)):
    return lax.while_p.bind(*args, cond_jaxpr=cond_jaxpr,
                            body_jaxpr=body_jaxpr, cond_nconsts=cond_nconsts,
                            body_nconsts=body_nconsts)
  # An operand the condition and the body share is passed once (a ref may
  # not be passed twice).
  unique, where = [], []
  for x in list(cc) + list(bc):
    k = next((k for k, u in enumerate(unique) if u is x), None)
    if k is None:
      k = len(unique)
      unique.append(x)
    where.append(k)
  n_cc = len(cc)

  def cond(consts, carry):
    ops = [consts[k] for k in where[:n_cc]]
    return core.jaxpr_as_fun(cond_jaxpr)(*ops, *carry)[0]

  def body(consts, carry):
    ops = [consts[k] for k in where[n_cc:]]
    return list(core.jaxpr_as_fun(body_jaxpr)(*ops, *carry))

  return _loop(cond, body, unique, init)


def _loop(cond, body, consts, init):
  """`while cond(c): c = body(consts, c)` from `init`, as a custom_vjp that
  reverses by recomputation (see the module's docstring)."""
  c_mask, k_mask = _floats(consts), _floats(init)

  def run(consts, init):
    def step(state):
      n, carry = state
      return n + 1, body(consts, carry)
    return lax.while_loop(lambda s: cond(consts, s[1]), step,
                          (jnp.int32(0), init))

  @jax.custom_vjp
  def loop(consts, init):
    return run(consts, init)[1]

  def fwd(consts, init):
    n, out = run(consts, init)
    return out, (consts, init, n)

  def bwd(res, ct):
    consts, init, n = res

    def carry_at(k):
      return lax.fori_loop(0, k, lambda _, c: body(consts, c), init)

    def back(j, acc):
      ct_consts, ct_carry = acc
      carry = carry_at(n - 1 - j)

      def float_body(fc, fk):
        out = body(_merge(consts, fc, c_mask), _merge(carry, fk, k_mask))
        return _pick(out, k_mask)
      _, pull = jax.vjp(float_body, _pick(consts, c_mask),
                        _pick(carry, k_mask))
      d_consts, d_carry = pull(list(ct_carry))
      return [a + d for a, d in zip(ct_consts, d_consts)], d_carry

    zeros = [jnp.zeros_like(c) for c in _pick(consts, c_mask)]
    ct_consts, ct_init = lax.fori_loop(0, n, back,
                                       (zeros, _pick(ct, k_mask)))
    return (_merge([None] * len(consts), ct_consts, c_mask),
            _merge([None] * len(init), ct_init, k_mask))

  loop.defvjp(fwd, bwd)
  return loop(list(consts), list(init))


def reversible_loops(closed: ClosedJaxpr) -> ClosedJaxpr:
  """`closed` with each `while_loop` that carries tangents reversible (see
  the module's docstring); `closed` itself when it has none."""
  return _rewrite(closed)
