"""`@kernel`: a kernel body becomes a JAX-callable function."""
from __future__ import annotations

import functools
from typing import Any

from dsl.errors import api_boundary, kernel_name
from dsl.pallas_call import pallas_call


def _resolve(value, args):
  """Values given as callables of the inputs are called with them."""
  if callable(value) and not hasattr(value, "shape") and not hasattr(
      value, "block_shape"):
    return value(*args)
  return value


def kernel(body=None, *, out_shape: Any, grid: Any = (), in_specs: Any = None,
           out_specs: Any = None, scratch_shapes: Any = (),
           input_output_aliases=None, compiler_params=None, backend=None,
           interpret: bool = False, name: str | None = None,
           debug: bool = False, grid_spec: Any = None, cost_estimate=None):
  """Decorator: `body(*in_refs, *out_refs, *scratch_refs)` becomes a function
  of arrays that works inside `jax.jit`, `grad`, `vmap` like any jnp function.

  `out_shape`, `grid`, `in_specs`, `out_specs`, `scratch_shapes` and
  `grid_spec` may be callables of the inputs, so one kernel serves every size.
  """
  def decorate(fn):
    @functools.wraps(fn)
    @api_boundary
    def call(*args):
      __tracebackhide__ = True
      return pallas_call(
          fn, _resolve(out_shape, args), grid=_resolve(grid, args),
          in_specs=_resolve(in_specs, args), out_specs=_resolve(out_specs, args),
          scratch_shapes=_resolve(scratch_shapes, args),
          grid_spec=_resolve(grid_spec, args),
          input_output_aliases=input_output_aliases,
          compiler_params=compiler_params, backend=backend,
          interpret=interpret, name=name or kernel_name(fn), debug=debug,
          cost_estimate=cost_estimate)(*args)
    call.kernel_body = fn
    return call

  if body is not None:
    return decorate(body)
  return decorate
