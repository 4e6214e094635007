"""Where a model keeps its state: buffer regions, their cells, semaphores.

Every buffer has one *region* per owner (a device for HBM operands, an
instance for VMEM/SMEM blocks, scratch and `run_scoped` buffers), numbered
from 1 in the order of `KernelModel.buffers`; a region is cut into at most
30 cells (`model.layout_cells`), and a set of cells is a bit mask. The
semaphores of all owners are one `sem[]` array. `Layout` writes the Promela
expressions for these: the region of a buffer, the mask of a window, the
index of a semaphore, as seen from the running process or from a device.
"""
from __future__ import annotations

from typing import Optional

from lowering_mosaic.verification.promela import model as M
from lowering_mosaic.verification.promela.model import binop, const


class Layout:
  """Region and semaphore numbering of one kernel model (`options` is a
  builder.Options: its `max_cells` bounds the cells per region)."""

  def __init__(self, km: M.KernelModel, options):
    self.km = km
    for b in km.buffers:
      M.layout_cells(b, min(options.max_cells, 30))
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
