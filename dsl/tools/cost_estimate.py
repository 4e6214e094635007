"""`pl.estimate_cost(fn, *args)`: a `CostEstimate` for a pallas_call, counted
from the plain JAX function the kernel computes.

The function is traced for the arguments' shapes (arrays or
`jax.ShapeDtypeStruct`s) and its equations are counted by a rule table keyed
by primitive, with the conventions Pallas's estimates use, so a kernel gets
the same estimate (and the same TPU custom call) on dsl as on Pallas:

- an elementwise binary op costs one flop per output element, a cheap unary
  op one flop per element, a transcendental one transcendental per element;
- `x ** n` (integer_pow) costs the multiplies of repeated squaring;
- a dot costs 2 flops per multiply-add: 2 x |output| x |contracted dims|;
- calls (`jit`, `custom_vjp`, `run_state`) cost what their bodies cost;
- other primitives (data movement, comparisons, reductions) cost nothing;
- bytes accessed are the bytes of the arguments and of the results.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
from jax import lax

from dsl.core.jax_internals import custom_derivatives, pjit, state_discharge
from dsl.core.pallas_call import CostEstimate

# (flops, transcendentals) of one equation: rule(in_avals, out_avals, params)
Rule = Callable[[list, list, dict], tuple[int, int]]


def _size(aval) -> int:
  return math.prod(aval.shape)


def _per_output(in_avals, out_avals, params):
  return _size(out_avals[0]), 0


def _per_input(in_avals, out_avals, params):
  return _size(in_avals[0]), 0


def _transcendental(in_avals, out_avals, params):
  return 0, _size(in_avals[0])


def _integer_pow(in_avals, out_avals, params):
  y = params["y"]
  if y in (0, 1):
    return 0, 0                       # a constant or a copy
  squarings = abs(y).bit_length() - 1
  multiplies = bin(abs(y)).count("1")
  return _size(in_avals[0]) * (squarings + multiplies + (y < 0)), 0


def _dot_general(in_avals, out_avals, params):
  (lhs_contracting, _), _ = params["dimension_numbers"]
  lhs_shape = in_avals[0].shape
  contracted = math.prod(lhs_shape[d] for d in lhs_contracting)
  return 2 * _size(out_avals[0]) * contracted, 0


def _body(param: str) -> Rule:
  def rule(in_avals, out_avals, params):
    return _count(params[param])
  return rule


RULES: dict[Any, Rule] = {
    **{p: _per_output for p in (lax.add_p, lax.mul_p, lax.sub_p, lax.div_p,
                                lax.min_p, lax.max_p, lax.or_p, lax.and_p,
                                lax.xor_p)},
    **{p: _per_input for p in (lax.neg_p, lax.floor_p, lax.ceil_p,
                               lax.round_p, lax.not_p)},
    **{p: _transcendental for p in (lax.cos_p, lax.sin_p, lax.tan_p,
                                    lax.sinh_p, lax.cosh_p, lax.tanh_p,
                                    lax.acos_p, lax.asin_p, lax.atan_p,
                                    lax.exp_p, lax.log_p, lax.logistic_p,
                                    lax.sqrt_p)},
    lax.integer_pow_p: _integer_pow,
    lax.dot_general_p: _dot_general,
}


def _call_rules() -> dict[Any, Rule]:
  return {pjit.jit_p: _body("jaxpr"),
          custom_derivatives.custom_vjp_call_p: _body("call_jaxpr"),
          state_discharge.run_state_p: _body("jaxpr")}


def _count(jaxpr) -> tuple[int, int]:
  """(flops, transcendentals) of a jaxpr's equations."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  rules = {**RULES, **_call_rules()}
  flops = transcendentals = 0
  for eqn in jaxpr.eqns:
    rule = rules.get(eqn.primitive)
    if rule is None:
      continue
    f, t = rule([v.aval for v in eqn.invars], [v.aval for v in eqn.outvars],
                eqn.params)
    flops, transcendentals = flops + f, transcendentals + t
  return flops, transcendentals


def _nbytes(aval) -> int:
  return _size(aval) * aval.dtype.itemsize


def estimate_cost(fun, *args, **kwargs) -> CostEstimate:
  """The cost of `fun(*args, **kwargs)`, for `pallas_call(cost_estimate=)`.

  `args` are arrays or `jax.ShapeDtypeStruct`s (pytrees of them); only their
  shapes and dtypes matter.
  """
  structs = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
  closed = jax.make_jaxpr(functools.partial(fun, **kwargs))(*structs)
  flops, transcendentals = _count(closed.jaxpr)
  bytes_in = sum(_nbytes(v.aval) for v in closed.jaxpr.invars)
  bytes_out = sum(_nbytes(v.aval) for v in closed.jaxpr.outvars)
  return CostEstimate(flops=int(flops), transcendentals=int(transcendentals),
                      bytes_accessed=int(bytes_in + bytes_out))
