"""KernelSpec -> Mosaic MLIR module.

The module holds the kernel as `func.func @<kernel name>` and one
`@transform_<k>` function per blocked operand (its index map), with the
attributes Mosaic reads:

  func.func @kernel(%grid_0: i32, ..., %prefetch: memref<..., smem>, ...,
                  %operand blocks: memref<block, vmem | smem>
                                   (or the whole array in #tpu.memory_space<any>),
                  %scratch: memref<..., vmem> | memref<N x !tpu.dma_semaphore, semaphore_mem>)
    attributes {dimension_semantics = [#tpu.dimension_semantics<parallel|arbitrary>, ...],
                iteration_bounds = array<i64: grid...>,
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
`dsl.jaxpr_walk.walk_jaxpr` through `TABLE`, a table keyed by primitive that
the modules of rules/ fill. Every operation carries the user's source line as
its MLIR location, which the interpreter and the race checker report.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core
from jax._src.lib import tpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, func

from dsl.blockspec import Buffered, Element, RevisitMode, squeezed
from dsl import config
from dsl.errors import BackendError, marked_jaxpr, source_info_frame
from dsl.interpret.plan import declared_semantics
from dsl.jaxpr_walk import LoweringHost, RuleTable, walk_jaxpr
from lowering_mosaic import dialect

MOSAIC_VERSION = 14

# The rule table, keyed by primitive; the modules of `lowering_mosaic.rules`
# fill it when the package is imported.
TABLE = RuleTable("the Mosaic (TPU) lowering")


@dataclasses.dataclass(frozen=True)
class ZeroSize:
  """A value of a zero-size array. MLIR vectors cannot have a zero dim, so
  it has no MLIR value; only the primitives of ZERO_SIZE_PRIMITIVES (the
  slices and concatenation that `jnp.roll` by 0 or by the axis length
  makes) take or make one, and any other primitive on one is an error."""
  aval: Any


ZERO_SIZE_PRIMITIVES = frozenset({lax.slice_p, lax.split_p,
                                  lax.concatenate_p})


def has_zero_size(aval) -> bool:
  return (hasattr(aval, "shape") and not hasattr(aval, "inner_aval")
          and 0 in tuple(aval.shape))


@dataclasses.dataclass
class RefVal:
  """A ref in the kernel: its memref value and what it is."""
  value: ir.Value
  aval: Any                 # AbstractRef
  space: str                # dialect.VMEM / SMEM / ANY / SEMAPHORE_MEM
  name: str = ""            # "x_ref (in_specs[0])"-style, for messages
  # memref dims the kernel does not see (a BlockSpec's squeezed dims): the
  # memref keeps them as 1s, and every access indexes them with 0
  hidden: tuple = ()

  @property
  def shape(self):
    """The shape the kernel sees."""
    return tuple(self.aval.inner_aval.shape)

  @property
  def memref_shape(self):
    shape = list(self.shape)
    for d in self.hidden:
      shape.insert(d, 1)
    return tuple(shape)

  @property
  def dtype(self):
    return self.aval.inner_aval.dtype

  @property
  def is_semaphore(self):
    return self.space == dialect.SEMAPHORE_MEM


@dataclasses.dataclass
class LoweringContext:
  """One kernel being lowered."""
  kernel: str
  where: str                    # the pallas_call site
  grid: tuple[int, ...]
  mesh_axes: tuple = ()         # ((name, size), ...) when inside shard_map
  uses_barrier: bool = False
  uses_remote: bool = False
  named_axes: set = dataclasses.field(default_factory=set)  # axis_index'd
  current_line: str | None = None
  kernel_jaxpr: Any = None      # for jax_pallas_verbose_errors

  def error(self, message: str, primitive: str | None = None,
            line: str | None = None, eqn=None) -> BackendError:
    """A BackendError naming the kernel and the user's line; with
    jax_pallas_verbose_errors on, it shows the kernel jaxpr with `eqn`
    (the failing equation) marked."""
    what = f"primitive '{primitive}': " if primitive else ""
    detail = None
    if eqn is not None and self.kernel_jaxpr is not None and \
        config.verbose_errors():
      detail = ("The kernel jaxpr, the failing equation marked:\n"
                + marked_jaxpr(self.kernel_jaxpr, eqn))
    return BackendError(self.kernel, f"{what}{message}",
                        line or self.current_line or self.where,
                        detail=detail)


@dataclasses.dataclass
class RuleContext:
  """What a lowering rule sees of its equation."""
  lctx: LoweringContext
  eqn: Any
  avals_in: list
  avals_out: list
  outs_used: list = dataclasses.field(default_factory=list)

  @property
  def primitive(self) -> str:
    return self.eqn.primitive.name

  def error(self, message: str) -> BackendError:
    return self.lctx.error(message, self.primitive)

  def lower_sub(self, jaxpr: core.Jaxpr, consts, args):
    return lower_jaxpr(self.lctx, jaxpr, consts, args)


# ------------------------------------------------------------ constants

def scalar_attr(value, dtype) -> ir.Attribute:
  dtype = jnp.dtype(dtype)
  t = dialect.element_type(dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    return ir.FloatAttr.get(t, float(value))
  if dtype == jnp.bool_:
    return ir.IntegerAttr.get(t, int(bool(value)))
  v = int(value)
  bits = dtype.itemsize * 8
  if jnp.issubdtype(dtype, jnp.unsignedinteger) and v >= 1 << (bits - 1):
    v -= 1 << bits           # signless: store the bit pattern
  return ir.IntegerAttr.get(t, v)


def constant(value, shape, dtype) -> ir.Value:
  """An arith.constant (a splat or dense vector for shape != ())."""
  shape = tuple(shape)
  dtype = jnp.dtype(dtype)
  arr = np.asarray(value)
  if shape == ():
    return arith.ConstantOp(dialect.element_type(dtype),
                            scalar_attr(arr.reshape(()).item(), dtype)).result
  vt = dialect.value_type(shape, dtype)
  if arr.size == 1 or np.all(arr == arr.reshape(-1)[0]):
    attr = ir.DenseElementsAttr.get_splat(
        vt, scalar_attr(arr.reshape(-1)[0].item(), dtype))
    return arith.ConstantOp(vt, attr).result
  arr = np.broadcast_to(arr, shape)
  if dtype in (jnp.float32, jnp.int32, jnp.int16, jnp.int8):
    attr = ir.DenseElementsAttr.get(np.ascontiguousarray(arr.astype(dtype)),
                                    type=vt)
    return arith.ConstantOp(vt, attr).result
  if dtype == jnp.bool_:
    ints = constant(arr.astype(np.int32), shape, jnp.int32)
    zero = constant(0, shape, jnp.int32)
    return arith.CmpIOp(arith.CmpIPredicate.ne, ints, zero).result
  if jnp.issubdtype(dtype, jnp.floating):
    f = constant(arr.astype(np.float32), shape, jnp.float32)
    return arith.TruncFOp(vt, f).result
  raise NotImplementedError(f"constant of dtype {dtype}")


def i32_const(v: int) -> ir.Value:
  return constant(v, (), jnp.int32)


def index_const(v: int) -> ir.Value:
  return arith.ConstantOp(dialect.index_type(),
                          ir.IntegerAttr.get(dialect.index_type(), int(v))).result


def to_index(v) -> ir.Value:
  """An `index` value from a static int or an integer MLIR scalar."""
  if isinstance(v, (int, np.integer)):
    return index_const(int(v))
  if isinstance(v.type, ir.IndexType):
    return v
  return arith.IndexCastOp(dialect.index_type(), v).result


def to_i32(v) -> ir.Value:
  if isinstance(v, (int, np.integer)):
    return i32_const(int(v))
  t = v.type
  if isinstance(t, ir.IndexType):
    return arith.IndexCastOp(dialect.i32(), v).result
  w = ir.IntegerType(t).width
  if w == 32:
    return v
  if w < 32:
    return arith.ExtSIOp(dialect.i32(), v).result
  return arith.TruncIOp(dialect.i32(), v).result


# ------------------------------------------------------------ locations

def _location(eqn, lctx: LoweringContext, outer_line) -> ir.Location:
  # equations of inner jaxprs (a jitted jnp function) have no user frame:
  # they take the line of the equation that holds them
  line = source_info_frame(eqn.source_info) or outer_line
  lctx.current_line = line
  name = eqn.primitive.name
  if line is None:
    return ir.Location.name(name)
  path, _, lineno = line.rpartition(":")
  return ir.Location.name(name, childLoc=ir.Location.file(path, int(lineno),
                                                          0))


# ------------------------------------------------------------ the jaxpr walk

class _Walk(LoweringHost):
  """The shared walker's hooks for one jaxpr lowered into `lctx`."""
  rules = TABLE

  def __init__(self, lctx: LoweringContext):
    self.lctx = lctx
    self.outer_line = lctx.current_line
    self.scopes: list[str] = []     # the named scopes now open

  def enter_scopes(self, eqn):
    """`tpu.trace_start` / `trace_stop` where the equations' named scopes
    (`jax.named_scope`, einsum) begin and end, as Pallas marks them for
    the profiler."""
    names = [s.name for s in eqn.source_info.name_stack.stack]
    keep = 0
    while (keep < min(len(names), len(self.scopes))
           and names[keep] == self.scopes[keep]):
      keep += 1
    self.close_scopes(len(self.scopes) - keep)
    for name in names[keep:]:
      tpu.TraceStartOp(name, 10)
    self.scopes = names

  def close_scopes(self, n=None):
    n = len(self.scopes) if n is None else n
    for _ in range(n):
      tpu.TraceStopOp()
    self.scopes = self.scopes[:len(self.scopes) - n]

  def literal(self, atom):
    return constant(atom.val, atom.aval.shape, atom.aval.dtype)

  def constvar(self, var, value):
    if isinstance(value, (ir.Value, RefVal)):
      return value
    return constant(np.asarray(value), var.aval.shape, var.aval.dtype)

  def rule_context(self, eqn, used, position):
    return RuleContext(self.lctx, eqn, [v.aval for v in eqn.invars],
                       [v.aval for v in eqn.outvars],
                       [v in used for v in eqn.outvars])

  def error(self, message, eqn=None):
    line = source_info_frame(eqn.source_info) if eqn is not None else None
    return self.lctx.error(message, line=line or self.outer_line, eqn=eqn)

  @contextlib.contextmanager
  def lowering_eqn(self, eqn):
    with _location(eqn, self.lctx, self.outer_line):
      if eqn.primitive not in ZERO_SIZE_PRIMITIVES and any(
          has_zero_size(v.aval) for v in (*eqn.invars, *eqn.outvars)):
        raise self.lctx.error("zero-size arrays are not supported by the "
                              "Mosaic lowering (TPU vectors need positive "
                              "sizes)", eqn.primitive.name)
      self.enter_scopes(eqn)
      yield


def lower_jaxpr(lctx: LoweringContext, jaxpr: core.Jaxpr, consts, args):
  """Lowers `jaxpr` at the current insertion point; returns its outputs."""
  outer_line = lctx.current_line
  walk = _Walk(lctx)
  try:
    outs = walk_jaxpr(walk, jaxpr, consts, args)
    walk.close_scopes()
    return outs
  finally:
    lctx.current_line = outer_line


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
  from lowering_mosaic.tpu_rules import check_tpu_rules
  check_tpu_rules(spec)
  ctx = dialect.make_context()
  lctx = LoweringContext(spec.name, spec.where,
                         tuple(spec.grid_mapping.grid), tuple(mesh_axes),
                         kernel_jaxpr=spec.jaxpr)
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


def has_trivial_window(bm) -> bool:
  """The block is the whole array at block index 0 at every grid point."""
  outs = bm.index_map_jaxpr.jaxpr.outvars
  return (tuple(bm.block_sizes) == tuple(bm.array_aval.shape)
          and all(isinstance(v, core.Literal) and v.val == 0 for v in outs))


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
  avals = ([*gm.prefetch_avals] + [bm.ref_aval for bm in gm.block_mappings]
           + [*gm.scratch_avals])
  spaces = ([dialect.SMEM] * gm.num_scalar_prefetch
            + [dialect.block_space(bm) for bm in gm.block_mappings]
            + [dialect.space_name(a.memory_space, dialect.VMEM)
               for a in gm.scratch_avals])
  hidden = ([()] * gm.num_scalar_prefetch
            + [() if dialect.block_space(bm) == dialect.ANY
               else tuple(squeezed_dims(bm)) for bm in gm.block_mappings]
            + [()] * len(gm.scratch_avals))
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
    with ir.InsertionPoint(block):
      args = list(block.arguments)
      refs = _operand_refs(spec, args[n_grid:])
      jaxpr = spec.jaxpr
      lower_jaxpr(lctx, jaxpr.jaxpr, jaxpr.consts, args[:n_grid] + refs)
      func.ReturnOp([])
  _entry_attributes(main, spec, lctx, window_params)
  module.operation.attributes["stable_mosaic.version"] = ir.IntegerAttr.get(
      ir.IntegerType.get_signless(64), MOSAIC_VERSION)
  return module


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
        list(gm.grid))
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
  goes to a TPU: only attributes Mosaic knows)."""
  with module.context, ir.Location.unknown():
    clone = ir.Module.parse(module.operation.get_asm(enable_debug_info=True))
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
