"""KernelSpec -> Mosaic MLIR module.

The module holds the kernel as `func.func @main` and one `@transform_<k>`
function per blocked operand (its index map), with the attributes Mosaic
reads:

  func.func @main(%grid_0: i32, ..., %prefetch: memref<..., smem>, ...,
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
    returns the block index of operand k per array dim (element offsets for
    `Element` dims, listed in its window's `dsl.element_dims`).

The kernel jaxpr is lowered equation by equation by the shared
`dsl.jaxpr_walk.walk_jaxpr` through `TABLE`, a table keyed by primitive that
the modules of rules/ fill. Every operation carries the user's source line as
its MLIR location, which the interpreter and the race checker report.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, func

from dsl.blockspec import Element, squeezed
from dsl.errors import BackendError, source_info_frame
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

  @property
  def shape(self):
    return tuple(self.aval.inner_aval.shape)

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
  current_line: str | None = None

  def error(self, message: str, primitive: str | None = None,
            line: str | None = None) -> BackendError:
    what = f"primitive '{primitive}': " if primitive else ""
    return BackendError(self.kernel, f"{what}{message}",
                        line or self.current_line or self.where)


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
    return self.lctx.error(message, line=line or self.outer_line)

  @contextlib.contextmanager
  def lowering_eqn(self, eqn):
    with _location(eqn, self.lctx, self.outer_line):
      if eqn.primitive not in ZERO_SIZE_PRIMITIVES and any(
          has_zero_size(v.aval) for v in (*eqn.invars, *eqn.outvars)):
        raise self.lctx.error("zero-size arrays are not supported by the "
                              "Mosaic lowering (TPU vectors need positive "
                              "sizes)", eqn.primitive.name)
      yield


def lower_jaxpr(lctx: LoweringContext, jaxpr: core.Jaxpr, consts, args):
  """Lowers `jaxpr` at the current insertion point; returns its outputs."""
  outer_line = lctx.current_line
  try:
    return walk_jaxpr(_Walk(lctx), jaxpr, consts, args)
  finally:
    lctx.current_line = outer_line


# ------------------------------------------------------------ the module

def _dimension_semantics(spec, grid_rank) -> list[str]:
  from dsl.errors import KernelError
  params = spec.compiler_params
  sem = getattr(params, "dimension_semantics", None)
  if sem is None:
    return ["arbitrary"] * grid_rank
  sem = [str(getattr(s, "value", s)).lower() for s in sem]
  # grid axes added by vmap lead the grid (num_hidden_axes); they are parallel.
  hidden = spec.grid_mapping.num_hidden_axes
  if hidden and len(sem) == grid_rank - hidden:
    sem = ["parallel"] * hidden + sem
  if len(sem) != grid_rank:
    raise KernelError(spec.name, f"dimension_semantics has {len(sem)} "
                      f"entries but the grid has rank {grid_rank}",
                      spec.where, operand="compiler_params")
  for s in sem:
    if s not in ("parallel", "arbitrary", "core_parallel"):
      raise KernelError(spec.name, f"dimension_semantics entry {s!r} must be "
                        "'parallel' or 'arbitrary'", spec.where,
                        operand="compiler_params")
  return sem


def _block_space(bm) -> str:
  if bm.whole_array and dialect.space_name(bm.memory_space) == dialect.ANY:
    return dialect.ANY
  return dialect.space_name(bm.memory_space, dialect.VMEM)


def operand_memref_type(bm) -> ir.MemRefType:
  space = _block_space(bm)
  shape = bm.array_aval.shape if space == dialect.ANY else bm.kernel_shape
  return dialect.memref_type(shape, bm.array_aval.dtype, space)


def _param_names(spec) -> list[str]:
  gm = spec.grid_mapping
  return ([f"grid[{d}]" for d in range(len(gm.grid))]
          + [f"scalar prefetch {i}" for i in range(gm.num_scalar_prefetch)]
          + [bm.origin for bm in gm.block_mappings]
          + [f"scratch_shapes[{i}]" for i in range(len(gm.scratch_avals))])


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
    outs = lower_jaxpr(lctx, jaxpr.jaxpr, jaxpr.consts, args + pf)
    func.ReturnOp([to_i32(o) for o in outs])
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
                         tuple(spec.grid_mapping.grid), tuple(mesh_axes))
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


def _build(spec, lctx) -> ir.Module:
  gm = spec.grid_mapping
  mesh_axes = lctx.mesh_axes
  module = ir.Module.create()
  n_grid = len(gm.grid)
  prefetch_types = [dialect.ref_memref_type(a, dialect.SMEM)
                    for a in gm.prefetch_avals]
  operand_types = [operand_memref_type(bm) for bm in gm.block_mappings]
  scratch_types = [dialect.ref_memref_type(a, dialect.VMEM)
                   for a in gm.scratch_avals]
  window_params = []
  with ir.InsertionPoint(module.body):
    main = func.FuncOp("main", ir.FunctionType.get(
        [dialect.i32()] * n_grid + prefetch_types + operand_types
        + scratch_types, []))
    for k, bm in enumerate(gm.block_mappings):
      if _block_space(bm) == dialect.ANY:
        window_params.append(ir.DictAttr.get({}))
        continue
      tname = _lower_transform(lctx, spec, k, bm, prefetch_types)
      entries = {
          "transform_indices": ir.FlatSymbolRefAttr.get(tname),
          "window_bounds": ir.DenseI64ArrayAttr.get(list(bm.block_sizes)),
      }
      elem = [d for d, b in enumerate(bm.block_shape) if isinstance(b, Element)]
      if elem:
        entries["dsl.element_dims"] = ir.DenseI64ArrayAttr.get(elem)
        entries["dsl.element_padding_low"] = ir.DenseI64ArrayAttr.get(
            [bm.block_shape[d].padding[0] for d in elem])
        entries["dsl.element_padding_high"] = ir.DenseI64ArrayAttr.get(
            [bm.block_shape[d].padding[1] for d in elem])
      sq = [d for d, b in enumerate(bm.block_shape) if b is squeezed]
      if sq:
        entries["dsl.squeezed_dims"] = ir.DenseI64ArrayAttr.get(sq)
      window_params.append(ir.DictAttr.get(entries))
    block = main.add_entry_block()
    with ir.InsertionPoint(block):
      args = list(block.arguments)
      ids = args[:n_grid]
      refs = []
      names = _param_names(spec)[n_grid:]
      avals = ([*gm.prefetch_avals] + [bm.ref_aval for bm in gm.block_mappings]
               + [*gm.scratch_avals])
      spaces = ([dialect.SMEM] * gm.num_scalar_prefetch
                + [_block_space(bm) for bm in gm.block_mappings]
                + [dialect.space_name(a.memory_space, dialect.VMEM)
                   for a in gm.scratch_avals])
      for a, aval, space, nm in zip(args[n_grid:], avals, spaces, names):
        refs.append(RefVal(a, aval, space, nm))
      jaxpr = spec.jaxpr
      lower_jaxpr(lctx, jaxpr.jaxpr, jaxpr.consts, ids + refs)
      func.ReturnOp([])
    main.attributes["dimension_semantics"] = ir.ArrayAttr.get([
        ir.Attribute.parse(f"#tpu.dimension_semantics<{s}>")
        for s in _dimension_semantics(spec, n_grid)])
    main.attributes["iteration_bounds"] = ir.DenseI64ArrayAttr.get(
        list(gm.grid))
    main.attributes["scalar_prefetch"] = ir.IntegerAttr.get(
        ir.IntegerType.get_signless(64), gm.num_scalar_prefetch)
    main.attributes["scratch_operands"] = ir.IntegerAttr.get(
        ir.IntegerType.get_signless(64), len(gm.scratch_avals))
    main.attributes["tpu.core_type"] = ir.Attribute.parse("#tpu.core_type<tc>")
    main.attributes["window_params"] = ir.ArrayAttr.get(window_params)
    # Our own annotations (discardable `dsl.` attributes): which operands are
    # inputs and outputs, and where the kernel comes from.
    main.attributes["dsl.kernel_name"] = ir.StringAttr.get(spec.name)
    main.attributes["dsl.kernel_src"] = ir.StringAttr.get(spec.kernel_src)
    main.attributes["dsl.num_inputs"] = ir.IntegerAttr.get(
        ir.IntegerType.get_signless(64), gm.num_inputs)
    main.attributes["dsl.num_outputs"] = ir.IntegerAttr.get(
        ir.IntegerType.get_signless(64), gm.num_outputs)
    main.attributes["dsl.operand_names"] = ir.ArrayAttr.get(
        [ir.StringAttr.get(n) for n in _param_names(spec)])
    if mesh_axes:
      main.attributes["dsl.mesh_axes"] = ir.ArrayAttr.get(
          [ir.StringAttr.get(str(n)) for n, _ in mesh_axes])
      main.attributes["dsl.mesh_shape"] = ir.DenseI64ArrayAttr.get(
          [s for _, s in mesh_axes])
    if spec.input_output_aliases:
      main.attributes["dsl.input_output_aliases"] = ir.DenseI64ArrayAttr.get(
          [x for pair in spec.input_output_aliases for x in pair])
  module.operation.attributes["stable_mosaic.version"] = ir.IntegerAttr.get(
      ir.IntegerType.get_signless(64), MOSAIC_VERSION)
  return module


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
          for k in ("transform_indices", "window_bounds", "pipeline_mode"):
            if k in d:
              keep[k] = d[k]
          cleaned.append(ir.DictAttr.get(keep))
        op.attributes["window_params"] = ir.ArrayAttr.get(cleaned)
  return clone
