"""`KernelModel` -> Promela text: the processes, declarations and macros
of the file; layout.py numbers the regions, cells and semaphores, and
statements.py writes the kernel's statements.

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
the kind: `no_race`, `sem_balanced`, `valid_model` (error_table.py holds the
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

from lowering_mosaic.verification.promela import error_table as E
from lowering_mosaic.verification.promela import model as M
from lowering_mosaic.verification.promela.error_table import fail
from lowering_mosaic.verification.promela.extract import extract
from lowering_mosaic.verification.promela.layout import Layout
from lowering_mosaic.verification.promela.statements import (Lines, Statements,
                                                             clean)


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


class Builder:
  """Writes one model; `build()` returns the Promela text."""

  def __init__(self, km: M.KernelModel, options: Options):
    self.km = km
    self.o = options
    self.lay = Layout(km, options)

  def build(self) -> str:
    kernel = self.out = Lines()
    self.statements = Statements(self.lay, self.o, kernel)
    self._kernel()
    self._init()
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
    e(f"/* Promela model of the Mosaic kernel `{clean(km.name)}`"
      + (f" (defined at {clean(km.source)})" if km.source else ""))
    e(" * written by lowering_mosaic.verification.promela from its MLIR module; data values")
    e(" * are abstracted away: the model tracks who touches which buffer when.")
    e(f" * devices: {km.num_devices}; grid: {km.grid} "
      f"({', '.join(km.semantics) or 'none'}); processes per device: "
      f"{km.num_parallel}; DMA queue: {self.o.queue} slots per device;")
    e(f" * DMA semaphores count units of {km.dma_unit} bytes.")
    for n in km.notes:
      e(f" * note: {clean(n)}")
    e(" *")
    e(f" * @@model kernel={clean(km.name).replace(' ', '_')} devices={km.num_devices} "
      f"par={km.num_parallel} queue={self.o.queue} unit={km.dma_unit}")
    for s in km.stmts:
      e(f" * @@stmt {s.id} {clean(s.line or '-')} | {clean(s.what)}")
    for b in km.buffers:
      e(f" * @@buf {self.lay.reg_base[b]} {self.lay.owners(b.scope)} {b.scope} "
        f"{b.ncells} | {clean(b.name)} ({b.space}{list(b.shape)})")
    for s in km.sems:
      e(f" * @@sem {self.lay.sem_base[s]} {s.count} {self.lay.owners(s.scope)} "
        f"{s.scope} {s.kind} {int(s.remote_recv)} | {clean(s.name)}")
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
    e(f"#define NSEMS {max(1, self.lay.nsems)}")
    e("/* cell masks: cell c, cells lo..hi, rows lo..hi of n cells each */")
    e("#define CELL(c) (1 << (c))")
    e("#define RANGE(lo, hi) ((1 << ((hi) + 1)) - (1 << (lo)))")
    e("#define CLAMP(x, top) ((x) < 0 -> 0 : ((x) > (top) -> (top) : (x)))")
    e("#define ROWS(lo, hi, n) (((1 << (((hi) + 1) * (n))) - (1 << ((lo) * (n)))) "
      "/ ((1 << (n)) - 1))")
    e("")
    e("/* assertion names say the kind of error */")
    for name in E.ASSERTION.values():
      e(f"hidden byte {name};")
    e("/* scratch for atomic steps (not part of the state) */")
    e("hidden int h_k, h_j, h_sreg, h_smask, h_dreg, h_dmask, h_sem, h_tdev, "
      "h_fin;")
    if self.statements.temps:
      temps = range(self.statements.temps)
      e(f"hidden int {', '.join(f'h_t{k}' for k in temps)};")
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
    amounts = [self.lay.amount(s.nbytes) for s in M.walk(km.body)
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
    if any(isinstance(s, (M.DmaStart, M.Signal)) and s.remote
           and s.device is None for s in M.walk(km.body)):
      e("byte rdev;")
    e("d_step { entered[inst] = 1; entered[NINST + dev] = 1 };  "
      "/* the kernel starts */")
    self.statements.block(km.body)
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
    base = f"{self.lay.sem_base[sm]} + {owner} * {sm.count}"
    fin = "inst" if owner == "inst" else "NINST + dev"
    e("h_j = 0;")
    e(f"do :: h_j < {sm.count} -> if :: sem[{base} + h_j] != 0 -> "
      f"{fail(code, f'{base} + h_j', f'sem[{base} + h_j]', fin)} "
      ":: else -> skip fi; h_j++ :: else -> break od;")


def build(km: M.KernelModel, options: Optional[Options] = None) -> str:
  """The Promela text of a kernel model."""
  return Builder(km, options or Options()).build()


def to_promela(module, num_devices=None, options=None) -> str:
  """The Promela model (text) of a Mosaic module: its model extracted
  (extract.py), then built."""
  options = options or Options()
  km = extract(module, num_devices, max_parallel=options.max_parallel)
  return build(km, options)
