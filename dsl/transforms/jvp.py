"""Forward mode: one kernel computes primals and tangents together.

The kernel jaxpr is differentiated by JAX's own `jvp_jaxpr`, which gives
every float ref a tangent ref beside it. The derived kernel takes the tangent
blocks with the same BlockSpecs as their primals.
"""
from __future__ import annotations

from dsl.core.jax_internals import ad, core

from dsl.core.errors import KernelError
from dsl.core.normalize import rewrite_closed, SCANS_TO_DIFFERENTIATE
from dsl.core.pallas_call import KernelSpec, pallas_call_p
from dsl.core.tracing import program_id
from dsl.core.dtypes import has_tangent
from dsl.core.kernel_layout import KernelLayout
from dsl.transforms.common import (block_spec_of, derived_spec, eval_ref_jaxpr,
                                   sds)


def tangent_pattern(spec: KernelSpec, in_nz):
  """Which outputs and scratch buffers carry tangents."""
  gm = spec.grid_mapping
  out_nz = [has_tangent(bm.array_aval.dtype) for bm in gm.out_mappings]
  scr_nz = [has_tangent(a.inner_aval.dtype) for a in gm.scratch_avals]
  return out_nz, scr_nz


def input_tangent_mask(spec: KernelSpec, nonzeros):
  """Which inputs have a tangent: where the derivation of forward and
  reverse mode starts (an explicit GPU kernel with one is refused)."""
  gm = spec.grid_mapping
  mask = [bool(nz) and has_tangent(bm.array_aval.dtype)
          for nz, bm in zip(gm.split_operands(nonzeros).inputs,
                            gm.in_mappings)]
  if any(mask):
    refuse_explicit_gpu_kernel(spec)
  return mask


def _jvp_jaxpr(spec: KernelSpec, nonzeros):
  jaxpr = rewrite_closed(spec.jaxpr, SCANS_TO_DIFFERENTIATE)
  try:
    return ad.jvp_jaxpr(jaxpr, nonzeros, instantiate=False)[0]
  except KernelError as e:
    if e.kernel != "<kernel>":
      raise
    raise KernelError(spec.name, e.short, e.where or spec.where,
                      e.operand) from e


def jvp_spec(spec: KernelSpec, in_nz, meta=(), saved=()) -> KernelSpec:
  """The kernel that computes primal and tangent outputs together.

  Operands: (*prefetch, *inputs, *saved, *tangents of in_nz inputs), where
  `saved` (BlockMappings of the kernel's outputs) are arrays it does not
  read: residuals its transpose reads (`residuals.saved_outputs`);
  outputs: (*outputs, *tangents of float outputs).
  """
  gm = spec.grid_mapping
  n_grid = len(gm.grid)
  out_nz, scr_nz = tangent_pattern(spec, in_nz)
  nonzeros = ([False] * (n_grid + gm.num_scalar_prefetch) + list(in_nz)
              + out_nz + scr_nz)
  jj = _jvp_jaxpr(spec, nonzeros)
  layout = (gm.ref_layout().insert("inputs", saved=len(saved),
                                   tangent_inputs=sum(in_nz))
            .insert("outputs", tangent_outputs=sum(out_nz))
            .insert("scratch", tangent_scratch=sum(scr_nz)))

  def body(*refs):
    ids = [program_id(d) for d in range(n_grid)]
    _, pf, ins, _, tins, outs, touts, scr, tscr = layout.split(refs)
    eval_ref_jaxpr(jj, *ids, *pf, *ins, *outs, *scr, *tins, *touts, *tscr)

  in_maps = list(gm.in_mappings) + list(saved)
  tin_maps = [bm for bm, nz in zip(gm.in_mappings, in_nz) if nz]
  out_maps = list(gm.out_mappings)
  tout_maps = [bm for bm, nz in zip(out_maps, out_nz) if nz]
  args = ([sds(a.inner_aval) for a in gm.prefetch_avals]
          + [sds(bm.array_aval) for bm in in_maps + tin_maps])
  out_shapes = [sds(bm.array_aval) for bm in out_maps + tout_maps]
  spec_of = lambda bm: block_spec_of(bm, n_grid)
  scratch = list(gm.scratch_avals) + [
      a for a, nz in zip(gm.scratch_avals, scr_nz) if nz]
  return derived_spec(spec, body, args, out_shapes, grid=gm.grid,
                      in_specs=[spec_of(bm) for bm in in_maps + tin_maps],
                      out_specs=[spec_of(bm) for bm in out_maps + tout_maps],
                      scratch=scratch, aliases=_tangent_aliases(
                          spec, in_nz, out_nz, len(saved)),
                      suffix="jvp", meta=meta)


def _tangent_aliases(spec: KernelSpec, in_nz, out_nz,
                     n_saved: int = 0) -> dict[int, int]:
  """The kernel's aliases, and the tangent of an aliased input aliased to
  the tangent of its output where both have one."""
  gm = spec.grid_mapping
  operands = gm.call_layout().only("prefetch", "inputs").insert(
      "inputs", saved=n_saved, tangents=sum(in_nz))
  outputs = KernelLayout.of(outputs=gm.num_outputs, tangents=sum(out_nz))
  tin_pos = dict(zip((k for k, nz in enumerate(in_nz) if nz),
                     operands.positions("tangents")))
  tout_pos = dict(zip((o for o, nz in enumerate(out_nz) if nz),
                      outputs.positions("tangents")))
  aliases = dict(spec.input_output_aliases)
  for i, o in spec.input_output_aliases:
    group, k = gm.aliased_operand(i)
    if group == "inputs" and k in tin_pos and o in tout_pos:
      aliases[tin_pos[k]] = tout_pos[o]
  return aliases


def _zero_tangent(aval):
  return ad.Zero(core.ShapedArray(aval.shape, aval.dtype).to_tangent_aval())


def split_outputs(spec: KernelSpec, outs, out_nz):
  gm = spec.grid_mapping
  primal, tangents = KernelLayout.of(outputs=gm.num_outputs,
                                     tangents=None).split(outs)
  primal, tangents = list(primal), iter(tangents)
  touts = [next(tangents) if nz else _zero_tangent(bm.array_aval)
           for bm, nz in zip(gm.out_mappings, out_nz)]
  return primal, touts


def refuse_explicit_gpu_kernel(spec: KernelSpec) -> None:
  """A `plgpu.kernel` (Pallas's explicit Mosaic GPU API; its compiler
  params carry the warpgroup mesh) orders its work between warpgroups with
  barriers, TMA copies and WGMMAs, which no derivative rule here
  transforms: differentiating it is an error naming the kernel."""
  if getattr(spec.compiler_params, "mesh", None) is None:
    return
  raise KernelError(
      spec.name, "jax.jvp and jax.grad cannot differentiate a plgpu.kernel: "
      "its TMA copies, barriers and WGMMAs order work between warpgroups, "
      "which dsl's derivation does not transform (Pallas cannot "
      "differentiate it either). Give it a hand-written backward pass with "
      "jax.custom_vjp, as Pallas's attention_mgpu does", spec.where,
      operand="plgpu.kernel")


def pallas_call_jvp(primals, tangents, *, spec: KernelSpec):
  gm = spec.grid_mapping
  in_nz = input_tangent_mask(spec, [type(t) is not ad.Zero for t in tangents])
  out_nz, _ = tangent_pattern(spec, in_nz)
  if not any(in_nz):
    outs = pallas_call_p.bind(*primals, spec=spec)
    return outs, [_zero_tangent(bm.array_aval) for bm in gm.out_mappings]
  new = jvp_spec(spec, in_nz)
  tins = [ad.instantiate_zeros(t) for t, nz in
          zip(gm.split_operands(tangents).inputs, in_nz) if nz]
  outs = pallas_call_p.bind(*primals, *tins, spec=new)
  return split_outputs(spec, outs, out_nz)


ad.primitive_jvps[pallas_call_p] = pallas_call_jvp
