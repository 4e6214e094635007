"""plgpu's WGMMA accumulators (`plgpu.ACC`) in a `plgpu.kernel`: values
that the code carries, as Pallas's lowering makes them.

An accumulator lives in registers, so the `run_scoped` that allocates one
lowers a *discharged* body (JAX's state discharge): the accumulator is an
input value (zero, behind a `mosaic_gpu.optimization_barrier` and a
`wgmma.fence`, so that no WGMMA reads registers still being written), every
`wgmma(acc, a, b)` returns its new value (`wgmma_acc`, a
`mosaic_gpu.wgmma`), loops carry it (`scf.for` iter_args) and `pl.when`
branches return it. Before the discharge, the body is rewritten:

- a read of an accumulator (`acc[...]`) first waits for every WGMMA in
  flight (`wgmma_wait(0)`), as plgpu promises; reads in a row (those at
  the end of `pl.run_state`) wait once, as Pallas's `run_state` does;
- a write of one (`acc[...] = x`) passes `x` through `acc_fence`: the
  barrier and the fence above;
- each `run_scoped` nested in the body becomes a `nested_scope`, whose
  discharge rule discharges only the accumulators it closes over and
  keeps its own allocations (shared memory, barriers) as refs; it binds
  `run_scoped` again, with the accumulators' final values as extra
  results.
"""
from __future__ import annotations

from jax.extend.core import Primitive

from dsl.core.jax_internals import (ClosedJaxpr, core, state_discharge,
                                    mosaic_gpu_dialect as mgpu,
                                    state_primitives)
from dsl.core.operand_layout import (effects as ref_effects,
                                     eqn_ref_operands, position, unpack)
from dsl.core.primitives import run_scoped_p
from dsl.mosaic_gpu.compute import wgmma_p, wgmma_wait_p
from dsl.mosaic_gpu.memory import is_accumulator_aval
from lowering_mosaic.gpu.accumulators import map_jaxpr_param, selects_whole
from lowering_mosaic.gpu.host import void_asm


def wgmma_fence() -> None:
  """Orders the warpgroup's register writes before the WGMMAs that follow."""
  void_asm("wgmma.fence.sync.aligned;")


def fenced(value):
  """`value` (a WGMMA accumulator) made safe for the WGMMAs that follow:
  behind an optimization barrier (so its computation stays before the
  fence) and a `wgmma.fence`."""
  value = mgpu.optimization_barrier([value])
  wgmma_fence()
  return value


# ------------------------------------------------------------ primitives

# wgmma_acc(acc value, a, b; wgmma's params) = the new value of acc
wgmma_acc_p = Primitive("wgmma_acc")


@wgmma_acc_p.def_effectful_abstract_eval
def _wgmma_acc_abstract_eval(*avals, layout, a_is_ref):
  reads = ("a", "b") if a_is_ref else ("b",)
  return unpack(avals, layout)["acc"], ref_effects(layout, reads=reads)


@state_discharge.register_discharge_rule(wgmma_p)
def _wgmma_discharge(ctx, *args, layout, a_is_ref):
  acc = position(layout, "acc")
  if unpack(args, layout)["acc_t"]:
    raise NotImplementedError("windows of plgpu.ACC accumulators "
                              "(wgmma(acc.at[...], ...))")
  new = wgmma_acc_p.bind(*args, layout=layout, a_is_ref=a_is_ref)
  return [new if i == acc else None for i in range(len(args))], []


# acc_fence(x) = x, made an accumulator's value (a write of `acc[...]`)
acc_fence_p = Primitive("acc_fence")
acc_fence_p.def_abstract_eval(lambda aval: aval)

# a run_scoped nested in an accumulator's scope (see the module doc)
nested_scope_p = Primitive("nested_scope")
nested_scope_p.multiple_results = True
nested_scope_p.def_effectful_abstract_eval(
    lambda *avals, **params: run_scoped_p.abstract_eval(*avals, **params))


@state_discharge.register_discharge_rule(nested_scope_p)
def _nested_scope_discharge(ctx, *args, jaxpr, num_consts, collective_axes=()):
  should = list(ctx.should_discharge[:num_consts])
  should += [False] * (len(jaxpr.invars) - num_consts)
  body = discharged(jaxpr, should)
  outs = run_scoped_p.bind(*args, jaxpr=body, num_consts=num_consts,
                           collective_axes=collective_axes)
  n_out = len(jaxpr.outvars)
  finals = iter(outs[n_out:])
  new_invals = [next(finals) if s else None for s in should[:num_consts]]
  return new_invals + [None] * (len(args) - num_consts), outs[:n_out]


# ------------------------------------------------------------- rewrites

def _is_acc(v) -> bool:
  return isinstance(v, core.Var) and is_accumulator_aval(v.aval)


def _is_acc_read(eqn) -> bool:
  return eqn.primitive is state_primitives.get_p and _is_acc(eqn.invars[0])


def _rewrite_eqn(eqn, wait: bool) -> list:
  """The equations that replace `eqn` in an accumulator's scope; a read
  of an accumulator is preceded by a `wgmma_wait(0)` where `wait`."""
  params = {k: map_jaxpr_param(v, _rewrite) for k, v in eqn.params.items()}
  if eqn.primitive is run_scoped_p:
    return [eqn.replace(primitive=nested_scope_p, params=params)]
  eqn = eqn.replace(params=params)
  if _is_acc_read(eqn) and wait:
    wait_eqn = core.new_jaxpr_eqn([], [], wgmma_wait_p, dict(n=0),
                                  wgmma_wait_p.abstract_eval(n=0)[1],
                                  eqn.source_info, eqn.ctx)
    return [wait_eqn, eqn]
  if eqn.primitive is state_primitives.swap_p and _is_acc(eqn.invars[0]):
    value = eqn.invars[1]
    fenced = core.Var(value.aval)
    fence = core.new_jaxpr_eqn([value], [fenced], acc_fence_p, {},
                               core.no_effects, eqn.source_info, eqn.ctx)
    invars = [eqn.invars[0], fenced, *eqn.invars[2:]]
    return [fence, eqn.replace(invars=invars)]
  return [eqn]


def _rewrite(jaxpr: core.Jaxpr) -> core.Jaxpr:
  # A read right after another accumulator read issues no WGMMA to wait
  # for: the reads in a row (the end of `pl.run_state`) wait once.
  eqns, after_read = [], False
  for eqn in jaxpr.eqns:
    eqns += _rewrite_eqn(eqn, wait=not after_read)
    after_read = _is_acc_read(eqn)
  return jaxpr.replace(eqns=eqns)


def discharged(jaxpr: core.Jaxpr, should: list[bool]) -> core.Jaxpr:
  """`jaxpr` (a scope's body, its consts first among its inputs) with the
  inputs marked in `should` (accumulators) discharged: they are values,
  and their final values follow the body's results."""
  closed = ClosedJaxpr(_rewrite(jaxpr), ())
  out = state_discharge.discharge_state(closed, should_discharge=should,
                                        strip_memory_space=True)
  out = out if isinstance(out, ClosedJaxpr) else ClosedJaxpr(out, ())
  if out.consts:
    raise NotImplementedError("constants in the body of an accumulator's "
                              "scope")
  return out.jaxpr


def accumulator_body(jaxpr: core.Jaxpr, num_consts: int) -> core.Jaxpr:
  """The body a `run_scoped` of a plgpu.kernel lowers: `jaxpr` itself, or,
  when it allocates accumulators, `jaxpr` with them discharged."""
  should = [i >= num_consts and is_accumulator_aval(v.aval)
            for i, v in enumerate(jaxpr.invars)]
  return discharged(jaxpr, should) if any(should) else jaxpr


def written_first(jaxpr: core.Jaxpr, acc: core.Var) -> bool:
  """Whether the first use of accumulator `acc` in `jaxpr` writes all of
  it (`acc[...] = x`), so that its initial value is never read."""
  for eqn in jaxpr.eqns:
    if any(v is acc for v in eqn.invars):
      return (eqn.primitive is state_primitives.swap_p
              and eqn.invars[0] is acc and eqn.invars[1] is not acc
              and selects_whole(eqn_ref_operands(eqn).transforms))
  return False
