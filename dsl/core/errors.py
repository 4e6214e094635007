"""Errors raised for bad kernels, and the user's source line they point at."""
from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import linecache
import os
import sys
import threading
import traceback
import types

import jax
from dsl.core.jax_internals import core, source_info_util, traceback_util

from dsl.core import config

_JAX_DIR = os.path.dirname(jax.__file__)
_DSL_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PY_LIB = os.path.dirname(os.__file__)


def _is_internal(filename: str) -> bool:
  filename = os.path.abspath(filename)
  return (filename.startswith(_JAX_DIR) or filename.startswith(_DSL_DIR)
          or filename.startswith(_PY_LIB) or "jaxlib" in filename
          or "/lowering_triton/" in filename or "/lowering_mosaic/" in filename)


def hide_package_frames(path: str) -> None:
  """Leaves the frames of the package at `path` out of the tracebacks users
  see (JAX's traceback filtering) and out of JAX's source lines."""
  directory = os.path.dirname(os.path.abspath(path))
  traceback_util.register_exclusion(directory)
  source_info_util.register_exclusion(directory)


hide_package_frames(os.path.join(_DSL_DIR, "__init__.py"))


def _generated_method(code) -> bool:
  """A method that dataclasses and namedtuples generate: compiled from a
  string (`<string>`), named `__init__`, `__eq__`, ... The user's own
  `python -c` and `exec` code is compiled from a string too."""
  filename, name = code.co_filename, code.co_name
  return (filename.startswith("<") and filename.endswith(">")
          and name.startswith("__") and name.endswith("__"))


def _internal_flags(frames) -> list[bool]:
  """Whether each frame (outermost first) is internal. A generated method is
  internal when its caller is: JAX's dataclasses' `__init__` is JAX's."""
  flags, caller = [], None
  for frame in frames:
    filename = frame.f_code.co_filename
    if _generated_method(frame.f_code):
      if caller is None:
        back = frame.f_back
        caller = back is not None and _is_internal(back.f_code.co_filename)
      internal = caller
    else:
      internal = _is_internal(filename)
    flags.append(internal)
    caller = internal
  return flags


def _user_tb_frames(tb) -> list:
  """(frame, lineno) of `tb`'s user frames, outermost first."""
  entries = list(traceback.walk_tb(tb))
  flags = _internal_flags([f for f, _ in entries])
  return [e for e, internal in zip(entries, flags) if not internal]


def user_traceback(tb):
  """`tb` without the frames of jax, dsl and the lowerings: the user's own
  frames (the kernel body's line among them)."""
  out = None
  for frame, lineno in reversed(_user_tb_frames(tb)):
    out = types.TracebackType(out, frame, frame.f_lasti, lineno)
  return out


def api_boundary(fn):
  """JAX's API boundary: an exception raised below `fn` reaches the user
  with jax's, dsl's and the lowerings' frames filtered out."""
  return traceback_util.api_boundary(fn)


def raise_from_user_frames(err: BaseException, cause: BaseException):
  """Raises `err` in place of `cause`, with the user's frames of `cause`
  (e.g. the kernel body's line) as its traceback. The internal traceback of
  `cause` is chained only when JAX's traceback filtering is off or
  jax_pallas_verbose_errors is on; `err.original_error` keeps it."""
  err.original_error = cause
  if verbose_errors() or traceback_util._filtering_mode() == "off":
    raise err from cause
  err.__suppress_context__ = True
  raise err.with_traceback(user_traceback(cause.__traceback__))


def kernel_name(fn) -> str:
  """The name of a kernel function, seen through `functools.partial`."""
  while isinstance(fn, functools.partial):
    fn = fn.func
  return getattr(fn, "__name__", "kernel")


def in_user_code(filename: str) -> bool:
  """Whether `filename` is the user's (not jax, dsl, a lowering, stdlib)."""
  return not _is_internal(filename)


def user_frame(skip_internal: bool = True) -> str:
  """Returns 'file:line' of the innermost frame outside jax and dsl."""
  frames = []
  frame = sys._getframe(1)
  while frame is not None:
    frames.append(frame)
    frame = frame.f_back
  frames.reverse()
  flags = (_internal_flags(frames) if skip_internal
           else [False] * len(frames))
  for frame, internal in zip(reversed(frames), reversed(flags)):
    if not internal:
      return f"{frame.f_code.co_filename}:{frame.f_lineno}"
  return "<unknown>"


def frame_of_traceback(tb) -> str | None:
  """The innermost user 'file:line' in an exception's traceback."""
  frames = _user_tb_frames(tb)
  if not frames:
    return None
  frame, lineno = frames[-1]
  return f"{frame.f_code.co_filename}:{lineno}"


def source_info_frame(source_info) -> str | None:
  """'file:line' of a jaxpr equation's user frame."""
  if source_info is None:
    return None
  return traceback_frame(source_info.traceback)


def traceback_frame(tb) -> str | None:
  """'file:line' of the innermost user frame of a JAX traceback."""
  if tb is None:
    return None
  for frame in source_info_util.user_frames(tb):
    if not _is_internal(frame.file_name):
      return f"{frame.file_name}:{frame.start_line}"
  return None


def function_location(fn) -> str:
  while isinstance(fn, functools.partial):
    fn = fn.func
  code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
  if code is None:
    return "<unknown>"
  return f"{code.co_filename}:{code.co_firstlineno}"


_LOWERING_KERNEL: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "dsl_lowering_kernel", default=None)
_TRACING_KERNEL: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "dsl_tracing_kernel", default=None)


@contextlib.contextmanager
def tracing_kernel(name: str):
  """Names the kernel whose body is being traced, for errors raised
  meanwhile (dsl.core.tracing enters it around the body)."""
  token = _TRACING_KERNEL.set(name)
  try:
    yield
  finally:
    _TRACING_KERNEL.reset(token)


@contextlib.contextmanager
def lowering_kernel(name: str):
  """Names the kernel a backend is lowering, for errors raised meanwhile."""
  token = _LOWERING_KERNEL.set(name)
  try:
    yield
  finally:
    _LOWERING_KERNEL.reset(token)


def current_kernel() -> str:
  """The name of the kernel being traced or lowered ('<kernel>' if none)."""
  return (_TRACING_KERNEL.get() or _LOWERING_KERNEL.get()
          or "<kernel>")


def verbose_errors() -> bool:
  """JAX's own jax_pallas_verbose_errors option."""
  return config.verbose_errors()


class KernelError(ValueError):
  """A kernel or its specs are wrong; the message names kernel, operand, line.

  `kernel=None` names the kernel being traced or lowered.

  With `jax_pallas_verbose_errors` on, the message also carries `detail`
  (the kernel's source or jaxpr with the failing line marked); off, it is
  one line ending in the user's file:line.
  """

  def __init__(self, kernel: str | None, message: str,
               where: str | None = None, operand: str | None = None,
               detail: str | None = None):
    kernel = self._record(kernel, message, where, operand, detail)
    parts = [f"kernel '{kernel}'"]
    if operand:
      parts.append(operand)
    head = ", ".join(parts) + f": {message}"
    if verbose_errors():
      text = head + (f"\n  at {where}" if where else "")
      if detail:
        text += "\n" + detail
    else:
      text = " ".join(head.split("\n")[0:1]) + (f" (at {where})" if where else "")
    super().__init__(text)

  def _record(self, kernel, message, where, operand, detail) -> str:
    """Keeps the parts of the message; returns the kernel's name (the one
    being traced when `kernel` is None)."""
    kernel = current_kernel() if kernel is None else kernel
    self.kernel = kernel
    self.operand = operand
    self.where = where
    self.short = message
    self.detail = detail
    return kernel


class KernelRuntimeError(KernelError, jax.errors.JaxRuntimeError):
  """A kernel failed while it ran: a failed run-time check, a deadlock, a
  race or an out-of-bounds access found by a host backend.

  The first line of the message is always `kernel 'name': message (at
  file:line)`; `detail` (values, grid point, device) follows on the next
  lines. It is a `jax.errors.JaxRuntimeError`, which is what JAX raises
  when the same failure happens inside `jax.jit` (see `kernel_error_of`).
  """

  def __init__(self, kernel: str | None, message: str,
               where: str | None = None, operand: str | None = None,
               detail: str | None = None):
    kernel = self._record(kernel, message, where, operand, detail)
    head = f"kernel '{kernel}'" + (f", {operand}" if operand else "")
    text = f"{head}: {message}" + (f" (at {where})" if where else "")
    self.text = text + (f"\n{detail}" if detail else "")
    jax.errors.JaxRuntimeError.__init__(self, self.text)

  def __str__(self):
    return self.text

  def __reduce__(self):
    return (type(self), (self.kernel, self.short, self.where, self.operand,
                         self.detail))


class KernelCheckError(KernelRuntimeError):
  """A run-time check (`pl.debug_check`, `checkify.check`) failed."""


class KernelDeadlockError(KernelRuntimeError):
  """A DMA or semaphore wait can never finish."""


class KernelRaceError(KernelRuntimeError):
  """A buffer was touched while a DMA into or out of it was in flight."""


class KernelTypeError(KernelError, TypeError):
  """A KernelError about types (dtype mismatches, non-integer indices)."""


class BackendError(KernelError, NotImplementedError):
  """A backend cannot run the kernel (missing, unsupported primitive)."""


class KernelWarning(UserWarning):
  """Something in a kernel is likely wrong but cannot be proven at trace
  time; the message reads like a KernelError's."""

  def __init__(self, kernel: str, message: str, where: str | None = None,
               operand: str | None = None):
    head = f"kernel '{kernel}'" + (f", {operand}" if operand else "")
    super().__init__(f"{head}: {message}" + (f" (at {where})" if where
                                             else ""))


# ------------------------------------------------------------ host failures
#
# A kernel failure found by a host backend (dsl/core/host_failures.py) is parked
# here under an id; a host callback raises it, and XLA hands it to the caller
# of a jitted function as a JaxRuntimeError whose text ends in
# `KernelCheckError: kernel ...`. The eager pallas_call re-raises the error
# itself, and `kernel_error_of` finds it behind a JaxRuntimeError.

_PARKED: collections.OrderedDict[int, KernelError] = collections.OrderedDict()
_PARKED_LOCK = threading.Lock()
_MAX_PARKED = 64
_next_id = iter(range(1, 2**23))
# Ids carry the process that parked the error (a job of several processes
# exchanges them between processes): id = n * PROCESSES + process index.
PROCESSES = 256


def park(err: KernelError) -> int:
  """Keeps `err` for `parked`; returns its id (never 0). The tracebacks of
  `err` and of its cause go: their frames hold the failed run's buffers."""
  for e in (err, err.__cause__, err.__context__):
    if e is not None:
      e.__traceback__ = None
  with _PARKED_LOCK:
    key = next(_next_id) * PROCESSES + jax.process_index() % PROCESSES
    _PARKED[key] = err
    while len(_PARKED) > _MAX_PARKED:
      _PARKED.popitem(last=False)
  return key


def parked(key: int) -> KernelError | None:
  with _PARKED_LOCK:
    return _PARKED.get(int(key))


def kernel_error_of(exc: BaseException) -> KernelError | None:
  """The KernelError behind `exc`: `exc` itself, or the error a kernel's host
  backend reported when `exc` is what XLA made of it (`jax.jit` raises a
  JaxRuntimeError, or a ValueError from its C++ fast path, whose text ends
  with the error's). None when `exc` has nothing to do with a kernel."""
  if isinstance(exc, KernelError):
    return exc
  text = str(exc)
  with _PARKED_LOCK:
    for err in reversed(_PARKED.values()):
      if f"{type(err).__name__}: {err}" in text:
        return err
  return None


def source_excerpt(where: str | None, context: int = 3) -> str | None:
  """The source lines around 'file:line', the line itself marked '>'."""
  if not where or ":" not in where:
    return None
  filename, _, line = where.rpartition(":")
  line = line.split(" ")[0]
  if not line.isdigit():
    return None
  n = int(line)
  rows = []
  for k in range(max(1, n - context), n + context + 1):
    text = linecache.getline(filename, k)
    if text:
      rows.append(f"{'>' if k == n else ' '} {k:5d} | {text.rstrip()}")
  return "\n".join(rows) or None


def marked_jaxpr(jaxpr, failing_eqn) -> str:
  """The kernel jaxpr, one equation a line, the failing one marked '>>>'."""
  ctx = core.JaxprPpContext()
  settings = core.JaxprPpSettings()
  inner = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr

  def contains(eqn):
    if eqn is failing_eqn:
      return True
    for v in eqn.params.values():
      for x in (v if isinstance(v, (tuple, list)) else (v,)):
        j = getattr(x, "jaxpr", x)
        if isinstance(j, core.Jaxpr) and any(contains(e) for e in j.eqns):
          return True
    return False

  args = " ".join(str(core.pp_var(v, ctx)) for v in inner.invars)
  rows = [f"    {{ lambda ; {args}. let"]
  for eqn in inner.eqns:
    text = core.pp_eqn(eqn, ctx, settings).format()
    first, *rest = text.split("\n")
    mark = ">>> " if contains(eqn) else "    "
    where = source_info_frame(eqn.source_info)
    rows.append(f"{mark}  {first}" + (f"    # {where}" if where else ""))
    rows += [f"      {r}" for r in rest]
  rows.append("    }")
  return "\n".join(rows)


def eqn_error(cls, kernel: str, eqn, message: str, jaxpr=None,
              operand: str | None = None):
  """An error about one kernel-jaxpr equation, pointing at its source line."""
  where = source_info_frame(eqn.source_info)
  detail = marked_jaxpr(jaxpr, eqn) if (jaxpr is not None and
                                        verbose_errors()) else None
  return cls(kernel, message, where, operand=operand, detail=detail)


__all__ = ["KernelError", "KernelTypeError", "KernelWarning", "BackendError",
           "KernelRuntimeError", "KernelCheckError", "KernelDeadlockError",
           "KernelRaceError", "kernel_error_of", "park", "parked", "user_frame",
           "frame_of_traceback", "source_info_frame", "function_location"]
