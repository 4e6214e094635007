"""Inlined calls, `cond` (`pl.when`, `lax.cond`, `lax.switch`) and loops
(`fori_loop`, `while_loop`) as `scf.index_switch` / `scf.for` / `scf.while`;
loop carries may be vectors (the library infers one layout for a carry
across iterations)."""
from __future__ import annotations

from jax import lax
from dsl.core.jax_internals import ClosedJaxpr, arith, core, ir, scf
import jax.numpy as jnp

from dsl.core.jaxpr_walk import CALL_PRIMITIVES, call_body
from dsl.core.normalize import scan_layout
from dsl.core.primitives import run_scoped_p
from lowering_mosaic.gpu.mesh_accumulators import nested_scope_p
from lowering_mosaic.gpu.host import TRITON_HINT, i32, index_cast_i32, typed
from lowering_mosaic.gpu.rules import TABLE


@TABLE.register(*CALL_PRIMITIVES)
def _call(ctx, *args, **params):
  body = call_body(params, args)
  if body is None:
    raise ctx.error("call without a body")
  jaxpr, consts, operands = body
  return ctx.lower(jaxpr, consts, operands)


def _branch(ctx, closed, args):
  outs = ctx.lower_closed(closed, args)
  scf.yield_(outs)


@TABLE.register(lax.cond_p)
def _cond(ctx, index, *args, branches, **_):
  """`scf.index_switch` (the region op the library infers layouts
  through): case k runs branch k, the default runs the last branch."""
  if ir.IntegerType(index.type).width == 1:
    index = arith.extui(ir.IntegerType.get_signless(32), index)
  index = arith.index_cast(ir.IndexType.get(), index_cast_i32(index))
  result_types = [typed(a.shape, a.dtype) for a in ctx.avals_out]
  n = len(branches)
  op = scf.IndexSwitchOp(result_types, index, list(range(n - 1)))
  for block, branch in zip(list(op.case_blocks) + [op.default_block],
                           branches):
    with ir.InsertionPoint(block):
      _branch(ctx, branch, args)
  return list(op.results)


def _without_increment(body, n_before: int, n_bound: int):
  """`body` (a loop body whose carry starts with a counter at invar
  `n_before`) without the equation `counter + 1` that makes its first
  output and without its first `n_bound` outputs; None when the body does
  not count that way (the counter an int32 scalar, the sum used nowhere
  else)."""
  if len(body.invars) <= n_before:
    return None
  counter, out = body.invars[n_before], body.outvars[0]
  if counter.aval.shape or counter.aval.dtype != jnp.int32:
    return None
  for k, eqn in enumerate(body.eqns):
    if (eqn.primitive is lax.add_p and eqn.invars[0] is counter
        and isinstance(eqn.invars[1], core.Literal) and eqn.invars[1].val == 1
        and eqn.outvars[0] is out):
      rest = body.eqns[:k] + body.eqns[k + 1:]
      if any(out in e.invars for e in rest) or out in body.outvars[n_bound:]:
        return None
      return body.replace(eqns=rest, outvars=body.outvars[n_bound:])
  return None


def _for_loop(ctx, closed, consts, start, length, carry, unroll=None,
              has_index=True):
  """`scf.for` over i32 steps 0..length (as Pallas's lowering builds it):
  step `k` runs `closed` (on `consts`, with `has_index` the index, and the
  carry) `unroll or 1` times on indices `start + k * unroll + j`; a loop
  whose `unroll` covers it is inlined."""
  body, body_consts = _closed_parts(closed)

  def steps(base, state):
    if unroll is not None:
      base = arith.muli(base, i32(unroll))
    base = arith.addi(base, start)
    for j in range(unroll or 1):
      index = [arith.addi(base, i32(j))] if has_index else []
      state = ctx.lower(body, body_consts, list(consts) + index + list(state))
    return state

  if unroll is not None and unroll == length:
    return steps(i32(0), carry)
  if unroll is not None:
    if length % unroll:
      raise ctx.error(f"a loop of {length} steps unrolled by {unroll} (which "
                      "does not divide it)" + TRITON_HINT)
    length //= unroll
  bound = i32(length) if isinstance(length, int) else length
  loop = scf.ForOp(i32(0), bound, i32(1), list(carry))
  with ir.InsertionPoint(loop.body):
    scf.yield_(steps(loop.induction_variable, list(loop.inner_iter_args)))
  return list(loop.results)


def _closed_parts(closed):
  if isinstance(closed, ClosedJaxpr):
    return closed.jaxpr, list(closed.consts)
  return closed, []


@TABLE.register(lax.scan_p)
def _scan(ctx, *args, jaxpr, length, reverse, unroll=1, **params):
  """`fori_loop` with static bounds (a scan whose first carry counts and
  that has no stacked inputs or outputs): `scf.for` over i32 from the
  counter's start, unrolled as asked; another scan without stacked
  operands: `scf.for` of `length` steps."""
  num_consts, _, n_xs, n_ys = scan_layout(params)
  if n_xs or n_ys or reverse:
    raise ctx.error("lax.scan over arrays is not supported by the Mosaic GPU "
                    "lowering; use fori_loop" + TRITON_HINT)
  consts, carry = list(args[:num_consts]), list(args[num_consts:])
  unroll = int(length) if unroll is True else int(unroll)
  body, body_consts = _closed_parts(jaxpr)
  fori = _without_increment(body, num_consts, 1)
  if fori is None:
    return _for_loop(ctx, jaxpr, consts, i32(0), int(length), carry, unroll,
                     has_index=False)
  start = carry[0]
  outs = _for_loop(ctx, ClosedJaxpr(fori, body_consts), consts, start,
                   int(length), carry[1:], unroll)
  return [arith.addi(start, i32(int(length)))] + list(outs)


@TABLE.register(lax.while_p)
def _while(ctx, *args, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts):
  """`scf.while`; a fori_loop with bounds known at run time (the condition
  `i < upper` alone, the body adding 1 to i and keeping upper) is the
  `scf.for` of `upper - i` steps from `i` (as in Pallas)."""
  cconsts = list(args[:cond_nconsts])
  bconsts = list(args[cond_nconsts:cond_nconsts + body_nconsts])
  carry = list(args[cond_nconsts + body_nconsts:])
  body = _fori_while_body(cond_jaxpr, cond_nconsts, body_jaxpr, body_nconsts)
  if body is not None:
    lb, ub = carry[:2]
    outs = _for_loop(ctx, body, bconsts, lb, arith.subi(ub, lb), carry[2:])
    return [ub, ub] + list(outs)
  types = [c.type for c in carry]
  op = scf.WhileOp(types, carry)
  before = op.before.blocks.append(*types)
  with ir.InsertionPoint(before):
    (pred,) = ctx.lower_closed(cond_jaxpr, cconsts + list(before.arguments))
    scf.condition(pred, list(before.arguments))
  after = op.after.blocks.append(*types)
  with ir.InsertionPoint(after):
    outs = ctx.lower_closed(body_jaxpr, bconsts + list(after.arguments))
    scf.yield_(outs)
  return list(op.results)


def _fori_while_body(cond_closed, cond_nconsts, body_closed, body_nconsts):
  """The body of a while loop that is a fori_loop, taking (consts, index,
  carry...) and giving the carry; None for another while loop."""
  cond, cond_consts = _closed_parts(cond_closed)
  body, body_consts = _closed_parts(body_closed)
  if cond_nconsts or cond_consts or body_consts or len(cond.invars) < 2:
    return None
  i, upper = cond.invars[:2]
  if (len(cond.eqns) != 1 or cond.eqns[0].primitive is not lax.lt_p
      or list(cond.eqns[0].invars) != [i, upper]
      or list(cond.eqns[0].outvars) != list(cond.outvars)
      or any(v.aval.shape or v.aval.dtype != jnp.int32 for v in (i, upper))):
    return None
  bound = body.invars[body_nconsts + 1]
  if body.outvars[1] is not bound:
    return None
  fori = _without_increment(body, body_nconsts, 2)
  if fori is None or any(bound in e.invars for e in fori.eqns):
    return None
  invars = body.invars[:body_nconsts + 1] + body.invars[body_nconsts + 2:]
  return fori.replace(invars=invars)


@TABLE.register(run_scoped_p, nested_scope_p)
def _run_scoped(ctx, *consts, jaxpr, num_consts, collective_axes=(), **_):
  """The scope's refs come from the host: buffers the plan set aside for
  this equation, or (a plgpu kernel) allocations made here."""
  with ctx.host.scope(ctx, jaxpr, num_consts, collective_axes) as refs:
    body = ctx.host.scope_body(jaxpr, num_consts)
    outs = ctx.lower(body, (), list(consts) + list(refs))
    return outs[:len(jaxpr.outvars)]
