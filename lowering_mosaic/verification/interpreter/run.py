"""Runs a Mosaic module on CPU: the grid loop, block pipeline and devices.

The grid loop does what Mosaic's pipeline does around the kernel body: for
each grid point (row-major order; "parallel" dims too), it evaluates every
blocked operand's `@transform_k` to get its block index; when the index
changed since the previous step, an input block is copied from the operand's
HBM array into its VMEM buffer, and an output block is written back. An
output block is never read from HBM (aliased outputs included): at the
first step and whenever its index changes, the output's VMEM buffer holds
stale data on a TPU and poison here, so a kernel accumulates into an output
block only over consecutive steps (initialising it at the first one), and
an aliased output's old values are read through the aliased input. A return
to an output block already written back would lose the earlier writes on a
TPU: it is an error naming the operand, the block and the grid points. The
part of a block past its array (partial edge blocks, `Element` padding, a block index
read from data that leaves the array) reads poison on the way in (dsl/core/poison.py:
NaN for floats; hardware reads garbage there) and is dropped on the way
out, so no access leaves a buffer; with runtime checks on, a block index
outside the array is an error naming the operand. Scratch buffers persist
over the whole grid; they start at zero, or as poison with
`poison_buffers`. A grid dim whose `iteration_bounds` entry is dynamic
takes its size from the launch's leading operands (one int32 scalar per
such dim, in grid order), as a TPU does; `tpu.iteration_bound` reads it. In HBM, outputs not aliased start as poison, as a TPU
hands a kernel uninitialized output memory: the blocks no grid point visits
and what a kernel leaves unwritten in an `ANY` output read back as poison.
On a chip of several cores (`InterpreterOptions.num_cores`), each core runs
its share of the grid (cores.py) on its own copy of everything but the HBM
buffers, which the chip's cores share.
"""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
from dsl.core.jax_internals import core, ir

from dsl.core import checks
from dsl.core.kernel_layout import KernelLayout
from dsl.core.output_revisits import FIX
from lowering_mosaic import dialect
# prng_ops registers the random generator's ops.
from lowering_mosaic.verification.interpreter import prng_ops  # noqa: F401
from lowering_mosaic.verification.interpreter.buffers import (Buffer, MemRef,
                                                              fresh_array,
                                                              poison_of,
                                                              poison_of_dtype)
from lowering_mosaic.verification.interpreter.cores import (claim_output_block,
                                                            core_points,
                                                            semantics_of)
from lowering_mosaic.verification.interpreter.program import (CFunc, Frame,
                                                              compile_module,
                                                              run_block,
                                                              run_to_end)
from lowering_mosaic.verification.interpreter.simulator import (PREEMPT,
                                                                InterpreterOptions,
                                                                KernelSimulationError,
                                                                World)


@dataclasses.dataclass
class Window:
  transform: str | None        # None: the whole array (pl.ANY)
  bounds: tuple = ()
  element_dims: tuple = ()
  padding_low: tuple = ()
  padding_high: tuple = ()
  origin: str | None = None    # the spec it comes from: "in_specs[0]"


@dataclasses.dataclass
class KernelProgram:
  name: str
  funcs: dict
  grid: tuple
  layout: KernelLayout          # of arg_types: prefetch, inputs, outputs,
  windows: list                 # scratch; a window per input and output
  arg_types: list               # memref types after the grid ids
  operand_names: list
  aliases: list                 # [(operand index, output index)]
  entry: str = "main"
  semantics: tuple = ()         # dimension_semantics, one per grid dim

  @property
  def main(self) -> CFunc:
    return self.funcs[self.entry]

  @property
  def window_positions(self) -> range:
    """Where each window's operand sits among `arg_types`."""
    inputs, outputs = (self.layout.positions(g) for g in ("inputs",
                                                          "outputs"))
    return range(inputs.start, outputs.stop)


def _i64s(attr):
  return tuple(int(x) for x in ir.DenseI64ArrayAttr(attr))


def entry_of(funcs: dict) -> str:
  """The kernel function: the one with `dimension_semantics` (the others
  are index maps), else `main`."""
  for name, f in funcs.items():
    if "dimension_semantics" in f.attrs:
      return name
  return "main" if "main" in funcs else next(iter(funcs))


# The transform of a grid-free kernel's blocks: the whole array, always.
TRIVIAL = ""


def _grid_free_windows(arg_types) -> list:
  return [Window(None) if _space(t) == dialect.ANY
          else Window(TRIVIAL, tuple(ir.MemRefType(t).shape))
          for t in arg_types]


def program_from_module(module: ir.Module) -> KernelProgram:
  funcs = compile_module(module)
  entry = entry_of(funcs)
  main = funcs[entry]
  a = main.attrs
  grid = _i64s(a["iteration_bounds"]) if "iteration_bounds" in a else ()
  refs = KernelLayout.of(ids=len(grid), refs=None)
  arg_types = list(refs.split(main.arg_types).refs)
  layout = dialect.entry_layout(a, len(arg_types))
  windows = []
  origins = ([ir.StringAttr(s).value for s in ir.ArrayAttr(
      a["dsl.operand_origins"])] if "dsl.operand_origins" in a else [])
  if "window_params" not in a:
    by_role = layout.split(arg_types)
    windows = _grid_free_windows(by_role.inputs + by_role.outputs)
  for w in (ir.ArrayAttr(a["window_params"]) if "window_params" in a else ()):
    d = ir.DictAttr(w)
    if "transform_indices" not in d:
      windows.append(Window(None))
      continue
    elem = _i64s(d["dsl.element_dims"]) if "dsl.element_dims" in d else ()
    pad_lo, pad_hi = (_i64s(d[f"dsl.element_padding_{side}"])
                      if f"dsl.element_padding_{side}" in d else ()
                      for side in ("low", "high"))
    origin = origins[len(windows)] if len(windows) < len(origins) else None
    windows.append(Window(ir.FlatSymbolRefAttr(d["transform_indices"]).value,
                          _i64s(d["window_bounds"]), elem, pad_lo, pad_hi,
                          origin))
  names = ([ir.StringAttr(s).value for s in ir.ArrayAttr(a["dsl.operand_names"])]
           if "dsl.operand_names" in a else [])
  aliases = []
  if "dsl.input_output_aliases" in a:
    flat = _i64s(a["dsl.input_output_aliases"])
    aliases = [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
  name = (ir.StringAttr(a["dsl.kernel_name"]).value
          if "dsl.kernel_name" in a else "kernel")
  return KernelProgram(name, funcs, grid, layout, windows, arg_types,
                       list(refs.split(names).refs) if names else [],
                       aliases, entry, semantics_of(a))


# ------------------------------------------------------------ buffers

def _space(t) -> str:
  return dialect.memref_space(t)


def _name(prog, k, default):
  return prog.operand_names[k] if k < len(prog.operand_names) else default


@dataclasses.dataclass
class Operand:
  index: int
  is_output: bool
  window: Window
  hbm: Buffer
  block: Buffer | None
  current: tuple | None = None
  since: tuple | None = None      # the grid point that entered `current`
  # output blocks written back: block index -> (first, last) grid point
  left: dict = dataclasses.field(default_factory=dict)
  # output blocks the chip's cores started: block index -> (core, point)
  claims: dict = dataclasses.field(default_factory=dict)


def _setup_chip(world: World, prog: KernelProgram, chip: int, inputs,
                out_shapes, dtypes=None) -> list:
  """Buffers of one chip: (kernel args, operands) per core. `dtypes`: the
  dtype of every kernel operand (None for semaphores), for its poison."""
  dtypes = list(dtypes or [])
  dtype_of = lambda p: dtypes[p] if p < len(dtypes) else None
  cores = [d.index for d in world.devices if d.chip == chip]
  hbm = _hbm_buffers(prog, cores[0], inputs, out_shapes, dtype_of)
  claims = {k: {} for k in hbm}
  return [_setup_core(world, prog, dev, inputs, hbm, claims, dtype_of)
          for dev in cores]


def _hbm_buffers(prog: KernelProgram, dev: int, inputs, out_shapes,
                 dtype_of) -> dict:
  """Operand index -> its HBM buffer (an aliased output shares its
  input's), which the chip's cores share."""
  hbm = {}
  layout = prog.layout
  alias_of = {o: i for i, o in prog.aliases}
  for k, pos in enumerate(prog.window_positions):
    t = prog.arg_types[pos]
    name = _name(prog, pos, f"operand {k}")
    group, j = layout.locate(pos)
    if group == "inputs":
      arr = np.array(inputs[pos], copy=True)
    else:
      src = alias_of.get(j)
      arr = None
      if src is not None and layout.locate(src)[0] == "inputs":
        # the output shares the aliased input's HBM buffer
        hbm[k] = hbm[layout.locate(src)[1]]
      elif src is not None:
        arr = np.array(inputs[src], copy=True)
      if arr is None and k not in hbm:
        # A TPU hands a kernel its outputs uninitialized.
        dtype = _dtype(t)
        arr = np.full(out_shapes[j], poison_of_dtype(
            dtype_of(pos) or dtype, dtype), dtype)
    if k not in hbm:
      hbm[k] = Buffer(f"{name} (HBM)", ("hbm", k), arr, dialect.ANY, dev)
      hbm[k].poison = poison_of_dtype(dtype_of(pos), arr.dtype)
  return hbm


def _setup_core(world: World, prog: KernelProgram, dev: int, inputs, hbm,
                claims, dtype_of):
  """The buffers of one core (its SMEM prefetch copies, blocks, scratch,
  barrier semaphore) beside its chip's `hbm`; returns (kernel args,
  operands)."""
  device = world.devices[dev]
  for buf in hbm.values():
    device.add(buf)
  args, operands = [], []
  for i in prog.layout.positions("prefetch"):
    t = prog.arg_types[i]
    arr = np.array(inputs[i], dtype=dialect.numpy_dtype(
        ir.MemRefType(t).element_type)).reshape(tuple(ir.MemRefType(t).shape))
    buf = device.add(Buffer(_name(prog, i, f"scalar prefetch {i}"),
                            ("prefetch", i), arr, dialect.SMEM, dev))
    args.append(MemRef(buf))
  for k, (win, pos) in enumerate(zip(prog.windows, prog.window_positions)):
    t = prog.arg_types[pos]
    name = _name(prog, pos, f"operand {k}")
    is_out = prog.layout.locate(pos)[0] == "outputs"
    if win.transform is None:
      operands.append(Operand(k, is_out, win, hbm[k], None))
      args.append(MemRef(hbm[k]))
    else:
      blk = device.add(Buffer(f"{name} block", ("block", k), fresh_array(t),
                              _space(t), dev))
      blk.poison = poison_of_dtype(dtype_of(pos), blk.array.dtype)
      operands.append(Operand(k, is_out, win, hbm[k], blk,
                              claims=claims[k]))
      args.append(MemRef(blk))
  for i, pos in enumerate(prog.layout.positions("scratch")):
    t = prog.arg_types[pos]
    kind = dialect.semaphore_kind_of(t)
    name = _name(prog, pos, f"scratch_shapes[{i}]")
    buf = device.add(Buffer(name, ("scratch", i), fresh_array(t), _space(t),
                            dev, kind))
    if not kind:
      buf.poison = poison_of_dtype(
          dtype_of(pos), buf.array.dtype)
      if world.options.poison_buffers:
        buf.array[...] = poison_of(buf)
    args.append(MemRef(buf))
  device.add(Buffer("barrier semaphore", "barrier", np.zeros((), np.int64),
                    "semaphore_mem", dev, "regular"))
  return args, operands


def _dtype(t):
  return dialect.numpy_dtype(ir.MemRefType(t).element_type)


# ------------------------------------------------------------ pipeline

def _window_box(op: Operand, idx):
  """(starts, sizes) of the block in the HBM array (may leave it)."""
  win = op.window
  starts = []
  for d, (i, b) in enumerate(zip(idx, win.bounds)):
    if d in win.element_dims:
      lo = win.padding_low[win.element_dims.index(d)]
      starts.append(int(i) - lo)
    else:
      starts.append(int(i) * b)
  return starts, list(win.bounds)


def _clip(starts, sizes, shape):
  src, dst = [], []
  for s, n, full in zip(starts, sizes, shape):
    lo, hi = max(s, 0), min(s + n, full)
    if hi <= lo:
      return None
    src.append(slice(lo, hi))
    dst.append(slice(lo - s, hi - s))
  return tuple(src), tuple(dst)


def _copy_in(world, op: Operand, idx, line):
  starts, sizes = _window_box(op, idx)
  hbm = op.hbm.array
  full = np.full(sizes, poison_of(op.hbm), hbm.dtype)
  clipped = _clip(starts, sizes, hbm.shape)
  if clipped is not None:
    src, dst = clipped
    box = (tuple(s.start for s in src), tuple(s.stop - s.start for s in src))
    world.check_access(op.hbm, box, False, line, "read by the grid pipeline")
    full[dst] = hbm[src]
  blk = op.block
  world.check_access(blk, ((0,) * blk.array.ndim, blk.array.shape), True,
                     line, "overwritten by the grid pipeline")
  blk.array[...] = full.reshape(blk.array.shape)


def _poison_block(world, op: Operand, line):
  """A new output block: the VMEM buffer holds what it held (stale data;
  poison here), never the block's HBM contents."""
  blk = op.block
  world.check_access(blk, ((0,) * blk.array.ndim, blk.array.shape), True,
                     line, "overwritten by the grid pipeline")
  blk.array[...] = poison_of(blk)


def _copy_out(world, op: Operand, idx, line):
  starts, sizes = _window_box(op, idx)
  blk = op.block
  world.check_access(blk, ((0,) * blk.array.ndim, blk.array.shape), False,
                     line, "written back by the grid pipeline")
  clipped = _clip(starts, sizes, op.hbm.array.shape)
  if clipped is None:
    return
  src, dst = clipped
  op.hbm.array[src] = blk.array.reshape(sizes)[dst]


def _first_line(f: CFunc) -> str | None:
  return next((op.line for op in f.block.ops if op.line), None)


def _outside(op: Operand, idx) -> tuple | None:
  """(dim, what it takes) of the first dim where the block at `idx` holds
  no element of its array (of the padded array for `Element` dims)."""
  win, shape = op.window, op.hbm.array.shape
  for d, (i, b, n) in enumerate(zip(idx, win.bounds, shape)):
    if d in win.element_dims:
      e = win.element_dims.index(d)
      padded = n + win.padding_low[e] + win.padding_high[e]
      if i < 0 or i >= padded:
        return d, f"element offsets in [0, {padded})"
    elif i < 0 or i * b >= n:
      return d, f"blocks of {b} take block indices in [0, {-(-n // b)})"
  return None


def _check_block_index(world, prog, op: Operand, idx, point):
  """With runtime checks on, a block index outside the array is an error,
  worded as on every backend (dsl/core/checks.py)."""
  bad = _outside(op, idx) if world.options.runtime_checks else None
  if bad is None:
    return
  win = op.window
  name = win.origin or _name(prog, prog.window_positions[op.index],
                             f"operand {op.index}")
  f = prog.funcs.get(win.transform)
  line = _first_line(f) if f is not None else None
  shape = op.hbm.array.shape
  array = core.ShapedArray(shape, op.hbm.array.dtype)
  pads = {d: (win.padding_low[e], win.padding_high[e])
          for e, d in enumerate(win.element_dims)}
  message = checks.block_index_message(
      name, idx, point, array.str_short(),
      checks.block_limits_text(shape, win.bounds, pads), line)
  raise KernelSimulationError(
      "check", f"kernel '{prog.name}': " + checks.check_text(message, line),
      (line,) if line else ())


def _next_output_block(world, prog, dev, op: Operand, idx, point, line):
  """Writes the output block left back and starts `idx` (poison); a block
  already written back is an error (a TPU would lose its earlier writes)."""
  if op.current is not None:
    _copy_out(world, op, op.current, line)
    op.left[op.current] = (op.since,
                           _previous(world.devices[dev].grid, point))
  if idx in op.left:
    _revisit_error(world, prog, dev, op, idx, point)
  if world.options.num_cores > 1:
    claim_output_block(world, dev, op.claims, _operand_name(prog, op), idx,
                       point, _transform_line(prog, op)
                       or _first_line(prog.main))
  _poison_block(world, op, line)


def _operand_name(prog, op: Operand) -> str:
  return op.window.origin or _name(prog, prog.window_positions[op.index],
                                   f"operand {op.index}")


def _transform_line(prog, op: Operand) -> str | None:
  """The user's line of the operand's index map."""
  f = prog.funcs.get(op.window.transform)
  return _first_line(f) if f is not None else None


def _previous(grid, point) -> tuple:
  """The grid point before `point` in row-major order."""
  flat = int(np.ravel_multi_index(tuple(point), grid)) - 1
  return tuple(int(i) for i in np.unravel_index(flat, grid))


def _revisit_error(world, prog, dev, op: Operand, idx, point):
  first, last = op.left[idx]
  name = _operand_name(prog, op)
  where = _transform_line(prog, op)
  block = tuple(int(i) for i in idx)
  span = (f"grid point {first}" if first == last
          else f"grid points {first} to {last}")
  raise KernelSimulationError(
      "revisit", f"{world._prefix(dev)}: {name}: output block {block} is "
      f"visited again at grid point {tuple(int(i) for i in point)} after "
      f"it was visited at {span} and written back; a TPU never reads an "
      f"output block back from HBM, so the earlier writes would be lost. "
      f"Fix: {FIX}", (where,) if where else ())


def device_program(world: World, prog: KernelProgram, dev: int, args,
                   operands):
  """The grid points of one core (the whole grid on a chip of one core;
  a generator for the scheduler)."""
  main = prog.main
  prefetch = list(prog.layout.split(args).prefetch)
  line = f"the grid pipeline of kernel '{prog.name}'"
  device = world.devices[dev]
  for point in core_points(device.grid, prog.semantics,
                           world.options.num_cores, device.core):
    ids = [np.int32(i) for i in point]
    for op in operands:
      if op.block is None:
        continue
      if op.window.transform == TRIVIAL:
        idx = (0,) * len(op.window.bounds)
      else:
        f = prog.funcs[op.window.transform]
        tframe = Frame(world, dev, prog.name)
        idx = tuple(int(x) for x in run_to_end(
            run_block(tframe, f.block, ids + prefetch)))
      if idx == op.current:
        continue
      _check_block_index(world, prog, op, idx, point)
      if op.is_output:
        _next_output_block(world, prog, dev, op, idx, point, line)
      else:
        _copy_in(world, op, idx, line)
      op.current, op.since = idx, tuple(point)
      if op.window.transform != TRIVIAL:
        op.block.block_index = idx
    frame = Frame(world, dev, prog.name, tuple(int(i) for i in point))
    yield from run_block(frame, main.block, ids + args)
    yield PREEMPT
  for op in operands:
    if op.is_output and op.block is not None and op.current is not None:
      _copy_out(world, op, op.current, line)


def simulate(prog: KernelProgram, per_device_inputs, out_shapes,
             options: InterpreterOptions, dtypes=None):
  """Runs the kernel on len(per_device_inputs) devices (chips of
  `options.num_cores` cores); returns the outputs of every device (list per
  device). `dtypes`: every kernel operand's dtype (the module's integer
  types are signless), for its poison."""
  out_shapes = [tuple(s) for s in out_shapes]
  n = len(per_device_inputs)
  world = World(n, options, prog.name)
  chips = []
  for chip, inputs in enumerate(per_device_inputs):
    cores = [d for d in world.devices if d.chip == chip]
    for d in cores:
      own = _take_grid_sizes(d, prog, inputs)
    chips.append(_setup_chip(world, prog, chip, own, out_shapes, dtypes))
  with np.errstate(all="ignore"):
    world.run(device_program(world, prog, d.index, args, ops)
              for d, (args, ops) in zip(world.devices,
                                        [c for chip in chips for c in chip]))
  outs = []
  for chip in chips:
    _, ops = chip[0]
    outs.append([np.array(op.hbm.array) for op in ops if op.is_output])
  return outs, world


def _take_grid_sizes(device, prog: KernelProgram, inputs) -> list:
  """Sets the grid `device` runs (a dynamic dim's size is one of the
  leading `inputs`) and returns the kernel's own inputs."""
  dynamic = [d for d, n in enumerate(prog.grid) if n == dialect.DYNAMIC_SIZE]
  sizes = [int(np.asarray(x).reshape(())) for x in inputs[:len(dynamic)]]
  grid = list(prog.grid)
  for d, size in zip(dynamic, sizes):
    grid[d] = max(size, 0)
  device.grid = tuple(grid)
  return list(inputs[len(dynamic):])


# ------------------------------------------------------------ program cache

_PROGRAMS: dict = {}
_LOCK = threading.Lock()


def cached_program(key, module_text: str) -> KernelProgram:
  with _LOCK:
    prog = _PROGRAMS.get(key)
    if prog is None:
      ctx = dialect.make_context()
      with ctx:
        module = ir.Module.parse(module_text)
        prog = program_from_module(module)
      prog.context, prog.module = ctx, module   # keep them alive
      _PROGRAMS[key] = prog
    return prog
