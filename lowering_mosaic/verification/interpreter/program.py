"""Compiles an MLIR module into Python closures and runs them.

`compile_module(module)` walks every function once: each operation becomes a
`COp` (a closure that has read the op's attributes, its operand and result
slots, and its source line from the MLIR location). Running a block is a
generator (`run_block`), so an operation that must wait (a DMA wait, a
semaphore wait) can yield to the scheduler of `simulator.World`.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from dsl.core.jax_internals import ir

from dsl.core import checks
from dsl.core.jaxpr_walk import RuleTable
from lowering_mosaic import dialect
from lowering_mosaic.verification.interpreter.buffers import (Buffer, MemRef,
                                                             fresh_array,
                                                             poison_of)
from lowering_mosaic.verification.interpreter.simulator import (
    KernelSimulationError, Wait)
from lowering_mosaic.verification.interpreter.sync_ops import SYNC_OPS
from lowering_mosaic.verification.interpreter.value_ops import (VALUE_OPS,
                                                                i64_array_attr,
                                                                result_dtype,
                                                                result_shape)


class COp:
  __slots__ = ("name", "fn", "args", "outs", "gen", "line")

  def __init__(self, name, fn, args, outs, gen, line):
    self.name, self.fn, self.args, self.outs = name, fn, args, outs
    self.gen, self.line = gen, line


class CBlock:
  __slots__ = ("args", "ops", "term")

  def __init__(self, args, ops, term):
    self.args, self.ops, self.term = args, ops, term


@dataclasses.dataclass
class CFunc:
  name: str
  block: CBlock
  attrs: dict
  arg_types: list


class Frame:
  """The state of one device running one function (at grid `point`)."""
  __slots__ = ("env", "device", "world", "line", "kernel", "point")

  def __init__(self, world, device: int, kernel: str, point=None):
    self.env = {}
    self.world = world
    self.device = device
    self.line = None
    self.kernel = kernel
    self.point = point


TERMINATORS = {"scf.yield", "func.return", "tpu.yield", "scf.condition"}


class Compiler:
  def __init__(self):
    self.slots: dict = {}

  def slot(self, v) -> int:
    s = self.slots.get(v)
    if s is None:
      s = self.slots[v] = len(self.slots)
    return s

  def block(self, blk) -> CBlock:
    args = [self.slot(a) for a in blk.arguments]
    ops, term = [], []
    for op in blk.operations:
      op = op.operation
      if op.name in TERMINATORS:
        term = [self.slot(v) for v in op.operands]
        continue
      ops.append(self.op(op))
    return CBlock(args, ops, term)

  def op(self, op) -> COp:
    name = op.name
    line = dialect.location_line(op.location)
    outs = [self.slot(r) for r in op.results]
    stateful_op = STATEFUL.lookup(name) or SYNC_OPS.lookup(name)
    if stateful_op is not None:
      fn, args, gen = stateful_op(op, self)
      args = [self.slot(v) for v in args]
      return COp(name, fn, args, outs, gen, line)
    make = VALUE_OPS.lookup(name)
    if make is None:
      raise KernelSimulationError(
          "unsupported", f"the Mosaic interpreter cannot run '{name}' "
          f"(at {line})", (line,))
    pure = make(op)
    return COp(name, lambda frame, *a: pure(*a),
               [self.slot(v) for v in op.operands], outs, False, line)


def run_block(frame: Frame, cb: CBlock, args):
  """Runs a block (a generator); returns its terminator's operands."""
  env = frame.env
  for s, v in zip(cb.args, args):
    env[s] = v
  for op in cb.ops:
    frame.line = op.line
    vals = [env[s] for s in op.args]
    try:
      if op.gen:
        res = yield from op.fn(frame, *vals)
      else:
        res = op.fn(frame, *vals)
    except KernelSimulationError:
      raise
    except (IndexError, ValueError, TypeError, FloatingPointError) as e:
      raise KernelSimulationError(
          "error", f"kernel '{frame.kernel}': {op.name} at {op.line} "
          f"failed: {e}", (op.line,)) from e
    outs = op.outs
    if len(outs) == 1:
      env[outs[0]] = res
    elif outs:
      for s, r in zip(outs, res):
        env[s] = r
  return [env[s] for s in cb.term]


def run_to_end(gen):
  """Drives a generator that must not block (index maps)."""
  try:
    while True:
      req = next(gen)
      if isinstance(req, Wait):
        raise KernelSimulationError("error", "an index map cannot wait")
  except StopIteration as stop:
    return stop.value


def compile_module(module) -> dict[str, CFunc]:
  c = Compiler()
  funcs = {}
  for op in module.body.operations:
    op = op.operation
    if op.name != "func.func":
      continue
    name = ir.StringAttr(op.attributes["sym_name"]).value
    attrs = {}
    for a in op.attributes:
      key = a if isinstance(a, str) else a.name
      attrs[key] = op.attributes[key]
    block = op.regions[0].blocks[0]
    arg_types = [a.type for a in block.arguments]
    funcs[name] = CFunc(name, c.block(block), attrs, arg_types)
  return funcs


# ------------------------------------------------------------ stateful ops

STATEFUL = RuleTable("the Mosaic interpreter")
stateful = STATEFUL.register


def _fail(frame, message):
  raise KernelSimulationError(
      "error", f"kernel '{frame.kernel}': {message} at {frame.line}",
      (frame.line,))


def _access(frame, ref: MemRef, idx, shape, write, strides=None,
            padding=False):
  """(numpy index, part) of an access: `part` is where the lanes `index`
  selects lie in the access (None: all of it; the rest is tile padding,
  or past the ref); `index` is None when no lane lies inside. An access
  that leaves its ref (a window placed at run time) fails a check with
  runtime checks on, else keeps only its lanes inside the ref."""
  try:
    if padding:
      index, box, part = ref.access_padded(idx, shape, strides)
    else:
      (index, box), part = ref.access(idx, shape, strides), None
  except IndexError:
    if frame.world.options.runtime_checks:
      _window_outside(frame, ref, idx, shape, strides, write)
    clipped = ref.access_clipped(idx, shape, strides)
    if clipped is None:
      return None, ()
    index, box, part = clipped
  frame.world.check_access(ref.buf, box, write, frame.line)
  return index, part


def _window_outside(frame, ref: MemRef, idx, shape, strides, write):
  """The failed check of a window that leaves its ref, worded as on every
  backend (dsl/core/checks.py)."""
  strides = list(strides) if strides else [1] * len(idx)
  parts = []
  for k, d in enumerate(ref.dims):
    i, n, s = int(idx[k]), shape[k], strides[k]
    stop = i + (n - 1) * s + 1
    parts.append(":" if (i, stop, s) == (0, ref.sizes[d], 1) else
                 f"{i}:{stop}" + (f":{s}" if s != 1 else ""))
  name = ref.buf.name.removesuffix(" block")
  access = checks.window_access("store to" if write else "load from", name,
                                ", ".join(parts), ref.shape)
  message = checks.window_message(access, ref.buf.block_index, frame.point)
  raise KernelSimulationError(
      "check", f"kernel '{frame.kernel}': "
      + checks.check_text(message, frame.line), (frame.line,))


def _load(frame, ref, idx, shape, strides=None):
  """A vector load; lanes in the tile padding past the buffer read poison,
  as block padding does (masked loads past an array's end read them), and
  so do lanes of a window placed at run time outside its ref."""
  index, part = _access(frame, ref, idx, shape, False, strides, padding=True)
  if part is None:
    return np.array(ref.buf.array[index]).reshape(shape)
  out = np.full(shape, poison_of(ref.buf), ref.buf.array.dtype)
  if index is not None:
    out[part] = np.asarray(ref.buf.array[index]).reshape(out[part].shape)
  return out


@stateful("vector.load")
def _vector_load(op, c):
  shape = result_shape(op)

  def fn(frame, ref, *idx):
    return _load(frame, ref, idx, shape)
  return fn, list(op.operands), False


@stateful("tpu.strided_load")
def _strided_load(op, c):
  shape = result_shape(op)
  strides = i64_array_attr(op, "strides")

  def fn(frame, ref, *idx):
    return _load(frame, ref, idx, shape, strides)
  return fn, list(op.operands), False


def _store(frame, ref, idx, val, strides=None, mask=None):
  val = np.asarray(val)
  padded = mask is not None   # lanes masked off may lie in the tile padding
  index, part = _access(frame, ref, idx, val.shape, True, strides,
                        padding=padded)
  if index is None:
    return
  if part is not None:
    if mask is not None:
      mask = np.broadcast_to(np.asarray(mask), val.shape)
      outside = mask.copy()
      outside[part] = False
      if outside.any() and _in_view(ref, idx, val.shape, strides):
        _fail(frame, f"out-of-bounds store to {ref.buf.name}: "
              f"{int(outside.sum())} lane(s) the mask keeps lie past its "
              f"end {ref.shape}")
      mask = mask[part]
    val = val[part]
  target = ref.buf.array
  view_shape = target[index].shape
  val = val.reshape(view_shape)
  if mask is not None:
    old = target[index]
    val = np.where(np.asarray(mask).reshape(view_shape), val, old)
  target[index] = val


def _in_view(ref, idx, shape, strides) -> bool:
  """Whether an access starts inside its view and leaves it only through
  the tile padding at the buffer's end (not a window placed at run time
  outside its ref)."""
  try:
    ref.access_padded(idx, shape, strides)
    return True
  except IndexError:
    return False


@stateful("vector.store")
def _vector_store(op, c):
  def fn(frame, val, ref, *idx):
    _store(frame, ref, idx, val)
  return fn, list(op.operands), False


@stateful("tpu.strided_store")
def _strided_store(op, c):
  strides = i64_array_attr(op, "strides")

  def fn(frame, val, ref, *idx):
    _store(frame, ref, idx, val, strides)
  return fn, list(op.operands), False


@stateful("tpu.vector_store")
def _tpu_vector_store(op, c):
  operands = list(op.operands)
  rank = ir.MemRefType(operands[1].type).rank
  has_mask = len(operands) > 2 + rank

  def fn(frame, val, ref, *rest):
    idx, mask = rest[:rank], (rest[rank] if has_mask else None)
    _store(frame, ref, idx, val, mask=mask)
  return fn, operands, False


@stateful("memref.load")
def _memref_load(op, c):
  dtype = result_dtype(op)

  def fn(frame, ref, *idx):
    index, _ = _access(frame, ref, idx, (1,) * len(idx), False)
    if index is None:       # outside the ref: poison
      return dtype.type(poison_of(ref.buf))
    return dtype.type(ref.buf.array[index].reshape(()))
  return fn, list(op.operands), False


@stateful("memref.store")
def _memref_store(op, c):
  def fn(frame, val, ref, *idx):
    index, _ = _access(frame, ref, idx, (1,) * len(idx), True)
    if index is not None:   # outside the ref: dropped
      ref.buf.array[index] = val
  return fn, list(op.operands), False


@stateful("tpu.memref_slice")
def _memref_slice(op, c):
  t = ir.MemRefType(op.results[0].type)
  sizes = list(t.shape)
  src_rank = ir.MemRefType(op.operands[0].type).rank
  operands = list(op.operands)[:1 + src_rank]

  def fn(frame, ref, *starts):
    v = ref.slice(starts, sizes)
    for d in v.dims:
      if v.base[d] < 0 or v.base[d] + v.sizes[d] > ref.buf.array.shape[d]:
        _fail(frame, f"tpu.memref_slice of {ref.buf.name} out of bounds: "
              f"{[int(s) for s in starts]} + {sizes} in {ref.shape}")
    return v
  return fn, operands, False


@stateful("tpu.memref_squeeze")
def _memref_squeeze(op, c):
  shape = tuple(ir.MemRefType(op.results[0].type).shape)
  return (lambda frame, ref: ref.squeeze(shape)), list(op.operands), False


@stateful("tpu.memref_reshape")
def _memref_reshape(op, c):
  shape = tuple(ir.MemRefType(op.results[0].type).shape)

  def fn(frame, ref):
    out = ref.reshape(shape)
    if out is None:
      _fail(frame, f"tpu.memref_reshape of {ref} to {shape}: the window is "
            "not contiguous in its buffer")
    return out
  return fn, list(op.operands), False


def _new_buffer(frame, op_key, name, t, space, sem_kind=None):
  dev = frame.world.devices[frame.device]
  n = dev.alloc_counts.get(op_key, 0)
  dev.alloc_counts[op_key] = n + 1
  array = fresh_array(t, frame.world.options.poison_buffers)
  buf = Buffer(f"{name}#{n}", (op_key, n), array, space, frame.device,
               sem_kind)
  dev.add(buf)
  return MemRef(buf)


@stateful("memref.alloca")
def _alloca(op, c):
  t = ir.MemRefType(op.results[0].type)
  space = dialect.memref_space(op.results[0].type)
  key = ("alloca", id(op), dialect.location_line(op.location))
  name = f"run_scoped buffer ({dialect.location_line(op.location)})"
  return (lambda frame: _new_buffer(frame, key, name, t, space)), [], False


@stateful("tpu.sem_alloc")
def _sem_alloc(op, c):
  t = ir.MemRefType(op.results[0].type)
  kind = dialect.semaphore_kind_of(op.results[0].type)
  key = ("sem_alloc", id(op), dialect.location_line(op.location))
  name = f"run_scoped semaphore ({dialect.location_line(op.location)})"
  return (lambda frame: _new_buffer(frame, key, name, t, "semaphore_mem",
                                    kind)), [], False


@stateful("tpu.sem_barrier")
def _sem_barrier(op, c):
  def fn(frame):
    return MemRef(frame.world.devices[frame.device].buffers["barrier"])
  return fn, [], False


@stateful("tpu.device_id")
def _device_id(op, c):
  return (lambda frame: np.int32(frame.world.devices[frame.device].chip)
          ), [], False


@stateful("tpu.iteration_bound")
def _iteration_bound(op, c):
  """The size of a grid dim (dynamic ones come with the launch)."""
  dim = ir.IntegerAttr(op.attributes["dim"]).value
  return (lambda frame: np.int32(frame.world.devices[frame.device].grid[dim])
          ), [], False


@stateful("tpu.trace_start", "tpu.trace_stop")
def _trace(op, c):
  """Profiler marks: nothing to do."""
  return (lambda frame: None), [], False


@stateful("cf.assert")
def _assert(op, c):
  msg = ir.StringAttr(op.attributes["msg"]).value

  def fn(frame, ok):
    if not np.all(np.asarray(ok)):
      raise KernelSimulationError(
          "check", f"kernel '{frame.kernel}': {msg} (check at {frame.line})",
          (frame.line,))
  return fn, list(op.operands), False


@stateful("tpu.log")
def _log(op, c):
  tag = ir.StringAttr(op.attributes["tag"]).value

  def fn(frame, *vals):
    vals = [np.asarray(v) for v in vals]
    try:
      text = tag.format(*vals)
    except (IndexError, KeyError, ValueError):
      text = tag + " " + " ".join(str(v) for v in vals)
    where = frame.world.where(frame.device)
    prefix = f"[{where}] " if where else ""
    print(prefix + text, flush=True)
  return fn, list(op.operands), False


# ------------------------------------------------------------ control flow

@stateful("scf.for")
def _scf_for(op, c):
  body = c.block(op.regions[0].blocks[0])
  operands = list(op.operands)

  def fn(frame, lb, ub, step, *carry):
    carry = list(carry)
    for i in range(int(lb), int(ub), int(step)):
      iv = type(lb)(i) if not isinstance(lb, int) else i
      carry = yield from run_block(frame, body, [iv] + carry)
    return carry if len(carry) != 1 else carry[0]
  return fn, operands, True


@stateful("scf.if")
def _scf_if(op, c):
  then_b = c.block(op.regions[0].blocks[0])
  else_b = c.block(op.regions[1].blocks[0]) if len(
      op.regions[1].blocks) else None
  n = len(op.results)

  def fn(frame, cond):
    if bool(cond):
      outs = yield from run_block(frame, then_b, [])
    elif else_b is not None:
      outs = yield from run_block(frame, else_b, [])
    else:
      outs = []
    return outs[0] if n == 1 else outs
  return fn, list(op.operands), True


@stateful("scf.while")
def _scf_while(op, c):
  before = c.block(op.regions[0].blocks[0])
  after = c.block(op.regions[1].blocks[0])
  n = len(op.results)

  def fn(frame, *init):
    vals = list(init)
    while True:
      cond_and_args = yield from run_block(frame, before, vals)
      cond, args = cond_and_args[0], cond_and_args[1:]
      if not bool(cond):
        return args[0] if n == 1 else args
      vals = yield from run_block(frame, after, args)
  return fn, list(op.operands), True


@stateful("tpu.region")
def _tpu_region(op, c):
  body = c.block(op.regions[0].blocks[0])
  n = len(op.results)

  def fn(frame):
    outs = yield from run_block(frame, body, [])
    return outs[0] if n == 1 else outs
  return fn, [], True
