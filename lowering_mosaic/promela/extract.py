"""Mosaic MLIR module -> `KernelModel` (see model.py).

The walk follows `func.func @main` op by op, in the style of the lowering's
rule table: `OPS[op name] = handler(extractor, op, env)`. The environment
maps each MLIR value to what the model knows of it:

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

import dataclasses
import math
import re
from typing import Callable, Optional

from jax._src.lib.mlir import ir

from lowering_mosaic import dialect
from lowering_mosaic.promela import model as M
from lowering_mosaic.promela.model import Expr, binop, const, select, var


class ModelError(Exception):
  """The module uses something the Promela export cannot model."""


# ------------------------------------------------------------ types

_ITEMSIZE = {"f64": 8, "i64": 8, "f32": 4, "i32": 4, "bf16": 2, "f16": 2,
             "i16": 2, "i8": 1, "i1": 1, "f8E4M3FN": 1, "f8E5M2": 1,
             "i4": 1, "index": 8}


def _itemsize(elt) -> int:
  return _ITEMSIZE.get(str(elt), 4)


def _is_int(t) -> bool:
  return isinstance(t, ir.IntegerType) or isinstance(t, ir.IndexType)


def _is_memref(t) -> bool:
  return isinstance(t, ir.MemRefType)


def _space(t) -> str:
  return dialect.memref_space(t)


_sem_kind = dialect.semaphore_kind_of


def _shape(t) -> tuple:
  return tuple(int(d) if d >= 0 else 1 for d in ir.ShapedType(t).shape)


def _nbytes(t) -> int:
  st = ir.ShapedType(t)
  return math.prod(_shape(t)) * _itemsize(st.element_type)


# ------------------------------------------------------------ locations

_FILE_LOC = re.compile(r'"(?P<file>[^"]+)":(?P<line>\d+):\d+')
_NAME_LOC = re.compile(r'loc\("(?P<name>[^"]+)"\(')


def short(line: Optional[str]) -> str:
  """'kernel.py:12' for '/long/path/kernel.py:12' (names, not locations)."""
  if not line:
    return "?"
  path, _, num = line.rpartition(":")
  return f"{path.rsplit('/', 1)[-1]}:{num}"


def location_of(op) -> tuple[Optional[str], Optional[str]]:
  """('file:line' or None, op name from a NameLoc or None)."""
  text = str(op.location)
  m = _FILE_LOC.search(text)
  line = f"{m.group('file')}:{m.group('line')}" if m else None
  n = _NAME_LOC.match(text)
  return line, (n.group("name") if n else None)


# ------------------------------------------------------------ views

@dataclasses.dataclass
class View:
  """A box of a buffer or semaphore array; `dims` lists the base dims the
  memref value still has (slicing keeps them, squeezing drops some)."""
  base: object               # M.Buffer | M.SemArray
  offsets: list
  sizes: list
  dims: list
  opaque: bool = False       # reshaped/bitcast: any access covers the box

  @staticmethod
  def whole(base, shape):
    return View(base, [const(0)] * len(shape), list(shape),
                list(range(len(shape))))

  @property
  def shape(self):
    return [self.sizes[d] for d in self.dims]

  def slice(self, starts, sizes) -> "View":
    if self.opaque:
      return self
    offs, szs = list(self.offsets), list(self.sizes)
    for d, s, n in zip(self.dims, starts, sizes):
      offs[d] = binop("+", offs[d], s)
      szs[d] = n
    return View(self.base, offs, szs, list(self.dims))

  def squeeze(self, out_shape) -> "View":
    """Drops unit dims, the leading ones first (the indexed-away dims)."""
    if self.opaque:
      return View(self.base, self.offsets, self.sizes, [], True)
    drops = len(self.dims) - len(out_shape)
    keep = []
    for d in self.dims:
      if drops > 0 and self.sizes[d] == 1:
        drops -= 1
      else:
        keep.append(d)
    return View(self.base, self.offsets, self.sizes, keep)

  def window(self, indices=None, sizes=None) -> M.Window:
    """The box an access at `indices` of extent `sizes` (view dims) covers."""
    if self.opaque or indices is None:
      return M.Window(self.base, list(self.offsets), list(self.sizes))
    v = self.slice(indices, sizes)
    return M.Window(self.base, v.offsets, v.sizes)

  def sem_index(self) -> Optional[Expr]:
    """The flat element index of a single-semaphore view."""
    shape = self.base.shape
    idx = const(0)
    stride = 1
    for d in reversed(range(len(shape))):
      idx = binop("+", idx, binop("*", self.offsets[d], const(stride)))
      stride *= shape[d]
    return idx


# ------------------------------------------------------------ the walk

OPS: dict[str, Callable] = {}


def handles(*names):
  def deco(fn):
    for n in names:
      OPS[n] = fn
    return fn
  return deco


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
      handler = OPS.get(name, _generic)
      handler(self, op, env, out)
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
      if ir.StringAttr(f.attributes["sym_name"]).value == "main":
        return f
    for f in funcs:
      if "window_params" in f.attributes or "iteration_bounds" in f.attributes:
        return f
    if funcs:
      return funcs[0]
    raise ModelError("the module has no kernel function (func.func @main)")

  def _kernel(self, main) -> M.KernelModel:
    attrs = main.attributes

    def get(name, default=None):
      return attrs[name] if name in attrs else default

    name = (ir.StringAttr(get("dsl.kernel_name")).value
            if get("dsl.kernel_name") else "kernel")
    source = (ir.StringAttr(get("dsl.kernel_src")).value
              if get("dsl.kernel_src") else "")
    block = main.regions[0].blocks[0]
    args = list(block.arguments)
    grid = (tuple(ir.DenseI64ArrayAttr(get("iteration_bounds")))
            if get("iteration_bounds") is not None else ())
    n_grid = len(grid)
    if not grid:
      n_grid = 0
      while n_grid < len(args) and not _is_memref(args[n_grid].type):
        n_grid += 1
      grid = (1,) * n_grid
    semantics = ["arbitrary"] * len(grid)
    if get("dimension_semantics") is not None:
      for k, a in enumerate(ir.ArrayAttr(get("dimension_semantics"))):
        m = re.search(r"<(\w+)>", str(a))
        s = m.group(1) if m else "arbitrary"
        semantics[k] = "parallel" if s in ("parallel", "core_parallel") else s
    mesh_shape = (tuple(ir.DenseI64ArrayAttr(get("dsl.mesh_shape")))
                  if get("dsl.mesh_shape") is not None else ())
    if self.num_devices_arg is not None:
      num_devices = int(self.num_devices_arg)
    else:
      num_devices = math.prod(mesh_shape) if mesh_shape else 1
    if num_devices < 1:
      raise ModelError(f"num_devices must be at least 1, got {num_devices}")

    par = [(d, int(n)) for d, (n, s) in enumerate(zip(grid, semantics))
           if s == "parallel" and n > 1]
    if math.prod(n for _, n in par) > self.max_parallel:
      self.note(f"the parallel grid dims {[d for d, _ in par]} have "
                f"{math.prod(n for _, n in par)} points, more than "
                f"max_parallel={self.max_parallel}; they run in order in one "
                "process per device, as on a single TensorCore")
      par = []
    par_dims = {d for d, _ in par}

    names = ([ir.StringAttr(a).value for a in ir.ArrayAttr(
        get("dsl.operand_names"))] if get("dsl.operand_names") else [])
    env: dict = {}
    for d in range(n_grid):
      env[args[d]] = var(f"p{d}") if d in par_dims else (
          var(f"g{d}") if grid[d] > 1 else const(0))
    self._arguments(args[n_grid:], names[n_grid:] if names else [], attrs)
    for a, v in zip(args[n_grid:], self._arg_views):
      env[a] = v

    self.scopes.append([])
    body, _ = self.block(block, env)
    self.scopes.pop()
    arbitrary = [(f"g{d}", int(n)) for d, n in enumerate(grid)
                 if d not in par_dims and n > 1]
    if arbitrary:
      for v, _ in arbitrary:
        self.locals.append((v, "int"))
      blocked = [b for b in self.buffers if b.blocked]
      src = source if re.search(r":\d+$", source or "") else None
      step = M.GridStep(arbitrary, body, blocked,
                        M.Stmt(len(self.stmts) + 1, src,
                               "end of a grid step: the pipeline copies "
                               "blocks in and out"))
      self.stmts.append(step.info)
      body = [step]

    km = M.KernelModel(name=name, source=source, num_devices=num_devices,
                       grid=tuple(int(g) for g in grid),
                       semantics=tuple(semantics), parallel_dims=par,
                       buffers=self.buffers, sems=self.sems, body=body,
                       stmts=self.stmts, locals=self.locals, notes=self.notes,
                       mesh_shape=mesh_shape)
    km.dma_unit = _dma_unit(km)
    for i, b in enumerate(km.buffers):
      b.index = i
    for i, s in enumerate(km.sems):
      s.index = i
    return km

  def _arguments(self, margs, names, attrs):
    def iattr(n, default):
      if n in attrs:
        return int(ir.IntegerAttr(attrs[n]).value)
      return default
    n = len(margs)
    n_prefetch = iattr("scalar_prefetch", 0)
    n_scratch = iattr("scratch_operands", 0)
    n_in = iattr("dsl.num_inputs", None)
    windows = (list(ir.ArrayAttr(attrs["window_params"]))
               if "window_params" in attrs else [])
    self._arg_views = []
    for k, a in enumerate(margs):
      t = a.type
      label = names[k] if k < len(names) else f"arg{k}"
      if k < n_prefetch:
        role = "prefetch"
      elif k >= n - n_scratch:
        role = "scratch"
      elif n_in is not None:
        role = "input" if k - n_prefetch < n_in else "output"
      else:
        role = "operand"
      if not _is_memref(t):
        self._arg_views.append(None)
        continue
      kind = _sem_kind(t)
      shape = _shape(t)
      if kind is not None:
        s = M.SemArray(label, kind, shape, "instance")
        self.sems.append(s)
        self._arg_views.append(View.whole(s, shape))
        continue
      space = _space(t)
      blocked = False
      w = k - n_prefetch
      if role in ("input", "output", "operand") and 0 <= w < len(windows):
        blocked = "transform_indices" in ir.DictAttr(windows[w])
      b = M.Buffer(label, space, shape, _itemsize(ir.MemRefType(t).element_type),
                   "device" if space in ("any", "hbm") else "instance", role,
                   blocked)
      self.buffers.append(b)
      self._arg_views.append(View.whole(b, shape))


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


# ------------------------------------------------------------ integer ops

_BIN = {"arith.addi": "+", "arith.subi": "-", "arith.muli": "*",
        "arith.divsi": "/", "arith.divui": "/", "arith.remsi": "%",
        "arith.remui": "%", "arith.andi": "&", "arith.ori": "|",
        "arith.xori": "^", "arith.shli": "<<", "arith.shrsi": ">>",
        "arith.shrui": ">>"}

_CMP = {0: "==", 1: "!=", 2: "<", 3: "<=", 4: ">", 5: ">=", 6: "<",
        7: "<=", 8: ">", 9: ">="}


def _set_int(x: Extractor, op, env, out, value):
  """Binds the op's integer result; long expressions become a variable."""
  r = op.results[0]
  if not _is_int(r.type):
    env[r] = None
    return
  if value is not None and value.const is None and len(value.text) > 160:
    name = x.fresh("t")
    out.append(M.Assign(name, value))
    value = var(name)
  env[r] = value


@handles(*_BIN)
def _binary(x, op, env, out):
  a, b = (x.int_value(env, v) for v in op.operands)
  _set_int(x, op, env, out, binop(_BIN[op.operation.name], a, b))


@handles("arith.maxsi", "arith.maxui")
def _max(x, op, env, out):
  a, b = (x.int_value(env, v) for v in op.operands)
  _set_int(x, op, env, out, M.emax(a, b))


@handles("arith.minsi", "arith.minui")
def _min(x, op, env, out):
  a, b = (x.int_value(env, v) for v in op.operands)
  _set_int(x, op, env, out, M.emin(a, b))


@handles("arith.floordivsi")
def _floordiv(x, op, env, out):
  a, b = (x.int_value(env, v) for v in op.operands)
  neg = binop("-", const(0), binop("/", binop("-", binop("+", binop(
      "-", const(0), a), b), const(1)), b))
  _set_int(x, op, env, out, select(binop(">=", a, const(0)), binop("/", a, b), neg))


@handles("arith.ceildivsi", "arith.ceildivui")
def _ceildiv(x, op, env, out):
  a, b = (x.int_value(env, v) for v in op.operands)
  _set_int(x, op, env, out, binop("/", binop("-", binop("+", a, b), const(1)), b))


@handles("arith.cmpi")
def _cmpi(x, op, env, out):
  a, b = (x.int_value(env, v) for v in op.operands)
  pred = int(ir.IntegerAttr(op.attributes["predicate"]).value)
  _set_int(x, op, env, out, binop(_CMP[pred], a, b))


@handles("arith.select")
def _select(x, op, env, out):
  c, a, b = (x.int_value(env, v) for v in op.operands)
  _set_int(x, op, env, out, select(c, a, b))


@handles("arith.index_cast", "arith.index_castui", "arith.extsi",
         "arith.extui", "arith.trunci", "tpu.assume_multiple")
def _cast(x, op, env, out):
  _set_int(x, op, env, out, x.int_value(env, op.operands[0]))


@handles("arith.constant")
def _constant(x, op, env, out):
  r = op.results[0]
  if not _is_int(r.type):
    env[r] = None
    return
  a = op.attributes["value"]
  if isinstance(a, ir.BoolAttr):
    env[r] = const(int(ir.BoolAttr(a).value))
  elif isinstance(a, ir.IntegerAttr):
    v = int(ir.IntegerAttr(a).value)
    if isinstance(r.type, ir.IntegerType) and ir.IntegerType(r.type).width == 1:
      v = v & 1
    env[r] = const(v)
  else:
    env[r] = None


@handles("tpu.device_id")
def _device_id(x, op, env, out):
  env[op.results[0]] = var("dev")


@handles("tpu.sem_read")
def _sem_read(x, op, env, out):
  env[op.results[0]] = None


# ------------------------------------------------------------ views

@handles("tpu.memref_slice")
def _memref_slice(x, op, env, out):
  v = x.view(env, op.operands[0], op, "sliced")
  starts = [x.int_value(env, i) for i in op.base_idx]
  sizes = list(_shape(op.results[0].type))
  if list(op.dynamic_sizes):
    x.note("a tpu.memref_slice with dynamic sizes is modelled as its whole "
           "source window")
    env[op.results[0]] = View(v.base, v.offsets, v.sizes, v.dims, True)
    return
  env[op.results[0]] = v.slice(starts, sizes)


@handles("tpu.memref_squeeze")
def _memref_squeeze(x, op, env, out):
  v = x.view(env, op.operands[0], op, "squeezed")
  env[op.results[0]] = v.squeeze(list(_shape(op.results[0].type)))


@handles("tpu.memref_reshape", "tpu.memref_bitcast", "memref.reinterpret_cast",
         "memref.collapse_shape", "memref.expand_shape", "memref.cast",
         "tpu.reinterpret_cast", "memref.subview", "memref.view")
def _opaque_view(x, op, env, out):
  v = x.view(env, op.operands[0], op, "reshaped")
  env[op.results[0]] = View(v.base, v.offsets, v.sizes, [], True)


@handles("tpu.sem_barrier")
def _sem_barrier(x, op, env, out):
  s = x.barrier_sem()
  env[op.results[0]] = View.whole(s, ())


@handles("memref.alloca", "memref.alloc")
def _alloca(x, op, env, out):
  t = op.results[0].type
  line, _ = location_of(op)
  b = M.Buffer(f"run_scoped buffer at {short(line or x.line)}",
               _space(t), _shape(t), _itemsize(ir.MemRefType(t).element_type),
               "instance", "scoped")
  x.buffers.append(b)
  if x.scopes:
    x.scopes[-1].append(b)
  env[op.results[0]] = View.whole(b, b.shape)


@handles("tpu.sem_alloc")
def _sem_alloc(x, op, env, out):
  t = op.results[0].type
  line, _ = location_of(op)
  s = M.SemArray(f"run_scoped semaphore at {short(line or x.line)}",
                 _sem_kind(t) or "regular", _shape(t), "instance", scoped=True)
  x.sems.append(s)
  if x.scopes:
    x.scopes[-1].append(s)
  env[op.results[0]] = View.whole(s, s.shape)


# ------------------------------------------------------------ accesses

def _access(x, op, env, out, kind, base, indices, vshape, strides=None):
  v = x.view(env, base, op, "accessed")
  if isinstance(v.base, M.SemArray):
    raise ModelError(f"{op.operation.name} reads a semaphore as data")
  rank = len(v.dims) if not v.opaque else 0
  idx = [x.int_value(env, i) for i in indices]
  if v.opaque:
    w = v.window()
  else:
    vshape = list(vshape)
    sizes = [1] * (rank - len(vshape)) + vshape
    if strides:
      strides = [int(s) for s in strides]
      sizes = [(n - 1) * s + 1 for n, s in zip(sizes, strides)]
    sizes = [min(n, full) for n, full in zip(sizes, v.shape)]
    w = v.window(idx + [const(0)] * (rank - len(idx)), sizes)
  v.base.windows.append(w)
  _, nm = location_of(op)
  verb = "reads" if kind == "read" else "writes"
  out.append(M.Access(kind, w, x.info(op, f"{verb} {w.describe()}"
                                      + (f" ({nm})" if nm else ""))))


def _vshape(t):
  return list(_shape(t)) if isinstance(t, ir.ShapedType) else []


@handles("vector.load", "tpu.load")
def _vector_load(x, op, env, out):
  _access(x, op, env, out, "read", op.operands[0], list(op.operands[1:]) if
          op.operation.name == "vector.load" else list(op.indices),
          _vshape(op.results[0].type))
  env[op.results[0]] = None


@handles("memref.load")
def _memref_load(x, op, env, out):
  _access(x, op, env, out, "read", op.operands[0], list(op.operands[1:]), [])
  env[op.results[0]] = None


@handles("vector.store")
def _vector_store(x, op, env, out):
  _access(x, op, env, out, "write", op.operands[1], list(op.operands[2:]),
          _vshape(op.operands[0].type))


@handles("memref.store")
def _memref_store(x, op, env, out):
  _access(x, op, env, out, "write", op.operands[1], list(op.operands[2:]), [])


@handles("tpu.store", "tpu.vector_store")
def _tpu_store(x, op, env, out):
  strides = None
  if "strides" in op.attributes:
    strides = list(ir.DenseI32ArrayAttr(op.attributes["strides"])) or None
  _access(x, op, env, out, "write", op.base, list(op.indices),
          _vshape(op.valueToStore.type), strides)


@handles("tpu.strided_load")
def _strided_load(x, op, env, out):
  strides = list(ir.DenseI32ArrayAttr(op.attributes["strides"]))
  _access(x, op, env, out, "read", op.base, list(op.indices),
          _vshape(op.results[0].type), strides)
  env[op.results[0]] = None


@handles("tpu.strided_store")
def _strided_store(x, op, env, out):
  strides = list(ir.DenseI32ArrayAttr(op.attributes["strides"]))
  _access(x, op, env, out, "write", op.base, list(op.indices),
          _vshape(op.valueToStore.type), strides)


@handles("vector.transfer_read")
def _transfer_read(x, op, env, out):
  _access(x, op, env, out, "read", op.operands[0], list(op.indices),
          _vshape(op.results[0].type))
  env[op.results[0]] = None


@handles("vector.transfer_write")
def _transfer_write(x, op, env, out):
  _access(x, op, env, out, "write", op.operands[1], list(op.indices),
          _vshape(op.operands[0].type))


# ------------------------------------------------------------ DMAs

def _device(x, env, v) -> Optional[Expr]:
  if v is None:
    return None
  d = x.int_value(env, v)
  if d is None:
    x.note("a remote device id is computed from values the model does not "
           "track; the model lets it be any device")
    return None
  return d


@handles("tpu.enqueue_dma")
def _enqueue_dma(x, op, env, out):
  src = x.view(env, op.source, op, "DMA source")
  dst = x.view(env, op.target, op, "DMA target")
  dst_sem = x.sem_ref(env, op.target_semaphore, op)
  src_sem = (x.sem_ref(env, op.source_semaphore, op)
             if op.source_semaphore is not None else None)
  remote = op.device_id is not None
  dev = _device(x, env, op.device_id) if remote else None
  sw, dw = src.window(), dst.window()
  src.base.windows.append(sw)
  dst.base.windows.append(dw)
  if remote:
    dst_sem.sem.remote_recv = True
  nbytes = _nbytes(op.source.type)
  what = f"DMA {sw.describe()} -> {dw.describe()}"
  if remote:
    what += f" on device {M.show(dev)}"
  what += f", signals {dst_sem.describe()}"
  if src_sem is not None:
    what += f" and {src_sem.describe()}"
  out.append(M.DmaStart(sw, dw, src_sem, dst_sem, dev, remote, nbytes,
                        x.info(op, what)))


@handles("tpu.wait_dma2", "tpu.wait_dma")
def _wait_dma(x, op, env, out):
  sem = x.sem_ref(env, op.semaphore, op)
  if op.operation.name == "tpu.wait_dma2":
    nbytes = _nbytes(op.dst.type)
    what = f"waits for DMA {x.view(env, op.src, op, 'src').window().describe()}"
    what += f" -> {x.view(env, op.dst, op, 'dst').window().describe()}"
  else:
    nbytes = _nbytes(op.operands[1].type)
    what = "waits for a DMA"
  what += f" on {sem.describe()}"
  out.append(M.DmaWait(sem, nbytes, x.info(op, what)))


@handles("tpu.sem_signal")
def _sem_signal(x, op, env, out):
  sem = x.sem_ref(env, op.semaphore, op)
  amount = x.int_value(env, op.amount)
  remote = op.device_id is not None
  dev = _device(x, env, op.device_id) if remote else None
  what = f"signals {sem.describe()}"
  what += f" by {M.show(amount)}"
  if remote:
    what += f" on device {M.show(dev)}"
  out.append(M.Signal(sem, amount, dev, remote, x.info(op, what)))


@handles("tpu.sem_wait")
def _sem_wait(x, op, env, out):
  sem = x.sem_ref(env, op.semaphore, op)
  amount = x.int_value(env, op.amount)
  what = f"waits for {sem.describe()} >= {M.show(amount)}"
  out.append(M.SemWait(sem, amount, x.info(op, what)))


# ------------------------------------------------------------ control flow

@handles("scf.for")
def _for(x, op, env, out):
  lo, hi, step = (x.int_value(env, v) for v in op.operands[:3])
  inits = list(op.operands[3:])
  body = op.regions[0].blocks[0]
  bargs = list(body.arguments)
  known = None not in (lo, hi, step)
  iv = x.fresh("i") if known else None
  if not known:
    x.note("a loop with bounds the model does not track runs any number of "
           "times")
  benv = dict(env)
  benv[bargs[0]] = var(iv) if known else None
  carried = []
  for a, init in zip(bargs[1:], inits):
    if _is_int(a.type):
      c = x.fresh("c")
      carried.append((c, x.int_value(env, init)))
      benv[a] = var(c)
    else:
      benv[a] = None
  info = x.info(op, "loop")
  stmts, yields = x.block(body, benv)
  ys = [y if isinstance(y, Expr) else None
        for a, y in zip(bargs[1:], yields) if _is_int(a.type)]
  out.append(M.Loop(iv, lo, hi, step, carried, stmts, ys, info))
  k = 0
  for a, r in zip(bargs[1:], op.results):
    if _is_int(a.type):
      env[r] = var(carried[k][0])
      k += 1
    else:
      env[r] = None


@handles("scf.if")
def _if(x, op, env, out):
  cond = x.int_value(env, op.operands[0])
  then_b = op.regions[0].blocks[0]
  then, ty = x.block(then_b, dict(env))
  orelse, ey = [], []
  if len(op.regions) > 1 and len(op.regions[1].blocks):
    orelse, ey = x.block(op.regions[1].blocks[0], dict(env))
  results, tys, eys = [], [], []
  for k, r in enumerate(op.results):
    if _is_int(r.type):
      name = x.fresh("r")
      results.append(name)
      tys.append(ty[k] if k < len(ty) and isinstance(ty[k], Expr) else None)
      eys.append(ey[k] if k < len(ey) and isinstance(ey[k], Expr) else None)
      env[r] = var(name)
    else:
      env[r] = None
  if cond is not None and cond.const is not None:
    # A static branch: keep only the side that runs.
    taken, ys = (then, tys) if cond.const else (orelse, eys)
    out.extend(taken)
    for name, y in zip(results, ys):
      out.append(M.Assign(name, y))
    return
  if cond is None:
    x.note("a branch on a value the model does not track may go either way")
  out.append(M.If(cond, then, orelse, results, tys, eys,
                  x.info(op, "branch")))


@handles("scf.while")
def _while(x, op, env, out):
  inits = list(op.operands)
  before = op.regions[0].blocks[0]
  after = op.regions[1].blocks[0]
  carried, benv = [], dict(env)
  for a, init in zip(before.arguments, inits):
    if _is_int(a.type):
      c = x.fresh("w")
      carried.append((c, x.int_value(env, init)))
      benv[a] = var(c)
    else:
      benv[a] = None
  info = x.info(op, "while loop")
  bstmts, cvals = x.block(before, benv)
  cond = cvals[0] if cvals and isinstance(cvals[0], Expr) else None
  passed = cvals[1:]
  aenv, after_vars = dict(env), []
  for a, pv in zip(after.arguments, passed):
    if _is_int(a.type):
      n = x.fresh("a")
      after_vars.append((n, pv if isinstance(pv, Expr) else None))
      aenv[a] = var(n)
    else:
      aenv[a] = None
  astmts, yvals = x.block(after, aenv)
  yields = [y if isinstance(y, Expr) else None
            for a, y in zip(before.arguments, yvals) if _is_int(a.type)]
  results = []
  for r, pv in zip(op.results, passed):
    if _is_int(r.type):
      n = x.fresh("q")
      results.append((n, pv if isinstance(pv, Expr) else None))
      env[r] = var(n)
    else:
      env[r] = None
  if cond is None:
    x.note("a while loop whose condition the model does not track runs any "
           "number of times")
  out.append(M.While(carried, bstmts, cond, after_vars, astmts, yields,
                     results, info))


@handles("tpu.region")
def _region(x, op, env, out):
  x.scopes.append([])
  stmts, _ = x.block(op.regions[0].blocks[0], dict(env))
  scope = x.scopes.pop()
  out.extend(stmts)
  bufs = [b for b in scope if isinstance(b, M.Buffer)]
  sems = [s for s in scope if isinstance(s, M.SemArray)]
  if bufs or sems:
    out.append(M.ScopeEnd(bufs, sems, x.info(op, "end of run_scoped")))
  for r in op.results:
    env[r] = None


@handles("func.call")
def _call(x, op, env, out):
  raise ModelError(f"func.call at {location_of(op)[0]}: calls are not "
                   "modelled (the lowering inlines them)")


def _generic(x, op, env, out):
  """Ops with no rule: data ops are invisible; memref operands are
  conservatively written; results are unknown values."""
  views = [env.get(v) for v in op.operands if isinstance(env.get(v), View)]
  if op.regions and len(op.regions) and any(len(r.blocks) for r in op.regions):
    raise ModelError(f"{op.operation.name} at {location_of(op)[0]}: an op "
                     "with regions the Promela export does not know")
  for v in views:
    if isinstance(v.base, M.SemArray):
      raise ModelError(f"{op.operation.name} at {location_of(op)[0]}: an op "
                       "on semaphores that the Promela export does not model")
    if isinstance(v.base, M.Buffer):
      w = v.window()
      v.base.windows.append(w)
      x.note(f"{op.operation.name} is modelled as writing its whole memref "
             "operand")
      out.append(M.Access("write", w, x.info(
          op, f"{op.operation.name} touches {w.describe()}")))
  for r in op.results:
    if _is_memref(r.type) and views:
      v = views[0]
      env[r] = View(v.base, v.offsets, v.sizes, [], True)
    else:
      env[r] = None


def extract(module, num_devices: Optional[int] = None, *,
            max_parallel: int = 4) -> M.KernelModel:
  """The `KernelModel` of a Mosaic module (an `ir.Module`)."""
  return Extractor(module, num_devices, max_parallel).run()
