"""Backend "triton_interpret": the generated Triton source, run by Triton's
interpreter on numpy buffers inside `jax.jit` (through `jax.pure_callback`).

Triton's interpreter normally needs `TRITON_INTERPRET=1` before `triton` is
imported and torch tensors as arguments. Here the interpreter is driven
directly: pointers are built from numpy buffers, and for the duration of a
run `triton.language` is patched the way `TRITON_INTERPRET=1` would have
set it up (builtins on numpy, `@jit` library functions such as `tl.sum` as
interpreted functions). Everything is restored afterwards, so Triton's
compiler keeps working in the same process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import threading
import traceback

import jax
import numpy as np
from dsl.core.jax_internals import config as jax_config, mlir

from dsl.core import checks
from dsl.core import host_failures
from dsl.core import config
from dsl.core.errors import BackendError, KernelCheckError, KernelRuntimeError
from dsl.core.kernel_layout import KernelLayout
from dsl.core.poison import poison_value
from lowering_triton import triton_dtypes as dtypes
from lowering_triton import interpret_memory, loader
from lowering_triton.check_values import fill_in
from lowering_triton.kernel import GeneratedKernel, generate
from lowering_triton.rules.reductions import NAN_REDUCTIONS

_LOCK = threading.RLock()


def _interpreter():
  from triton.runtime import interpreter
  return interpreter


@contextlib.contextmanager
def _interpreter_scope(debug: bool = False):
  """Patches triton.language for interpretation; restores it on exit.

  `debug` enables `tl.device_assert`, as compiling with debug=True does.
  """
  import triton.language as tl
  from triton.runtime.jit import JITFunction
  ti = _interpreter()
  scope = ti._LangPatchScope()
  try:
    for lang in (tl, tl.core):
      ti._patch_builtin(lang, ti.interpreter_builder, scope)
      ti._patch_builtin(lang.tensor, ti.interpreter_builder, scope)
      if lang is tl:
        ti._patch_builtin(lang.math, ti.interpreter_builder, scope)
      ti._patch_lang_tensor(lang.tensor, scope)
      ti._patch_lang_core(lang, scope)
    ti._patch_builtin(tl.core.tensor_descriptor_base, ti.interpreter_builder,
                      scope)
    ti._patch_reduce_scan(scope)
    # Library functions decorated with @triton.jit (tl.sum, tl.max, ...).
    wrapped: dict[int, object] = {}
    for mod_name, mod in list(sys.modules.items()):
      if mod is None or not mod_name.startswith("triton.language"):
        continue
      for attr, value in list(vars(mod).items()):
        if isinstance(value, JITFunction):
          w = wrapped.setdefault(id(value), ti.InterpretedFunction(value.fn))
          scope.set_attr(mod, attr, w)
    # Loop variables are int32 tensors in compiled Triton; the interpreter's
    # range yields Python ints, which lack tensor methods such as .to().
    # A library function (tl.sum, ...) patches the language again each time
    # it is called, and would put the int-yielding range back: its patching
    # installs this range too.
    _use_tensor_range(tl, scope)
    scope.set_attr(ti, "_patch_lang_core",
                   _keeping_tensor_range(ti._patch_lang_core))
    # The interpreter's dot multiplies bf16 bit patterns as integers, and its
    # casts truncate (f32 -> bf16) or reinterpret (int <-> bf16) values.
    # Compiled Triton rounds to nearest even; these versions do too.
    scope.set_attr(ti.InterpreterBuilder, "create_dot", _create_dot)
    scope.set_attr(ti.interpreter_builder, "options", dataclasses.replace(
        ti.interpreter_builder.options, debug=debug, sanitize_overflow=False))
    scope.set_attr(ti.InterpreterBuilder, "cast_impl", _cast_impl)
    # Loads, stores and atomics stay inside the run's buffers, and read
    # their operands as contiguous arrays (an atomic's broadcast value was
    # read past its first lane).
    interpret_memory.install(ti, scope)
    # A Python float meeting a bf16 tensor (tl.where(m, float('nan'), x))
    # becomes a bf16 constant; the interpreter's builder had no get_bf16.
    scope.set_attr(ti.InterpreterBuilder, "get_bf16", _get_bf16)
    scope.set_attr(ti.InterpreterBuilder, "create_fp_to_fp", _fp_to_fp)
    for name in ("create_si_to_fp", "create_ui_to_fp", "create_fp_to_si",
                 "create_fp_to_ui", "create_fp_ext", "create_fp_trunc"):
      scope.set_attr(ti.InterpreterBuilder, name, _cast_impl)
    # maxnumf/minnumf (tl.maximum without propagate_nan) return the number
    # when one operand is NaN on the GPU; maximumf/minimumf (with it) follow
    # IEEE 754-2019: NaN wins and -0.0 < +0.0. The interpreter's numpy
    # versions did neither.
    scope.set_attr(ti.InterpreterBuilder, "create_maxnumf", _binary(np.fmax))
    scope.set_attr(ti.InterpreterBuilder, "create_minnumf", _binary(np.fmin))
    scope.set_attr(ti.InterpreterBuilder, "create_maximumf",
                   _binary(ieee_maximum))
    scope.set_attr(ti.InterpreterBuilder, "create_minimumf",
                   _binary(ieee_minimum))
    # Comparisons are int1 (bool) in compiled Triton; the interpreter kept
    # the operands' type on the result handle and cast the booleans to it,
    # so a compared scalar broadcast and and-ed with a mask failed.
    for name, fn in _comparisons().items():
      scope.set_attr(ti.InterpreterBuilder, name, fn)
    scope.set_attr(ti.ReduceOps, "apply_impl",
                   _fast_reduce(ti.ReduceOps.apply_impl))
    # Integer sums wrap around in their type, as on the GPU (numpy's sum
    # widens to int64, and the interpreter then failed to narrow it back).
    scope.set_attr(ti.ReduceOps, "sum", _wrapping_sum)
    yield
  finally:
    scope.restore()


def _get_bf16(self, value):
  import triton.language as tl
  ti = _interpreter()
  return ti.TensorHandle(_encode(np.array([value], np.float32), tl.bfloat16),
                         tl.bfloat16)


def _use_tensor_range(lang, scope):
  scope.set_attr(lang, "range", _tensor_range)
  scope.set_attr(lang, "static_range", _tensor_range)


def _keeping_tensor_range(patch_lang_core):
  def patch(lang, scope):
    patch_lang_core(lang, scope)
    _use_tensor_range(lang, scope)
  return patch


def _tensor_range(arg1, arg2=None, step=None, **kwargs):
  import triton.language as tl
  ti = _interpreter()
  start, end = (0, arg1) if arg2 is None else (arg1, arg2)
  as_int = lambda v: int(v.handle.data.reshape(-1)[0]) if hasattr(v, "handle") \
      else int(v)
  for i in range(as_int(start), as_int(end), as_int(step or 1)):
    yield tl.tensor(ti.TensorHandle(np.array([i], dtype=np.int32), tl.int32),
                    tl.int32)


def _ml_dtype(tl_type):
  """The ml_dtypes type of a Triton float type the interpreter stores as
  unsigned ints (bf16, fp8), or None."""
  import ml_dtypes
  return {"bf16": ml_dtypes.bfloat16, "fp8e4nv": ml_dtypes.float8_e4m3fn,
          "fp8e5": ml_dtypes.float8_e5m2,
          "fp8e4b8": ml_dtypes.float8_e4m3fnuz,
          "fp8e5b16": ml_dtypes.float8_e5m2fnuz}.get(tl_type.name)


def _decode(data: np.ndarray, tl_type) -> np.ndarray:
  ml = _ml_dtype(tl_type)
  return data.view(ml) if ml is not None else data


def _encode(values: np.ndarray, tl_type) -> np.ndarray:
  ti = _interpreter()
  ml = _ml_dtype(tl_type)
  if ml is not None:
    return np.asarray(values).astype(np.float32).astype(ml).view(
        ti._get_np_dtype(tl_type))
  target = ti._get_np_dtype(tl_type)
  if target == np.bool_:
    return np.asarray(values) != 0
  values = np.asarray(values)
  if values.dtype.kind == "V" or values.dtype.name in ("bfloat16",) or \
      values.dtype.name.startswith("float8"):
    values = values.astype(np.float32)
  return values.astype(target)


def _cast_impl(self, src, dst_type, *unused):
  ti = _interpreter()
  out = _encode(_decode(src.data, src.dtype.scalar), dst_type.scalar)
  return ti.TensorHandle(out, dst_type.scalar)


def _fp_to_fp(self, src, dst_type, rounding_mode):
  return _cast_impl(self, src, dst_type)


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
  ti = _interpreter()
  a_data = _decode(a.data, a.dtype.scalar).astype(np.float32) \
      if _ml_dtype(a.dtype.scalar) is not None else a.data
  b_data = _decode(b.data, b.dtype.scalar).astype(np.float32) \
      if _ml_dtype(b.dtype.scalar) is not None else b.data
  # Products and sums in the accumulator's type, as the GPU's MMA does
  # (int8 x int8 accumulates in int32, f16 x f16 in float32).
  out = np.matmul(a_data, b_data, dtype=d.data.dtype) + d.data
  return ti.TensorHandle(out, d.dtype.scalar)


def _binary(np_fn):
  def create(self, lhs, rhs):
    return self.binary_op(lhs, rhs, np_fn)
  return create


_ORDERED = {"LT": np.less, "GT": np.greater, "LE": np.less_equal,
            "GE": np.greater_equal, "EQ": np.equal, "NE": np.not_equal}


def _compare(np_fn, unordered: bool):
  def create(self, lhs, rhs):
    import triton.language as tl
    a = _decode(lhs.data, lhs.dtype.scalar)
    b = _decode(rhs.data, rhs.dtype.scalar)
    out = np.asarray(np_fn(a, b))
    if unordered:                       # true when either operand is NaN
      out = out | np.isnan(a) | np.isnan(b)
    return _interpreter().TensorHandle(out.astype(bool), tl.int1)
  return create


def _comparisons() -> dict:
  """create_icmp*/create_fcmp* of the builder, giving int1 results."""
  table = {}
  for cond, fn in _ORDERED.items():
    for sign in ("S", "U"):
      if cond in ("EQ", "NE"):
        table[f"create_icmp{cond}"] = _compare(fn, False)
      else:
        table[f"create_icmp{sign}{cond}"] = _compare(fn, False)
    table[f"create_fcmpO{cond}"] = _compare(fn, False)
    # UNE is `!=`: np.not_equal is already true for NaN
    table[f"create_fcmpU{cond}"] = _compare(fn, cond != "NE")
  return table


def _signed_zero(out, a, b, pick_negative: bool):
  """`out` with equal operands (+0.0 vs -0.0) resolved by their sign bits."""
  a, b = np.broadcast_arrays(np.asarray(a), np.asarray(b))
  if a.dtype.kind != "f":
    return out
  sign = (np.signbit(a) | np.signbit(b)) if pick_negative else (
      np.signbit(a) & np.signbit(b))
  return np.where(a == b, np.where(sign, -np.abs(a), np.abs(a)), out)


def ieee_maximum(a, b):
  """IEEE 754-2019 maximum: NaN propagates, -0.0 < +0.0."""
  return _signed_zero(np.maximum(a, b), a, b, pick_negative=False)


def ieee_minimum(a, b):
  """IEEE 754-2019 minimum: NaN propagates, -0.0 < +0.0."""
  return _signed_zero(np.minimum(a, b), a, b, pick_negative=True)


def _reduce_extreme(values, axis: int, keepdims: bool, kind: str):
  """np.max/np.min (NaN propagates) with IEEE's order of signed zeros."""
  out = getattr(np, kind)(values, axis=axis, keepdims=True)
  if values.dtype.kind == "f":
    zero = (values == 0)
    sign = np.signbit(values)
    if kind == "max":   # -0.0 only if every zero is -0.0
      neg = ~np.any(zero & ~sign, axis=axis, keepdims=True)
    else:               # -0.0 if any zero is -0.0
      neg = np.any(zero & sign, axis=axis, keepdims=True)
    out = np.where(out == 0, np.where(neg, -0.0, 0.0).astype(out.dtype), out)
  return out if keepdims else np.squeeze(out, axis=axis)


def _wrapping_sum(self, input):
  data = input.handle.data
  out = np.sum(data, axis=self.axis, keepdims=self.keep_dims, dtype=data.dtype)
  return self.to_tensor(out, input.dtype)


def _fast_reduce(generic):
  """`ReduceOps.apply_impl` that runs the NaN-propagating combine helpers
  of the generated source (rules.reductions.NAN_REDUCTIONS) with numpy: the
  interpreter would call them once per element. np.max/np.min propagate
  NaN and np.argmax/np.argmin pick the first NaN, else the first extreme,
  which is what those helpers compute."""

  def apply_impl(self, inputs):
    kind = NAN_REDUCTIONS.get(getattr(getattr(self.combine_fn, "fn", None),
                                      "__name__", None))
    if kind is None or self.axis is None:
      return generic(self, inputs)
    values = inputs[0].handle.data
    if kind in ("max", "min"):
      out = _reduce_extreme(values, self.axis, self.keep_dims, kind)
      return [self.to_tensor(out, inputs[0].dtype)]
    pos = np.expand_dims(getattr(np, kind)(values, axis=self.axis), self.axis)
    outs = []
    for t in inputs:
      picked = np.take_along_axis(t.handle.data, pos, axis=self.axis)
      if not self.keep_dims:
        picked = np.squeeze(picked, axis=self.axis)
      outs.append(self.to_tensor(picked, t.dtype))
    return outs
  return apply_impl


def _pointer(array: np.ndarray, dtype):
  import triton.language as tl
  ti = _interpreter()
  ty = tl.pointer_type(dtypes.tl_object(dtype))
  handle = ti.TensorHandle(np.array([array.ctypes.data], dtype=np.uint64), ty)
  return tl.tensor(handle, ty)


_LOC = re.compile(r"^\s*# (\S+:\d+)(?::|$)")


def user_line(source: str, lineno: int) -> str | None:
  """The user's source line commented above line `lineno` of `source`."""
  lines = source.splitlines()
  for k in range(min(lineno, len(lines)) - 1, -1, -1):
    m = _LOC.match(lines[k])
    if m and not lines[k].lstrip().startswith("# Triton kernel"):
      return m.group(1)
  return None


def _generated_frame(gk: GeneratedKernel, exc: BaseException):
  """(frame, line number) of the generated kernel where `exc` was raised,
  or (None, None)."""
  filename = loader.filename_of(gk.source, gk.fn_name)
  found = (None, None)
  e = exc
  while e is not None:
    for frame, lineno in traceback.walk_tb(e.__traceback__):
      if frame.f_code.co_filename == filename:
        found = (frame, lineno)
    e = e.__cause__ or e.__context__
    if found[0] is not None:
      break
  return found


def _generated_lineno(gk: GeneratedKernel, exc: BaseException) -> int | None:
  return _generated_frame(gk, exc)[1]


def _failed_check(gk: GeneratedKernel, e: AssertionError) -> KernelCheckError:
  """The KernelCheckError of a failed `tl.device_assert`, with the values
  its line names filled in (lowering_triton/check_values.py)."""
  frame, lineno = _generated_frame(gk, e)
  lines = gk.source.splitlines()
  line = lines[lineno - 1] if lineno and lineno <= len(lines) else ""
  message, where = checks.split_check_text(str(e))
  message = fill_in(message, line, frame)
  return KernelCheckError(gk.name, message, where or gk.where)


BUFFER_ALIGNMENT = 64   # as XLA's buffers: tensor descriptors need 16


def _aligned_copy(a, dtype=None) -> np.ndarray:
  """A C-contiguous copy of `a` whose data starts at a multiple of
  BUFFER_ALIGNMENT bytes."""
  a = np.asarray(a, dtype)
  raw = np.empty(a.nbytes + BUFFER_ALIGNMENT, np.uint8)
  skip = (-raw.ctypes.data) % BUFFER_ALIGNMENT
  out = raw[skip:skip + a.nbytes].view(a.dtype).reshape(a.shape)
  out[...] = a
  return out


def _buffers(gk: GeneratedKernel, arrays) -> tuple[dict, list[np.ndarray]]:
  """Kernel parameter name -> numpy buffer, and the output buffers (poison,
  what the memory a kernel never writes holds, or a copy of the aliased
  input), each aligned as XLA's buffers are."""
  operands = [_aligned_copy(a) for a in arrays]
  n_pf = sum(p.kind == "prefetch" for p in gk.params)
  aliases = {o: i for i, o in gk.aliases}
  outs = []
  for p in gk.params:
    if p.kind == "output":
      src = aliases.get(p.index)
      outs.append(_aligned_copy(
          np.full(p.shape, poison_value(p.dtype), p.dtype) if src is None
          else operands[src], p.dtype))
  prefetch, inputs = KernelLayout.of(prefetch=n_pf, inputs=None).split(
      operands)
  by_kind = {"prefetch": prefetch, "input": inputs,
             "const": [_aligned_copy(c) for c in gk.consts],
             "output": outs}
  return {p.name: by_kind[p.kind][p.index] for p in gk.params}, outs


_PARAM_ROLES = {"prefetch": "scalar prefetch {}", "input": "in_specs[{}]",
                "output": "out_specs[{}]", "const": "constant {}"}


def _buffer_names(gk: GeneratedKernel, buffers: dict) -> dict:
  """Buffers by the name an error gives them: `in0 (in_specs[0])`."""
  roles = {p.name: _PARAM_ROLES[p.kind].format(p.index) for p in gk.params}
  return {f"{name.removesuffix('_ptr')} ({roles.get(name, name)})": buf
          for name, buf in buffers.items()}


def _out_of_bounds(exc: BaseException):
  while exc is not None:
    if isinstance(exc, interpret_memory.OutOfBounds):
      return exc
    exc = exc.__cause__ or exc.__context__
  return None


def run(gk: GeneratedKernel, arrays) -> list[np.ndarray]:
  """Runs the kernel over its grid with Triton's interpreter."""
  jf = loader.jit_function(gk)
  ti = _interpreter()
  fn = ti.InterpretedFunction(jf.fn).rewrite()
  buffers, outs = _buffers(gk, arrays)
  gx, gy, gz = gk.launch_grid
  with _LOCK, np.errstate(all="ignore"), _interpreter_scope(gk.debug), \
      interpret_memory.guard(_buffer_names(gk, buffers),
                             config.enable_runtime_assert()):
    ti.interpreter_builder.set_grid_dim(gx, gy, gz)
    kwargs = {name: _pointer(buf, buf.dtype) for name, buf in buffers.items()}
    try:
      for x in range(gx):
        for y in range(gy):
          for z in range(gz):
            ti.interpreter_builder.set_grid_idx(x, y, z)
            fn(**kwargs)
    except AssertionError as e:     # a failed tl.device_assert: a check
      raise _failed_check(gk, e) from None
    except Exception as e:
      lineno = _generated_lineno(gk, e)
      where = user_line(gk.source, lineno) if lineno else None
      oob = _out_of_bounds(e)
      if oob is not None:
        raise KernelRuntimeError(gk.name, str(oob), where or gk.where) from None
      raise BackendError(
          gk.name, f"Triton's interpreter failed running the generated kernel "
          f"(generated line {lineno}): {type(e).__name__}: {e}",
          where or gk.where) from e
    finally:
      if gk.has_side_effects:
        sys.stdout.flush()      # tl.device_print output, in program order
  return outs


def _lowering(ctx, *args, spec):
  gk = generate(spec)
  result_shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype)
                   for a in spec.grid_mapping.out_avals]

  axis_context = ctx.module_context.axis_context

  def call(*xs):
    outs, failed = host_failures.call_host(
        lambda *arrays: run(gk, arrays), result_shapes, *xs, kernel=spec.name,
        source=spec.kernel_src)
    host_failures.raise_parked(axis_context, failed)
    return outs

  # Inside shard_map the operands vary over manual axes and the callback's
  # results are per device, as the interpret backend's are.
  check_vma = getattr(jax_config, "_check_vma", None)
  guard = check_vma(False) if check_vma is not None else contextlib.nullcontext()
  with guard:
    return mlir.lower_fun(call, multiple_results=True)(ctx, *args)

