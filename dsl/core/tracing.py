"""Tracing a kernel body to a jaxpr over ref block avals.

The kernel jaxpr takes `(*grid_indices, *prefetch_refs, *in_refs, *out_refs,
*scratch_refs)`. Grid indices are ordinary int32 inputs: `program_id(axis)`
returns the tracer of that input, so every backend sees them the same way
(Triton as `tl.program_id`, Mosaic as the kernel's index arguments, the
interpreter as vectorized values). `num_programs(axis)` is a static int, or
for a dim whose size is traced a `num_programs` equation at the kernel's
top level (dsl.core.dynamic_grid).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import traceback
from typing import Any

import jax
import jax.numpy as jnp
from dsl.core.jax_internals import (api_util, close_jaxpr, ClosedJaxpr, core,
                                    linear_util as lu, mesh as mesh_lib,
                                    partial_eval as pe)

from dsl.core import dynamic_grid, fixits, refs as refs_mod
from dsl.core.blockspec import BlockMapping, call_mismatch
from dsl.core.errors import (KernelError, KernelTypeError, function_location,
                             frame_of_traceback, kernel_name,
                             raise_from_user_frames,
                             source_excerpt, tracing_kernel, user_frame,
                             user_traceback)
from dsl.core import named_axes
from dsl.core.gridspec import GridMapping


@dataclasses.dataclass
class _GridEnv:
  kernel: str
  indices: tuple[Any, ...]
  sizes: tuple[int, ...]
  names: frozenset = frozenset()
  trace: Any = None        # the kernel body's top-level trace


_GRID_ENV: contextvars.ContextVar[_GridEnv | None] = contextvars.ContextVar(
    "dsl_grid_env", default=None)


def program_id(axis: int):
  """The index of this program along grid axis `axis`."""
  env = _GRID_ENV.get()
  if env is None:
    raise KernelError("<none>", "program_id can only be called inside a "
                      "kernel body", user_frame())
  if not 0 <= axis < len(env.indices):
    raise KernelError(env.kernel, f"program_id({axis}) is outside the grid of "
                      f"rank {len(env.indices)}", user_frame())
  return env.indices[axis]


def num_programs(axis: int):
  """The grid's size along `axis`: a static int, or an int32 scalar where
  the size is traced."""
  env = _GRID_ENV.get()
  if env is None:
    raise KernelError("<none>", "num_programs can only be called inside a "
                      "kernel body", user_frame())
  if not 0 <= axis < len(env.sizes):
    raise KernelError(env.kernel, f"num_programs({axis}) is outside the grid "
                      f"of rank {len(env.sizes)}", user_frame())
  if dynamic_grid.is_dynamic(env.sizes[axis]):
    return dynamic_grid.bind_num_programs(env.trace, axis)
  return env.sizes[axis]


def in_kernel_body() -> bool:
  """Whether a kernel body is being traced."""
  return _GRID_ENV.get() is not None


@contextlib.contextmanager
def grid_env(kernel: str, indices, sizes, names=()):
  """Inside it, `program_id` and `num_programs` speak of this grid; a
  dynamic size's `num_programs` is bound in the trace current on entry."""
  token = _GRID_ENV.set(_GridEnv(kernel, tuple(indices), tuple(sizes),
                                 frozenset(n for n in names or () if n),
                                 dynamic_grid.current_trace()))
  try:
    with tracing_kernel(kernel):
      yield
  finally:
    _GRID_ENV.reset(token)


def traced_kernel_name() -> str | None:
  """The name of the kernel whose body is being traced, or None."""
  env = _GRID_ENV.get()
  return env.kernel if env is not None else None


def grid_axis_names() -> frozenset:
  """The named grid axes of the kernel being traced (they are in JAX's axis
  environment beside any shard_map mesh axes)."""
  env = _GRID_ENV.get()
  return env.names if env is not None else frozenset()



def _param_names(fn, n):
  try:
    names = [p.name for p in inspect.signature(fn).parameters.values()]
  except (TypeError, ValueError):
    names = []
  return names + [f"arg{i}" for i in range(len(names), n)]


def kernel_ref_names(kernel_fn, gm: GridMapping) -> tuple[str | None, ...]:
  """The user's name of each flat kernel ref (prefetch, inputs, outputs,
  scratch): its parameter's name, with the pytree path inside it (`sem`,
  `bufs[1]`, `refs[0]` for `*refs`), as JAX names a function's arguments;
  None where unknown."""
  names: list[str | None] = [None] * gm.num_refs
  try:
    params = list(inspect.signature(kernel_fn).parameters.values())
    args = gm.unflatten_kernel_refs(list(range(gm.num_refs)))
  except (TypeError, ValueError):
    return tuple(names)
  named = []
  for k, p in enumerate(params):
    if p.kind == p.VAR_POSITIONAL:
      named += [(f"{p.name}[{j}]", a) for j, a in enumerate(args[k:])]
      break
    if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
      break
    if k < len(args):
      named.append((p.name, args[k]))
  for name, arg in named:
    for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
      if isinstance(leaf, int) and 0 <= leaf < len(names):
        names[leaf] = name + jax.tree_util.keystr(path)
  return tuple(names)


def trace_kernel(kernel_fn, name: str, gm: GridMapping, where: str
                 ) -> ClosedJaxpr:
  """Traces `kernel_fn` over the block refs of `gm`; checks its arity."""
  n_refs = gm.num_refs
  n_args = len(gm.unflatten_kernel_refs([object()] * n_refs))
  mismatch = call_mismatch(kernel_fn, n_args, kernel_name(kernel_fn))
  if mismatch is not None:
    raise KernelTypeError(
        name, f"{mismatch}: pallas_call passes "
        f"{gm.num_scalar_prefetch} scalar prefetch + {gm.num_inputs} inputs + "
        f"{gm.num_outputs} outputs + {len(gm.scratch_avals)} scratch refs",
        f"{where} (kernel defined at {function_location(kernel_fn)})")
  grid_avals = [core.ShapedArray((), jnp.int32)] * len(gm.grid)
  ref_avals = list(gm.ref_avals)
  origins = list(gm.ref_origins)
  param_names = _param_names(kernel_fn, n_refs)
  traced_names: dict = {}

  def flat(*args):
    ids, refs = args[:len(gm.grid)], args[len(gm.grid):]
    names = {id(r): f"{pn} ({o})" for r, pn, o in zip(refs, param_names,
                                                       origins)}
    names["__kernel__"] = name
    traced_names.update(names)
    token = refs_mod._ACTIVE.set(names)
    try:
      with grid_env(name, ids, gm.grid, gm.grid_names):
        out = kernel_fn(*gm.unflatten_kernel_refs(refs))
    finally:
      refs_mod._ACTIVE.reset(token)
    if out is not None:
      # Pallas's wording, so code that matches its error matches ours.
      raise KernelError(
          name, f"The kernel function in the pallas_call "
          f"{kernel_name(kernel_fn)} at "
          f"{function_location(kernel_fn)} should return None (it writes its "
          f"results to its output refs), but it returned "
          f"{type(out).__name__}", function_location(kernel_fn))
    return []

  dbg = api_util.debug_info(f"kernel {name}", kernel_fn,
                            tuple(range(len(grid_avals) + len(ref_avals))), {})
  try:
    with _blocks_mesh(), named_axes.bind_grid_axes(gm):
      jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(
          lu.wrap_init(flat, debug_info=dbg), [*grid_avals, *ref_avals])
      closed = named_axes.rewrite(close_jaxpr(jaxpr, consts), name, gm)
  except KernelError as e:
    __tracebackhide__ = True
    raise e.with_traceback(user_traceback(e.__traceback__))
  except Exception as e:
    __tracebackhide__ = True
    _raise_trace_error(e, name, gm, where, traced_names,
                       dict(zip(param_names, origins)))
  return closed


def _blocks_mesh():
  """The mesh a kernel body is traced under: none, unless inside
  shard_map. Blocks are never sharded; a mesh from `jax.set_mesh` would put
  sharding annotations in the kernel (and in each device's part of a
  partitioned kernel)."""
  am = mesh_lib.get_abstract_mesh()
  if am.empty or am.manual_axes:
    return contextlib.nullcontext()
  return mesh_lib.use_abstract_mesh(mesh_lib.empty_abstract_mesh)


def _raise_trace_error(e, name, gm, where, traced_names, origins):
  """Raises the KernelError for an exception from the kernel body: a fix-it
  hint where one applies, pointing at the user's line."""
  __tracebackhide__ = True
  line = frame_of_traceback(e.__traceback__) or where
  operand = _operand_in_traceback(e.__traceback__, traced_names)
  mappings = gm.per_ref(lambda a: None, lambda bm: bm, lambda bm: bm,
                        lambda a: None)
  params = {pn: (bm if isinstance(bm, BlockMapping) else None)
            for pn, bm in zip(origins, mappings)}
  labels = {pn: f"{pn} ({o})" for pn, o in origins.items()}
  ctx = fixits.HintContext(operand, line, params, gm.grid, labels)
  message = fixits.hint(e, ctx)
  # The class of the user's error is kept (a TypeError stays a TypeError),
  # so code that catches Pallas's errors catches ours.
  cls = KernelTypeError if isinstance(e, TypeError) else KernelError
  err = cls(name, message or f"{type(e).__name__}: {e}", line,
            operand=ctx.operand, detail=source_excerpt(line))
  raise_from_user_frames(err, e)


def _operand_in_traceback(tb, names: dict) -> str | None:
  """Names the kernel ref that the failing statement touched: the one ref
  among the parameters of the innermost function that was passed exactly
  one (a function passed several, such as the kernel body, does not say
  which; other locals may be left over from loops)."""
  for frame, _ in reversed(list(traceback.walk_tb(tb))):
    code = frame.f_code
    params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    found = {names[id(base)] for p in params
             if id(base := getattr(frame.f_locals.get(p), "ref",
                                   frame.f_locals.get(p))) in names}
    if len(found) == 1:
      return found.pop()
  return None
