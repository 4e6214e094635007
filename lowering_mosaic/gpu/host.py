"""The walker's host for the Mosaic GPU lowering, and value helpers.

A lowered value is an MLIR value: a scalar (`i32`, `f32`, ...), a vector
(`vector<128x64xf32>`, one per warpgroup; the library's layout inference
decides how its elements are spread over the 128 threads), or a shared-memory
`memref` (a ref: an operand's block, a scratch buffer).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import numpy as np
from dsl.core.jax_internals import (arith, core, ir, llvm,
                                    mosaic_gpu_dialect as mgpu, vector)
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import layouts
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from dsl.core import dtypes
from dsl.core.errors import BackendError, source_info_frame
from dsl.core.jaxpr_walk import (LoweringHost, RuleContextBase, RuleTable,
                                 walk_jaxpr)

TRITON_HINT = "; use backend='triton' for this kernel"


def ir_type(dtype) -> ir.Type:
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return ir.IntegerType.get_signless(1)
  return mgpu_utils.dtype_to_ir_type(dtype)


def is_vector(v) -> bool:
  return isinstance(v.type, ir.VectorType)


def is_ref(v) -> bool:
  return isinstance(v.type, ir.MemRefType)


def shape_of(v) -> tuple[int, ...]:
  if is_vector(v):
    return tuple(ir.VectorType(v.type).shape)
  return ()


def elem_type(v) -> ir.Type:
  return ir.VectorType(v.type).element_type if is_vector(v) else v.type


def phys(shape) -> tuple[int, ...]:
  """The physical shape of a value of logical shape `shape`: its unit dims
  dropped. Lowered vectors never have unit dims (the library has no
  register layout for (n, 1) tiles): keepdims results, (1, n) rows and
  their broadcasts are (n,) vectors, and shapes of one element scalars."""
  return tuple(int(d) for d in shape if int(d) != 1)


def typed(shape, dtype) -> ir.Type:
  """The lowered type of a value of logical shape `shape`."""
  t = dtype if isinstance(dtype, ir.Type) else ir_type(dtype)
  p = phys(shape)
  return ir.VectorType.get(list(p), t) if p else t


def scalar_constant(value, dtype) -> ir.Value:
  dtype = np.dtype(dtype)
  t = ir_type(dtype)
  if dtypes.is_float(dtype):
    return arith.constant(t, ir.FloatAttr.get(t, float(value)))
  if dtype == np.bool_:
    return arith.constant(t, ir.IntegerAttr.get(t, int(bool(value))))
  v = int(value)
  if dtypes.is_unsigned(dtype) and v >= 1 << (dtype.itemsize * 8 - 1):
    v -= 1 << (dtype.itemsize * 8)
  return arith.constant(t, ir.IntegerAttr.get(t, v))


def constant(value, shape, dtype) -> ir.Value:
  """A scalar or a splat vector of logical shape `shape`; a vector of
  distinct values cannot be distributed over a warpgroup by the library."""
  arr = np.asarray(value)
  if arr.size and not np.all(arr == arr.reshape(-1)[0]):
    raise ValueError("array constants with distinct elements are not "
                     "supported (only splats); compute them with iota")
  s = scalar_constant(arr.reshape(-1)[0] if arr.size else 0, dtype)
  return broadcast_to(s, phys(shape))


def broadcast_to(v, pshape: tuple[int, ...]) -> ir.Value:
  """A scalar `v` splatted to the physical shape `pshape` (vectors are
  returned unchanged)."""
  if not pshape or is_vector(v):
    return v
  return vector.broadcast(ir.VectorType.get(list(pshape), v.type), v)


def phys_position(shape) -> list:
  """For each logical dim of `shape`, its index in the physical shape
  (None for unit dims)."""
  out, k = [], 0
  for d in shape:
    out.append(None if int(d) == 1 else k)
    k += int(d) != 1
  return out


def reshape(x, in_shape, shape, dtype) -> ir.Value:
  """`x` (logical shape `in_shape`) laid out as `shape` (same size)."""
  pin, pout = phys(in_shape), phys(shape)
  if pin == pout:
    return x
  if not is_vector(x):
    return broadcast_to(x, pout)
  if not pout:
    return vector.extract(x, [], [0] * len(pin))
  return vector.shape_cast(typed(shape, dtype), x)


def broadcast_in_dim(x, in_shape, shape, dims, dtype) -> ir.Value:
  """`x` (logical shape `in_shape`) broadcast to `shape`, its dim i
  becoming dim `dims[i]`."""
  pin, pout = phys(in_shape), phys(shape)
  if not is_vector(x):
    return broadcast_to(x, pout)
  if pin == pout:            # only unit dims come or go
    return x
  pos = phys_position(shape)
  pdims = [pos[dims[i]] for i, d in enumerate(in_shape) if int(d) != 1]
  if len(pout) == 2 and pout[0] % 64 == 0 and len(pdims) == 1:
    # A row or column vector across a tile: the wgmma layouts, which the
    # tile's reductions use too (layout inference alone may find none).
    vec = fa.WGMMA_ROW_LAYOUT if pdims == [0] else fa.WGMMA_COL_LAYOUT
    x = mgpu.layout_cast(x, layouts.to_layout_attr(vec))
  return mgpu.broadcast_in_dim(typed(shape, dtype), x, pdims)


def to_shape(x, in_shape, shape, dtype) -> ir.Value:
  """`x` (logical `in_shape`) broadcast numpy-style to `shape`."""
  offset = len(shape) - len(in_shape)
  return broadcast_in_dim(x, in_shape, shape,
                          list(range(offset, len(shape))), dtype)


def void_asm(text: str) -> None:
  """One PTX instruction with side effects, no operands and no results
  (`wgmma.fence.sync.aligned;`), as inline assembly."""
  llvm.inline_asm(ir.Type.parse("!llvm.void"), [], text, "",
                  has_side_effects=True)


def i32(v: int) -> ir.Value:
  return scalar_constant(v, np.int32)


def decode(flat: ir.Value, sizes: list[int]) -> list[ir.Value]:
  """Row-major coordinates of `flat` (i32, less than the product of
  `sizes`) in a grid of `sizes`: the outermost is what is left of `flat`."""
  coords = []
  for k, n in enumerate(reversed(sizes)):
    if n == 1:
      coords.append(i32(0))
    elif k == len(sizes) - 1:
      coords.append(flat)
    else:
      coords.append(arith.remui(flat, i32(n)))
      flat = arith.divui(flat, i32(n))
  return coords[::-1]


def index_cast_i32(v) -> ir.Value:
  t = ir.IntegerType.get_signless(32)
  if isinstance(v.type, ir.IndexType):
    return arith.index_cast(t, v)
  if ir.IntegerType(v.type).width != 32:
    return arith.trunci(t, v) if ir.IntegerType(v.type).width > 32 else \
        arith.extsi(t, v)
  return v


def to_index(v) -> ir.Value:
  if isinstance(v.type, ir.IndexType):
    return v
  return arith.index_cast(ir.IndexType.get(), v)


@dataclasses.dataclass
class RuleContext(RuleContextBase):
  """What a lowering rule sees of its equation (RuleContextBase), and the
  kernel's host (`host`)."""
  host: "GpuHost"
  eqn: Any
  used: list

  def out_used(self, i: int = 0) -> bool:
    return self.used[i]

  def error(self, message: str) -> BackendError:
    return self.host.error(message, self.eqn)

  def lower(self, jaxpr: core.Jaxpr, consts, args) -> list:
    return walk_jaxpr(self.host, jaxpr, consts, args)


class GpuHost(LoweringHost):
  """Lowers one kernel's jaxprs at the current insertion point, through
  `rules` (the rule table of lowering_mosaic.gpu.rules)."""

  def __init__(self, kernel: str, where: str | None, rules: RuleTable):
    self.rules = rules
    self.kernel = kernel
    self.spec = None        # the KernelSpec, for its range analysis
    self.where = where
    self.scoped = {}        # id(run_scoped equation) -> its SMEM buffers
    # (byte offset, bytes) of the shared scratch of cross-warp reductions
    self.reduction_scratch = None
    # transcendental functions computed approximately (fastmath afn)
    self.approx_math = False
    # the steps loop's carried accumulators that only WGMMAs write (fenced
    # once, before the loop: kernel.py)
    self.fenced_carry = []
    # (id(dot equation), "before" / "after" the issue of its wgmma) -> what
    # emits the schedule's turn ops there (specialized.py, turns.py)
    self.turns = {}
    # what only a plgpu.kernel has (mesh_kernel.MeshHost): the device mesh
    # of the shard_map around it, its global-memory semaphores, the
    # predicate of one thread of the warpgroup
    self.jax_mesh = None
    self.semaphores = None
    self.lane_predicate = None
    self.auto_barriers = True

  def take_turns(self, eqn, when: str):
    """Emits the turn ops the schedule puts `when` ("before", "after") the
    issue of the wgmma of `eqn` (none outside a turn-taking schedule)."""
    for emit in self.turns.get((id(eqn), when), ()):
      emit()

  @contextlib.contextmanager
  def scope(self, ctx, jaxpr, num_consts, collective_axes):
    """The refs of a `run_scoped` equation (`ctx`): shared-memory buffers
    the plan set aside for it (each run_scoped gets its own)."""
    bufs = self.scoped.get(id(ctx.eqn))
    if bufs is None:
      raise ctx.error("internal error: no buffers planned for this run_scoped")
    yield bufs

  def scope_body(self, jaxpr, num_consts):
    """The jaxpr a `run_scoped` lowers (its refs from `scope`): its own
    body (a plgpu.kernel discharges its accumulators there)."""
    return jaxpr

  def literal(self, atom):
    return self._constant(atom.val, atom.aval)

  def constvar(self, var, value):
    if isinstance(value, ir.Value):
      return value
    return self._constant(np.asarray(value), var.aval)

  def _constant(self, value, aval):
    try:
      return constant(value, aval.shape, aval.dtype)
    except ValueError as e:
      raise self.error(f"{e}{TRITON_HINT}") from e

  def rule_context(self, eqn, used, position):
    return RuleContext(self, eqn, [v in used for v in eqn.outvars])

  def error(self, message, eqn=None):
    line = source_info_frame(eqn.source_info) if eqn is not None else None
    return BackendError(self.kernel, message, line or self.where)

  def unsupported(self, eqn):
    return self.error(
        f"primitive '{eqn.primitive.name}' is not supported by "
        f"{self.rules.owner} (it has no lowering rule there)" + TRITON_HINT
        + " (or backend='interpret' off the GPU)", eqn)

  @contextlib.contextmanager
  def lowering_eqn(self, eqn):
    line = source_info_frame(eqn.source_info)
    if line and ":" in line:
      path, _, num = line.rpartition(":")
      loc = ir.Location.file(path, int(num) if num.isdigit() else 0, 0)
      with ir.Location.name(eqn.primitive.name, childLoc=loc):
        yield
    else:
      yield
