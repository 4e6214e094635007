"""Run-time checks of the interpret backend, made values.

The interpret backend runs a kernel as plain JAX ops, vectorized over the
parallel grid dims: a `pl.when` becomes a select that evaluates both branches,
and a loop whose trip count differs between grid points runs every point to
the longest. A check that raised where it stands would fire for grid points
that never reach it. So checks are functionalized: `checked_spec` derives a
kernel that also writes, for each grid point, the error state of its checks
(JAX's checkify threads it through conds and loops), and once the grid has
run one host callback raises the first failure, in grid order, as a
KernelError (dsl/core/errors.py says how it reaches the caller).

Checked are the run-time checks (`pl.debug_check` and `checkify.check` with
jax_pallas_enable_runtime_assert on) and every DMA or semaphore wait: the
interpret backend completes a DMA when it starts and a signal when it is
made, so a wait on a semaphore whose count is short at that point can never
finish. On hardware that wait blocks forever; here it is a
KernelDeadlockError naming the wait, its semaphore and the user's line.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util
from dsl.core.jax_internals import (api_util, checkify as jax_checkify,
                                    close_jaxpr, ClosedJaxpr, core,
                                    linear_util as lu, partial_eval as pe)

from dsl.core import checks, host_failures, primitives
from dsl.core.access import SLICE, DimWindow
from dsl.tpu import primitives as tp
from dsl.core.blockspec import BlockSpec, Element, element_padding
from dsl.core.errors import (KernelCheckError, KernelDeadlockError,
                             KernelError, KernelRuntimeError, park,
                             traceback_frame)
from dsl.core.jaxpr_walk import sub_jaxprs
from dsl.core.kernel_layout import KernelLayout
from dsl.core.operand_layout import pack, unpack
from dsl.core.pallas_call import KernelSpec
from dsl.core.ranges import analyze_kernel
from dsl.core.tracing import program_id
from dsl.transforms.common import block_spec_of, derived_spec, sds
from dsl.transforms.window_checks import WindowOutsideRef, window_check_eqn

_USER_CHECKS = frozenset({jax_checkify.FailedCheckError})


class NeverFinishingWait(jax_checkify.FailedCheckError):
  """A DMA or semaphore wait that nothing before it can satisfy (a user
  check for checkify: `checkify.user_checks` enables it)."""


class BlockOutsideArray(jax_checkify.FailedCheckError):
  """A block index read from data (scalar prefetch) that puts the block
  outside its array (checked with jax_pallas_enable_runtime_assert)."""


# ------------------------------------------------------------ what to check

def _waits_on_a_semaphore(eqn) -> bool:
  return (eqn.primitive in _WAIT_NEEDS
          and unpack(eqn.invars, eqn.params["layout"])["sem"] is not None)


def is_checked(spec: KernelSpec) -> bool:
  """Whether `spec` is a kernel derived by `checked_spec`."""
  return bool(spec.meta) and spec.meta[0] == "checked"


def needs_checks(jaxpr: core.Jaxpr, include_debug: bool = False) -> bool:
  """Whether a kernel has run-time checks (debug-only ones too, with
  `include_debug`) or semaphore waits."""
  for eqn in jaxpr.eqns:
    if eqn.primitive is checks.check_p and (include_debug
                                            or not eqn.params["debug"]):
      return True
    if _waits_on_a_semaphore(eqn):
      return True
    if any(needs_checks(j, include_debug)
           for j in sub_jaxprs(eqn.params)):
      return True
  return False


def _operand_names(spec: KernelSpec) -> list[str | None]:
  gm = spec.grid_mapping
  return [None] * len(gm.grid) + spec.ref_labels()


def _while_operands(eqn, key):
  cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
  carry = eqn.invars[cn + bn:]
  return (eqn.invars[:cn] + carry if key == "cond_jaxpr"
          else eqn.invars[cn:cn + bn] + carry)


# primitive name -> the outer operands that a sub-jaxpr's invars stand for
# (default: the equation's operands, in order).
_SUB_OPERANDS = {
    "cond": lambda eqn, key: eqn.invars[1:],
    "while": _while_operands,
}


def _inner_names(eqn, key, inner: core.Jaxpr, names: dict) -> dict:
  outer = _SUB_OPERANDS.get(eqn.primitive.name,
                            lambda e, k: e.invars)(eqn, key)
  out = {}
  for k, v in enumerate(inner.invars):
    if k < len(outer):
      if isinstance(outer[k], core.Var) and outer[k] in names:
        out[v] = names[outer[k]]
    else:                               # run_scoped's own buffers
      out[v] = f"run_scoped buffer {k - len(outer)}"
  return out


def _prepare_param(eqn, key, value, names, keep_debug, check_windows):
  if isinstance(value, tuple) and any(
      isinstance(x, (core.Jaxpr, ClosedJaxpr)) for x in value):
    return tuple(_prepare_param(eqn, key, x, names, keep_debug,
                                check_windows) for x in value)
  if isinstance(value, ClosedJaxpr):
    inner = _inner_names(eqn, key, value.jaxpr, names)
    return close_jaxpr(_prepare(value.jaxpr, inner, keep_debug,
                                     check_windows), value.consts)
  if isinstance(value, core.Jaxpr):
    return _prepare(value, _inner_names(eqn, key, value, names), keep_debug,
                    check_windows)
  return value


def _prepare(jaxpr: core.Jaxpr, names: dict, keep_debug: bool,
             check_windows: bool = False) -> core.Jaxpr:
  """Drops debug-only checks (unless `keep_debug`), names the semaphore of
  every wait (an `origin` param that only the wait checks read) and, with
  `check_windows` (the kernel's range analysis, `KernelRanges`), checks
  every window placed at run time that it does not prove inside."""
  eqns = []
  for eqn in jaxpr.eqns:
    if (eqn.primitive is checks.check_p and eqn.params["debug"]
        and not keep_debug):
      continue
    params = {k: _prepare_param(eqn, k, v, names, keep_debug, check_windows)
              for k, v in eqn.params.items()}
    if check_windows and (check := window_check_eqn(
        eqn, names.get(eqn.invars[0]) if eqn.invars and isinstance(
            eqn.invars[0], core.Var) else None, check_windows)) is not None:
      eqns.append(check)
    if _waits_on_a_semaphore(eqn):
      sem = unpack(eqn.invars, eqn.params["layout"])["sem"]
      params["origin"] = names.get(sem) if isinstance(sem, core.Var) else None
    eqns.append(eqn.replace(params=params))
  effects = pe.make_jaxpr_effects(jaxpr.constvars, jaxpr.invars,
                                  jaxpr.outvars, eqns)
  return jaxpr.replace(eqns=eqns, effects=effects)


# ------------------------------------------------------------ checkify rules

def _index_text(transforms, args: list) -> str:
  """`[1]`, or `[{}]` with the index appended to `args` when it is traced."""
  text = ""
  for t in tree_util.tree_leaves(transforms, is_leaf=lambda x: hasattr(
      x, "indices")):
    parts = []
    for i in getattr(t, "indices", ()):
      if DimWindow.of(i, None).kind == SLICE:
        parts.append(":")
        continue
      try:
        parts.append(str(int(core.concrete_or_error(None, i))))
      except Exception:  # noqa: BLE001 - a traced index: printed at run time
        parts.append("{}")
        args.append(jnp.asarray(i, jnp.int32))
    text += f"[{', '.join(parts)}]"
  return text


def _dma_need(a, params):
  side = params["side"]
  ref, t = (a["src"], a["src_t"]) if side == "send" else (a["dst"], a["dst_t"])
  view = tp.view_shape(ref, t)
  nbytes = tp.nbytes_of(view, tp.view_dtype(ref))
  what = {"send": "the send of a DMA", "recv": "a remote DMA"}.get(side,
                                                                  "a DMA")
  return jnp.int32(nbytes), f"{what} of {nbytes} bytes"


def _signal_need(a, params):
  return jnp.asarray(a["value"], jnp.int32), None


# wait primitive -> (sem fields, params) -> (count needed, what it waits for)
_WAIT_NEEDS = {tp.dma_wait_p: _dma_need, tp.semaphore_wait_p: _signal_need}


def _wait_rule(prim):
  need_of = _WAIT_NEEDS[prim]

  def rule(ctx, error, enabled_errors, *flat, origin=None, **params):
    a = unpack(flat, params["layout"])
    if a["sem"] is not None:
      need, what = need_of(a, params)
      args = []
      sem = f"semaphore {origin or 'of the kernel'}" + _index_text(
          a["sem_t"], args)
      read_flat, read_layout = pack(sem=a["sem"], sem_t=a["sem_t"])
      now = tp.semaphore_read_p.bind(*read_flat, layout=read_layout,
                                     kind=tp.semaphore_kind(a["sem"]))
      if what is None:
        text = f"the wait for {sem} (now {{}}) to reach {{}}"
        args += [now, need]
      else:
        text = f"the wait for {what} on {sem} (now {{}})"
        args += [now]
      fmt = ("a wait can never finish (no DMA or signal before it "
             f"satisfies it): {text}")
      error = jax_checkify.assert_func(
          ctx, error, now < need,
          NeverFinishingWait(jax_checkify.get_traceback(), fmt, *args))
    return error, prim.bind(*flat, **params)
  return rule


def _run_scoped_rule(ctx, error, enabled_errors, *args, jaxpr, num_consts):
  """Checks inside `run_scoped`: the error goes in and out as values."""
  err_vals, err_tree = tree_util.tree_flatten(error)
  n_err, out_trees = len(err_vals), []

  def body(*vals):
    err, outs = jax_checkify.checkify_jaxpr_flat(
        ctx, jaxpr, (), enabled_errors, err_tree, *vals)
    leaves, tree = tree_util.tree_flatten(err)
    out_trees.append(tree)
    return [*leaves, *outs]

  avals = [core.typeof(v) for v in err_vals] + [v.aval for v in jaxpr.invars]
  dbg = api_util.debug_info("run_scoped", body, tuple(range(len(avals))), {})
  new, _, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(body,
                                                          debug_info=dbg),
                                             avals)
  new = pe.convert_constvars_jaxpr(new)
  outs = primitives.run_scoped_p.bind(
      *consts, *err_vals, *args, jaxpr=new,
      num_consts=len(consts) + n_err + num_consts)
  n_out = out_trees[0].num_leaves
  return tree_util.tree_unflatten(out_trees[0], outs[:n_out]), outs[n_out:]


for _p in _WAIT_NEEDS:
  jax_checkify.error_checks[_p] = _wait_rule(_p)
jax_checkify.error_checks[primitives.run_scoped_p] = _run_scoped_rule


# ------------------------------------------------------------ block indices

def data_dependent_blocks(spec: KernelSpec) -> list:
  """The block mappings whose index maps read scalar-prefetch data."""
  gm = spec.grid_mapping
  return [bm for bm in gm.block_mappings
          if not bm.whole_array and bm.block_shape and gm.reads_prefetch(bm)]


def _block_limits(bm):
  """Per dim: the first illegal index, or None (unchecked)."""
  out = []
  for dim, n, b in zip(bm.block_shape, bm.array_aval.shape, bm.block_sizes):
    if n == 0:
      out.append(None)
    elif isinstance(dim, Element):
      lo, hi = dim.padding
      out.append(n + lo + hi)
    else:
      out.append(-(-n // b))
  return out


def _placeholders(n: int) -> str:
  """`({}, {})`: a tuple of `n` values to format in."""
  return f"({', '.join(['{}'] * n)}{',' if n == 1 else ''})"


def _block_index_errors(ctx, error, spec: KernelSpec, ids, pf):
  """`error` with a check, per operand whose block index comes from data,
  that the block lies inside its array."""
  for bm in data_dependent_blocks(spec):
    j = bm.index_map_jaxpr
    idx = core.eval_jaxpr(j.jaxpr, j.consts, *ids, *pf)[:len(bm.block_shape)]
    idx = [jnp.asarray(i, jnp.int32) for i in idx]
    bad = jnp.bool_(False)
    for i, lim in zip(idx, _block_limits(bm)):
      if lim is not None:
        bad = bad | (i < 0) | (i >= lim)
    rank, n_grid = len(idx), len(ids)
    fmt = checks.block_index_message(
        bm.origin, _placeholders(rank), _placeholders(n_grid),
        bm.array_aval.str_short(),
        checks.block_limits_text(bm.array_aval.shape, bm.block_sizes,
                                 element_padding(bm)),
        checks.index_map_at(bm))
    # The failure's line is the index map's.
    tb = next((e.source_info.traceback for e in j.jaxpr.eqns
               if e.source_info is not None), None)
    exc = BlockOutsideArray(tb or jax_checkify.get_traceback(), fmt, *idx,
                            *[jnp.asarray(i, jnp.int32) for i in ids])
    error = jax_checkify.assert_func(ctx, error, bad, exc)
  return error


# ------------------------------------------------------------ the kernel

def _checkify_kernel(spec, jaxpr, enabled_errors, check_blocks, args):
  """The error state of the kernel's checks at one grid point; `args`:
  grid ids, prefetch, inputs, outputs, scratch."""
  ctx, err = jax_checkify.CheckifyContext(), jax_checkify.init_error
  if check_blocks:
    by_role = spec.grid_mapping.split(args)
    err = _block_index_errors(ctx, err, spec, by_role.ids, by_role.prefetch)
  err, _ = jax_checkify.checkify_jaxpr(ctx, jaxpr, enabled_errors, err,
                                       *args)
  return err


def _error_structure(spec, jaxpr: ClosedJaxpr, enabled_errors,
                     check_blocks):
  """(treedef, leaf avals) of the error a checkified kernel produces."""
  box = []

  def f(*args):
    err = _checkify_kernel(spec, jaxpr, enabled_errors, check_blocks, args)
    leaves, tree = tree_util.tree_flatten(err)
    box.append(tree)
    return leaves

  avals = [v.aval for v in jaxpr.jaxpr.invars]
  dbg = api_util.debug_info("checks", f, tuple(range(len(avals))), {})
  _, out_avals, _ = pe.trace_to_jaxpr_dynamic(lu.wrap_init(f, debug_info=dbg),
                                              avals)
  return box[0], out_avals


def _error_block_spec(aval, n_grid: int) -> BlockSpec:
  rank = len(aval.shape)
  return BlockSpec((None,) * n_grid + tuple(aval.shape),
                   lambda *a: (*a[:n_grid], *(0,) * rank))


def _blocked(gm):
  """The block mappings whose block index a message gives: those with a
  BlockSpec (not whole arrays)."""
  return [bm for bm in gm.block_mappings if not bm.whole_array]


def _all_block_indices(gm, ids, pf):
  """Every blocked operand's block index at grid point `ids`, flat."""
  out = []
  for bm in _blocked(gm):
    j = bm.index_map_jaxpr
    idx = core.eval_jaxpr(j.jaxpr, j.consts, *ids, *pf)[:len(bm.block_shape)]
    out += [jnp.asarray(i, jnp.int32) for i in idx]
  return jnp.stack(out) if out else jnp.zeros((1,), jnp.int32)


@functools.lru_cache(maxsize=256)
def checked_spec(spec: KernelSpec, keep_debug: bool = False,
                 enabled_errors=_USER_CHECKS, check_blocks: bool = False,
                 check_windows: bool = False):
  """The kernel that also writes the error state of its checks, one block per
  grid point: `(spec', error treedef)`; the error outputs follow the
  kernel's own outputs. `keep_debug`: debug-only checks count too (for
  `checkify.checkify`); `enabled_errors`: the checkify error kinds;
  `check_blocks`: block indices read from data are checked too;
  `check_windows`: so are windows placed at run time, and a last output
  holds every blocked operand's block index at each grid point (for the
  message)."""
  gm = spec.grid_mapping
  _refuse_dynamic_grid(spec)
  n_grid = len(gm.grid)
  names = dict(zip(spec.jaxpr.jaxpr.invars, _operand_names(spec)))
  jaxpr = close_jaxpr(_prepare(spec.jaxpr.jaxpr, names, keep_debug,
                              check_windows and analyze_kernel(spec)),
                      spec.jaxpr.consts)
  err_tree, err_avals = _error_structure(spec, jaxpr, enabled_errors,
                                         check_blocks)
  n_err = len(err_avals)
  n_blocks = sum(len(bm.block_shape) for bm in _blocked(gm)) or 1
  if check_windows:
    err_avals = list(err_avals) + [core.ShapedArray((n_blocks,), jnp.int32)]

  layout = gm.ref_layout().insert("outputs", errors=len(err_avals))

  def body(*refs):
    ids = [program_id(d) for d in range(n_grid)]
    _, pf, ins, outs, errs, scr = layout.split(refs)
    err = _checkify_kernel(spec, jaxpr, enabled_errors, check_blocks,
                           (*ids, *pf, *ins, *outs, *scr))
    for ref, leaf in zip(errs, tree_util.tree_leaves(err)):
      ref[...] = jnp.asarray(leaf, ref.dtype)
    if check_windows:
      errs[-1][...] = _all_block_indices(gm, ids, pf)

  args = ([sds(a.inner_aval) for a in gm.prefetch_avals]
          + [sds(bm.array_aval) for bm in gm.in_mappings])
  out_shapes = ([sds(bm.array_aval) for bm in gm.out_mappings]
                + [jax.ShapeDtypeStruct(tuple(gm.grid) + tuple(a.shape),
                                        a.dtype) for a in err_avals])
  spec_of = lambda bm: block_spec_of(bm, n_grid)
  new = derived_spec(
      spec, body, args, out_shapes, grid=gm.grid,
      in_specs=[spec_of(bm) for bm in gm.in_mappings],
      out_specs=([spec_of(bm) for bm in gm.out_mappings]
                 + [_error_block_spec(a, n_grid) for a in err_avals]),
      scratch=list(gm.scratch_avals), aliases=dict(spec.input_output_aliases),
      suffix="checked", meta=("checked", spec))
  new = new.replace(name=spec.name, grid_mapping=dataclasses.replace(
      new.grid_mapping, num_hidden_axes=gm.num_hidden_axes))
  return new, err_tree


def _refuse_dynamic_grid(spec: KernelSpec):
  """The checked kernel writes an error state per grid point: a grid with
  a traced size has no such array here."""
  gm = spec.grid_mapping
  if gm.dynamic_dims:
    dim = gm.dynamic_dims[0] - gm.num_hidden_axes
    raise KernelError(
        spec.name, f"grid dim {dim} has a traced size, and the interpret "
        "backend checks a kernel's run-time checks (pl.debug_check, "
        "checkify, jax_pallas_enable_runtime_assert) and semaphore waits "
        "per grid point of a static grid; run it without them, or with "
        "backend='mosaic_interpret', which checks pl.debug_check and "
        "runtime asserts as it runs (checkify.checkify needs a static "
        "grid)", spec.where, operand="grid")


# ------------------------------------------------------------ reporting

def _first_failure(err_tree, leaves):
  """(grid point, exception) of the first failing grid point, or None."""
  batched = tree_util.tree_unflatten(err_tree, list(leaves))
  preds = [np.asarray(p) for p in batched._pred.values()]
  if not preds:
    return None
  failed = np.logical_or.reduce(preds) if len(preds) > 1 else preds[0]
  hits = np.argwhere(failed)
  if not len(hits):
    return None
  point = tuple(int(i) for i in hits[0])
  err = tree_util.tree_unflatten(err_tree, [np.asarray(x)[point]
                                            for x in leaves])
  return point, err.get_exception()


def _values_text(exc) -> str | None:
  args = tuple(np.asarray(a).tolist() for a in getattr(exc, "args", ()))
  if not args:
    return None
  try:
    return exc.fmt_string.format(*args, **getattr(exc, "kwargs", {}))
  except (IndexError, KeyError, ValueError):
    return ", ".join(map(str, args))


def _block_index_of(spec: KernelSpec, ref: str | None, blocks):
  """The block index of the operand named `ref` in the flat `blocks` of a
  grid point (`_all_block_indices`), or None (scratch, whole arrays)."""
  if blocks is None or ref is None:
    return None
  gm = spec.grid_mapping
  labels = gm.split(spec.ref_labels())
  offset = 0
  for label, bm in zip(labels.inputs + labels.outputs, gm.block_mappings):
    if bm.whole_array:
      continue
    rank = len(bm.block_shape)
    if label == ref:
      return [int(b) for b in np.asarray(blocks)[offset:offset + rank]]
    offset += rank
  return None


def kernel_failure(kernel: str, point, exc, device=None, spec=None,
                   blocks=None) -> KernelRuntimeError:
  """The KernelError for a failed check `exc` at grid `point`; `blocks`:
  the operands' block indices there (windows placed at run time)."""
  where = traceback_frame(getattr(exc, "traceback_info", None))
  detail = []
  if isinstance(exc, NeverFinishingWait):
    cls, message = KernelDeadlockError, _values_text(exc) or exc.fmt_string
  elif isinstance(exc, WindowOutsideRef):
    cls = KernelCheckError
    message = checks.window_message(
        _values_text(exc) or exc.fmt_string,
        _block_index_of(spec, exc.ref, blocks) if spec else None, point)
  elif isinstance(exc, BlockOutsideArray):
    cls, message = KernelCheckError, _values_text(exc) or exc.fmt_string
  elif isinstance(exc, jax_checkify.FailedCheckError):
    # The first line is the message as written, as every backend gives it;
    # the values of its `{}` fields follow.
    cls, message = KernelCheckError, exc.fmt_string
    values = _values_text(exc)
    if values is not None:
      detail.append(f"  with its values: {values}")
  else:
    cls, message = KernelRuntimeError, str(exc)
  if point and not isinstance(exc, (BlockOutsideArray, WindowOutsideRef)):
    detail.append(f"  at grid point {point}")
  if device is not None:
    detail.append(f"  on device {device}" + (
        " (the interpret backend runs the devices in lockstep: what another "
        "device signals later in its program does not count)"
        if cls is KernelDeadlockError else ""))
  return cls(kernel, message, where, detail="\n".join(detail) or None)


def _park_first_failure(kernel, err_tree, *leaves, device=None, spec=None,
                        blocks=None):
  found = _first_failure(err_tree, leaves)
  if found is None:
    return np.int32(0)
  point, exc = found
  dev = None if device is None else int(np.asarray(device))
  at = None if blocks is None else np.asarray(blocks)[point]
  return np.int32(park(kernel_failure(kernel, point, exc, dev, spec, at)))


def _device_id(axes):
  """This device's id (row-major over the shard_map axes `axes`)."""
  with core.extend_axis_env_nd(list(axes)):
    device = jnp.int32(0)
    for name, size in axes:
      device = device * size + jax.lax.axis_index(name)
  return device


def checked_results(spec: KernelSpec, results) -> tuple[tuple, tuple]:
  """(the kernel's outputs, the error outputs) among the results of the
  kernel `checked_spec(spec)` gives."""
  return KernelLayout.of(outputs=spec.grid_mapping.num_outputs,
                         errors=None).split(results)


def run_checked(spec: KernelSpec, run, args, axis_context,
                check_blocks: bool = False, check_windows: bool = False):
  """Runs `spec` through `run(*args, spec=...)` with its checks (and, with
  `check_blocks`, its block indices read from data; with `check_windows`,
  its windows placed at run time), and raises the first failure
  (dsl/core/host_failures.py)."""
  new, err_tree = checked_spec(spec, check_blocks=check_blocks,
                               check_windows=check_windows)
  outs, errors = checked_results(spec, run(*args, spec=new))
  axes = host_failures.manual_axes(axis_context)
  extra = (_device_id(axes),) if axes else ()

  def find(*leaves):
    device = blocks = None
    if axes:
      *leaves, device = leaves
    if check_windows:
      *leaves, blocks = leaves
    return _park_first_failure(spec.name, err_tree, *leaves, device=device,
                               spec=spec, blocks=blocks)

  failed = jax.pure_callback(find, jax.ShapeDtypeStruct((), jnp.int32),
                             *errors, *extra, vmap_method="sequential")
  host_failures.raise_parked(axis_context, failed)
  return list(outs)
