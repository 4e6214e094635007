"""The base of every backend's compiler parameters (`pl.CompilerParams`),
and the launch parameters an enclosing `dsl.autotune` config sets."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses


class CompilerParams:
  """Base class of `tpu.CompilerParams` and `triton.CompilerParams`: code
  may test `isinstance(params, pl.CompilerParams)`."""
  __slots__ = ()


# Launch parameters (num_warps, num_stages) that an enclosing autotuned
# call chose without the tuned function taking them.
_TUNED: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "dsl_tuned_launch", default=None)


@contextlib.contextmanager
def tuned_launch(params: dict | None):
  """Gives `params` to every pallas_call inside that names no
  compiler_params (see `tuned_params`)."""
  token = _TUNED.set(params or None)
  try:
    yield
  finally:
    _TUNED.reset(token)


def tuned_params(params_class: type | None):
  """The tuned launch parameters as an instance of a backend's compiler
  params class, when it takes them all; else None."""
  launch = _TUNED.get()
  if not launch or params_class is None:
    return None
  fields = {f.name for f in dataclasses.fields(params_class)}
  if not set(launch) <= fields:
    return None
  return params_class(**launch)
