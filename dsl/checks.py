"""Runtime checks inside kernels: `debug_check`.

With `jax_pallas_enable_runtime_assert` on, a failing check raises when the
kernel runs; off (the default) checks are ignored.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import debugging
from jax._src.interpreters import batching, mlir
from jax.extend.core import Primitive

debug_check_p = Primitive("debug_check")
debug_check_p.multiple_results = True


class KernelCheckError(RuntimeError):
  """A `debug_check` failed while a kernel ran."""


@debug_check_p.def_effectful_abstract_eval
def _abstract_eval(pred_aval, *fmt_avals, msg, where):
  return [], {debugging.debug_effect}


def _raise_if_false(pred, *fmt_args, msg, where):
  if not np.all(np.asarray(pred)):
    text = msg.format(*[np.asarray(a) for a in fmt_args]) if fmt_args else msg
    raise KernelCheckError(f"{text} (check at {where})")


def _impl(pred, *fmt_args, msg, where):
  from dsl import config
  if config.enable_runtime_assert():
    jax.debug.callback(
        lambda p, *a: _raise_if_false(p, *a, msg=msg, where=where),
        pred, *fmt_args)
  return []


mlir.register_lowering(debug_check_p, mlir.lower_fun(_impl,
                                                     multiple_results=True))


def _batch(args, dims, *, msg, where):
  args = [batching.moveaxis(a, d, 0) if d is not None else a
          for a, d in zip(args, dims)]
  return debug_check_p.bind(*args, msg=msg, where=where), []


batching.primitive_batchers[debug_check_p] = _batch


def debug_check(condition, message: str = "debug_check failed", *fmt_args):
  """Checks `condition` when the kernel runs (see jax_pallas_enable_runtime_assert)."""
  from dsl.errors import user_frame
  debug_check_p.bind(jnp.asarray(condition, jnp.bool_), *fmt_args,
                     msg=message, where=user_frame())
