"""`@kernel`: a kernel body becomes a JAX-callable function.

Two forms, as in Pallas: the grid form (`out_shape`, `grid`, `in_specs`,
`out_specs`; dsl's own, whose arguments may be callables of the inputs) and
JAX 0.11's mesh form (`pl.kernel(body, out_type, mesh=...)`): the body gets
whole-array refs in `ANY` memory for every input and output plus its scratch,
and runs once per core of the mesh (see dsl.tpu.mesh).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from jax import tree_util

from dsl.core.errors import KernelError, api_boundary, kernel_name, user_frame
from dsl.core.pallas_call import pallas_call
from dsl import tpu
from dsl.core.blockspec import BlockSpec
from dsl.tpu.mesh import check_mesh

_UNSET = object()


def _resolve(value, args):
  """Values given as callables of the inputs are called with them."""
  if callable(value) and not hasattr(value, "shape") and not hasattr(
      value, "block_shape"):
    return value(*args)
  return value


def kernel(body=None, out_type: Any = _UNSET, *, out_shape: Any = _UNSET,
           mesh: Any = None, scratch_types: Any = None, grid: Any = (),
           in_specs: Any = None, out_specs: Any = None,
           scratch_shapes: Any = (), input_output_aliases=None,
           compiler_params=None, backend=None, interpret: bool = False,
           name: str | None = None, debug: bool = False,
           grid_spec: Any = None, cost_estimate=None, metadata=None):
  """Decorator: `body(*in_refs, *out_refs, *scratch_refs)` becomes a function
  of arrays that works inside `jax.jit`, `grad`, `vmap` like any jnp function.

  Grid form: `out_shape`, `grid`, `in_specs`, `out_specs`, `scratch_shapes`
  and `grid_spec` may be callables of the inputs, so one kernel serves every
  size. Mesh form (`mesh=` a `dsl.tpu.TensorCoreMesh`): `out_type` (or
  `out_shape`) and `scratch_types`; the refs are whole arrays in `ANY`
  memory and `lax.axis_index(mesh.axis_name)` is the core's index.
  `metadata` is accepted as in Pallas and not used.
  """
  del metadata
  where = user_frame()
  if out_type is not _UNSET and out_shape is not _UNSET:
    raise KernelError(kernel_name(body) if body else "<kernel>",
                      "give out_type or out_shape, not both", where,
                      operand="out_type")
  out = out_shape if out_type is _UNSET else out_type
  if mesh is not None:
    if isinstance(body, (list, tuple)) or isinstance(mesh, (list, tuple)):
      raise KernelError("<kernel>", "pl.kernel over a list of bodies and "
                        "meshes (MPMD) is not supported; call one kernel per "
                        "mesh", where, operand="mesh")
    extra = [k for k, given in (
        ("grid", grid != ()), ("in_specs", in_specs is not None),
        ("out_specs", out_specs is not None),
        ("grid_spec", grid_spec is not None),
        ("scratch_shapes", scratch_shapes != ())) if given]
    if extra:
      raise KernelError(kernel_name(body) if body else "<kernel>",
                        f"a mesh kernel takes no {extra[0]}: its refs are "
                        "whole arrays (use scratch_types for scratch)", where,
                        operand=extra[0])
    make = functools.partial(
        _mesh_kernel, mesh=mesh, out_shape=() if out is _UNSET else out,
        scratch=scratch_types or (), input_output_aliases=input_output_aliases,
        compiler_params=compiler_params, backend=backend,
        interpret=interpret, name=name, debug=debug,
        cost_estimate=cost_estimate, where=where)
    return make(body) if body is not None else make
  if out is _UNSET:
    raise KernelError(kernel_name(body) if body else "<kernel>",
                      "kernel needs out_shape (or mesh= for the mesh form)",
                      where, operand="out_shape")
  if scratch_types is not None:
    scratch_shapes = scratch_types

  def decorate(fn):
    @functools.wraps(fn)
    @api_boundary
    def call(*args):
      __tracebackhide__ = True
      return pallas_call(
          fn, _resolve(out, args), grid=_resolve(grid, args),
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


def _is_shape(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def _mesh_kernel(fn, *, mesh, out_shape, scratch, input_output_aliases,
                 compiler_params, backend, interpret, name, debug,
                 cost_estimate, where):
  """The mesh form: a `pallas_call` over the mesh's named parallel grid with
  every operand in `ANY` memory."""
  kname = name or kernel_name(fn)
  mesh = check_mesh(kname, mesh, where)
  whole = BlockSpec(memory_space=tpu.ANY)
  params = compiler_params
  if params is None:
    params = tpu.CompilerParams(dimension_semantics=mesh.dimension_semantics)
  elif (isinstance(params, tpu.CompilerParams)
        and params.dimension_semantics is None):
    params = dataclasses.replace(
        params, dimension_semantics=mesh.dimension_semantics)

  @functools.wraps(fn)
  @api_boundary
  def call(*args):
    __tracebackhide__ = True
    outs = _resolve(out_shape, args)
    if isinstance(outs, list):
      outs = tuple(outs)
    in_specs = tuple(tree_util.tree_map(lambda _: whole, a) for a in args)
    out_specs = tree_util.tree_map(lambda _: whole, outs, is_leaf=_is_shape)
    return pallas_call(
        fn, outs, grid=mesh.grid, in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=scratch, input_output_aliases=input_output_aliases,
        compiler_params=params, backend=backend, interpret=interpret,
        name=kname, debug=debug, cost_estimate=cost_estimate)(*args)
  call.kernel_body = fn
  call.mesh = mesh
  return call
