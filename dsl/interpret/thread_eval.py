"""One warpgroup of a `plgpu.kernel`, evaluated as a coroutine over the
kernel jaxpr (the interpret backend's warpgroup interpreter; the scheduler
that runs the warpgroups together is dsl/interpret/warpgroups.py).

`eval_jaxpr(thread, jaxpr, consts, args)` is a generator: it runs the
equations in order and pauses (yields a `Blocked`) where the warpgroup
waits for another (an mbarrier phase not complete yet); the scheduler
resumes it when what it waits for has happened. Control flow that holds
such waits (`cond`, `while`, `scan`, calls, `run_scoped`) is evaluated here
equation by equation, so a wait can pause inside a loop.

Reads and writes of refs are checked against the tensor core's operations
in flight (`thread.machine.tensor_core`, dsl/interpret/tensor_core.py).

Values are arrays; refs are `Cell`s, numpy storage that the warpgroups of a
block share where the kernel shares it (its operands, the allocations of
`run_scoped(..., collective_axes=thread axis)`). A ref's transforms
(`x.at[i]`, `x.transpose(...)`) become numpy views of its storage.

Runs of equations without effects are compiled once each with `jax.jit`
(`_plan`) and called as one function, so the interpreter pays XLA's
compile time once per run of arithmetic, not once per operation.
Primitives with effects go through `TABLE`, keyed by primitive; one that
has no rule there is refused with the kernel's name, the primitive and the
user's line.
"""
from __future__ import annotations

import dataclasses
import inspect
import threading
from typing import Any, Callable

import jax
import numpy as np
from jax import tree_util

from dsl.core import checks, primitives
from dsl.core.access import INDEX, SLICE, DimWindow
from dsl.core.errors import (BackendError, KernelCheckError, KernelError,
                             source_info_frame)
from dsl.core.jax_internals import (ClosedJaxpr, NDIndexer, core,
                                    lax_control_flow as cf, state_primitives,
                                    state_types)
from dsl.core.jaxpr_walk import (CALL_PRIMITIVES, RuleTable, call_body,
                                 sub_jaxprs)
from dsl.core.normalize import scan_layout
from dsl.core.operand_layout import ref_operands
from dsl.mosaic_gpu.multi_device import PeerMemRef

TABLE = RuleTable("the warpgroup interpreter")


class Cell:
  """The storage of one ref: `array` (numpy), and for mbarriers the state
  of each (`barriers`, indexed by the flat id `array` holds). A ref in
  global memory has a copy on every device of the launch: `copies`
  (dsl/interpret/devices.py), which a `plgpu.remote_ref` reaches."""
  __slots__ = ("array", "barriers", "label", "copies")

  def __init__(self, array: np.ndarray, label: str = "", barriers=None):
    self.array = array
    self.barriers = barriers
    self.label = label
    self.copies = None


@dataclasses.dataclass
class Blocked:
  """What a paused warpgroup waits for: `ready()` says when it may go on;
  `what` and `eqn` describe the wait for a deadlock report."""
  ready: Callable[[], bool]
  what: str
  eqn: Any


# The warpgroup and equation being evaluated now (in this host thread):
# what an access of memory is attributed to (dsl/interpret/device_races.py).
running = threading.local()


def where(eqn) -> str | None:
  return source_info_frame(eqn.source_info) if eqn is not None else None


# --------------------------------------------------------------- ref views

def _index(dim: int, idx, what: str, through: bool = False):
  """A numpy index for one NDIndexer entry over a dim of size `dim`.
  `through`: the entry makes a view that later transforms index further
  (`x.at[pl.ds(start, k)]` then a block of it), which may reach past the
  end of its dim as on the hardware: only what is accessed through it must
  lie inside (the later transforms index the view, cut at the dim's end)."""
  w = DimWindow.of(idx, dim)
  if w.kind == SLICE:
    start, size, stride = int(w.start), w.size, w.stride
    last = start + (size - 1) * stride if size else start
    if start < 0 or (size and last >= dim and not through):
      raise IndexError(f"{what}: the window {start}:{start + size * stride}"
                       f" lies outside a dim of size {dim}")
    return slice(start, start + size * stride, stride)
  arr = np.asarray(w.start)
  if w.kind == INDEX:
    i = int(arr)
    if not 0 <= i < dim:
      raise IndexError(f"{what}: index {i} is outside a dim of size {dim}")
    return i
  if arr.size and (arr.min() < 0 or arr.max() >= dim):
    raise IndexError(f"{what}: an index lies outside a dim of size {dim}")
  return arr


def _apply(x: np.ndarray, transform, what: str, through: bool = False):
  if isinstance(transform, NDIndexer):
    idx = tuple(_index(d, i, what, through)
                for d, i in zip(x.shape, transform.indices))
    return x[idx]
  name = type(transform).__name__
  if name == "TransposeTransform":
    return x.transpose(transform.permutation)
  if name == "ReshapeTransform":
    out = x.view().reshape(transform.shape)
    return out
  raise BackendError(None, f"the ref transform {name} is not supported by "
                     "the warpgroup interpreter")


def on_device(cell: Cell, transforms) -> tuple[Cell, tuple]:
  """The cell a ref's transforms reach (the copy on a peer device after a
  `plgpu.remote_ref`) and its other transforms."""
  transforms = tuple(transforms or ())
  peers = [t for t in transforms if isinstance(t, PeerMemRef)]
  if not peers:
    return cell, transforms
  if cell.copies is None:
    raise ValueError(f"plgpu.remote_ref of {cell.label}: only refs in "
                     "global memory (the kernel's operands, its "
                     "semaphores) have a copy on each device")
  rest = tuple(t for t in transforms if not isinstance(t, PeerMemRef))
  return cell.copies.on_peer(cell, peers[-1]), rest


def _accessed(cell: Cell, transforms, writes: bool) -> None:
  """Records an access of a ref in global memory, where races between
  devices are checked."""
  copies = cell.copies
  if copies is not None and copies.races is not None:
    copies.races.access(cell, copies.device_of(cell), transforms, writes)


def view(cell: Cell, transforms, what: str = "ref") -> np.ndarray:
  """The numpy view of `cell` that `transforms` select."""
  cell, transforms = on_device(cell, transforms)
  _accessed(cell, transforms, writes=False)
  x = cell.array
  for k, t in enumerate(transforms):
    x = _apply(x, t, what, through=k < len(transforms) - 1)
  return x


def read(cell: Cell, transforms, what: str = "ref") -> np.ndarray:
  """A copy of what `transforms` select in `cell`."""
  return np.array(view(cell, transforms, what))


def _check_view(x: np.ndarray, cell: Cell, what: str) -> np.ndarray:
  """`x` if it is a view of `cell`'s storage (a write through it lands)."""
  if x.size and not np.shares_memory(x, cell.array):
    raise BackendError(None, f"{what}: a write through this view of the ref "
                       "(a gather or a reshape that copies) is not supported "
                       "by the warpgroup interpreter")
  return x


def write(cell: Cell, transforms, value, what: str = "ref") -> None:
  """Writes `value` where `transforms` select in `cell`."""
  cell, transforms = on_device(cell, transforms)
  _accessed(cell, transforms, writes=True)
  transforms = list(transforms)
  base = cell.array
  for t in transforms[:-1]:
    base = _check_view(_apply(base, t, what, through=True), cell, what)
  value = np.asarray(value)
  if transforms and isinstance(transforms[-1], NDIndexer):
    # the last indexer may gather: numpy writes through it in place
    idx = tuple(_index(d, i, what) for d, i in zip(base.shape,
                                                   transforms[-1].indices))
    base[idx] = value.astype(base.dtype)
    return
  target = _apply(base, transforms[-1], what) if transforms else base
  _check_view(target, cell, what)[...] = value.astype(target.dtype)


# ------------------------------------------------------------- evaluation

# Compiled runs of array arithmetic, keyed by their printed jaxpr: a kernel
# traced again (a new spec) finds its runs compiled.
_COMPILED: dict[str, Any] = {}


_SEGMENT_INFO = core.DebugInfo("the warpgroup interpreter", "<segment>", None,
                               None)


def _scalar(v) -> bool:
  return getattr(v.aval, "shape", None) == ()


@dataclasses.dataclass
class _Segment:
  """A run of equations without effects, evaluated as one function: index
  arithmetic on scalars eagerly (JAX caches each primitive's executable),
  array arithmetic compiled once (`_COMPILED`)."""
  eqns: list
  inputs: list
  outputs: list
  fn: Any = None

  def run(self, values):
    if self.fn is None:
      jaxpr = core.Jaxpr((), self.inputs, self.outputs, self.eqns,
                         debug_info=_SEGMENT_INFO)
      if all(_scalar(v) for v in (*self.inputs, *self.outputs)) and not any(
          sub_jaxprs(e.params) for e in self.eqns):
        self.fn = lambda *xs: core.eval_jaxpr(jaxpr, (), *xs)
      else:
        key = str(jaxpr)
        fn = _COMPILED.get(key)
        if fn is None:
          fn = _COMPILED[key] = jax.jit(
              core.jaxpr_as_fun(ClosedJaxpr(jaxpr, ())))
        self.fn = fn
    return self.fn(*values)


def _pure(eqn) -> bool:
  if eqn.effects or TABLE.lookup(eqn.primitive) is not None:
    return False
  return not any(isinstance(getattr(v, "aval", None), state_types.AbstractRef)
                 for v in (*eqn.invars, *eqn.outvars))


_PLANS: dict[int, tuple[Any, list]] = {}


def _plan(jaxpr: core.Jaxpr) -> list:
  """`jaxpr`'s equations with its runs of pure ones grouped (cached)."""
  hit = _PLANS.get(id(jaxpr))
  if hit is not None and hit[0] is jaxpr:
    return hit[1]
  eqns = jaxpr.eqns
  live_after, live = [None] * len(eqns), {
      v for v in jaxpr.outvars if not isinstance(v, core.Literal)}
  for i in range(len(eqns) - 1, -1, -1):
    live_after[i] = set(live)
    live -= set(eqns[i].outvars)
    live |= {v for v in eqns[i].invars if not isinstance(v, core.Literal)}
  steps, run = [], []

  def close(last):
    if not run:
      return
    defined = {v for e in run for v in e.outvars}
    inputs = list(dict.fromkeys(
        v for e in run for v in e.invars
        if not isinstance(v, core.Literal) and v not in defined))
    outputs = [v for v in dict.fromkeys(v for e in run for v in e.outvars)
               if v in live_after[last] and not isinstance(v, core.DropVar)]
    if outputs:
      steps.append(_Segment(list(run), inputs, outputs))
    run.clear()

  for i, eqn in enumerate(eqns):
    if _pure(eqn):
      run.append(eqn)
      continue
    close(i - 1)
    steps.append(eqn)
  close(len(eqns) - 1)
  _PLANS[id(jaxpr)] = (jaxpr, steps)
  return steps


def eval_jaxpr(thread, jaxpr: core.Jaxpr, consts, args):
  """Generator: evaluates `jaxpr` for `thread`; returns its outputs."""
  env: dict = {}

  def get(v):
    return v.val if isinstance(v, core.Literal) else env[v]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for step in _plan(jaxpr):
    if isinstance(step, _Segment):
      env.update(zip(step.outputs, step.run([get(v) for v in step.inputs])))
      continue
    outs = yield from _eval_eqn(thread, step, [get(v) for v in step.invars])
    for v, x in zip(step.outvars, outs):
      if not isinstance(v, core.DropVar):
        env[v] = x
  return [get(v) for v in jaxpr.outvars]


def eval_closed(thread, closed, args):
  if isinstance(closed, ClosedJaxpr):
    return eval_jaxpr(thread, closed.jaxpr, closed.consts, args)
  return eval_jaxpr(thread, closed, (), args)


def _eval_eqn(thread, eqn, invals):
  rule = TABLE.lookup(eqn.primitive)
  if rule is None and eqn.primitive in CALL_PRIMITIVES:
    rule = _call
  if rule is None:
    raise BackendError(thread.kernel, f"primitive {eqn.primitive.name} is not "
                       "supported by the interpret backend's warpgroup "
                       "interpreter", where(eqn), operand=eqn.primitive.name)
  try:
    running.thread, running.eqn = thread, eqn
    out = rule(thread, eqn, invals)
    if inspect.isgenerator(out):
      out = yield from out
  except KernelError:
    raise
  except Exception as e:  # noqa: BLE001 - named with the kernel's line
    raise BackendError(thread.kernel, f"{eqn.primitive.name}: "
                       f"{type(e).__name__}: {e}", where(eqn)) from e
  if not eqn.primitive.multiple_results and not isinstance(out, list):
    out = [out]
  return out


def _call(thread, eqn, invals):
  jaxpr, consts, args = call_body(eqn.params, invals)
  return (yield from eval_jaxpr(thread, jaxpr, consts, args))


# ----------------------------------------------------------- control flow

@TABLE.register(cf.cond_p)
def _cond(thread, eqn, invals):
  index, *ops = invals
  branches = eqn.params["branches"]
  branch = branches[min(max(int(np.asarray(index)), 0), len(branches) - 1)]
  return (yield from eval_closed(thread, branch, ops))


@TABLE.register(cf.while_p)
def _while(thread, eqn, invals):
  p = eqn.params
  cc, bc = p["cond_nconsts"], p["body_nconsts"]
  cond_consts, body_consts, carry = (invals[:cc], invals[cc:cc + bc],
                                     invals[cc + bc:])
  while True:
    (go,) = yield from eval_closed(thread, p["cond_jaxpr"],
                                   [*cond_consts, *carry])
    if not bool(np.asarray(go)):
      return carry
    carry = yield from eval_closed(thread, p["body_jaxpr"],
                                   [*body_consts, *carry])


@TABLE.register(cf.scan_p)
def _scan(thread, eqn, invals):
  p = eqn.params
  nc, nk, _, n_ys = scan_layout(p)
  consts, carry, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
  ys = []
  order = range(p["length"] - 1, -1, -1) if p["reverse"] else range(
      p["length"])
  for i in order:
    outs = yield from eval_closed(thread, p["jaxpr"],
                                  [*consts, *carry, *[x[i] for x in xs]])
    carry, y = outs[:nk], outs[nk:]
    ys.append(y)
  if p["reverse"]:
    ys.reverse()
  stacked = [np.stack([np.asarray(y[k]) for y in ys]) if ys else np.zeros(
      v.aval.shape, v.aval.dtype) for k, v in zip(range(n_ys),
                                                  eqn.outvars[nk:])]
  return [*carry, *stacked]


# -------------------------------------------------------------- ref state

@TABLE.register(state_primitives.get_p)
def _get(thread, eqn, invals):
  ops = ref_operands(eqn.primitive, invals, eqn.params)
  thread.machine.tensor_core.check(thread, eqn, ops.ref, ops.transforms,
                                   reads=True)
  return [read(ops.ref, ops.transforms, ops.ref.label)]


@TABLE.register(state_primitives.swap_p)
def _swap(thread, eqn, invals):
  ops = ref_operands(eqn.primitive, invals, eqn.params)
  thread.machine.tensor_core.check(thread, eqn, ops.ref, ops.transforms,
                                   writes=True)
  old = read(ops.ref, ops.transforms, ops.ref.label)
  write(ops.ref, ops.transforms, ops.value, ops.ref.label)
  return [old]


@TABLE.register(state_primitives.addupdate_p)
def _addupdate(thread, eqn, invals):
  ops = ref_operands(eqn.primitive, invals, eqn.params)
  thread.machine.tensor_core.check(thread, eqn, ops.ref, ops.transforms,
                                   reads=True, writes=True)
  old = read(ops.ref, ops.transforms, ops.ref.label)
  write(ops.ref, ops.transforms, old + np.asarray(ops.value), ops.ref.label)
  return []


# ------------------------------------------------------- prints and checks

@TABLE.register(primitives.debug_print_p)
def _debug_print(thread, eqn, invals):
  print(eqn.params["fmt"].format(*[np.asarray(x) for x in invals]))
  return []


@TABLE.register(checks.check_p)
def _check(thread, eqn, invals):
  """A run-time check (`debug=False`) that fails raises; debug-only ones
  are ignored, as on every backend."""
  if eqn.params["debug"]:
    return []
  error = tree_util.tree_unflatten(eqn.params["err_tree"], list(invals))
  message = error.get()
  if message:
    raise KernelCheckError(thread.kernel, message.split("\n")[0],
                           where(eqn), detail=thread.name)
  return []
