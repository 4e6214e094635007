"""The synchronization skeleton of an explicit `plgpu.kernel`, read from its
kernel jaxpr: what each warpgroup of one block does with TMA copies, shared
memory and mbarriers, in program order.

`skeleton(spec)` walks the kernel jaxpr once per warpgroup (`lax.axis_index`
of the thread axis is that warpgroup's index; block ids are 0: blocks share
no shared memory nor mbarriers) with one rule per primitive (`_RULES`), and
records `Event`s:

  load     `copy_gmem_to_smem`: a TMA copy into SMEM cells that arrives (with
           its bytes) on an mbarrier
  store    `copy_smem_to_gmem`: a TMA copy reading SMEM cells until a
           `wait_smem_to_gmem` retires its bulk group
  read     a load of SMEM into registers (`smem[...]`)
  write    a store into SMEM (`smem[...] = x`)
  mma      a `wgmma` reading SMEM operands until `wgmma_wait` (or a read of
           the accumulator) retires it
  retire   the end of an asynchronous read (a store's or a WGMMA's)
  arrive   `barrier_arrive`;  wait: `barrier_wait`
  unwaited the warpgroup ends with SMEM -> GMEM copies not waited for

Integers the kernel computes from the warpgroup index, loop counters and
constants (slots, trip counts, `pl.when` conditions) are evaluated; data
(what refs hold, WGMMA results) is unknown. Loops run their trip counts (at
the sizes the kernel is traced with: verify at small sizes), unrolled; a
branch on unknown data becomes a `Choice` between its branches. SMEM
buffers are cut into cells along their leading dim (ring slots), at most
`MAX_CELLS` per buffer: windows that share a cell count as overlapping.

lowering_mosaic/gpu/plgpu_model.py writes the skeleton as a Promela model.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from dsl.core.access import INDEX, INDICES, SLICE, DimWindow
from dsl.core.errors import KernelError, source_info_frame
from dsl.core.jax_internals import NDIndexer, lax_control_flow as cf
from dsl.core.jax_internals import core, state_primitives, state_types
from dsl.core.jaxpr_walk import CALL_PRIMITIVES, RuleTable, call_body
from dsl.core.normalize import scan_layout
from dsl.core.operand_layout import ref_operands, unpack
from dsl.core.primitives import run_scoped_p
from dsl.mosaic_gpu import compute, primitives as prims
from dsl.mosaic_gpu.memory import (SMEM, is_accumulator_aval, is_barrier_aval,
                                   space_of)
from lowering_mosaic.gpu.plgpu_names import (Buffer, Names, operand_names,
                                             scope_names)

MAX_CELLS = 8          # cells per SMEM buffer
MAX_EVENTS = 20_000
LIBRARY_FILES = "/pallas/ops/"   # Pallas's kernel library, served onto dsl    # per kernel: beyond, verify at smaller sizes


class ModelError(KernelError):
  """A `plgpu.kernel` whose protocol the skeleton cannot follow."""


class _Unknown:
  """A value the skeleton does not follow (data)."""

  def __repr__(self):
    return "?"


UNKNOWN = _Unknown()


@dataclasses.dataclass(frozen=True)
class Ref:
  buffer: Buffer


@dataclasses.dataclass
class Event:
  id: int
  kind: str
  wg: int
  line: str | None
  what: str
  cells: tuple = ()
  barrier: int | None = None


@dataclasses.dataclass
class Choice:
  """Branches on a value the skeleton does not know: any may run."""
  branches: list
  line: str | None


@dataclasses.dataclass
class Skeleton(Names):
  kernel: str
  thread_name: str
  programs: list            # per warpgroup: its nodes (Event | Choice)
  buffers: list             # every Buffer
  events: list              # Event by id
  loops: dict               # "file:line" -> trip counts seen
  notes: list

  @property
  def num_cells(self) -> int:
    return sum(b.count for b in self.buffers if b.kind == "smem")

  @property
  def num_barriers(self) -> int:
    return sum(b.count for b in self.buffers if b.kind == "barrier")

  def wg_name(self, wg: int) -> str:
    return f"warpgroup {self.thread_name}={wg}"


# ------------------------------------------------------------- naming

def _window(buf: Buffer, transforms) -> str:
  """`name`, `name[i]` or `name[a:b]`: the leading window of `transforms`."""
  t = transforms[0] if transforms else None
  if not isinstance(t, NDIndexer) or not t.indices:
    return buf.name
  w = DimWindow.of(t.indices[0], None, _static)
  if w.kind == SLICE:
    if w.static_start is not None and w.size is not None:
      start = w.static_start
      if start == 0 and w.size == (buf.shape or (0,))[0]:
        return buf.name
      return f"{buf.name}[{start}:{start + w.size}]"
    return f"{buf.name}[?]"
  return f"{buf.name}[{w.static_start}]" if w.kind == INDEX and \
      w.static_start is not None else f"{buf.name}[?]"


def _known(x) -> bool:
  return x is not UNKNOWN and not isinstance(x, Ref)


def _static(x) -> int | None:
  """A known scalar index as an int (the access model's `static`)."""
  return int(x) if _known(x) and np.ndim(x) == 0 else None


# ---------------------------------------------------------------- the walk

class _Builder(Names):
  """What the warpgroups' walks share: allocations, events, notes."""

  def __init__(self, spec):
    self.spec = spec
    self.buffers: list[Buffer] = []
    self.events: list[Event] = []
    self.shared: dict = {}
    self.loops: dict = {}
    self.notes: list[str] = []
    self.cells = self.barriers = 0

  def allocate(self, aval, name: str) -> Buffer:
    shape = tuple(aval.inner_aval.shape)
    if is_barrier_aval(aval):
      b = Buffer(name, "barrier", shape, self.barriers, math.prod(shape),
                 int(aval.memory_space.num_arrivals))
      self.barriers += b.count
    elif is_accumulator_aval(aval):
      b = Buffer(name, "acc", shape)
    elif space_of(aval) is SMEM:
      count = min(shape[0], MAX_CELLS) if shape and shape[0] else 1
      b = Buffer(name, "smem", shape, self.cells, count)
      self.cells += count
    else:
      b = Buffer(name, "other", shape)
    self.buffers.append(b)
    return b

  def note(self, text: str) -> None:
    if text not in self.notes:
      self.notes.append(text)


class _Walk:
  """One warpgroup's walk: the nodes it emits and its asynchronous reads in
  flight (WGMMAs, bulk groups of SMEM -> GMEM copies)."""

  def __init__(self, builder: _Builder, wg: int):
    self.b = builder
    self.wg = wg
    self.sink: list = []
    self.mma: list[tuple] = []
    self.stores: list[tuple] = []
    self.open_store: tuple = ()
    self.entries: dict = {}

  def emit(self, kind, eqn, what, cells=(), barrier=None) -> None:
    if len(self.b.events) >= MAX_EVENTS:
      raise ModelError(self.b.spec.name, f"the protocol has more than "
                       f"{MAX_EVENTS} steps: verify the kernel at smaller "
                       "sizes (fewer loop steps)", _line(eqn))
    ev = Event(len(self.b.events), kind, self.wg, _line(eqn), what,
               tuple(cells), barrier)
    self.b.events.append(ev)
    self.sink.append(ev)

  def pending(self):
    return (tuple(self.mma), tuple(self.stores), self.open_store)

  def run(self, jaxpr: core.Jaxpr, consts, args) -> list:
    env: dict = {}

    def read(v):
      return v.val if isinstance(v, core.Literal) else env.get(v, UNKNOWN)

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
      outs = self.eqn(eqn, [read(v) for v in eqn.invars])
      for v, x in zip(eqn.outvars, outs):
        if not isinstance(v, core.DropVar):
          env[v] = x
    return [read(v) for v in jaxpr.outvars]

  def run_closed(self, closed, args) -> list:
    if hasattr(closed, "consts"):
      return self.run(closed.jaxpr, closed.consts, args)
    return self.run(closed, (), args)

  def eqn(self, eqn, invals) -> list:
    has_refs = any(isinstance(x, Ref) for x in invals)
    rule = _RULES.lookup(eqn.primitive)
    if rule is not None and (eqn.effects or has_refs):
      return rule(self, eqn, invals)
    if eqn.primitive in CALL_PRIMITIVES and (eqn.effects or has_refs):
      jaxpr, consts, args = call_body(eqn.params, invals)
      return self.run(jaxpr, consts, args)
    if eqn.effects or has_refs:
      self.b.note(f"{eqn.primitive.name} (at {_line(eqn)}) is not part of "
                  "the protocol model")
      refs = [x for x in invals if isinstance(x, Ref)]
      return [refs[0] if refs and isinstance(v.aval, state_types.AbstractRef)
              else UNKNOWN for v in eqn.outvars]
    return _evaluate(eqn, invals)


def _line(eqn) -> str | None:
  """The kernel line of `eqn`: the user's frame, else (a kernel of Pallas's
  library served onto dsl, whose file lies in JAX's package) the innermost
  frame of that library."""
  if eqn is None:
    return None
  line = source_info_frame(eqn.source_info)
  tb = getattr(eqn.source_info, "traceback", None)
  if line is None and tb is not None:
    for frame in tb.frames:
      if LIBRARY_FILES in frame.file_name:
        return f"{frame.file_name}:{frame.line_num}"
  return line


def _evaluate(eqn, invals) -> list:
  """Integer arithmetic on known values, evaluated; anything else unknown."""
  n = len(eqn.outvars)
  small = all(math.prod(getattr(v.aval, "shape", (1 << 20,))) <= 64
              for v in eqn.outvars)
  if not small or not all(_known(x) for x in invals):
    return [UNKNOWN] * n
  try:
    with jax.ensure_compile_time_eval():
      out = eqn.primitive.bind(*invals, **eqn.params)
  except Exception:  # noqa: BLE001 - what cannot be evaluated is data
    return [UNKNOWN] * n
  outs = out if eqn.primitive.multiple_results else [out]
  return [np.asarray(x) for x in outs]


_RULES = RuleTable("the plgpu protocol extractor")


# ------------------------------------------------------------ SMEM access

def _cells(buf: Buffer, transforms) -> tuple[int, ...]:
  """The cells of `buf` a window touches (every cell when not known)."""
  whole = tuple(range(buf.base, buf.base + buf.count))
  t = transforms[0] if transforms else None
  if buf.count == 1 or not isinstance(t, NDIndexer) or not t.indices:
    return whole
  w, rows = DimWindow.of(t.indices[0], None, _static), buf.shape[0]
  if w.kind == INDICES or w.static_start is None or w.size is None:
    return whole
  lo = w.static_start
  hi = lo + max(w.size - 1, 0) * w.stride
  if not 0 <= lo <= hi < rows:
    return whole
  first, last = lo * buf.count // rows, hi * buf.count // rows
  return tuple(range(buf.base + first, buf.base + last + 1))


def _barrier(walk: _Walk, eqn, ref, transforms) -> int:
  buf = ref.buffer
  index = ()
  for t in transforms or ():
    if not isinstance(t, NDIndexer):
      break
    index = tuple(t.indices)
  if not buf.shape:
    return buf.base
  if len(index) != len(buf.shape) or not all(
      _known(i) and np.ndim(i) == 0 for i in index):
    raise ModelError(walk.b.spec.name, f"the index of the mbarrier "
                     f"{buf.name} is not known from the warpgroup index, "
                     "loop counters and constants: the protocol model "
                     "needs it", _line(eqn), operand=buf.name)
  return buf.base + int(np.ravel_multi_index(tuple(int(i) for i in index),
                                             buf.shape))


def _smem(x) -> bool:
  return isinstance(x, Ref) and x.buffer.kind == "smem"


@_RULES.register(state_primitives.get_p, state_primitives.swap_p,
                 state_primitives.addupdate_p)
def _ref_access(walk: _Walk, eqn, invals):
  ops = ref_operands(eqn.primitive, invals, eqn.params)
  ref = ops.ref
  out = [UNKNOWN] * len(eqn.outvars)
  if isinstance(ref, Ref) and ref.buffer.kind == "acc":
    if eqn.primitive is state_primitives.get_p:
      _retire_mma(walk, eqn, 0)
    return out
  if not _smem(ref):
    return out
  t = ops.transforms
  cells, what = _cells(ref.buffer, t), _window(ref.buffer, t)
  if eqn.primitive is not state_primitives.swap_p:
    walk.emit("read", eqn, f"reads {what}", cells)
  if eqn.primitive is not state_primitives.get_p:
    walk.emit("write", eqn, f"writes {what}", cells)
  return out


# ------------------------------------------------------- copies, barriers

def _enabled(parts):
  pred = parts["predicate"]
  return True if not pred else (bool(pred[0]) if _known(pred[0]) else None)


def _maybe(walk: _Walk, eqn, enabled, emit) -> None:
  """`emit()` when `enabled`; a choice with and without it when unknown."""
  if enabled is None:
    outer, walk.sink = walk.sink, []
    emit()
    outer.append(Choice([walk.sink, []], _line(eqn)))
    walk.sink = outer
  elif enabled:
    emit()


def _label(x, transforms) -> str:
  return _window(x.buffer, transforms) if isinstance(x, Ref) else "?"


@_RULES.register(prims.copy_gmem_to_smem_p)
def _copy_in(walk: _Walk, eqn, invals):
  a = unpack(invals, eqn.params["layout"])
  dst, bar = a["dst"], a["barrier"]
  b = _barrier(walk, eqn, bar, a["barrier_t"])
  what = (f"starts a TMA copy {_label(a['src'], a['src_t'])} -> "
          f"{_label(dst, a['dst_t'])}, arriving on {walk.b.barrier_name(b)}")
  cells = _cells(dst.buffer, a["dst_t"]) if _smem(dst) else ()
  _maybe(walk, eqn, _enabled(a),
         lambda: walk.emit("load", eqn, what, cells, b))
  return []


@_RULES.register(prims.copy_smem_to_gmem_p)
def _copy_out(walk: _Walk, eqn, invals):
  a = unpack(invals, eqn.params["layout"])
  src = a["src"]
  if not _smem(src):
    return []
  cells = _cells(src.buffer, a["src_t"])
  what = (f"starts a TMA copy {_label(src, a['src_t'])} -> "
          f"{_label(a['dst'], a['dst_t'])}")

  def emit():
    walk.emit("store", eqn, what, cells)
    walk.open_store = walk.open_store + cells
    if eqn.params["commit_group"]:
      walk.stores.append(walk.open_store)
      walk.open_store = ()
  _maybe(walk, eqn, _enabled(a), emit)
  return []


@_RULES.register(prims.commit_group_p)
def _commit_group(walk: _Walk, eqn, invals):
  if walk.open_store:
    walk.stores.append(walk.open_store)
    walk.open_store = ()
  return []


@_RULES.register(prims.wait_smem_to_gmem_p)
def _wait_stores(walk: _Walk, eqn, invals):
  n = eqn.params["n"]
  while len(walk.stores) > n:
    cells = walk.stores.pop(0)
    walk.emit("retire", eqn, "waits for its SMEM -> GMEM copies of "
              + walk.b.cells_name(cells), cells)
  return []


@_RULES.register(prims.barrier_arrive_p, prims.barrier_wait_p)
def _barrier_op(walk: _Walk, eqn, invals):
  a = unpack(invals, eqn.params["layout"])
  b = _barrier(walk, eqn, a["barrier"], a["barrier_t"])
  kind = "arrive" if eqn.primitive is prims.barrier_arrive_p else "wait"
  walk.emit(kind, eqn, f"{kind}s on {walk.b.barrier_name(b)}", (), b)
  return []


@_RULES.register(compute.wgmma_p)
def _wgmma(walk: _Walk, eqn, invals):
  a = unpack(invals, eqn.params["layout"])
  cells, names = (), []
  for part in ("a", "b"):
    x = a[part]
    if _smem(x):
      cells += _cells(x.buffer, a[part + "_t"])
      names.append(_label(x, a[part + "_t"]))
  walk.emit("mma", eqn, "issues a WGMMA reading " + " and ".join(names),
            cells)
  walk.mma.append(cells)
  return []


def _retire_mma(walk: _Walk, eqn, n: int) -> None:
  while len(walk.mma) > n:
    cells = walk.mma.pop(0)
    walk.emit("retire", eqn, "waits for its WGMMA reading "
              + walk.b.cells_name(cells), cells)


@_RULES.register(prims.commit_smem_p, compute.set_max_registers_p)
def _no_protocol(walk: _Walk, eqn, invals):
  """Fences and register budgets: no step of the protocol."""
  return []


@_RULES.register(compute.wgmma_wait_p)
def _wgmma_wait(walk: _Walk, eqn, invals):
  _retire_mma(walk, eqn, eqn.params["n"])
  return []


# ----------------------------------------------------------- control flow

@_RULES.register(cf.cond_p)
def _cond(walk: _Walk, eqn, invals):
  index, *ops = invals
  branches = eqn.params["branches"]
  if _known(index):
    k = min(max(int(index), 0), len(branches) - 1)
    return walk.run_closed(branches[k], ops)
  outer, before, ends = walk.sink, walk.pending(), []
  arms = []
  for br in branches:
    walk.sink = []
    walk.mma, walk.stores, walk.open_store = (list(before[0]),
                                              list(before[1]), before[2])
    walk.run_closed(br, ops)
    arms.append(walk.sink)
    ends.append(walk.pending())
  walk.sink = outer
  if any(e != ends[0] for e in ends):
    raise ModelError(walk.b.spec.name, "the branches of a condition on data "
                     "leave different WGMMAs or SMEM -> GMEM copies in "
                     "flight: the protocol model cannot follow them",
                     _line(eqn))
  outer.append(Choice(arms, _line(eqn)))
  return [UNKNOWN] * len(eqn.outvars)


def _trips(walk: _Walk, eqn, n: int) -> None:
  walk.b.loops.setdefault(_line(eqn), set()).add(n)


@_RULES.register(cf.while_p)
def _while(walk: _Walk, eqn, invals):
  p = eqn.params
  cc, bc = p["cond_nconsts"], p["body_nconsts"]
  cconsts, bconsts, carry = invals[:cc], invals[cc:cc + bc], invals[cc + bc:]
  trips = 0
  while True:
    (go,) = walk.run_closed(p["cond_jaxpr"], [*cconsts, *carry])
    if not _known(go):
      raise ModelError(walk.b.spec.name, "a loop whose trip count depends "
                       "on data: the protocol model needs it known from "
                       "constants, loop counters and the warpgroup index",
                       _line(eqn))
    if not bool(go):
      _trips(walk, eqn, trips)
      return carry
    carry = walk.run_closed(p["body_jaxpr"], [*bconsts, *carry])
    trips += 1


@_RULES.register(cf.scan_p)
def _scan(walk: _Walk, eqn, invals):
  p = eqn.params
  nc, nk, _, n_ys = scan_layout(p)
  consts, carry, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
  order = range(p["length"] - 1, -1, -1) if p["reverse"] else range(
      p["length"])
  for i in order:
    x = [np.asarray(v)[i] if _known(v) else UNKNOWN for v in xs]
    carry = walk.run_closed(p["jaxpr"], [*consts, *carry, *x])[:nk]
  _trips(walk, eqn, p["length"])
  return [*carry, *[UNKNOWN] * n_ys]


@_RULES.register(run_scoped_p)
def _run_scoped(walk: _Walk, eqn, invals):
  jaxpr = eqn.params["jaxpr"]
  avals = [v.aval for v in jaxpr.invars[eqn.params["num_consts"]:]]
  n = walk.entries.get(id(eqn), 0)
  walk.entries[id(eqn)] = n + 1
  key = (id(eqn), n)
  shared = bool(eqn.params.get("collective_axes"))
  bufs = walk.b.shared.get(key) if shared else None
  if bufs is None:
    where = f" at {_line(eqn)}" if _line(eqn) else ""
    names = scope_names(jaxpr, len(avals)) or [
        f"scratch{where}[{k}]" for k in range(len(avals))]
    bufs = [walk.b.allocate(a, nm) for a, nm in zip(avals, names)]
    if shared:
      walk.b.shared[key] = bufs
  return walk.run(jaxpr, (), [*invals, *map(Ref, bufs)])


# -------------------------------------------------------------- the entry

def skeleton(spec) -> Skeleton:
  """The skeleton of the `plgpu.kernel` of `spec` (a KernelSpec whose
  compiler params carry its `Mesh`): one program per warpgroup of block 0."""
  mesh = getattr(spec.compiler_params, "mesh", None)
  if mesh is None:
    raise ValueError(f"kernel {spec.name!r} is not a plgpu.kernel (its "
                     "compiler params carry no plgpu Mesh)")
  builder = _Builder(spec)
  gm = spec.grid_mapping
  refs = spec.jaxpr.jaxpr.invars[len(gm.grid):]
  operands = [Ref(builder.allocate(v.aval, name)) for v, name in zip(
      refs, operand_names(spec, len(refs)))]
  threads = mesh.num_threads or 1
  programs = []
  for wg in range(threads):
    walk = _Walk(builder, wg)
    ids = [np.int32(0)] * mesh.block_rank + (
        [np.int32(wg)] if mesh.num_threads else [])
    walk.run(spec.jaxpr.jaxpr, spec.jaxpr.consts, [*ids, *operands])
    if walk.open_store:
      walk.stores.append(walk.open_store)
    for cells in walk.stores:
      walk.emit("unwaited", None, "ends with its SMEM -> GMEM copy of "
                + walk.b.cells_name(cells) + " not waited for "
                "(wait_smem_to_gmem)", cells)
    programs.append(walk.sink)
  thread = mesh.thread_name or "wg"
  return Skeleton(spec.name, thread, programs, builder.buffers,
                  builder.events, {k: sorted(v) for k, v in
                                   builder.loops.items()}, builder.notes)


__all__ = ["Buffer", "Choice", "Event", "ModelError", "Skeleton", "UNKNOWN",
           "skeleton"]
