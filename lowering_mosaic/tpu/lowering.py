"""KernelSpec -> Mosaic MLIR module.

The module holds the kernel as `func.func @<kernel name>` and one
`@transform_<k>` function per blocked operand (its index map), with the
attributes Mosaic reads:

  func.func @kernel(%grid_0: i32, ..., %prefetch: memref<..., smem>, ...,
                  %operand blocks: memref<block, vmem | smem>
                                   (or the whole array in #tpu.memory_space<any>),
                  %scratch: memref<..., vmem> | memref<N x !tpu.dma_semaphore, semaphore_mem>)
    attributes {dimension_semantics = [#tpu.dimension_semantics<parallel|arbitrary>, ...],
                iteration_bounds = array<i64: grid...>  (a dim whose size is
                    traced: MLIR's dynamic size; the custom call takes the
                    size as a leading operand, `tpu.iteration_bound` reads it),
                scalar_prefetch = P, scratch_operands = S,
                tpu.core_type = #tpu.core_type<tc>,
                window_params = [{transform_indices = @transform_0,
                                  window_bounds = array<i64: block...>}, {} (ANY), ...],
                dsl.* = the kernel's name, source and operand roles}

  func.func @transform_k(%grid_0: i32, ..., %prefetch...) -> (i32, ...)
    returns the block index of operand k per array dim; for a block with
    `Element` dims, the element offset of every dim (`window_kind =
    #tpu.element_window<...>`, dims listed in `dsl.element_dims`).

The kernel jaxpr is lowered equation by equation by the shared
`dsl.core.jaxpr_walk.walk_jaxpr` (host.py) through `lowering_mosaic.tpu.rules.TABLE`,
a table keyed by primitive that the modules of rules/ fill. Every operation carries the user's source line as
its MLIR location, which the interpreter and the race checker report.
"""
from __future__ import annotations

import io
import re

from dsl.core.jax_internals import MOSAIC_MODULE_NAMED, arith, func, ir

from dsl.core.blockspec import Buffered, Element, RevisitMode, squeezed
from dsl.core.dynamic_grid import is_dynamic
from dsl.core.grid_plan import declared_semantics
from dsl.core.errors import BackendError
from lowering_mosaic import dialect
from lowering_mosaic.tpu.host import (LoweringContext, RefVal, i32_const,
                                      lower_jaxpr, to_i32)
from lowering_mosaic.tpu.rules import TABLE
from lowering_mosaic.tpu.constraints import check_tpu_rules, has_trivial_window

# ------------------------------------------------------------ the module

def _dimension_semantics(spec, grid_rank) -> list[str]:
  """The declared semantics (checked at trace time); without them the grid
  axes added by vmap are `parallel` and the others `arbitrary` (as Pallas)."""
  gm = spec.grid_mapping
  sem = declared_semantics(spec.compiler_params, grid_rank, gm.num_hidden_axes)
  if sem is None:
    hidden = gm.num_hidden_axes
    return ["parallel"] * hidden + ["arbitrary"] * (grid_rank - hidden)
  return list(sem)


def operand_memref_type(bm) -> ir.MemRefType:
  """The kernel's memref of an operand: the block (squeezed dims kept as
  1s, as Pallas), or the whole array for pl.ANY."""
  space = dialect.block_space(bm)
  shape = bm.array_aval.shape if space == dialect.ANY else bm.block_sizes
  return dialect.memref_type(shape, bm.array_aval.dtype, space)


def _param_names(spec) -> list[str]:
  gm = spec.grid_mapping
  return [f"grid[{d}]" for d in range(len(gm.grid))] + spec.ref_labels()


def _lower_transform(lctx, spec, k, bm, prefetch_types) -> str:
  gm = spec.grid_mapping
  name = f"transform_{k}"
  n_grid = len(gm.grid)
  rank = len(bm.block_shape)
  ftype = ir.FunctionType.get([dialect.i32()] * n_grid + prefetch_types,
                              [dialect.i32()] * rank)
  fn = func.FuncOp(name, ftype)
  fn.attributes["sym_visibility"] = ir.StringAttr.get("private")
  block = fn.add_entry_block()
  with ir.InsertionPoint(block):
    args = list(block.arguments[:n_grid])
    pf = [RefVal(a, aval, dialect.SMEM, f"scalar prefetch {i}")
          for i, (a, aval) in enumerate(zip(block.arguments[n_grid:],
                                            gm.prefetch_avals))]
    jaxpr = bm.index_map_jaxpr
    outs = [to_i32(o) for o in
            lower_jaxpr(lctx, jaxpr.jaxpr, jaxpr.consts, args + pf)]
    if bm.has_element_dims:
      # an element window reads every index as an element offset: a
      # blocked dim's block index becomes index * block size
      outs = [o if isinstance(b, Element) or b is squeezed or size == 1
              else arith.MulIOp(o, i32_const(size)).result
              for o, b, size in zip(outs, bm.block_shape, bm.block_sizes)]
    func.ReturnOp(outs)
  return name


def build_module(spec, mesh_axes=()) -> ir.Module:
  """Lowers a KernelSpec into a verified Mosaic module (in a new context)."""
  return build_module_and_context(spec, mesh_axes)[0]


def build_module_and_context(spec, mesh_axes=()):
  """(module, LoweringContext): the context says whether the kernel uses
  the barrier semaphore or remote operations."""
  check_tpu_rules(spec)
  ctx = dialect.make_context()
  lctx = LoweringContext(spec.name, spec.where,
                         tuple(spec.grid_mapping.grid), tuple(mesh_axes),
                         rules=TABLE, kernel_jaxpr=spec.jaxpr, spec=spec)
  with ctx, ir.Location.unknown():
    module = _build(spec, lctx)
    try:
      ok = module.operation.verify()
    except ir.MLIRError as e:
      ok, detail = False, str(e)
    else:
      detail = ""
    if not ok:
      # MLIR's message starts "Verification failed:"; the reason follows on
      # the next lines, and the one-line message keeps only the first.
      errors = [l.strip() for l in detail.splitlines()
                if l.strip().startswith("error:")]
      reason = errors[0] if errors else detail
      raise BackendError(spec.name, "the generated Mosaic module does not "
                         f"verify: {reason}\n{detail}\n" + str(module),
                         spec.where)
  return module, lctx


def entry_name(spec) -> str:
  """The kernel function's name: the kernel's, as a symbol (as Pallas)."""
  return re.sub(r"[^\w.-]", "_", spec.name) or "kernel"


def _window_param(lctx, spec, k, bm, prefetch_types) -> ir.Attribute:
  """The entry of `window_params` for operand k (lowers its index map)."""
  if dialect.block_space(bm) == dialect.ANY:
    return ir.DictAttr.get({})
  tname = _lower_transform(lctx, spec, k, bm, prefetch_types)
  entries = {
      "transform_indices": ir.FlatSymbolRefAttr.get(tname),
      "window_bounds": ir.DenseI64ArrayAttr.get(list(bm.block_sizes)),
  }
  if bm.has_element_dims:
    # every dim's index is an element offset (see _lower_transform)
    elem = list(range(len(bm.block_shape)))
    pads = [b.padding if isinstance(b, Element) else (0, 0)
            for b in bm.block_shape]
    lo, hi = [p[0] for p in pads], [p[1] for p in pads]
    entries["window_kind"] = ir.Attribute.parse(
        f"#tpu.element_window<{lo},{hi}>")
    entries["dsl.element_dims"] = ir.DenseI64ArrayAttr.get(elem)
    entries["dsl.element_padding_low"] = ir.DenseI64ArrayAttr.get(
        [pads[d][0] for d in elem])
    entries["dsl.element_padding_high"] = ir.DenseI64ArrayAttr.get(
        [pads[d][1] for d in elem])
  sq = squeezed_dims(bm)
  if sq:
    entries["dsl.squeezed_dims"] = ir.DenseI64ArrayAttr.get(sq)
  entries.update(_pipeline_entries(spec, bm))
  return ir.DictAttr.get(entries)


def _pipeline_entries(spec, bm) -> dict:
  """`pipeline_mode` (and `revisit_mode`) of a window: from the BlockSpec's
  `pl.Buffered`, or one buffer where the block never changes (nothing to
  prefetch), as Pallas emits them."""
  mode = bm.pipeline_mode
  if dialect.block_space(bm) == dialect.VMEM and has_trivial_window(bm):
    mode = Buffered(1)
  if mode is None:
    return {}
  where = f"{bm.origin} pipeline_mode"
  if mode.use_lookahead:
    raise BackendError(spec.name, "Buffered(use_lookahead=True) is not "
                       "supported by the Mosaic backend", spec.where,
                       operand=where)
  n = mode.buffer_count
  if n not in (1, 2):
    raise BackendError(spec.name, f"the Mosaic backend supports 1 or 2 "
                       f"buffers, got Buffered({n})", spec.where, operand=where)
  kind = "synchronous" if n == 1 else "double_buffered"
  out = {"pipeline_mode": ir.Attribute.parse(f"#tpu.pipeline_mode<{kind}>")}
  if mode.revisit is not None:
    if mode.revisit is RevisitMode.ANY and n > 1:
      raise BackendError(spec.name, "RevisitMode.ANY needs Buffered(1) on the "
                         "Mosaic backend", spec.where, operand=where)
    out["revisit_mode"] = ir.Attribute.parse(
        f"#tpu.revisit_mode<{mode.revisit.value}>")
  return out


def squeezed_dims(bm) -> list[int]:
  return [d for d, b in enumerate(bm.block_shape) if b is squeezed]


def _operand_refs(spec, args) -> list[RefVal]:
  gm = spec.grid_mapping
  names = _param_names(spec)[len(gm.grid):]
  avals = gm.ref_avals
  spaces = gm.per_ref(lambda a: dialect.SMEM, dialect.block_space,
                      dialect.block_space,
                      lambda a: dialect.space_name(a.memory_space,
                                                   dialect.VMEM))
  squeezed = lambda bm: (() if dialect.block_space(bm) == dialect.ANY
                         else tuple(squeezed_dims(bm)))
  hidden = gm.per_ref(lambda a: (), squeezed, squeezed, lambda a: ())
  return [RefVal(a, aval, space, nm, hid) for a, aval, space, nm, hid
          in zip(args, avals, spaces, names, hidden)]


def _build(spec, lctx) -> ir.Module:
  gm = spec.grid_mapping
  module = ir.Module.create()
  n_grid = len(gm.grid)
  prefetch_types = [dialect.ref_memref_type(a, dialect.SMEM)
                    for a in gm.prefetch_avals]
  operand_types = [operand_memref_type(bm) for bm in gm.block_mappings]
  scratch_types = [dialect.ref_memref_type(a, dialect.VMEM)
                   for a in gm.scratch_avals]
  with ir.InsertionPoint(module.body):
    main = func.FuncOp(entry_name(spec), ir.FunctionType.get(
        [dialect.i32()] * n_grid + prefetch_types + operand_types
        + scratch_types, []))
    # A grid-free kernel has no windows: every operand is whole (as Pallas).
    window_params = [_window_param(lctx, spec, k, bm, prefetch_types)
                     for k, bm in enumerate(gm.block_mappings)] if n_grid else []
    block = main.add_entry_block()
    _name_ref_arguments(spec, block.arguments[n_grid:])
    with ir.InsertionPoint(block):
      args = list(block.arguments)
      refs = _operand_refs(spec, args[n_grid:])
      jaxpr = spec.jaxpr
      lower_jaxpr(lctx, jaxpr.jaxpr, jaxpr.consts, args[:n_grid] + refs)
      func.ReturnOp([])
  _entry_attributes(main, spec, lctx, window_params)
  # No `stable_mosaic.version`: serializing the module for a tpu_custom_call
  # writes the version the installed jaxlib targets (as for Pallas's).
  if MOSAIC_MODULE_NAMED:
    module.operation.attributes["sym_name"] = ir.StringAttr.get(
        entry_name(spec))
  return module


def _name_ref_arguments(spec, ref_args):
  """Each ref argument's location names the kernel parameter it is (`x_ref`,
  `bufs[1]`), as Pallas names them."""
  for arg, name in zip(ref_args, spec.ref_names):
    if name is None:
      break
    arg.set_location(ir.Location.name(name, childLoc=arg.location))


def _i64(v: int) -> ir.Attribute:
  return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), v)


def _entry_attributes(main, spec, lctx, window_params):
  gm = spec.grid_mapping
  n_grid = len(gm.grid)
  main.attributes["dimension_semantics"] = ir.ArrayAttr.get([
      ir.Attribute.parse(f"#tpu.dimension_semantics<{s}>")
      for s in _dimension_semantics(spec, n_grid)])
  if n_grid:
    main.attributes["iteration_bounds"] = ir.DenseI64ArrayAttr.get(
        [dialect.DYNAMIC_SIZE if is_dynamic(g) else g for g in gm.grid])
    main.attributes["window_params"] = ir.ArrayAttr.get(window_params)
  main.attributes["scalar_prefetch"] = _i64(gm.num_scalar_prefetch)
  main.attributes["scratch_operands"] = _i64(len(gm.scratch_avals))
  main.attributes["tpu.core_type"] = ir.Attribute.parse("#tpu.core_type<tc>")
  # Our own annotations (discardable `dsl.` attributes): which operands are
  # inputs and outputs, and where the kernel comes from.
  main.attributes["dsl.kernel_name"] = ir.StringAttr.get(spec.name)
  main.attributes["dsl.kernel_src"] = ir.StringAttr.get(spec.kernel_src)
  main.attributes["dsl.num_inputs"] = _i64(gm.num_inputs)
  main.attributes["dsl.num_outputs"] = _i64(gm.num_outputs)
  main.attributes["dsl.operand_names"] = ir.ArrayAttr.get(
      [ir.StringAttr.get(n) for n in _param_names(spec)])
  # the spec each blocked operand comes from, for errors about its blocks
  main.attributes["dsl.operand_origins"] = ir.ArrayAttr.get(
      [ir.StringAttr.get(bm.origin) for bm in gm.block_mappings])
  if lctx.mesh_axes:
    main.attributes["dsl.mesh_axes"] = ir.ArrayAttr.get(
        [ir.StringAttr.get(str(n)) for n, _ in lctx.mesh_axes])
    main.attributes["dsl.mesh_shape"] = ir.DenseI64ArrayAttr.get(
        [s for _, s in lctx.mesh_axes])
  if spec.input_output_aliases:
    main.attributes["dsl.input_output_aliases"] = ir.DenseI64ArrayAttr.get(
        [x for pair in spec.input_output_aliases for x in pair])


def module_text(module: ir.Module, debug_info: bool = False) -> str:
  return module.operation.get_asm(enable_debug_info=debug_info)


def strip_annotations(module: ir.Module) -> ir.Module:
  """A copy of `module` without our discardable `dsl.*` attributes (what
  goes to a TPU: only attributes Mosaic knows). The copy goes through
  bytecode, which keeps every location (text drops those of the block
  arguments a custom form prints bare, such as a loop's induction
  variable)."""
  with module.context, ir.Location.unknown():
    buffer = io.BytesIO()
    module.operation.write_bytecode(buffer)
    clone = ir.Module.parse(buffer.getvalue())
    for op in clone.body.operations:
      op = op.operation
      if op.name != "func.func":
        continue
      names = [a if isinstance(a, str) else a.name for a in op.attributes]
      for n in names:
        if n.startswith("dsl."):
          del op.attributes[n]
      if "window_params" in op.attributes:
        cleaned = []
        for w in ir.ArrayAttr(op.attributes["window_params"]):
          d = ir.DictAttr(w)
          keep = {}
          for k in ("transform_indices", "window_bounds", "window_kind",
                    "pipeline_mode", "revisit_mode"):
            if k in d:
              keep[k] = d[k]
          cleaned.append(ir.DictAttr.get(keep))
        op.attributes["window_params"] = ir.ArrayAttr.get(cleaned)
  return clone
