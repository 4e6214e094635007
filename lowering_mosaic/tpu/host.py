"""The Mosaic lowering's host: what its rules see and how the shared walker
emits MLIR.

`lower_jaxpr(lctx, jaxpr, consts, args)` lowers a jaxpr at the current
insertion point with `dsl.core.jaxpr_walk.walk_jaxpr` through the rule table
of `lctx` (`lowering_mosaic.tpu.rules.TABLE`): `TpuHost` is the walker's host
(MLIR constants, source-line locations, named scopes as trace marks), a rule
gets a `RuleContext` and MLIR values or `RefVal`s for refs.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from dsl.core.jax_internals import arith, core, ir, mlir, tpu

from dsl.core import config
from dsl.core.errors import BackendError, marked_jaxpr, traceback_frame
from dsl.core.jaxpr_walk import (CALL_PRIMITIVES, LoweringHost, RuleContextBase,
                                 equation_traceback, walk_jaxpr)
from lowering_mosaic import dialect


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
  # the equation being lowered and the traceback it is located by
  current_eqn: Any = None
  current_traceback: Any = None
  in_call: bool = False         # lowering (inside) a call's body
  kernel_jaxpr: Any = None      # for jax_pallas_verbose_errors
  spec: Any = None              # the KernelSpec (its range analysis)
  # (ref, exits, line) of each access placed at run time that may leave
  # its ref (lowering_mosaic.unchecked_windows), noted with runtime asserts
  unchecked_windows: list = dataclasses.field(default_factory=list)
  # The RuleTable the walker dispatches through (`lowering_mosaic.tpu.rules`).
  rules: Any = None
  # JAX's cache of traceback -> MLIR location, one per module; made in the
  # module's MLIR context on first use
  tracebacks: Any = None

  @property
  def traceback_caches(self):
    """What `mlir.source_info_to_location` asks of its context."""
    if self.tracebacks is None:
      self.tracebacks = mlir.TracebackCaches()
    return self.tracebacks

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
class RuleContext(RuleContextBase):
  """What a lowering rule sees of its equation (RuleContextBase), and the
  kernel's LoweringContext (`lctx`)."""
  lctx: LoweringContext
  eqn: Any
  used: list = dataclasses.field(default_factory=list)

  def out_used(self, i: int = 0) -> bool:
    return self.used[i]

  def error(self, message: str) -> BackendError:
    return self.lctx.error(message, self.primitive)

  def lower(self, jaxpr: core.Jaxpr, consts, args) -> list:
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
  t = dialect.index_type()
  return arith.ConstantOp(t, ir.IntegerAttr.get(t, int(v))).result


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

def _location(eqn, lctx: LoweringContext, walk) -> ir.Location:
  """The location of an equation's operations: JAX's location of the
  equation (as StableHLO gives it), `"prim:"("scope/prim"(frames))` with the
  user's frames of its traceback (`equation_traceback`: an equation of an
  inner jaxpr may take the traceback of the one holding it), innermost
  first. Every equation gets its own, repeated ones included
  (docs/mosaic.md, "Locations")."""
  traceback = walk.traceback(eqn)
  lctx.current_eqn, lctx.current_traceback = eqn, traceback
  # errors name the user's line too
  lctx.current_line = traceback_frame(traceback) or walk.outer_line
  return mlir.source_info_to_location(lctx, eqn.primitive,
                                      eqn.source_info.name_stack, traceback)


# ------------------------------------------------------------ the jaxpr walk

class TpuHost(LoweringHost):
  """The shared walker's hooks for one jaxpr lowered into `lctx`."""

  def __init__(self, lctx: LoweringContext):
    self.lctx = lctx
    self.rules = lctx.rules
    # the equation holding this jaxpr (None for a kernel or index map), its
    # line and traceback, and whether this is (inside) a call's body
    self.outer_eqn = lctx.current_eqn
    self.outer_line = lctx.current_line
    self.outer_traceback = lctx.current_traceback
    self.outer_in_call = lctx.in_call
    self.in_call = lctx.in_call = lctx.in_call or (
        self.outer_eqn is not None
        and self.outer_eqn.primitive in CALL_PRIMITIVES)
    self.scopes: list[str] = []     # the named scopes now open

  def traceback(self, eqn):
    """The traceback `eqn` is located by."""
    return equation_traceback(eqn, self.outer_traceback, self.in_call)

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
    return RuleContext(self.lctx, eqn, [v in used for v in eqn.outvars])

  def error(self, message, eqn=None):
    line = traceback_frame(self.traceback(eqn)) if eqn else None
    return self.lctx.error(message, line=line or self.outer_line, eqn=eqn)

  @contextlib.contextmanager
  def lowering_eqn(self, eqn):
    with _location(eqn, self.lctx, self):
      if eqn.primitive not in ZERO_SIZE_PRIMITIVES and any(
          has_zero_size(v.aval) for v in (*eqn.invars, *eqn.outvars)):
        raise self.lctx.error("zero-size arrays are not supported by the "
                              "Mosaic lowering (TPU vectors need positive "
                              "sizes)", eqn.primitive.name)
      self.enter_scopes(eqn)
      yield


def lower_jaxpr(lctx: LoweringContext, jaxpr: core.Jaxpr, consts, args):
  """Lowers `jaxpr` at the current insertion point; returns its outputs."""
  walk = TpuHost(lctx)
  try:
    outs = walk_jaxpr(walk, jaxpr, consts, args)
    walk.close_scopes()
    return outs
  finally:
    lctx.current_eqn, lctx.in_call = walk.outer_eqn, walk.outer_in_call
    lctx.current_line = walk.outer_line
    lctx.current_traceback = walk.outer_traceback
