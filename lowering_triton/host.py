"""The lowering of kernel jaxprs to Triton source: environment, emission,
source-line comments and error reporting.

`TritonHost` walks a jaxpr equation by equation and calls the rule that the
rules table (`lowering_triton.rules`) holds for its primitive; each rule gets a
`RuleContext` (the equation, helpers to emit code and bind names) and the
lowered operands, and returns the lowered results.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import linecache
import os
from typing import Any, Sequence

import jax
import numpy as np
from dsl.core.jax_internals import ClosedJaxpr, core

from dsl.core import config
from dsl.core.errors import BackendError, marked_jaxpr, source_info_frame
from dsl.core.jaxpr_walk import LoweringHost, RuleContextBase, walk_jaxpr
from dsl.core.ranges import KernelRanges
from lowering_triton import triton_dtypes as dtypes
from lowering_triton.codegen import CodeBuffer, Names, paren
from lowering_triton.launch_config import DEFAULT_NUM_WARPS
from lowering_triton.kernel_refs import MemRef, ValueRef, row_major_strides
from lowering_triton.values import (MAX_NUMEL, TVal, full_expr, literal_value,
                                    numel, padded, py_literal)
from lowering_triton.kernel_refs import Axis, emit_address

def source_text(frame: str | None) -> str:
  """`file.py:12: <the stripped source line>` for a `file:line` frame."""
  if not frame:
    return ""
  path, _, line = frame.rpartition(":")
  text = linecache.getline(path, int(line)).strip() if line.isdigit() else ""
  loc = f"{os.path.basename(path)}:{line}"
  return f"{loc}: {text}" if text else loc


@functools.lru_cache(maxsize=64)
def _assignments(path: str, size: int) -> dict[int, str]:
  """Line -> name for each `name = ...` (or `name += ...`) statement of a
  source file: only real assignments, not keyword arguments of a call."""
  try:
    tree = ast.parse("".join(linecache.getlines(path)))
  except (SyntaxError, ValueError):
    return {}
  out = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
      target = node.targets[0]
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
      target = node.target
    else:
      continue
    if isinstance(target, ast.Name) and target.id not in ("self", "_"):
      out[node.lineno] = target.id
  return out


def _assigned_name(frame: str | None) -> str | None:
  """The variable that the statement at `file:line` assigns, if any."""
  if not frame:
    return None
  path, _, line = frame.rpartition(":")
  if not line.isdigit():
    return None
  lines = linecache.getlines(path)
  return _assignments(path, len(lines)).get(int(line)) if lines else None


def _subjaxprs_using(eqn) -> bool:
  return any(isinstance(v, (core.Jaxpr, ClosedJaxpr))
             for v in eqn.params.values())


class TritonHost(LoweringHost):
  """State of one kernel's generation: its code buffer, names and consts."""

  def __init__(self, kernel: str, where: str, names: Names, buf: CodeBuffer,
               rules, kernel_jaxpr=None, ranges: KernelRanges | None = None):
    self.rules = rules
    # What the range analysis proves of the kernel's ref accesses.
    self.ranges = ranges if ranges is not None else KernelRanges()
    self.kernel = kernel
    self.where = where
    self.names = names
    self.buf = buf
    self.kernel_jaxpr = kernel_jaxpr
    self.const_buffers: list[tuple[str, np.ndarray]] = []
    self._const_params: dict[tuple, tuple[str, str]] = {}
    self.helpers: dict[str, str] = {}     # name -> source of a @triton.jit helper
    self.uses_asserts = False
    self.has_side_effects = False
    # The grid point being emitted (a Sym per grid dim), for check messages.
    self.grid_point: tuple = ()
    self._last_comment: tuple | None = None
    self._eqn_stack: list = []
    self._hints: dict[int, dict[int, str]] = {}   # id(jaxpr) -> name hints
    # Operands stored to since the last barrier (see `before_read`), and
    # the operands the kernel reads at all.
    self._written: set[str] = set()
    self._writes = 0
    self.read_operands: set[str] = set()
    # Loops the code being emitted sits in, and the tensor descriptors the
    # kernel makes at its top: (pointer, box) -> (name, source) (tma.py).
    self.loop_depth = 0
    self.tensor_descriptors = True
    self.num_warps = DEFAULT_NUM_WARPS    # of the launch (the kernel's config)
    self.descriptors: dict[tuple, tuple[str, str]] = {}
    self._producers: dict[int, dict] = {}   # id(jaxpr) -> var -> eqn

  @contextlib.contextmanager
  def in_loop(self):
    """Marks the code emitted inside as a loop body."""
    self.loop_depth += 1
    try:
      yield
    finally:
      self.loop_depth -= 1

  def producers(self, jaxpr) -> dict:
    """The equation computing each variable of `jaxpr` (cached)."""
    if id(jaxpr) not in self._producers:
      self._producers[id(jaxpr)] = {v: e for e in jaxpr.eqns
                                    for v in e.outvars}
    return self._producers[id(jaxpr)]

  # ---------------------------------------------------------------- emission

  def fresh(self, hint: str) -> str:
    return self.names.fresh(hint)

  def emit(self, line: str) -> None:
    self.buf.line(line)

  def bind_raw(self, expr: str, hint: str, pure: bool = True) -> str:
    """Emits `name = expr`. Pure definitions nothing reads are dropped from
    the final source."""
    name = self.fresh(hint)
    self.buf.line(f"{name} = {expr}", defines=name if pure else None)
    return name

  def bind(self, expr: str, shape, dtype, hint: str, pure: bool = True
           ) -> TVal:
    shape = tuple(int(d) for d in shape)
    if numel(shape) > MAX_NUMEL:
      raise self.error(
          f"a value of shape {shape} pads to {padded(shape)} = {numel(shape)} "
          f"elements, more than Triton's limit of {MAX_NUMEL} per tensor; use "
          "smaller blocks")
    name = self.bind_raw(expr, hint, pure)
    return TVal(name, shape, np.dtype(dtype))

  # ---------------------------------------------------------------- ordering

  def wrote(self, operand: str) -> None:
    """Records a store to `operand` (its pointer name)."""
    self._written.add(operand)
    self._writes += 1

  def before_read(self, operand: str) -> None:
    """Threads of a program may load elements other threads stored; Triton
    orders shared memory, not global memory, so a load after a store to the
    same operand gets a barrier (uniform control flow: branches and loops
    depend on scalars only)."""
    self.read_operands.add(operand)
    if operand in self._written:
      self.buf.line("tl.debug_barrier()  # make this program's stores visible")
      self._written.clear()

  def barrier(self, comment: str) -> None:
    """A barrier for the stores so far; dropped at the end if the kernel
    never reads what they wrote (see `drop_needless_barriers`)."""
    if self._written:
      self.buf.line(f"tl.debug_barrier()  # {comment}",
                    tag=("barrier", frozenset(self._written)))
      self._written.clear()

  def drop_needless_barriers(self) -> None:
    self.buf.drop_tagged(lambda tag: tag[0] == "barrier" and
                         not (tag[1] & self.read_operands))

  def writes_mark(self) -> int:
    return self._writes

  def end_of_loop_body(self, mark: int) -> None:
    """A loop body that stores may be read by its next iteration."""
    if self._writes != mark:
      self.barrier("the next iteration may read these stores")

  def need_helper(self, name: str, source: str) -> str:
    self.helpers.setdefault(name, source)
    return name

  # ---------------------------------------------------------------- errors

  def current_frame(self) -> str | None:
    for eqn in reversed(self._eqn_stack):
      f = source_info_frame(eqn.source_info)
      if f:
        return f
    return None

  def error(self, message: str, eqn=None) -> BackendError:
    """A BackendError naming the kernel and the user's line of `eqn` (the
    equation being lowered if None); with jax_pallas_verbose_errors on, it
    shows the kernel jaxpr with that equation marked."""
    eqn = eqn if eqn is not None else (self._eqn_stack[-1] if self._eqn_stack
                                       else None)
    where = None
    if eqn is not None:
      where = source_info_frame(eqn.source_info)
    where = where or self.current_frame() or self.where
    detail = None
    if config.verbose_errors() and self.kernel_jaxpr is not None:
      try:
        detail = ("The kernel jaxpr, the failing equation marked:\n" +
                  marked_jaxpr(self.kernel_jaxpr, self._eqn_stack[0]
                               if self._eqn_stack else eqn))
      except Exception:
        detail = f"The kernel jaxpr:\n{self.kernel_jaxpr}"
    return BackendError(self.kernel, message, where, detail=detail)

  # ---------------------------------------------------------------- constants

  def const_value(self, value, hint: str = "const") -> Any:
    """A jaxpr constant (scalar or array) as a value of the kernel."""
    if isinstance(value, core.Literal):
      dtype = getattr(value.aval, "dtype", None)
      value = value.val
      arr = np.asarray(value, dtype=dtype)
    else:
      arr = np.asarray(value)
    if arr.dtype == object:
      raise self.error(f"unsupported constant {value!r}")
    if arr.ndim == 0:
      return literal_value(arr, arr.dtype)
    if arr.size and np.all(arr == arr.reshape(-1)[0]):
      return self.bind(full_expr(arr.shape, arr.reshape(-1)[0].item(),
                                 arr.dtype), arr.shape, arr.dtype, hint)
    # A general array constant becomes an extra buffer argument (one per
    # distinct array, however often a jaxpr using it is lowered).
    key = (arr.dtype.str, arr.shape, arr.tobytes())
    if key not in self._const_params:
      base = self.fresh(f"const{len(self.const_buffers)}")
      ptr = self.fresh(f"{base}_ptr")
      self.const_buffers.append((ptr, np.ascontiguousarray(arr)))
      self._const_params[key] = (base, ptr)
    base, ptr = self._const_params[key]
    ref = MemRef(base, ptr, arr.dtype, arr.shape, row_major_strides(arr.shape),
                 (), tuple(Axis(d, 0, 1, n) for d, n in enumerate(arr.shape)),
                 (False,) * arr.ndim, (False,) * arr.ndim)
    address, mask = emit_address(self, ref)
    load = f"tl.load({address}" + (f", mask={mask}" if mask else "") + ")"
    return self.bind(load, arr.shape, arr.dtype, base)

  # ---------------------------------------------------------------- jaxprs

  def lower_closed(self, closed, args: Sequence[Any]) -> list:
    if isinstance(closed, ClosedJaxpr):
      return self.lower_jaxpr(closed.jaxpr, closed.consts, args)
    return self.lower_jaxpr(closed, (), args)

  def lower_jaxpr(self, jaxpr: core.Jaxpr, consts: Sequence[Any],
                  args: Sequence[Any]) -> list:
    return walk_jaxpr(self, jaxpr, consts, args)

  # ------------------------------------------------- the walker's host hooks

  def literal(self, atom) -> Any:
    return self.const_value(atom)

  def constvar(self, var, value) -> Any:
    if isinstance(value, (TVal, MemRef, ValueRef)):
      return value
    return self.const_value(value)

  def fold(self, ctx, eqn, invals) -> Any | None:
    """A scalar equation whose operands are all literals, evaluated now."""
    if (eqn.primitive.multiple_results or not invals
        or not all(isinstance(a, TVal) and a.literal is not None
                   for a in invals)):
      return None
    vals = [np.asarray(a.literal, a.dtype) for a in invals]
    with jax.ensure_compile_time_eval():
      out = np.asarray(eqn.primitive.bind(*vals, **eqn.params))
    if out.ndim:
      return None
    return literal_value(out, eqn.outvars[0].aval.dtype)

  def rule_context(self, eqn, used: set, position: tuple) -> "RuleContext":
    jaxpr, i = position
    if i == 0:    # a walk starts: name hints from lines outside the callers
      outer = {source_info_frame(e.source_info) for e in self._eqn_stack}
      self._hints[id(jaxpr)] = {
          k: n for k, n in self._name_hints(jaxpr).items()
          if source_info_frame(jaxpr.eqns[k].source_info) not in outer}
    return RuleContext(self, eqn, used, self._hints[id(jaxpr)].get(i), jaxpr)

  @contextlib.contextmanager
  def lowering_eqn(self, eqn):
    self._comment(eqn)
    self._eqn_stack.append(eqn)
    try:
      yield
    finally:
      self._eqn_stack.pop()

  def _comment(self, eqn) -> None:
    frame = source_info_frame(eqn.source_info)
    if not frame:
      return
    key = (frame, self.buf.level)
    if key != self._last_comment:
      self.buf.comment(source_text(frame))
      self._last_comment = key

  def reset_comments(self) -> None:
    self._last_comment = None

  @staticmethod
  def _name_hints(jaxpr: core.Jaxpr) -> dict[int, str]:
    """Equation index -> the user's variable name for its result."""
    hints: dict[int, str] = {}
    frames = [source_info_frame(e.source_info) for e in jaxpr.eqns]
    i = 0
    while i < len(frames):
      j = i
      while j + 1 < len(frames) and frames[j + 1] == frames[i]:
        j += 1
      name = _assigned_name(frames[i])
      if name:
        for k in range(j, i - 1, -1):
          e = jaxpr.eqns[k]
          if (len(e.outvars) == 1 and not isinstance(e.outvars[0], core.DropVar)
              and isinstance(e.outvars[0].aval, core.ShapedArray)
              and not _subjaxprs_using(e)):
            hints[k] = name
            break
      i = j + 1
    return hints


class RuleContext(RuleContextBase):
  """What a lowering rule sees: its equation (RuleContextBase) and the
  emission helpers."""

  def __init__(self, host: "TritonHost", eqn, used: set, hint: str | None,
               jaxpr=None):
    self.host = host
    self.eqn = eqn
    self.jaxpr = jaxpr          # the jaxpr `eqn` belongs to
    self._used = used
    self._hint = hint

  # equation facts
  def out_used(self, i: int = 0) -> bool:
    v = self.eqn.outvars[i]
    return not isinstance(v, core.DropVar) and v in self._used

  def hint(self, default: str) -> str:
    return self._hint or default

  # emission
  @property
  def buf(self) -> CodeBuffer:
    return self.host.buf

  def emit(self, line: str) -> None:
    self.host.emit(line)

  def fresh(self, hint: str) -> str:
    return self.host.fresh(hint)

  def bind_raw(self, expr: str, hint: str, pure: bool = True) -> str:
    return self.host.bind_raw(expr, hint, pure)

  def bind(self, expr: str, shape, dtype, hint: str | None = None,
           pure: bool = True) -> TVal:
    return self.host.bind(expr, shape, dtype,
                              hint or self.hint(self.primitive), pure)

  def error(self, message: str) -> BackendError:
    return self.host.error(message, self.eqn)

  def lower(self, jaxpr: core.Jaxpr, consts, args) -> list:
    return self.host.lower_jaxpr(jaxpr, consts, args)

  # values
  def value(self, v: TVal) -> str:
    """`v` as a Triton tensor of exactly its dtype."""
    return v.expr

  def compute(self, v: TVal) -> str:
    """`v` in its compute dtype (float32 for f16/bf16/fp8), as an operand.

    Constants of the default Triton types stay Python literals.
    """
    cd = dtypes.compute_dtype(v.dtype)
    if v.literal is not None:
      if cd.name in ("float32", "int32", "bool"):
        return py_literal(v.literal, cd)
      return full_expr((), v.literal, cd)
    if cd != v.dtype:
      return f"{paren(v.expr)}.to(tl.float32)"
    return v.expr

  def finish(self, expr: str, shape, dtype, computed_in=None,
             hint: str | None = None) -> TVal:
    """Binds `expr` (computed in `computed_in`) as a value of `dtype`."""
    dtype = np.dtype(dtype)
    computed_in = np.dtype(computed_in or dtype)
    if computed_in != dtype:
      expr = f"{paren(expr)}.to({dtypes.tl_type(dtype)})"
    return self.bind(expr, shape, dtype, hint)

  def cast_expr(self, v: TVal, dtype) -> str:
    """An expression of `v` converted to `dtype`."""
    dtype = np.dtype(dtype)
    if v.dtype == dtype:
      return v.expr
    if v.literal is not None:
      return literal_value(v.literal, dtype).expr
    if dtype == np.bool_:
      return f"{paren(self.compute(v))} != 0"
    return f"{paren(v.expr)}.to({dtypes.tl_type(dtype)})"
