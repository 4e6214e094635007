"""The statements of a kernel model -> Promela, one writer per statement type.

`Statements.block` writes a statement list into a `Lines` buffer: each
statement that changes shared state or blocks (a DMA start or wait, a
signal, a semaphore wait, a loop or branch holding one, the end of a
`run_scoped`) is a step of its own; runs of the others (accesses, local
assignments) share one atomic `d_step`. `STATEMENTS` maps each statement
class of model.py to the method that writes it. Every statement line ends
with `/* @sN file:line: what */`, which trail.py reads back.
"""
from __future__ import annotations

from typing import Optional

from lowering_mosaic.verification.promela import error_table as E
from lowering_mosaic.verification.promela import model as M
from lowering_mosaic.verification.promela.error_table import fail
from lowering_mosaic.verification.promela.layout import Layout


class Lines:
  """An indented text buffer that knows its line numbers."""

  def __init__(self):
    self.lines: list[str] = []
    self.level = 0

  def emit(self, text: str, stmt: Optional[M.Stmt] = None):
    line = "  " * self.level + text
    if stmt is not None:
      line += f"  /* @s{stmt.id} {clean(stmt.line or '?')}: {clean(stmt.what)} */"
    self.lines.append(line)

  def indent(self):
    self.level += 1

  def dedent(self):
    self.level -= 1

  def text(self) -> str:
    return "\n".join(self.lines) + "\n"


def clean(s: str) -> str:
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


class Statements:
  """Writes statements into `out` (`options` is a builder.Options)."""

  def __init__(self, layout: Layout, options, out: Lines):
    self.lay = layout
    self.options = options
    self.num_devices = layout.km.num_devices
    self.out = out
    self.temps = 0           # hidden h_t* temporaries the model needs
    self.in_dstep = False

  def block(self, stmts):
    """Emits statements; runs of invisible ones share one atomic step."""
    run = []
    for s in stmts:
      if _visible(s):
        self.flush(run)
        run = []
        self.stmt(s)
      else:
        run.append(s)
    self.flush(run)

  def flush(self, run):
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
    rule = STATEMENTS.get(type(s))
    if rule is None:
      raise TypeError(f"no Promela for a {type(s).__name__} statement")
    rule(self, s)

  def access(self, s: M.Access):
    reg = self.lay.region(s.window.base)
    mask = self.lay.mask(s.window)
    code = (E.READ_VS_DMA_WRITE if s.kind == "read" else
            E.WRITE_VS_DMA_WRITE)
    fn = "chk_read" if s.kind == "read" else "chk_write"
    self.out.emit(f"h_dreg = {reg}; h_dmask = {mask}; "
                  f"{fn}(h_dreg, h_dmask, {s.info.id}, {code});", s.info)

  def assign(self, s: M.Assign):
    if s.value is None:
      self.out.emit(f"skip;  /* {s.var} keeps its value (not modelled) */")
      return
    self.out.emit(f"{s.var} = {s.value.text};", s.info)

  def check_device(self, dev_text: str, stmt: M.Stmt):
    self.out.emit(f"if :: {dev_text} < 0 || {dev_text} >= NDEV -> "
                  f"{fail(E.BAD_DEVICE, str(stmt.id), dev_text)} "
                  ":: else -> skip fi;")

  def pick_device(self, s):
    """The target device's expression; unknown ids are chosen freely."""
    if s.device is not None:
      return s.device.text
    alts = " ".join(f":: rdev = {d}" for d in range(self.num_devices))
    self.out.emit(f"if {alts} fi;", s.info)
    return "rdev"

  def dma_start(self, s: M.DmaStart):
    e = self.out.emit
    dev = self.pick_device(s) if s.remote else None
    free = " || ".join(f"dma_phase[dev * Q + {k}] == 0"
                       for k in range(self.options.queue))
    e(f"d_step {{ ({free}) ->", s.info)
    self.out.indent()
    if s.remote:
      e(f"h_tdev = {dev};")
      self.check_device("h_tdev", s.info)
    tdev = "h_tdev" if s.remote else None
    lay = self.lay
    e(f"h_sreg = {lay.region(s.src.base)}; h_smask = {lay.mask(s.src)};")
    e(f"chk_read(h_sreg, h_smask, {s.info.id}, {E.DMA_SRC_VS_DMA_WRITE});")
    e(f"h_dreg = {lay.region(s.dst.base, tdev)}; h_dmask = {lay.mask(s.dst)};")
    e(f"chk_write(h_dreg, h_dmask, {s.info.id}, {E.DMA_DST_VS_DMA_WRITE});")
    e("h_k = dev * Q;")
    e("do :: dma_phase[h_k] == 0 -> break :: else -> h_k++ od;")
    e(f"dma_phase[h_k] = 1; dma_remote[h_k] = {int(s.remote)}; "
      f"dma_inst[h_k] = inst + 1; dma_stmt[h_k] = {s.info.id};")
    e("dma_sreg[h_k] = h_sreg; dma_smask[h_k] = h_smask; "
      "dma_dreg[h_k] = h_dreg; dma_dmask[h_k] = h_dmask;")
    ssem = (f"{self.lay.sem_index(s.src_sem)} + 1" if s.src_sem is not None
            else "0")
    e(f"dma_ssem[h_k] = {ssem}; "
      f"dma_dsem[h_k] = {self.lay.sem_index(s.dst_sem, tdev)} + 1;")
    e(f"dma_amt[h_k] = {self.lay.amount(s.nbytes)}; "
      f"dma_fin[h_k] = {self.lay.fin(s.dst.base.scope, tdev)};")
    e(f'printf("@@S %d %d\\n", h_k, {s.info.id})')
    self.out.dedent()
    e("};")

  def dma_wait(self, s: M.DmaWait):
    i = self.lay.sem_index(s.sem)
    a = self.lay.amount(s.nbytes)
    self.out.emit(f"d_step {{ sem[{i}] >= {a} -> sem[{i}] = sem[{i}] - {a} }};",
                  s.info)

  def sem_wait(self, s: M.SemWait):
    i = self.lay.sem_index(s.sem)
    a = s.amount.text if s.amount is not None else "1"
    if s.sem.sem.kind == "dma" and s.amount is not None and s.amount.const:
      a = str(self.lay.amount(s.amount.const))
    self.out.emit(f"d_step {{ sem[{i}] >= {a} -> sem[{i}] = sem[{i}] - ({a}) }};",
                  s.info)

  def signal(self, s: M.Signal):
    e = self.out.emit
    a = s.amount.text if s.amount is not None else "1"
    if s.sem.sem.kind == "dma" and s.amount is not None and s.amount.const:
      a = str(self.lay.amount(s.amount.const))
    if not s.remote:
      i = self.lay.sem_index(s.sem)
      e(f"d_step {{ sem[{i}] = sem[{i}] + ({a}) }};", s.info)
      return
    dev = self.pick_device(s)
    e("d_step {", s.info)
    self.out.indent()
    e(f"h_tdev = {dev};")
    self.check_device("h_tdev", s.info)
    e(f"h_fin = {self.lay.fin(s.sem.sem.scope, 'h_tdev')};")
    e(f"if :: gone[h_fin] -> "
      f"{fail(E.SIGNAL_AFTER_EXIT, str(s.info.id), 'h_fin', 'inst')} "
      ":: else -> skip fi;")
    if self.options.check_entry and s.sem.sem.kind != "barrier":
      e(f"if :: !entered[h_fin] -> "
        f"{fail(E.SIGNAL_BEFORE_ENTRY, str(s.info.id), 'h_fin', 'inst')} "
        ":: else -> skip fi;")
    e(f"h_sem = {self.lay.sem_index(s.sem, 'h_tdev')};")
    e(f"sem[h_sem] = sem[h_sem] + ({a})")
    self.out.dedent()
    e("};")

  def loop(self, s: M.Loop):
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
    tail = self.parallel_assign(
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
    self.od()

  def od(self):
    # SPIN rejects a `break` that jumps straight into a d_step.
    self.out.emit("od;" if self.in_dstep else "od; skip;")

  def parallel_assign(self, updates) -> list[str]:
    """`c_k = y_k` for all k at once: through hidden temporaries when a new
    value reads another carried variable (always inside an atomic step)."""
    names = [c for c, _ in updates]
    if len(updates) <= 1 or not any(
        n in y.text for c, y in updates for n in names if n != c):
      return [f"{c} = {y.text};" for c, y in updates]
    self.temps = max(self.temps, len(updates))
    return ([f"h_t{k} = {y.text};" for k, (_, y) in enumerate(updates)]
            + [f"{c} = h_t{k};" for k, (c, _) in enumerate(updates)])

  def branch(self, s: M.If):
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

  def while_loop(self, s: M.While):
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
    tail = self.parallel_assign([(c, y) for (c, _), y in zip(s.carried, s.yields)
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
    self.od()

  def grid_step(self, s: M.GridStep):
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
        e(f"h_dreg = {self.lay.region(b)}; h_dmask = {self.lay.full_mask(b)}; "
          f"chk_write(h_dreg, h_dmask, {s.info.id}, "
          f"{E.PIPELINE_VS_DMA_WRITE});")
      e(":: else -> skip fi" + (" };" if opened else ";"))
      self.out.dedent()
    for v, n in reversed(dims):
      e(f"{v} = {v} + 1;")
      self.out.dedent()
      e(":: else -> break")
      self.od()

  def scope_end(self, s: M.ScopeEnd):
    e = self.out.emit
    e("d_step {", s.info)
    self.out.indent()
    for b in s.buffers:
      e(f"h_dreg = {self.lay.region(b)}; h_dmask = {self.lay.full_mask(b)}; "
        f"chk_write(h_dreg, h_dmask, {s.info.id}, {E.SCOPE_VS_DMA_WRITE});")
    for sm in s.sems:
      for k in range(sm.count):
        i = f"({self.lay.sem_base[sm]} + inst * {sm.count} + {k})"
        e(f"if :: sem[{i}] != 0 -> "
          f"{fail(E.SCOPE_SEM, i, f'sem[{i}]', 'inst')} :: else -> skip fi;")
        e(f"sem[{i}] = 0;")
    e("skip")
    self.out.dedent()
    e("};")


STATEMENTS = {
    M.Access: Statements.access,
    M.Assign: Statements.assign,
    M.DmaStart: Statements.dma_start,
    M.DmaWait: Statements.dma_wait,
    M.SemWait: Statements.sem_wait,
    M.Signal: Statements.signal,
    M.Loop: Statements.loop,
    M.If: Statements.branch,
    M.While: Statements.while_loop,
    M.GridStep: Statements.grid_step,
    M.ScopeEnd: Statements.scope_end,
}
