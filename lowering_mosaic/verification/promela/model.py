"""The kernel model that the Promela text is written from.

`extract.py` turns a Mosaic module into a `KernelModel`: the buffers and
semaphores the kernel touches, and a tree of statements (accesses, DMAs,
semaphore operations, loops and branches) whose integer values are Promela
expressions over the process's variables (its device id, its parallel grid
point, loop counters). Data values are abstracted away: a vector load is
only "this process reads these cells of that buffer now".

`builder.py` then writes the Promela text; layout.py numbers its regions
and semaphores (`layout_cells` here decides how finely each buffer is
tracked).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional


# ------------------------------------------------------------ expressions

@dataclasses.dataclass(frozen=True)
class Expr:
  """An integer Promela expression; `const` is its value when static."""
  text: str
  const: Optional[int] = None

  def __str__(self):
    return self.text


def const(v: int) -> Expr:
  v = int(v)
  return Expr(str(v) if v >= 0 else f"({v})", v)


def var(name: str) -> Expr:
  return Expr(name)


def c_div(a: int, b: int) -> int:
  """Integer division truncating toward zero, as C and Promela divide."""
  q = abs(a) // abs(b)
  return q if (a >= 0) == (b >= 0) else -q


def c_rem(a: int, b: int) -> int:
  return a - b * c_div(a, b)


_FOLD = {
    "+": lambda a, b: a + b, "-": lambda a, b: a - b,
    "*": lambda a, b: a * b, "/": c_div, "%": c_rem,
    "&": lambda a, b: a & b, "|": lambda a, b: a | b,
    "^": lambda a, b: a ^ b, "<<": lambda a, b: a << b,
    ">>": lambda a, b: a >> b,
    "==": lambda a, b: int(a == b), "!=": lambda a, b: int(a != b),
    "<": lambda a, b: int(a < b), "<=": lambda a, b: int(a <= b),
    ">": lambda a, b: int(a > b), ">=": lambda a, b: int(a >= b),
}


def binop(op: str, a: Optional[Expr], b: Optional[Expr]) -> Optional[Expr]:
  """`a op b` in C semantics (Promela's), folded when both are static.

  None stands for a value the model does not know; it is contagious.
  """
  if a is None or b is None:
    return None
  if a.const is not None and b.const is not None:
    if op in ("/", "%") and b.const == 0:
      return None
    return const(_FOLD[op](a.const, b.const))
  if op == "+" and a.const == 0:
    return b
  if op in ("+", "-") and b.const == 0:
    return a
  if op == "*" and (a.const == 1 or b.const == 1):
    return b if a.const == 1 else a
  if op == "*" and (a.const == 0 or b.const == 0):
    return const(0)
  if op == "/" and b.const == 1:
    return a
  return Expr(f"({a.text} {op} {b.text})")


def select(c: Optional[Expr], a: Optional[Expr],
           b: Optional[Expr]) -> Optional[Expr]:
  if c is None or a is None or b is None:
    return None
  if c.const is not None:
    return a if c.const else b
  if a == b:
    return a
  return Expr(f"({c.text} -> {a.text} : {b.text})")


def show(e: Optional[Expr]) -> str:
  """An expression for people: its value when static, else `{text}`, which
  trail.py evaluates with the values the trail had at that step."""
  if e is None:
    return "?"
  if e.const is not None:
    return str(e.const)
  return "{" + e.text + "}"


def emin(a, b):
  return select(binop("<", a, b), a, b)


def emax(a, b):
  return select(binop(">", a, b), a, b)


# ------------------------------------------------------------ storage

@dataclasses.dataclass(eq=False)
class Buffer:
  """A memref the kernel owns: an operand, a scratch buffer or an alloca.

  scope "device": one per device (HBM operands in `pl.ANY`);
  scope "instance": one per kernel instance (VMEM/SMEM blocks, scratch).
  """
  name: str
  space: str
  shape: tuple
  itemsize: int
  scope: str
  role: str                  # input | output | scratch | prefetch | scoped
  blocked: bool = False      # copied in/out by the pipeline at grid steps
  windows: list = dataclasses.field(default_factory=list)
  # Filled by layout_cells:
  cell_dims: tuple = ()      # ((dim, ncells, granularity), ...) <= 2 dims

  @property
  def ncells(self) -> int:
    return math.prod(n for _, n, _ in self.cell_dims) if self.cell_dims else 1


@dataclasses.dataclass(eq=False)
class SemArray:
  """An array of semaphores (`memref<N x !tpu.dma_semaphore>` and friends).

  kind: dma | regular | barrier. `remote_recv`: some remote DMA signals it on
  its receiving device, so a value left in it at kernel end means a peer's
  copy was never waited for.
  """
  name: str
  kind: str
  shape: tuple
  scope: str
  scoped: bool = False
  remote_recv: bool = False

  @property
  def count(self) -> int:
    return math.prod(self.shape) if self.shape else 1


@dataclasses.dataclass
class Window:
  """A box of `base`: per base dim an offset (Expr, None = unknown) and a size."""
  base: Buffer
  offsets: list
  sizes: list

  def describe(self) -> str:
    parts = []
    full = True
    for off, size, dim in zip(self.offsets, self.sizes, self.base.shape):
      if off is not None and off.const == 0 and size == dim:
        parts.append(":")
        continue
      full = False
      if off is None:
        parts.append(f"?:?+{size}")
      elif size == 1:
        parts.append(show(off))
      else:
        parts.append(f"{show(off)}:{show(binop('+', off, const(size)))}")
    return self.base.name if full else f"{self.base.name}[{', '.join(parts)}]"


@dataclasses.dataclass
class SemRef:
  """One semaphore of an array; `index` is its flat element (Expr or None)."""
  sem: SemArray
  index: Optional[Expr]

  def describe(self) -> str:
    if self.sem.count == 1 and not self.sem.shape:
      return self.sem.name
    return f"{self.sem.name}[{show(self.index)}]"


# ------------------------------------------------------------ statements

@dataclasses.dataclass
class Stmt:
  """Where a statement comes from: its id, kernel source line, and text."""
  id: int
  line: Optional[str]
  what: str


@dataclasses.dataclass
class Access:
  kind: str                  # read | write
  window: Window
  info: Stmt


@dataclasses.dataclass
class DmaStart:
  src: Window
  dst: Window
  src_sem: Optional[SemRef]
  dst_sem: SemRef
  device: Optional[Expr]     # None: local; else the target device's id
  remote: bool
  nbytes: int
  info: Stmt


@dataclasses.dataclass
class DmaWait:
  sem: SemRef
  nbytes: int
  info: Stmt


@dataclasses.dataclass
class Signal:
  sem: SemRef
  amount: Optional[Expr]
  device: Optional[Expr]
  remote: bool
  info: Stmt


@dataclasses.dataclass
class SemWait:
  sem: SemRef
  amount: Optional[Expr]
  info: Stmt


@dataclasses.dataclass
class Assign:
  var: str
  value: Optional[Expr]      # None: any value (nondeterministic)
  info: Optional[Stmt] = None


@dataclasses.dataclass
class Loop:
  """`for var in range(lo, hi, step)` (a known count) or, when bounds are
  unknown (var None), any number of iterations."""
  var: Optional[str]
  lo: Optional[Expr]
  hi: Optional[Expr]
  step: Optional[Expr]
  carried: list              # [(var name, init Expr|None)]
  body: list
  yields: list               # Expr|None per carried var
  info: Optional[Stmt] = None


@dataclasses.dataclass
class While:
  carried: list              # [(var, init)]
  before: list
  cond: Optional[Expr]
  after_vars: list           # [(var, Expr)] the after-region's arguments
  after: list
  yields: list
  results: list              # [(var, Expr)] values when the loop exits
  info: Optional[Stmt] = None


@dataclasses.dataclass
class If:
  cond: Optional[Expr]       # None: either branch (unknown condition)
  then: list
  orelse: list
  results: list              # var names
  then_yields: list
  else_yields: list
  info: Optional[Stmt] = None


@dataclasses.dataclass
class ScopeEnd:
  """The end of a `tpu.region` (run_scoped): its buffers and semaphores die."""
  buffers: list
  sems: list
  info: Stmt


@dataclasses.dataclass
class GridStep:
  """One pass of the body over the arbitrary grid dims (a loop nest)."""
  dims: list                 # [(var, bound)]
  body: list
  blocked: list              # buffers the pipeline copies between steps
  info: Stmt


@dataclasses.dataclass
class KernelModel:
  name: str
  source: str
  num_devices: int
  grid: tuple
  semantics: tuple
  parallel_dims: list        # [(grid dim, size)] one process per point
  buffers: list
  sems: list
  body: list
  stmts: list                # every Stmt, by id
  locals: list               # [(name, type)] per process
  notes: list = dataclasses.field(default_factory=list)
  dma_unit: int = 1          # DMA semaphore amounts are counted in these bytes
  mesh_shape: tuple = ()

  @property
  def num_parallel(self) -> int:
    return math.prod(n for _, n in self.parallel_dims) if self.parallel_dims else 1

  @property
  def num_instances(self) -> int:
    return self.num_devices * self.num_parallel


# ------------------------------------------------------------ cell layout

def walk(stmts):
  """Every statement in a statement tree, parents before children."""
  for s in stmts:
    yield s
    for field in ("body", "then", "orelse", "before", "after"):
      sub = getattr(s, field, None)
      if isinstance(sub, list):
        yield from walk(sub)


def layout_cells(buf: Buffer, max_cells: int = 16) -> None:
  """Chooses how finely `buf` is tracked: at most two dims cut into cells,
  at most `max_cells` cells in all.

  A dim's cell size is the gcd of the window sizes and static offsets seen
  on it, so windows that never overlap land in different cells. A window
  covers the cells from `offset // g` to `(offset + size - 1) // g`, which
  over-approximates the overlap of any two windows: the model may report a
  race on neighbouring data that a finer grain would clear, never miss one.
  """
  cands = []
  for d, dim in enumerate(buf.shape):
    g = dim
    for w in buf.windows:
      g = math.gcd(g, int(w.sizes[d]))
      off = w.offsets[d]
      if off is not None and off.const is not None and off.const > 0:
        g = math.gcd(g, off.const)
    g = max(g, 1)
    n = -(-dim // g)
    if n > 1:
      cands.append([d, n, g])
  cands = cands[:2]
  while cands and math.prod(c[1] for c in cands) > max_cells:
    c = max(cands, key=lambda c: c[1])
    c[2] *= 2
    c[1] = -(-buf.shape[c[0]] // c[2])
    cands = [c for c in cands if c[1] > 1]
  buf.cell_dims = tuple(tuple(c) for c in cands)
