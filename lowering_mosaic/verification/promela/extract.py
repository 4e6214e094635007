"""Mosaic MLIR module -> `KernelModel` (see model.py).

The walk follows the kernel function op by op, in the style of the lowering's
rule table `OPS` (a `RuleTable` keyed by op name; mosaic_ir.py),
with the rules of integer ops (ops_int.py), views (views.py), loads and
stores (ops_memory.py), DMAs and semaphores (ops_sync.py) and control flow
(ops_control.py). The environment maps each MLIR value to what the model
knows of it:

- an `Expr` for integer and index scalars computed from constants, grid ids,
  loop counters and `tpu.device_id` (arith ops are mirrored as Promela
  expressions); None for any other value (data, loads, `tpu.sem_read`);
- a `View` for memrefs: a box of a `Buffer` or of a `SemArray`, built from
  the function arguments, `memref.alloca`, `tpu.sem_alloc`, `tpu.sem_barrier`
  and narrowed by `tpu.memref_slice` / `tpu.memref_squeeze`.

Each op that touches memory becomes a statement carrying the kernel source
line of its MLIR location (`loc("dma_start"("kernel.py":21:0))`).
"""
from __future__ import annotations

import math
import re
from typing import Optional

from dsl.core.jax_internals import ir

from lowering_mosaic import dialect
from lowering_mosaic.verification.promela import model as M
# The op rules: importing them fills OPS.
from lowering_mosaic.verification.promela import (ops_control, ops_int,  # noqa: F401
                                                  ops_sync)
from lowering_mosaic.verification.promela.model import Expr, const, var
from lowering_mosaic.verification.promela.mosaic_ir import (OPS, ModelError,
                                                            is_memref,
                                                            itemsize,
                                                            location_of,
                                                            sem_kind, shape_of,
                                                            space)
from lowering_mosaic.verification.promela.ops_memory import unknown_op
from lowering_mosaic.verification.promela.views import View

__all__ = ["Extractor", "ModelError", "extract"]


class Extractor:
  """Builds one `KernelModel` from one module."""

  def __init__(self, module, num_devices: Optional[int] = None,
               max_parallel: int = 4):
    self.module = module
    self.num_devices_arg = num_devices
    self.max_parallel = max_parallel
    self.stmts: list[M.Stmt] = []
    self.locals: list[tuple[str, str]] = []
    self.buffers: list[M.Buffer] = []
    self.sems: list[M.SemArray] = []
    self.notes: list[str] = []
    self.barrier: Optional[M.SemArray] = None
    self.line: Optional[str] = None
    self.scopes: list[list] = []
    self._counter = 0

  # -------------------------------------------------------- helpers

  def fresh(self, prefix: str) -> str:
    self._counter += 1
    name = f"{prefix}{self._counter}"
    self.locals.append((name, "int"))
    return name

  def info(self, op, what: str) -> M.Stmt:
    line, _ = location_of(op)
    if line is None:
      line = self.line
    s = M.Stmt(len(self.stmts) + 1, line, what)
    self.stmts.append(s)
    return s

  def note(self, text: str):
    if text not in self.notes:
      self.notes.append(text)

  def int_value(self, env, v) -> Optional[Expr]:
    x = env.get(v)
    return x if isinstance(x, Expr) else None

  def view(self, env, v, op, what) -> View:
    x = env.get(v)
    if not isinstance(x, View):
      raise ModelError(f"{op.operation.name} at {location_of(op)[0]}: the "
                       f"{what} memref does not come from a kernel argument, "
                       "an alloca or a slice of one")
    return x

  def sem_ref(self, env, v, op) -> M.SemRef:
    vw = self.view(env, v, op, "semaphore")
    if not isinstance(vw.base, M.SemArray):
      raise ModelError(f"{op.operation.name} at {location_of(op)[0]}: "
                       "expected a semaphore")
    idx = vw.sem_index()
    if idx is None:
      self.note(f"a semaphore of {vw.base.name} is chosen by a value the "
                "model does not track; the model uses element 0")
      idx = const(0)
    return M.SemRef(vw.base, idx)

  def barrier_sem(self) -> M.SemArray:
    if self.barrier is None:
      self.barrier = M.SemArray("barrier semaphore", "barrier", (), "device")
      self.sems.append(self.barrier)
    return self.barrier

  # -------------------------------------------------------- blocks

  def block(self, block, env) -> tuple[list, list]:
    """Walks a block; returns (statements, values of its terminator)."""
    out: list = []
    ops = list(block.operations)
    for op in ops:
      name = op.operation.name
      line, _ = location_of(op)
      saved = self.line
      if line is not None:
        self.line = line
      if name in ("scf.yield", "tpu.yield", "scf.condition", "func.return"):
        self.line = saved
        return out, [env.get(v) for v in op.operands]
      rule = OPS.lookup(name) or unknown_op
      rule(self, op, env, out)
    return out, []

  # -------------------------------------------------------- the kernel

  def run(self) -> M.KernelModel:
    with self.module.context:
      main = self._main()
      return self._kernel(main)

  def _main(self):
    funcs = [op for op in self.module.body.operations
             if op.operation.name == "func.func"]
    for f in funcs:
      if "dimension_semantics" in f.attributes:
        return f
    for f in funcs:
      if ir.StringAttr(f.attributes["sym_name"]).value == "main":
        return f
    for f in funcs:
      if "window_params" in f.attributes or "iteration_bounds" in f.attributes:
        return f
    if funcs:
      return funcs[0]
    raise ModelError("the module has no kernel function")

  def _kernel(self, main) -> M.KernelModel:
    attrs = main.attributes
    block = main.regions[0].blocks[0]
    args = list(block.arguments)
    name = _string(attrs, "dsl.kernel_name", "kernel")
    source = _string(attrs, "dsl.kernel_src", "")
    grid, n_grid = _grid(attrs, args)
    semantics = _semantics(attrs, len(grid))
    mesh_shape = (tuple(ir.DenseI64ArrayAttr(attrs["dsl.mesh_shape"]))
                  if "dsl.mesh_shape" in attrs else ())
    num_devices = self._num_devices(mesh_shape)
    par = self._parallel_dims(grid, semantics)
    par_dims = {d for d, _ in par}

    names = ([ir.StringAttr(a).value for a in ir.ArrayAttr(
        attrs["dsl.operand_names"])] if "dsl.operand_names" in attrs else [])
    env: dict = {}
    for d in range(n_grid):
      env[args[d]] = var(f"p{d}") if d in par_dims else (
          var(f"g{d}") if grid[d] > 1 else const(0))
    views = self._arguments(args[n_grid:], names[n_grid:], attrs)
    env.update(zip(args[n_grid:], views))

    self.scopes.append([])
    body, _ = self.block(block, env)
    self.scopes.pop()
    arbitrary = [(f"g{d}", int(n)) for d, n in enumerate(grid)
                 if d not in par_dims and n > 1]
    if arbitrary:
      body = [self._grid_step(arbitrary, body, source)]

    km = M.KernelModel(name=name, source=source, num_devices=num_devices,
                       grid=tuple(int(g) for g in grid),
                       semantics=tuple(semantics), parallel_dims=par,
                       buffers=self.buffers, sems=self.sems, body=body,
                       stmts=self.stmts, locals=self.locals, notes=self.notes,
                       mesh_shape=mesh_shape)
    km.dma_unit = _dma_unit(km)
    return km

  def _num_devices(self, mesh_shape) -> int:
    if self.num_devices_arg is not None:
      num_devices = int(self.num_devices_arg)
    else:
      num_devices = math.prod(mesh_shape) if mesh_shape else 1
    if num_devices < 1:
      raise ModelError(f"num_devices must be at least 1, got {num_devices}")
    return num_devices

  def _parallel_dims(self, grid, semantics) -> list:
    """[(grid dim, size)] of the parallel dims that get a process per
    point; none when they have more than `max_parallel` points."""
    par = [(d, int(n)) for d, (n, s) in enumerate(zip(grid, semantics))
           if s == "parallel" and n > 1]
    if math.prod(n for _, n in par) > self.max_parallel:
      self.note(f"the parallel grid dims {[d for d, _ in par]} have "
                f"{math.prod(n for _, n in par)} points, more than "
                f"max_parallel={self.max_parallel}; they run in order in one "
                "process per device, as on a single TensorCore")
      par = []
    return par

  def _grid_step(self, arbitrary, body, source) -> M.GridStep:
    """The body as one step of the loop nest over the arbitrary grid dims,
    with the pipeline's copies of the blocked buffers between steps."""
    for v, _ in arbitrary:
      self.locals.append((v, "int"))
    blocked = [b for b in self.buffers if b.blocked]
    src = source if re.search(r":\d+$", source or "") else None
    step = M.GridStep(arbitrary, body, blocked,
                      M.Stmt(len(self.stmts) + 1, src,
                             "end of a grid step: the pipeline copies "
                             "blocks in and out"))
    self.stmts.append(step.info)
    return step

  def _arguments(self, margs, names, attrs) -> list:
    """The views of the kernel's operands (None for non-memrefs): their
    buffers and semaphore arrays, named after `names`."""
    layout = dialect.entry_layout(attrs, len(margs))
    roles = (_ROLES if "dsl.num_inputs" in attrs
             else {**_ROLES, "inputs": "operand", "outputs": "operand"})
    windows = (list(ir.ArrayAttr(attrs["window_params"]))
               if "window_params" in attrs else [])
    first_window = layout.start("inputs")
    views = []
    for k, a in enumerate(margs):
      t = a.type
      label = names[k] if k < len(names) else f"arg{k}"
      role = roles[layout.locate(k)[0]]
      if not is_memref(t):
        views.append(None)
        continue
      kind = sem_kind(t)
      shape = shape_of(t)
      if kind is not None:
        s = M.SemArray(label, kind, shape, "instance")
        self.sems.append(s)
        views.append(View.whole(s, shape))
        continue
      where = space(t)
      blocked = False
      w = k - first_window
      if role in ("input", "output", "operand") and 0 <= w < len(windows):
        blocked = "transform_indices" in ir.DictAttr(windows[w])
      b = M.Buffer(label, where, shape, itemsize(ir.MemRefType(t).element_type),
                   "device" if where in ("any", "hbm") else "instance", role,
                   blocked)
      self.buffers.append(b)
      views.append(View.whole(b, shape))
    return views


# A buffer's role by the group of its operand (dialect.entry_layout).
_ROLES = {"prefetch": "prefetch", "inputs": "input", "outputs": "output",
          "scratch": "scratch"}


def _dma_unit(km: M.KernelModel) -> int:
  g = 0
  for s in M.walk(km.body):
    if isinstance(s, (M.DmaStart, M.DmaWait)):
      g = math.gcd(g, s.nbytes)
    elif isinstance(s, (M.Signal, M.SemWait)) and s.sem.sem.kind == "dma":
      if s.amount is None or s.amount.const is None:
        return 1
      g = math.gcd(g, abs(s.amount.const))
  return g or 1


def _string(attrs, name: str, default: str) -> str:
  return ir.StringAttr(attrs[name]).value if name in attrs else default


def _grid(attrs, args) -> tuple[tuple, int]:
  """(the grid, how many leading arguments are grid ids)."""
  if "iteration_bounds" in attrs:
    grid = tuple(ir.DenseI64ArrayAttr(attrs["iteration_bounds"]))
    dynamic = [d for d, n in enumerate(grid) if n < 0]
    if dynamic:
      raise ModelError(f"grid dim {dynamic[0]} has a dynamic size (traced "
                       "when the kernel was called); a Promela model needs "
                       "static grid sizes")
    if grid:
      return grid, len(grid)
  n_grid = 0
  while n_grid < len(args) and not is_memref(args[n_grid].type):
    n_grid += 1
  return (1,) * n_grid, n_grid


def _semantics(attrs, rank: int) -> list:
  """Per grid dim: "parallel" (also for core_parallel) or "arbitrary"."""
  semantics = ["arbitrary"] * rank
  if "dimension_semantics" in attrs:
    for k, a in enumerate(ir.ArrayAttr(attrs["dimension_semantics"])):
      m = re.search(r"<(\w+)>", str(a))
      s = m.group(1) if m else "arbitrary"
      semantics[k] = "parallel" if s in ("parallel", "core_parallel") else s
  return semantics


def extract(module, num_devices: Optional[int] = None, *,
            max_parallel: int = 4) -> M.KernelModel:
  """The `KernelModel` of a Mosaic module (an `ir.Module`)."""
  return Extractor(module, num_devices, max_parallel).run()
