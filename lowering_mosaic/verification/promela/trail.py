"""Counterexample trails in the kernel's own terms.

A model file describes itself (builder.py writes the tables into its header
comment): `@@stmt id line | what`, `@@buf`, `@@sem`, `@@proc`, and every
statement line ends with `/* @sN ... */`. `ModelInfo.parse(text)` reads
that back, and `translate(info, replay_output)` turns the output of
`spin -t -p -g model.pml` into `TrailStep`s, the blocked processes of a
deadlock, and a one-paragraph message naming buffers, semaphores, devices
and kernel source lines.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

from lowering_mosaic.verification.promela.error_table import ERRORS
from lowering_mosaic.verification.promela.model import c_div, c_rem
from lowering_mosaic.verification.promela.spin_report import TrailStep


def display_line(line: Optional[str]) -> Optional[str]:
  """'file:line' with the file relative to the working directory when it
  lies below it."""
  if not line:
    return line
  path, _, num = line.rpartition(":")
  try:
    rel = os.path.relpath(path)
  except ValueError:
    return line
  return f"{rel}:{num}" if not rel.startswith("..") else line


# ------------------------------------------------------------ expressions

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_]\w*)|(->|<<|>>|<=|>=|==|!=|&&|"
                    r"\|\||[-+*/%<>&|^!():]))")
_BINARY = {"||": 2, "&&": 3, "|": 4, "^": 5, "&": 6, "==": 7, "!=": 7,
           "<": 8, "<=": 8, ">": 8, ">=": 8, "<<": 9, ">>": 9, "+": 10,
           "-": 10, "*": 11, "/": 11, "%": 11}


_APPLY = {
    "||": lambda a, b: int(bool(a) or bool(b)),
    "&&": lambda a, b: int(bool(a) and bool(b)),
    "|": lambda a, b: a | b, "^": lambda a, b: a ^ b, "&": lambda a, b: a & b,
    "==": lambda a, b: int(a == b), "!=": lambda a, b: int(a != b),
    "<": lambda a, b: int(a < b), "<=": lambda a, b: int(a <= b),
    ">": lambda a, b: int(a > b), ">=": lambda a, b: int(a >= b),
    "<<": lambda a, b: a << b, ">>": lambda a, b: a >> b,
    "+": lambda a, b: a + b, "-": lambda a, b: a - b,
    "*": lambda a, b: a * b, "/": c_div, "%": c_rem,
}


def evaluate(text: str, env: dict) -> Optional[int]:
  """The value of a Promela expression (the subset the builder writes:
  integers, variables, C operators, `(c -> a : b)`), or None."""
  toks, pos = [], 0
  while pos < len(text):
    m = _TOKEN.match(text, pos)
    if not m or m.end() == pos:
      if text[pos:].strip():
        return None
      break
    toks.append(m.group(1) or m.group(2) or m.group(3))
    pos = m.end()
  k = [0]

  def peek():
    return toks[k[0]] if k[0] < len(toks) else None

  def take():
    k[0] += 1
    return toks[k[0] - 1]

  def atom():
    t = take()
    if t == "(":
      v = expr(0)
      if peek() == "->":
        take()
        a = expr(0)
        if take() != ":":
          raise ValueError
        b = expr(0)
        v = a if v else b
      if take() != ")":
        raise ValueError
      return v
    if t == "-":
      return -atom()
    if t == "!":
      return int(not atom())
    if t.isdigit():
      return int(t)
    if t in env:
      return int(env[t])
    raise KeyError(t)

  def expr(level):
    v = atom()
    while peek() in _BINARY and _BINARY[peek()] > level:
      op = take()
      v = _APPLY[op](v, expr(_BINARY[op]))
    return v

  try:
    v = expr(0)
    return v if k[0] == len(toks) else None
  except (KeyError, ValueError, IndexError, ZeroDivisionError):
    return None


def render(what: str, env: Optional[dict]) -> str:
  """Replaces each `{expression}` of a statement's text by its value in
  `env` (the process's variables at that step); keeps the text otherwise."""
  def one(m):
    v = evaluate(m.group(1), env) if env is not None else None
    return str(v) if v is not None else m.group(1)
  return re.sub(r"\{([^{}]*)\}", one, what)


@dataclasses.dataclass
class BufInfo:
  base: int
  owners: int
  scope: str
  name: str


@dataclasses.dataclass
class SemInfo:
  base: int
  count: int
  owners: int
  scope: str
  kind: str
  remote_recv: bool
  name: str


@dataclasses.dataclass
class ModelInfo:
  kernel: str = "kernel"
  devices: int = 1
  par: int = 1
  stmts: dict = dataclasses.field(default_factory=dict)    # id -> (line, what)
  bufs: list = dataclasses.field(default_factory=list)
  sems: list = dataclasses.field(default_factory=list)
  procs: dict = dataclasses.field(default_factory=dict)    # pid -> text
  proc_args: dict = dataclasses.field(default_factory=dict)  # pid -> {var: v}
  line_stmt: dict = dataclasses.field(default_factory=dict)  # pml line -> id
  notes: list = dataclasses.field(default_factory=list)

  @classmethod
  def parse(cls, text: str) -> "ModelInfo":
    info = cls()
    for n, line in enumerate(text.splitlines(), start=1):
      m = re.search(r"/\* @s(\d+) ", line)
      if m:
        info.line_stmt[n] = int(m.group(1))
        continue
      m = re.match(r"\s*\* @@model (.*)", line)
      if m:
        kv = dict(p.split("=", 1) for p in m.group(1).split())
        info.kernel = kv.get("kernel", "kernel")
        info.devices = int(kv.get("devices", 1))
        info.par = int(kv.get("par", 1))
        continue
      m = re.match(r"\s*\* @@stmt (\d+) (\S+) \| (.*)", line)
      if m:
        src = None if m.group(2) == "-" else m.group(2)
        info.stmts[int(m.group(1))] = (src, m.group(3))
        continue
      m = re.match(r"\s*\* @@buf (\d+) (\d+) (\w+) \d+ \| (.*)", line)
      if m:
        info.bufs.append(BufInfo(int(m.group(1)), int(m.group(2)),
                                 m.group(3), m.group(4)))
        continue
      m = re.match(r"\s*\* @@sem (\d+) (\d+) (\d+) (\w+) (\w+) (\d) \| (.*)",
                   line)
      if m:
        info.sems.append(SemInfo(int(m.group(1)), int(m.group(2)),
                                 int(m.group(3)), m.group(4), m.group(5),
                                 m.group(6) == "1", m.group(7)))
        continue
      m = re.match(r"\s*\* @@proc (\d+) ((?:\w+=-?\d+ )*)\| (.*)", line)
      if m:
        pid = int(m.group(1))
        info.procs[pid] = m.group(3)
        info.proc_args[pid] = {k: int(v) for k, v in (
            a.split("=") for a in m.group(2).split())}
        continue
      m = re.match(r"\s*\* note: (.*)", line)
      if m:
        info.notes.append(m.group(1))
    return info

  # -------------------------------------------------------- naming

  def line(self, stmt: int) -> Optional[str]:
    return display_line(self.stmts.get(stmt, (None, ""))[0])

  def what(self, stmt: int, env: Optional[dict] = None) -> str:
    return render(self.stmts.get(stmt, (None, f"statement {stmt}"))[1], env)

  def at(self, stmt: int, env: Optional[dict] = None) -> str:
    return f"{self.line(stmt) or '?'} ({self.what(stmt, env)})"

  def pid_of(self, inst: int) -> Optional[int]:
    for pid, args in self.proc_args.items():
      if "inst" in args and args["inst"] == inst:
        return pid
    return None

  def instance(self, inst: int) -> str:
    dev, p = divmod(inst, max(self.par, 1))
    return f"device {dev}" + (f" (grid point {p})" if self.par > 1 else "")

  def issuer(self, inst1: int) -> str:
    return self.instance(inst1 - 1) if inst1 > 0 else "a device"

  def owner(self, fin: int) -> str:
    """An entered[]/gone[] index: an instance, or NINST + device."""
    ninst = self.devices * self.par
    if fin >= ninst:
      return f"device {fin - ninst}"
    return self.instance(fin)

  def region(self, reg: int) -> str:
    for b in self.bufs:
      if b.base <= reg < b.base + b.owners:
        k = reg - b.base
        who = f"device {k}" if b.scope == "device" else self.instance(k)
        return f"{who}'s {b.name}"
    return f"buffer region {reg}"

  def sem(self, idx: int) -> tuple[str, Optional[SemInfo]]:
    for s in self.sems:
      if s.base <= idx < s.base + s.count * s.owners:
        owner, elem = divmod(idx - s.base, s.count)
        who = f"device {owner}" if s.scope == "device" else self.instance(owner)
        name = s.name + (f"[{elem}]" if s.count > 1 else "")
        return f"{who}'s {name}", s
    return f"semaphore {idx}", None


# ------------------------------------------------------------ replay output

_STEP = re.compile(r"^\s*(\d+):\s+proc\s+(\d+)\s+\(([^)]*)\)\s+(\S+?):(\d+)\s+"
                   r"\(state\s+\d+\)\s*(.*)$")
_ERR = re.compile(r"@@E ((?:-?\d+\s*)+)")
_DMA = re.compile(r"@@D (read|land) (-?\d+) (-?\d+)(?: (-?\d+))?")
_SLOT = re.compile(r"@@S (\d+) (\d+)")


@dataclasses.dataclass
class Translation:
  steps: list
  blocked: list
  error: Optional[list]       # the @@E numbers
  error_pid: Optional[int]
  message: str
  error_line: Optional[str]


_LOCAL = re.compile(r"^\s+\w+\((\d+)\):(\w+) = (-?\d+)")


class _Texts:
  """Statement texts with their `{expressions}` evaluated as each process
  had them when it ran the statement."""

  def __init__(self, info: ModelInfo):
    self.info = info
    self.envs = {pid: dict(a) for pid, a in info.proc_args.items()}
    self.seen: dict = {}
    self.slots: dict = {}      # DMA queue slot -> (stmt, text) of its DMA

  def started(self, slot: int, stmt: int, pid: Optional[int]):
    self.slots[slot] = (stmt, self.what(stmt, pid))

  def dma_what(self, stmt: int, slot: Optional[int], pid: Optional[int]):
    got = self.slots.get(slot)
    if got is not None and got[0] == stmt:
      return got[1]
    return self.what(stmt, pid)

  def dma_at(self, stmt: int, slot: Optional[int], pid: Optional[int]) -> str:
    return f"{self.info.line(stmt) or '?'} ({self.dma_what(stmt, slot, pid)})"

  def run(self, stmt: int, pid: int) -> str:
    text = self.info.what(stmt, self.envs.get(pid))
    self.seen[(stmt, pid)] = text
    return text

  def what(self, stmt: int, pid: Optional[int]) -> str:
    if (stmt, pid) in self.seen:
      return self.seen[(stmt, pid)]
    return self.info.what(stmt, self.envs.get(pid))

  def at(self, stmt: int, pid: Optional[int]) -> str:
    return f"{self.info.line(stmt) or '?'} ({self.what(stmt, pid)})"


def translate(info: ModelInfo, output: str, kind: str) -> Translation:
  """Reads `spin -t -p -l` output of a trail of this model."""
  texts = _Texts(info)
  steps: list[TrailStep] = []
  error = None
  error_pid = None
  last_key = None
  last_pid = None
  final = False
  finals = []
  for raw in output.splitlines():
    if raw.startswith("#processes"):
      final = True
      continue
    m = _ERR.search(raw)
    if m and error is None:
      error = [int(x) for x in m.group(1).split()]
      continue
    m = _SLOT.search(raw)
    if m and not final:
      texts.started(int(m.group(1)), int(m.group(2)), last_pid)
      continue
    m = _DMA.search(raw)
    if m and not final:
      stmt, inst1 = int(m.group(2)), int(m.group(3))
      slot = int(m.group(4)) if m.group(4) is not None else None
      desc = texts.dma_what(stmt, slot, info.pid_of(inst1 - 1))
      what = (f"has read the source of: {desc} (send semaphore signalled)"
              if m.group(1) == "read" else f"lands: {desc}")
      steps.append(TrailStep(f"DMA engine of {info.issuer(inst1).split(' (')[0]}",
                             info.line(stmt), what))
      last_key = None
      continue
    m = _STEP.match(raw)
    if m:
      pid, pml_line, rest = int(m.group(2)), int(m.group(5)), m.group(6)
      if not final:
        last_pid = pid
      if final:
        finals.append((pid, pml_line, "<valid end state>" in rest))
        continue
      if error is not None:
        if error_pid is None:
          error_pid = pid
        continue              # the rest of the failing atomic step
      stmt = info.line_stmt.get(pml_line)
      if stmt is None:
        continue
      key = (pid, stmt, m.group(1))   # one atomic step shares its number
      if key == last_key:
        continue
      last_key = key
      steps.append(TrailStep(info.procs.get(pid, f"process {pid}"),
                             info.line(stmt), texts.run(stmt, pid)))
      continue
    m = _LOCAL.match(raw)
    if m and not final:
      texts.envs.setdefault(int(m.group(1)), {})[m.group(2)] = int(m.group(3))
  blocked = []
  for pid, pml_line, valid in finals:
    if valid:
      continue
    stmt = info.line_stmt.get(pml_line)
    desc = info.procs.get(pid, f"process {pid}")
    if stmt is None:
      blocked.append(TrailStep(desc, None, "ends"))
    else:
      blocked.append(TrailStep(desc, info.line(stmt),
                               "blocked: " + texts.what(stmt, pid)))
  message, line = _message(info, texts, kind, error, error_pid, blocked)
  return Translation(steps, blocked, error, error_pid, message, line)


def _message(info: ModelInfo, texts: _Texts, kind, error, pid, blocked):
  """(message, kernel line) of a failed run: its deadlock, or the error
  its model printed (`@@E code args...`, worded from error_table.ERRORS)."""
  if kind == "deadlock":
    if not blocked:
      return "deadlock: some process can never finish", None
    parts = [f"{b.process} waits forever at {b.line or '?'} "
             f"({b.what.removeprefix('blocked: ')})" for b in blocked]
    return "deadlock: " + "; ".join(parts), blocked[0].line
  if not error:
    return "", None
  code, args = error[0], error[1:]
  e = ERRORS.get(code)
  if e is None:
    return f"error code {code} {args}", None
  values = dict(zip(e.args, args + [0] * len(e.args)))
  fields = _fields(info, texts, values, pid)
  line = info.line(values[e.line]) if e.line is not None else None
  return f"{e.kind}: {e.message.format(**fields)}", line


def _fields(info: ModelInfo, texts: _Texts, v: dict, pid) -> dict:
  """The words for the arguments `v` of an error (see error_table.py)."""
  actor = info.procs.get(pid, "a process") if pid is not None else "a process"
  f = {"actor": actor.replace(" kernel", ""), "devices": info.devices}
  if "stmt" in v:
    f["at"] = texts.at(v["stmt"], pid)
    f["line"] = info.line(v["stmt"]) or "?"
  if "dma" in v:
    by = v["issuer"] - 1 if "issuer" in v else v["inst"]
    f["dma"] = texts.dma_at(v["dma"], v.get("slot"), info.pid_of(by))
  if "issuer" in v:
    f["issuer"] = info.issuer(v["issuer"])
  if "inst" in v:
    f["inst"] = info.instance(v["inst"])
  if "region" in v:
    f["region"] = info.region(v["region"])
  if "owner" in v:
    f["owner"] = info.owner(v["owner"])
  if "sem" in v:
    f["sem"] = info.sem(v["sem"])[0]
  for k in ("value", "device"):
    if k in v:
      f[k] = v[k]
  return f
