"""How a kernel failure found on the host reaches the caller.

The host backends (`interpret`'s run-time checks, `triton_interpret`,
`mosaic_interpret`) find failures in host callbacks. An exception raised in a
callback becomes a JaxRuntimeError; but with several devices, a device whose
callback raised alone never reaches its next collective, and the others wait
for it until XLA aborts the process. So a failure takes two steps:

1. `call_host` runs the kernel in a `jax.pure_callback` that never raises: a
   KernelError is parked (dsl.core.errors.park) and its id (0: none) comes back
   with the outputs;
2. `raise_parked` makes every device learn the id (a max over the shard_map
   axes; under a sharded `jax.jit`, a shard_map over its mesh) and raise the
   parked KernelError at the same point of the program, in a callback that
   each device runs.

The caller of an eager pallas_call gets the KernelError itself (its impl
re-raises it); inside `jax.jit`, JAX's JaxRuntimeError, whose message ends
with the same text and which `dsl.core.errors.kernel_error_of` maps back to it.
"""
from __future__ import annotations

import _thread
import atexit
import contextlib
import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from dsl.core.jax_internals import core, dispatch, sharding_impls
from jax.sharding import PartitionSpec

from dsl.core.errors import (PROCESSES, BackendError, KernelError,
                             KernelRuntimeError, kernel_error_of, park, parked)


# Context managers entered around every run of a kernel on the host,
# `hook(kernel, source)`: `dsl.profile`'s timer adds itself.
AROUND_HOST_RUNS: list = []


def call_host(fn, result_shapes, *args, kernel: str,
              source: str | None = None):
  """`jax.pure_callback(fn, result_shapes, *args)`, plus the id of the
  KernelError that `fn` raised (0 if none); outputs are zeros then.
  `kernel`, `source`: the kernel's name and where it is defined (for
  `dsl.profile`)."""

  def host(*arrays):
    try:
      with contextlib.ExitStack() as around:
        for hook in AROUND_HOST_RUNS:
          around.enter_context(hook(kernel, source))
        outs = fn(*arrays)
      return [*outs, np.int32(0)]
    except KernelError as e:
      failure = e
    except Exception as e:  # noqa: BLE001 - a bug of the host backend
      failure = BackendError(kernel, f"the host backend failed: "
                             f"{type(e).__name__}: {e}")
      failure.__cause__ = e
    zeros = [np.zeros(s.shape, s.dtype) for s in result_shapes]
    return [*zeros, np.int32(park(failure))]

  shapes = [*result_shapes, jax.ShapeDtypeStruct((), jnp.int32)]
  *outs, failed = jax.pure_callback(host, shapes, *args,
                                    vmap_method="sequential")
  return outs, failed


def _raise_if_failed(failed):
  """Raises the parked error of the first nonzero id in `failed`."""
  ids = np.asarray(failed).reshape(-1)
  found = ids[ids != 0]
  if not len(found):
    return
  err = parked(int(found[0]))
  if err is None:      # parked in another process of the job
    raise KernelRuntimeError(
        f"<a kernel of process {int(found[0]) % PROCESSES}>",
        "failed on a device of that process of the job, which raises the "
        "error with the kernel's name and line")
  raise err.with_traceback(_user_traceback(err))


_WHERE = re.compile(r"^(.+):(\d+)(?:$|[ ;])")


class _Catch:
  """Keeps the traceback of the exception raised in its `with` block."""

  def __init__(self):
    self.traceback = None
    self.done = _thread.allocate_lock()
    self.done.acquire()

  def __enter__(self):
    return self

  def __exit__(self, kind, value, traceback):
    self.traceback = traceback
    self.done.release()
    return True


def _user_traceback(err: KernelError):
  """A traceback of one frame, the user's line of `err`, or None.

  XLA reports an exception raised in a host callback under `jax.jit` as
  `CpuCallback error calling callback:` and a traceback that runs from the
  innermost frame of the exception's traceback up its callers: the user's
  call, then JAX's frames down to the callback. Raised with this traceback,
  whose one frame stands at the kernel's line and has no caller (it ran as
  the first frame of a thread of its own), the error reads: the user's
  line, then `KernelCheckError: kernel ...`."""
  m = _WHERE.match(err.where or "")
  if m is None or int(m.group(2)) < 2:
    return None
  filename, line = m.group(1), int(m.group(2))
  name = re.sub(r"\W", "_", err.kernel)
  name = name if name.isidentifier() else "kernel"
  # `raise` and the implicit return both on the user's line
  source = "\n" * (line - 2) + f"def {name}():\n with _catch: raise _err\n"
  catch = _Catch()
  namespace = {"_err": err, "_catch": catch}
  try:
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102
    _thread.start_new_thread(namespace[name], ())
  except Exception:  # noqa: BLE001 - then the error goes without it
    return None
  catch.done.acquire()
  return catch.traceback


def manual_axes(axis_context) -> tuple[tuple[str, int], ...]:
  """((axis, size), ...) of the shard_map axes being lowered for, or ()."""
  ac = axis_context
  if not isinstance(ac, sharding_impls.SPMDAxisContext) or not ac.manual_axes:
    return ()
  return tuple((n, int(ac.mesh.shape[n])) for n in ac.mesh.axis_names
               if n in ac.manual_axes)


def _jit_mesh(axis_context):
  """The mesh of a sharded jax.jit (no shard_map) over several devices."""
  ac = axis_context
  if (isinstance(ac, sharding_impls.ShardingContext) and ac.num_devices > 1
      and ac.abstract_mesh is not None and ac.abstract_mesh.axis_names):
    return ac.abstract_mesh
  return None


def raise_parked(axis_context, failed):
  """Raises the KernelError parked under `failed` (traced int32; 0: none) on
  every device; `axis_context`: the lowering context's axis context."""
  axes = manual_axes(axis_context)
  if axes:       # every device raises the failure of the first failing one
    with core.extend_axis_env_nd(list(axes)):
      failed = lax.all_gather(failed, tuple(n for n, _ in axes))
    jax.debug.callback(_raise_if_failed, failed)
    return
  mesh = _jit_mesh(axis_context)
  if mesh is None:
    jax.debug.callback(_raise_if_failed, failed)
    return

  def each_device(f):
    jax.debug.callback(_raise_if_failed, f)
    return f

  jax.shard_map(each_device, mesh=mesh, in_specs=PartitionSpec(),
                out_specs=PartitionSpec(), check_vma=False)(failed)


def forget_failed_runs():
  """Drops the runtime tokens of computations that failed with a kernel
  error; JAX would raise the error again at the next
  `jax.effects_barrier()` and at exit."""
  tokens = getattr(dispatch.runtime_tokens, "output_runtime_tokens", {})
  for device, token in list(tokens.items()):
    try:
      token.block_until_ready()
    except Exception as e:  # noqa: BLE001 - JaxRuntimeError or ValueError
      if kernel_error_of(e) is not None:
        tokens.pop(device, None)


def fresh_copy(err: KernelError) -> KernelError:
  """A new exception of `err`'s class with its message and parts (the parked
  error stays as it was: raising a copy chains nothing onto it)."""
  out = type(err).__new__(type(err))
  out.__dict__.update(err.__dict__)
  out.args = err.args
  return out


def raising_kernel_errors(fn):
  """`fn` (a jitted function, or any function that runs kernels), waiting
  for its results, so that a kernel failure at run time reaches the caller
  as its KernelError class (`KernelCheckError`, `KernelRaceError`, ...)
  chained from the error JAX raised, instead of JAX's `JaxRuntimeError`
  (docs/configuration.md, "Pallas Enable Runtime Assert")."""

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    __tracebackhide__ = True
    try:
      return jax.block_until_ready(fn(*args, **kwargs))
    except Exception as e:  # noqa: BLE001 - JaxRuntimeError or ValueError
      err = kernel_error_of(e)
      if err is None or err is e:
        raise
      forget_failed_runs()
      raise fresh_copy(err).with_traceback(None) from e

  return wrapper


# Runs before JAX's own exit handlers (registered earlier).
atexit.register(forget_failed_runs)


class _ParkedFailureFilter(logging.Filter):
  """Drops JAX's "callback failed" log records (with a full traceback) for
  kernel errors: the error itself reaches the caller."""

  def filter(self, record):
    exc = record.exc_info[1] if record.exc_info else None
    return not isinstance(exc, KernelError)


_FILTER = _ParkedFailureFilter()
for _name in ("jax._src.callback", "jax._src.debugging"):
  logging.getLogger(_name).addFilter(_FILTER)
