"""Errors raised for bad kernels, and the user's source line they point at."""
from __future__ import annotations

import os
import sys
import traceback

import jax

_JAX_DIR = os.path.dirname(jax.__file__)
_DSL_DIR = os.path.dirname(os.path.abspath(__file__))
_PY_LIB = os.path.dirname(os.__file__)


def _is_internal(filename: str) -> bool:
  filename = os.path.abspath(filename)
  return (filename.startswith(_JAX_DIR) or filename.startswith(_DSL_DIR)
          or filename.startswith(_PY_LIB) or "jaxlib" in filename
          or "/lowering_triton/" in filename or "/lowering_mosaic/" in filename)


def user_frame(skip_internal: bool = True) -> str:
  """Returns 'file:line' of the innermost frame outside jax and dsl."""
  for frame in reversed(traceback.extract_stack()):
    if skip_internal and _is_internal(frame.filename):
      continue
    return f"{frame.filename}:{frame.lineno}"
  return "<unknown>"


def frame_of_traceback(tb) -> str | None:
  """The innermost user 'file:line' in an exception's traceback."""
  found = None
  for frame, lineno in traceback.walk_tb(tb):
    if not _is_internal(frame.f_code.co_filename):
      found = f"{frame.f_code.co_filename}:{lineno}"
  return found


def source_info_frame(source_info) -> str | None:
  """'file:line' of a jaxpr equation's user frame."""
  from jax._src import source_info_util
  if source_info is None or source_info.traceback is None:
    return None
  for frame in source_info_util.user_frames(source_info.traceback):
    if not _is_internal(frame.file_name):
      return f"{frame.file_name}:{frame.start_line}"
  return None


def function_location(fn) -> str:
  code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
  if code is None:
    return "<unknown>"
  return f"{code.co_filename}:{code.co_firstlineno}"


class KernelError(ValueError):
  """A kernel or its specs are wrong; the message names kernel, operand, line."""

  def __init__(self, kernel: str, message: str, where: str | None = None,
               operand: str | None = None, detail: str | None = None):
    self.kernel = kernel
    self.operand = operand
    self.where = where
    self.short = message
    parts = [f"kernel '{kernel}'"]
    if operand:
      parts.append(operand)
    text = ", ".join(parts) + f": {message}"
    if where:
      text += f"\n  at {where}"
    if detail:
      text += "\n" + detail
    super().__init__(text)


class KernelTypeError(KernelError, TypeError):
  """A KernelError about types (dtype mismatches, non-integer indices)."""


class BackendError(KernelError, NotImplementedError):
  """A backend cannot run the kernel (missing, unsupported primitive)."""


def in_kernel_source_file(filename: str) -> bool:
  return not _is_internal(filename)


__all__ = ["KernelError", "KernelTypeError", "BackendError", "user_frame",
           "frame_of_traceback", "source_info_frame", "function_location"]
del sys
