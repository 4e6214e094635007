"""`KernelModel` -> Promela text.

The model (one Promela file, self-describing):

- `kernel(dev, inst, p...)`: one process per device x parallel grid point
  ("instance"), following the kernel's control flow; the arbitrary grid
  dims are loops inside it.
- `engine(d)`: the DMA engine of device d. Its queue is `Q` slots
  (`dma_*[d*Q + k]`); a start blocks while all are taken. The engine
  completes in-flight DMAs in any order: a local DMA lands in one step; a
  remote one first reads its source (signalling the send semaphore), then
  lands on the peer (signalling the receive semaphore there).
- Buffers are tracked as *regions* (one per buffer x owner, an owner being a
  device for HBM operands or an instance for VMEM/SMEM blocks and scratch),
  each cut into at most 30 cells; a DMA slot records the cells it reads and
  writes. Kernel accesses are checked against the in-flight DMAs: reading
  cells a DMA writes, or writing cells a DMA reads or writes, is a race.
- Semaphores are `sem[]` counters (DMA semaphores count bytes / `unit`).
  Waits block until the count is reached.
- Every statement line ends with `/* @sN file:line: what */`, and the header
  lists the statements, buffers, semaphores and processes, so that a trail
  of this file can be translated back to kernel source lines on its own.

Failures print `@@E code args...` and then assert a variable whose name is
the kind: `no_race`, `sem_balanced`, `valid_model` (errors.py holds the
codes, their arguments and their messages).
A blocked kernel process at the end of a run is SPIN's "invalid end state":
a deadlock.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import string
from typing import Optional

from lowering_mosaic.promela import errors as E
from lowering_mosaic.promela import model as M
from lowering_mosaic.promela.errors import fail
from lowering_mosaic.promela.model import binop, const

@dataclasses.dataclass
class Options:
  queue: int = 4              # DMA queue slots per device
  max_cells: int = 16         # cells per buffer region (<= 30)
  check_entry: bool = True    # remote writes before the peer entered: a race
  max_parallel: int = 4


@functools.cache
def _prelude_source() -> str:
  return (importlib.resources.files(__package__) / "prelude.pml").read_text()


def prelude(options: Options) -> str:
  """The inline macros of prelude.pml for these options: its `//` lines
  dropped, the `//@if OPTION` sections of options that are off left out,
  the `$NAME` error codes filled in."""
  lines, keep = [], [True]
  for line in _prelude_source().splitlines():
    if line.startswith("//@if "):
      keep.append(keep[-1] and bool(getattr(options, line.split()[1])))
    elif line.startswith("//@endif"):
      keep.pop()
    elif keep[-1] and not line.startswith("//"):
      lines.append(line)
  return string.Template("\n".join(lines) + "\n").substitute(E.CODES)


class Lines:
  """An indented text buffer that knows its line numbers."""

  def __init__(self):
    self.lines: list[str] = []
    self.level = 0

  def emit(self, text: str, stmt: Optional[M.Stmt] = None):
    line = "  " * self.level + text
    if stmt is not None:
      line += f"  /* @s{stmt.id} {_clean(stmt.line or '?')}: {_clean(stmt.what)} */"
    self.lines.append(line)

  def indent(self):
    self.level += 1

  def dedent(self):
    self.level -= 1

  def text(self) -> str:
    return "\n".join(self.lines) + "\n"


def _clean(s: str) -> str:
  return str(s).replace("*/", "* /").replace("\n", " ")


def _visible(s) -> bool:
  """Does the statement change shared state or block (so it is a step of
  its own)? Accesses and local assignments only look."""
  if isinstance(s, (M.Access, M.Assign)):
    return False
  if isinstance(s, M.Loop):
    return s.var is None or any(_visible(b) for b in s.body)
  if isinstance(s, M.If):
    return s.cond is None or any(_visible(b) for b in s.then + s.orelse)
  if isinstance(s, M.GridStep):
    return any(_visible(b) for b in s.body)
  return True       # DMAs, waits, signals, scope ends, while loops


class Builder:
  """Writes one model; `build()` returns the Promela text."""

  def __init__(self, km: M.KernelModel, options: Options):
    self.km = km
    self.o = options
    for b in km.buffers:
      M.layout_cells(b, min(options.max_cells, 30))
    self.out = Lines()
    # region bases and semaphore bases
    base = 1
    self.reg_base = {}
    for b in km.buffers:
      self.reg_base[b] = base
      base += self.owners(b.scope)
    self.sem_base = {}
    base = 0
    for s in km.sems:
      self.sem_base[s] = base
      base += self.owners(s.scope) * s.count
    self.nsems = base
    self.has_unknown_device = any(
        isinstance(s, (M.DmaStart, M.Signal)) and s.remote and s.device is None
        for s in M.walk(km.body))

  # -------------------------------------------------------- layout

  def owners(self, scope: str) -> int:
    return self.km.num_devices if scope == "device" else self.km.num_instances

  def owner(self, scope: str, device: Optional[str] = None) -> str:
    """The owner index expression: this process's, or device `device`'s."""
    if scope == "device":
      return device or "dev"
    if device is None:
      return "inst"
    if self.km.num_parallel == 1:
      return device
    return f"({device} * NPAR + inst % NPAR)"

  def fin(self, scope: str, device: Optional[str] = None) -> str:
    """Index in entered[]/gone[] of the owner of a buffer or semaphore."""
    if scope == "device":
      return f"(NINST + {device or 'dev'})"
    return self.owner(scope, device)

  def region(self, buf: M.Buffer, device: Optional[str] = None) -> str:
    return f"({self.reg_base[buf]} + {self.owner(buf.scope, device)})"

  def full_mask(self, buf: M.Buffer) -> int:
    return (1 << buf.ncells) - 1

  def mask(self, w: M.Window) -> str:
    """The cells of its buffer that window `w` covers, as a bit mask."""
    buf = w.base
    ranges = []      # per cut dim: (lo, hi) as ints or Promela text
    for d, n, g in buf.cell_dims:
      off, size = w.offsets[d], int(w.sizes[d])
      if off is None:
        ranges.append((0, n - 1))
      elif off.const is not None:
        ranges.append((min(max(off.const // g, 0), n - 1),
                       min(max((off.const + size - 1) // g, 0), n - 1)))
      else:
        lo = binop("/", off, const(g))
        hi = lo if size == 1 and g == 1 else binop(
            "/", binop("+", off, const(size - 1)), const(g))
        ranges.append((f"CLAMP({lo.text}, {n - 1})",
                       f"CLAMP({hi.text}, {n - 1})"))
    if not ranges:
      return "1"
    if all(isinstance(x, int) for r in ranges for x in r):
      m = 0
      if len(ranges) == 1:
        (lo, hi), = ranges
        for c in range(lo, hi + 1):
          m |= 1 << c
      else:
        (alo, ahi), (blo, bhi) = ranges
        nb = buf.cell_dims[1][1]
        for a in range(alo, ahi + 1):
          for b in range(blo, bhi + 1):
            m |= 1 << (a * nb + b)
      return str(m)

    def span(lo, hi):
      return f"CELL({lo})" if lo == hi else f"RANGE({lo}, {hi})"

    if len(ranges) == 1:
      return span(*ranges[0])
    (alo, ahi), (blo, bhi) = ranges
    nb = buf.cell_dims[1][1]
    return f"(ROWS({alo}, {ahi}, {nb}) * {span(blo, bhi)})"

  def sem_index(self, ref: M.SemRef, device: Optional[str] = None) -> str:
    s = ref.sem
    idx = ref.index.text if ref.index is not None else "0"
    owner = self.owner(s.scope, device)
    return f"({self.sem_base[s]} + {owner} * {s.count} + {idx})"

  def amount(self, nbytes: int) -> int:
    return max(1, nbytes // self.km.dma_unit)

  # -------------------------------------------------------- the file

  def build(self) -> str:
    self.temps = 0
    self.in_dstep = False
    self._kernel()
    self._init()
    kernel = self.out
    self.out = Lines()
    self._header()
    self._globals()
    self._inlines()
    self._engine()
    return self.out.text() + kernel.text()

  def _procs(self):
    """[(pid, description, kind, args)] in `run` order (init is pid 0)."""
    km = self.km
    procs = []
    pid = 1
    for d in range(km.num_devices):
      procs.append((pid, f"DMA engine of device {d}", "engine", (d,)))
      pid += 1
    for d in range(km.num_devices):
      for p in range(km.num_parallel):
        coords = self._par_coords(p)
        where = ""
        if coords:
          where = " at grid point (" + ", ".join(
              f"program_id({dim})={c}" for (dim, _), c in
              zip(km.parallel_dims, coords)) + ")"
        inst = d * km.num_parallel + p
        procs.append((pid, f"device {d} kernel{where}", "kernel",
                      (d, inst) + tuple(coords)))
        pid += 1
    return procs

  def _par_coords(self, p: int) -> list[int]:
    coords = []
    for _, n in reversed(self.km.parallel_dims):
      coords.append(p % n)
      p //= n
    return list(reversed(coords))

  def _header(self):
    km, e = self.km, self.out.emit
    e(f"/* Promela model of the Mosaic kernel `{_clean(km.name)}`"
      + (f" (defined at {_clean(km.source)})" if km.source else ""))
    e(" * written by lowering_mosaic.promela from its MLIR module; data values")
    e(" * are abstracted away: the model tracks who touches which buffer when.")
    e(f" * devices: {km.num_devices}; grid: {km.grid} "
      f"({', '.join(km.semantics) or 'none'}); processes per device: "
      f"{km.num_parallel}; DMA queue: {self.o.queue} slots per device;")
    e(f" * DMA semaphores count units of {km.dma_unit} bytes.")
    for n in km.notes:
      e(f" * note: {_clean(n)}")
    e(" *")
    e(f" * @@model kernel={_clean(km.name).replace(' ', '_')} devices={km.num_devices} "
      f"par={km.num_parallel} queue={self.o.queue} unit={km.dma_unit}")
    for s in km.stmts:
      e(f" * @@stmt {s.id} {_clean(s.line or '-')} | {_clean(s.what)}")
    for b in km.buffers:
      e(f" * @@buf {self.reg_base[b]} {self.owners(b.scope)} {b.scope} "
        f"{b.ncells} | {_clean(b.name)} ({b.space}{list(b.shape)})")
    for s in km.sems:
      e(f" * @@sem {self.sem_base[s]} {s.count} {self.owners(s.scope)} "
        f"{s.scope} {s.kind} {int(s.remote_recv)} | {_clean(s.name)}")
    for pid, desc, kind, args in self._procs():
      names = (["d"] if kind == "engine" else
               ["dev", "inst"] + [f"p{d}" for d, _ in km.parallel_dims])
      vals = " ".join(f"{n}={a}" for n, a in zip(names, args))
      e(f" * @@proc {pid} {vals} | {desc}")
    e(" */")
    e("")

  def _globals(self):
    km, e = self.km, self.out.emit
    e(f"#define NDEV {km.num_devices}")
    e(f"#define NPAR {km.num_parallel}")
    e(f"#define NINST {km.num_instances}")
    e(f"#define Q {self.o.queue}")
    e("#define NSLOTS (NDEV * Q)")
    e(f"#define NSEMS {max(1, self.nsems)}")
    e("/* cell masks: cell c, cells lo..hi, rows lo..hi of n cells each */")
    e("#define CELL(c) (1 << (c))")
    e("#define RANGE(lo, hi) ((1 << ((hi) + 1)) - (1 << (lo)))")
    e("#define CLAMP(x, top) ((x) < 0 -> 0 : ((x) > (top) -> (top) : (x)))")
    e("#define ROWS(lo, hi, n) (((1 << (((hi) + 1) * (n))) - (1 << ((lo) * (n)))) "
      "/ ((1 << (n)) - 1))")
    e("")
    e("/* assertion names say the kind of error */")
    e("hidden byte no_race;")
    e("hidden byte sem_balanced;")
    e("hidden byte valid_model;")
    e("/* scratch for atomic steps (not part of the state) */")
    e("hidden int h_k, h_j, h_sreg, h_smask, h_dreg, h_dmask, h_sem, h_tdev, "
      "h_fin;")
    if self.temps:
      e(f"hidden int {', '.join(f'h_t{k}' for k in range(self.temps))};")
    e("")
    e("int sem[NSEMS];")
    e("bit entered[NINST + NDEV];")
    e("bit gone[NINST + NDEV];")
    e("byte alive[NDEV];")
    e("/* DMA queue slots: phase 0 free, 1 in flight, 2 remote with its source "
      "read */")
    e("byte dma_phase[NSLOTS];")
    e("bit dma_remote[NSLOTS];")
    e("byte dma_inst[NSLOTS];    /* issuing instance + 1 */")
    e("short dma_stmt[NSLOTS];")
    mask_t = "short" if max((b.ncells for b in km.buffers), default=1) <= 15 \
        else "int"
    amounts = [self.amount(s.nbytes) for s in M.walk(km.body)
               if isinstance(s, M.DmaStart)]
    amt_t = "short" if max(amounts, default=1) < 32000 else "int"
    e("short dma_sreg[NSLOTS];")
    e(f"{mask_t} dma_smask[NSLOTS];")
    e("short dma_dreg[NSLOTS];")
    e(f"{mask_t} dma_dmask[NSLOTS];")
    e("short dma_ssem[NSLOTS];   /* send semaphore + 1, 0 for none */")
    e("short dma_dsem[NSLOTS];   /* receive semaphore + 1 */")
    e(f"{amt_t} dma_amt[NSLOTS];")
    e("byte dma_fin[NSLOTS];     /* entered[]/gone[] index of the target */")
    e("")

  def _inlines(self):
    for line in prelude(self.o).splitlines():
      self.out.emit(line)

  def _engine(self):
    e = self.out.emit
    e("proctype engine(byte d) {")
    e("end:")
    e("  do")
    for k in range(self.o.queue):
      s = f"d * Q + {k}"
      e(f"  :: d_step {{ dma_phase[{s}] == 1 && dma_remote[{s}] -> "
        f"dma_read({s}) }}")
      e(f"  :: d_step {{ dma_phase[{s}] == 2 || (dma_phase[{s}] == 1 && "
        f"!dma_remote[{s}]) -> dma_land({s}) }}")
    e("  od")
    e("}")
    e("")

  def _kernel(self):
    km, e = self.km, self.out.emit
    params = ["byte dev", "byte inst"] + [f"byte p{d}" for d, _ in
                                           km.parallel_dims]
    e(f"proctype kernel({'; '.join(params)}) {{")
    self.out.indent()
    names = [n for n, _ in km.locals]
    if names:
      e(f"int {', '.join(names)};")
    if self.has_unknown_device:
      e("byte rdev;")
    e("d_step { entered[inst] = 1; entered[NINST + dev] = 1 };  "
      "/* the kernel starts */")
    self.block(km.body)
    self._exit()
    self.out.dedent()
    e("}")
    e("")

  def _init(self):
    e = self.out.emit
    e("init {")
    e("  atomic {")
    for d in range(self.km.num_devices):
      e(f"    alive[{d}] = NPAR;")
    for pid, desc, kind, args in self._procs():
      e(f"    run {kind}({', '.join(str(a) for a in args)});  /* pid {pid}: {desc} */")
    e("  }")
    e("}")

  # -------------------------------------------------------- statements

  def block(self, stmts):
    """Emits statements; runs of invisible ones share one atomic step."""
    run = []
    for s in stmts:
      if _visible(s):
        self._flush(run)
        run = []
        self.stmt(s)
      else:
        run.append(s)
    self._flush(run)

  def _flush(self, run):
    if not run:
      return
    e = self.out.emit
    e("d_step {")
    self.out.indent()
    self.in_dstep = True
    for s in run:
      self.stmt(s)
    self.in_dstep = False
    self.out.dedent()
    e("};")

  def stmt(self, s):
    getattr(self, "_" + type(s).__name__)(s)

  def _Access(self, s: M.Access):
    reg = self.region(s.window.base)
    mask = self.mask(s.window)
    code = (E.READ_VS_DMA_WRITE if s.kind == "read" else
            E.WRITE_VS_DMA_WRITE)
    fn = "chk_read" if s.kind == "read" else "chk_write"
    self.out.emit(f"h_dreg = {reg}; h_dmask = {mask}; "
                  f"{fn}(h_dreg, h_dmask, {s.info.id}, {code});", s.info)

  def _Assign(self, s: M.Assign):
    if s.value is None:
      self.out.emit(f"skip;  /* {s.var} keeps its value (not modelled) */")
      return
    self.out.emit(f"{s.var} = {s.value.text};", s.info)

  def _check_device(self, dev_text: str, stmt: M.Stmt):
    self.out.emit(f"if :: {dev_text} < 0 || {dev_text} >= NDEV -> "
                  f"{fail(E.BAD_DEVICE, str(stmt.id), dev_text)} "
                  ":: else -> skip fi;")

  def _pick_device(self, s):
    """The target device's expression; unknown ids are chosen freely."""
    if s.device is not None:
      return s.device.text
    alts = " ".join(f":: rdev = {d}" for d in range(self.km.num_devices))
    self.out.emit(f"if {alts} fi;", s.info)
    return "rdev"

  def _DmaStart(self, s: M.DmaStart):
    e = self.out.emit
    dev = self._pick_device(s) if s.remote else None
    free = " || ".join(f"dma_phase[dev * Q + {k}] == 0"
                       for k in range(self.o.queue))
    e(f"d_step {{ ({free}) ->", s.info)
    self.out.indent()
    if s.remote:
      e(f"h_tdev = {dev};")
      self._check_device("h_tdev", s.info)
    tdev = "h_tdev" if s.remote else None
    e(f"h_sreg = {self.region(s.src.base)}; h_smask = {self.mask(s.src)};")
    e(f"chk_read(h_sreg, h_smask, {s.info.id}, {E.DMA_SRC_VS_DMA_WRITE});")
    e(f"h_dreg = {self.region(s.dst.base, tdev)}; h_dmask = {self.mask(s.dst)};")
    e(f"chk_write(h_dreg, h_dmask, {s.info.id}, {E.DMA_DST_VS_DMA_WRITE});")
    e("h_k = dev * Q;")
    e("do :: dma_phase[h_k] == 0 -> break :: else -> h_k++ od;")
    e(f"dma_phase[h_k] = 1; dma_remote[h_k] = {int(s.remote)}; "
      f"dma_inst[h_k] = inst + 1; dma_stmt[h_k] = {s.info.id};")
    e("dma_sreg[h_k] = h_sreg; dma_smask[h_k] = h_smask; "
      "dma_dreg[h_k] = h_dreg; dma_dmask[h_k] = h_dmask;")
    ssem = (f"{self.sem_index(s.src_sem)} + 1" if s.src_sem is not None
            else "0")
    e(f"dma_ssem[h_k] = {ssem}; "
      f"dma_dsem[h_k] = {self.sem_index(s.dst_sem, tdev)} + 1;")
    e(f"dma_amt[h_k] = {self.amount(s.nbytes)}; "
      f"dma_fin[h_k] = {self.fin(s.dst.base.scope, tdev)};")
    e(f'printf("@@S %d %d\\n", h_k, {s.info.id})')
    self.out.dedent()
    e("};")

  def _DmaWait(self, s: M.DmaWait):
    i = self.sem_index(s.sem)
    a = self.amount(s.nbytes)
    self.out.emit(f"d_step {{ sem[{i}] >= {a} -> sem[{i}] = sem[{i}] - {a} }};",
                  s.info)

  def _SemWait(self, s: M.SemWait):
    i = self.sem_index(s.sem)
    a = s.amount.text if s.amount is not None else "1"
    if s.sem.sem.kind == "dma" and s.amount is not None and s.amount.const:
      a = str(self.amount(s.amount.const))
    self.out.emit(f"d_step {{ sem[{i}] >= {a} -> sem[{i}] = sem[{i}] - ({a}) }};",
                  s.info)

  def _Signal(self, s: M.Signal):
    e = self.out.emit
    a = s.amount.text if s.amount is not None else "1"
    if s.sem.sem.kind == "dma" and s.amount is not None and s.amount.const:
      a = str(self.amount(s.amount.const))
    if not s.remote:
      i = self.sem_index(s.sem)
      e(f"d_step {{ sem[{i}] = sem[{i}] + ({a}) }};", s.info)
      return
    dev = self._pick_device(s)
    e("d_step {", s.info)
    self.out.indent()
    e(f"h_tdev = {dev};")
    self._check_device("h_tdev", s.info)
    e(f"h_fin = {self.fin(s.sem.sem.scope, 'h_tdev')};")
    e(f"if :: gone[h_fin] -> "
      f"{fail(E.SIGNAL_AFTER_EXIT, str(s.info.id), 'h_fin', 'inst')} "
      ":: else -> skip fi;")
    if self.o.check_entry and s.sem.sem.kind != "barrier":
      e(f"if :: !entered[h_fin] -> "
        f"{fail(E.SIGNAL_BEFORE_ENTRY, str(s.info.id), 'h_fin', 'inst')} "
        ":: else -> skip fi;")
    e(f"h_sem = {self.sem_index(s.sem, 'h_tdev')};")
    e(f"sem[h_sem] = sem[h_sem] + ({a})")
    self.out.dedent()
    e("};")

  def _Loop(self, s: M.Loop):
    e = self.out.emit
    inits = [f"{c} = {v.text};" for c, v in s.carried if v is not None]
    if s.var is not None:
      inits.insert(0, f"{s.var} = {s.lo.text};")
    if inits:
      e(" ".join(inits), s.info)
    e("do")
    e(f":: {s.var} < {s.hi.text} ->" if s.var is not None else ":: true ->")
    self.out.indent()
    self.block(s.body)
    tail = self._parallel_assign(
        [(c, y) for (c, _), y in zip(s.carried, s.yields) if y is not None])
    if s.var is not None:
      tail.append(f"{s.var} = {s.var} + {s.step.text};")
    if tail:
      e(("d_step { " + " ".join(tail) + " };") if _visible(s)
        else " ".join(tail))
    elif not s.body:
      e("skip;")
    self.out.dedent()
    e(":: else -> break" if s.var is not None else ":: true -> break")
    self._od()

  def _od(self):
    # SPIN rejects a `break` that jumps straight into a d_step.
    self.out.emit("od;" if self.in_dstep else "od; skip;")

  def _parallel_assign(self, updates) -> list[str]:
    """`c_k = y_k` for all k at once: through hidden temporaries when a new
    value reads another carried variable (always inside an atomic step)."""
    names = [c for c, _ in updates]
    if len(updates) <= 1 or not any(
        n in y.text for c, y in updates for n in names if n != c):
      return [f"{c} = {y.text};" for c, y in updates]
    self.temps = max(self.temps, len(updates))
    return ([f"h_t{k} = {y.text};" for k, (_, y) in enumerate(updates)]
            + [f"{c} = h_t{k};" for k, (c, _) in enumerate(updates)])

  def _If(self, s: M.If):
    e = self.out.emit
    e("if", s.info)
    for cond, body, ys in ((s.cond.text if s.cond is not None else "true",
                            s.then, s.then_yields),
                           ("else" if s.cond is not None else "true",
                            s.orelse, s.else_yields)):
      e(f":: {cond} ->")
      self.out.indent()
      self.block(body)
      assigns = [f"{r} = {y.text};" for r, y in zip(s.results, ys)
                 if y is not None]
      if assigns:
        e(" ".join(assigns))
      if not body and not assigns:
        e("skip;")
      self.out.dedent()
    e("fi;")

  def _While(self, s: M.While):
    e = self.out.emit
    inits = [f"{c} = {v.text};" for c, v in s.carried if v is not None]
    if inits:
      e(" ".join(inits), s.info)
    e("do")
    e(":: true ->")
    self.out.indent()
    self.block(s.before)
    e("if")
    e(f":: {s.cond.text if s.cond is not None else 'true'} ->")
    self.out.indent()
    a = [f"{n} = {v.text};" for n, v in s.after_vars if v is not None]
    if a:
      e(" ".join(a))
    self.block(s.after)
    tail = self._parallel_assign([(c, y) for (c, _), y in zip(s.carried, s.yields)
                                  if y is not None])
    e(("d_step { " + " ".join(tail) + " };") if tail else "skip;")
    self.out.dedent()
    e(f":: {'else' if s.cond is not None else 'true'} ->")
    self.out.indent()
    r = [f"{n} = {v.text};" for n, v in s.results if v is not None]
    e(" ".join(r + ["break;"]))
    self.out.dedent()
    e("fi;")
    self.out.dedent()
    self._od()

  def _GridStep(self, s: M.GridStep):
    e = self.out.emit
    dims = s.dims
    for v, n in dims:
      e(f"{v} = 0;")
      e("do")
      e(f":: {v} < {n} ->")
      self.out.indent()
    self.block(s.body)
    if s.blocked:
      last = " && ".join(f"{v} == {n - 1}" for v, n in dims)
      opened = not self.in_dstep
      e(("d_step { " if opened else "") + f"if :: !({last}) ->", s.info)
      self.out.indent()
      for b in s.blocked:
        e(f"h_dreg = {self.region(b)}; h_dmask = {self.full_mask(b)}; "
          f"chk_write(h_dreg, h_dmask, {s.info.id}, {E.PIPELINE_VS_DMA_WRITE});")
      e(":: else -> skip fi" + (" };" if opened else ";"))
      self.out.dedent()
    for v, n in reversed(dims):
      e(f"{v} = {v} + 1;")
      self.out.dedent()
      e(":: else -> break")
      self._od()

  def _ScopeEnd(self, s: M.ScopeEnd):
    e = self.out.emit
    e("d_step {", s.info)
    self.out.indent()
    for b in s.buffers:
      e(f"h_dreg = {self.region(b)}; h_dmask = {self.full_mask(b)}; "
        f"chk_write(h_dreg, h_dmask, {s.info.id}, {E.SCOPE_VS_DMA_WRITE});")
    for sm in s.sems:
      for k in range(sm.count):
        i = f"({self.sem_base[sm]} + inst * {sm.count} + {k})"
        e(f"if :: sem[{i}] != 0 -> "
          f"{fail(E.SCOPE_SEM, i, f'sem[{i}]', 'inst')} :: else -> skip fi;")
        e(f"sem[{i}] = 0;")
    e("skip")
    self.out.dedent()
    e("};")

  def _exit(self):
    """The kernel ends: nothing of this instance may still be in flight,
    its semaphores must be back at zero; the last instance of a device
    checks the device's HBM buffers and barrier semaphore too."""
    km, e = self.km, self.out.emit
    e("d_step {  /* the kernel ends */")
    self.out.indent()
    e("h_k = 0;")
    e("do")
    e(":: h_k < NSLOTS ->")
    e("   if")
    e("   :: dma_phase[h_k] == 1 && dma_inst[h_k] == inst + 1 ->")
    e("      " + fail(E.EXIT_OWN_DMA, "dma_stmt[h_k]", "inst", "dma_fin[h_k]",
                       "h_k"))
    e("   :: dma_phase[h_k] != 0 && dma_fin[h_k] == inst && dma_inst[h_k] != inst + 1 ->")
    e("      " + fail(E.EXIT_PEER_DMA, "dma_stmt[h_k]", "dma_inst[h_k]",
                       "inst", "h_k"))
    e("   :: else -> skip")
    e("   fi;")
    e("   h_k++")
    e(":: else -> break")
    e("od;")
    for sm in km.sems:
      if sm.scope == "instance" and not sm.scoped:
        self._sem_zero(sm, "inst")
    e("gone[inst] = 1;")
    e("alive[dev] = alive[dev] - 1;")
    e("if")
    e(":: alive[dev] == 0 ->")
    self.out.indent()
    e("h_k = 0;")
    e("do")
    e(":: h_k < NSLOTS ->")
    e("   if")
    e("   :: dma_phase[h_k] != 0 && dma_fin[h_k] == NINST + dev ->")
    e("      " + fail(E.EXIT_PEER_DMA, "dma_stmt[h_k]", "dma_inst[h_k]",
                       "NINST + dev", "h_k"))
    e("   :: else -> skip")
    e("   fi;")
    e("   h_k++")
    e(":: else -> break")
    e("od;")
    for sm in km.sems:
      if sm.scope == "device":
        self._sem_zero(sm, "dev")
    e("gone[NINST + dev] = 1")
    self.out.dedent()
    e(":: else -> skip")
    e("fi")
    self.out.dedent()
    e("}")

  def _sem_zero(self, sm: M.SemArray, owner: str):
    e = self.out.emit
    code = E.EXIT_RECV_SEM if sm.remote_recv else E.EXIT_SEM
    base = f"{self.sem_base[sm]} + {owner} * {sm.count}"
    fin = "inst" if owner == "inst" else "NINST + dev"
    e("h_j = 0;")
    e(f"do :: h_j < {sm.count} -> if :: sem[{base} + h_j] != 0 -> "
      f"{fail(code, f'{base} + h_j', f'sem[{base} + h_j]', fin)} "
      ":: else -> skip fi; h_j++ :: else -> break od;")


def build(km: M.KernelModel, options: Optional[Options] = None) -> str:
  """The Promela text of a kernel model."""
  return Builder(km, options or Options()).build()
