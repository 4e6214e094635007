"""checkify of a pallas_call: checks inside the kernel become an error value.

The kernel is run by the interpret backend's JAX implementation under the
checkify interpreter, so the errors of every grid point are functionalized.
"""
from __future__ import annotations

import functools

import jax
from jax._src import checkify as jax_checkify

from dsl import checks
from dsl.pallas_call import KernelSpec, pallas_call_p


def pallas_call_checkify(ctx, error, enabled_errors, *args, spec: KernelSpec):
  if not checks.has_checks(spec.jaxpr.jaxpr):
    return error, pallas_call_p.bind(*args, spec=spec)
  from dsl import interpret
  closed = jax.make_jaxpr(functools.partial(interpret.run, spec=spec))(*args)
  return jax_checkify.checkify_jaxpr(ctx, closed, enabled_errors, error, *args)


jax_checkify.error_checks[pallas_call_p] = pallas_call_checkify
