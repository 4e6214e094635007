"""checkify of a pallas_call: checks inside the kernel become an error value.

The kernel derived by `runtime_checks.checked_spec` writes the error state of
its checks for each grid point; the first failing grid point's error joins
the caller's. Checks are functionalized inside the kernel, so a check under
`pl.when` or in a loop counts only where it runs, on a vectorized grid too.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import tree_util
from dsl.core.jax_internals import checkify as jax_checkify

from dsl.core.pallas_call import KernelSpec, pallas_call_p
from dsl.transforms import runtime_checks


def _first_failing_point(err_tree, leaves, n_grid: int):
  """The error leaves of the first grid point (in grid order) that failed."""
  if n_grid == 0:
    return list(leaves)
  batched = tree_util.tree_unflatten(err_tree, list(leaves))
  preds = [jnp.reshape(p, (-1,)) for p in batched._pred.values()]
  if not preds:
    return [x.reshape((-1,) + x.shape[n_grid:])[0] for x in leaves]
  point = jnp.argmax(functools.reduce(jnp.logical_or, preds))
  return [x.reshape((-1,) + x.shape[n_grid:])[point] for x in leaves]


def pallas_call_checkify(ctx, error, enabled_errors, *args, spec: KernelSpec):
  if not runtime_checks.needs_checks(spec.jaxpr.jaxpr, include_debug=True):
    return error, pallas_call_p.bind(*args, spec=spec)
  checked, err_tree = runtime_checks.checked_spec(
      spec, keep_debug=True, enabled_errors=frozenset(enabled_errors))
  outs = pallas_call_p.bind(*args, spec=checked.replace(backend="interpret"))
  outs, errors = runtime_checks.checked_results(spec, outs)
  leaves = _first_failing_point(err_tree, errors,
                                len(spec.grid_mapping.grid))
  error, _ = jax_checkify.check_discharge_rule(
      ctx, error, enabled_errors, *leaves, err_tree=err_tree, debug=False)
  return error, list(outs)


jax_checkify.error_checks[pallas_call_p] = pallas_call_checkify
