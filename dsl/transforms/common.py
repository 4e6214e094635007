"""Shared pieces of the transformation rules: rebuilding specs of derived
kernels from BlockMappings, and a kernel's per-grid-point pure function."""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from dsl.core.jax_internals import ClosedJaxpr, core

from dsl.core import grid_plan
from dsl.core.blockspec import BlockMapping, BlockSpec
from dsl.core.normalize import rewrite_closed, SCANS_TO_DIFFERENTIATE
from dsl.core.operand_layout import flat_ref_operands, ref_operands
from dsl.core.ref_ops import masked_load_p
from dsl.transforms.discharge import discharged_kernel
from dsl.transforms.prefetch_reads import pure_reads
from dsl.transforms.reversible_loops import reversible_loops
from dsl.core.pallas_call import KernelSpec, build_spec, pallas_call_p


def block_spec_of(bm: BlockMapping, n_grid: int,
                  ids_fn: Callable[[Sequence], Sequence] = lambda ids: ids,
                  lead: Callable[[Sequence], Sequence] | None = None,
                  n_lead: int = 1) -> BlockSpec:
  """A BlockSpec equal to `bm`, for a grid of rank `n_grid`.

  `ids_fn` maps the new grid's ids to the ids `bm`'s index map expects;
  `lead(ids)` gives block indices of `n_lead` extra leading (squeezed) dims.
  """
  jaxpr = bm.index_map_jaxpr

  def index_map(*args):
    ids, pf = args[:n_grid], args[n_grid:]
    out = list(core.jaxpr_as_fun(jaxpr)(*ids_fn(ids), *pf))
    if lead is not None:
      out = list(lead(ids)) + out
    return tuple(out)

  return bm.to_spec(index_map, lead=n_lead if lead is not None else 0)


def sds(aval, batch: tuple[int, ...] = ()) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(batch + tuple(aval.shape), aval.dtype)


# The kernels of reverse mode (recording, transposed, finalizing), whose
# work is not their forward kernel's: `KernelSpec.launch_inherited`.
REVERSE_MODE_SUFFIXES = frozenset({"record", "transpose", "finalize"})


def derived_spec(spec: KernelSpec, body, args, out_shapes, *, grid, in_specs,
                 out_specs, scratch, aliases=(), suffix: str,
                 meta: tuple = (), compiler_params=None) -> KernelSpec:
  """Builds the KernelSpec of a kernel derived from `spec` by a transform,
  named `<kernel>_<suffix>` (the kernel's own name for an empty suffix),
  with `spec`'s compiler params unless given; a kernel of reverse mode
  leaves its launch parameters to the backend (`launch_inherited`)."""
  gm = spec.grid_mapping
  new_spec, _ = build_spec(
      body, tuple(args), list(out_shapes),
      name=f"{spec.name}_{suffix}" if suffix else spec.name,
      grid=grid, in_specs=list(in_specs), out_specs=list(out_specs),
      scratch_shapes=list(scratch), num_scalar_prefetch=gm.num_scalar_prefetch,
      input_output_aliases=dict(aliases), backend=spec.backend,
      debug=False, compiler_params=(spec.compiler_params
                                    if compiler_params is None
                                    else compiler_params),
      where=spec.where, meta=meta, metadata=spec.metadata)
  return new_spec.replace(kernel_src=spec.kernel_src,
                         launch_inherited=suffix in REVERSE_MODE_SUFFIXES)


def with_semantics(spec: KernelSpec, semantics):
  """`spec`'s compiler params with `dimension_semantics` for a derived
  grid (when the params have that field and set it)."""
  cp = spec.compiler_params
  if getattr(cp, "dimension_semantics", None) is None:
    return cp
  return dataclasses.replace(cp, dimension_semantics=tuple(semantics))


def eval_ref_jaxpr(jaxpr: ClosedJaxpr, *args):
  return core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *args)


def written_prefetch(spec: KernelSpec) -> tuple[bool, ...]:
  """Which scalar-prefetch refs the kernel writes (see `grid_plan`)."""
  gm = spec.grid_mapping
  return grid_plan.written_prefetch(spec.jaxpr, len(gm.grid),
                                    gm.num_scalar_prefetch)


def _zero_masked_lanes(*args, out_aval, **params):
  """A masked load whose masked-off lanes read 0 rather than poison."""
  ops = ref_operands(masked_load_p, args, params)
  if ops.mask is not None and ops.other is None:
    ops = dataclasses.replace(ops, other=jnp.zeros(out_aval.shape,
                                                   out_aval.dtype))
  args, layout = flat_ref_operands(masked_load_p, ops)
  return masked_load_p.bind(*args, **{**params, **layout}, out_aval=out_aval)


def discharged_point(spec: KernelSpec, transposable: bool = False,
                     rules=None):
  """(jaxpr, kept): the kernel at one grid point as a pure jaxpr
  `(ids, pf, ins, outs, scratch) -> (pf', outs', scratch')` (see
  `point_function`), and which scalar-prefetch refs stay refs (are not
  among its results); `rules`: more equations rewritten (primitive ->
  fn, as `rewrite_closed` takes them) before it is discharged."""
  gm = spec.grid_mapping
  kept = (tuple(not w for w in written_prefetch(spec)) if transposable
          else ())
  # What is differentiated: nonlinear cumulative ops as lax ops a TPU has.
  jaxpr = rewrite_closed(spec.jaxpr, {**SCANS_TO_DIFFERENTIATE,
                                     **(rules or {})})
  if transposable:
    jaxpr = rewrite_closed(jaxpr, {masked_load_p: _zero_masked_lanes})
  dj = discharged_kernel(jaxpr, len(gm.grid), kept)
  if any(kept):
    dj = pure_reads(dj)     # no ref effect in a `pl.when` to linearize
  if transposable:
    dj = reversible_loops(dj)
  return dj, kept


def point_function(spec: KernelSpec, transposable: bool = False,
                   rules=None):
  """The kernel at one grid point as a pure function.

  `F(ids, pf, ins, outs, scratch) -> (outs', scratch')`: given the blocks it
  sees on entry, the output and scratch blocks it leaves. Every `pf` is a
  value, except with `transposable` (the function the transposed kernel
  linearizes and transposes): there the scalar-prefetch refs that the kernel
  only reads are passed as the refs themselves (read a scalar at a time, as
  SMEM must be) and those it writes as the values they hold on entry (state,
  like scratch), its loops with a run-time trip count are reversible, and
  the masked-off lanes of its masked loads without `other` read 0 (memory
  there is unspecified: poison would reach the cotangents as `0 * NaN`).
  """
  gm = spec.grid_mapping
  dj, kept = discharged_point(spec, transposable, rules)

  def F(ids, pf, ins, outs, scratch):
    finals = iter(core.eval_jaxpr(dj.jaxpr, dj.consts, *ids, *pf, *ins,
                                  *outs, *scratch))
    pf_finals = [None if k else next(finals) for k in kept]
    split = gm.split(pf_finals + list(finals))
    return list(split.outputs), list(split.scratch)
  return F


def bind(spec: KernelSpec, *args):
  return pallas_call_p.bind(*args, spec=spec)
