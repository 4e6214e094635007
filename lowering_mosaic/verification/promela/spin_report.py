"""What a SPIN run found: `Report` (one kernel) and `TrailStep`."""
from __future__ import annotations

import dataclasses
from typing import Optional

KINDS = ("ok", "race", "deadlock", "semaphore", "bound", "error")


@dataclasses.dataclass
class TrailStep:
  """One step of a counterexample, in the kernel's terms."""
  process: str               # "device 1 kernel", "DMA engine of device 0"
  line: Optional[str]        # the kernel source line, "file.py:42"
  what: str

  def __str__(self):
    return f"{self.process}: {self.line or '?'}: {self.what}"


@dataclasses.dataclass
class Report:
  """The outcome of verifying one kernel.

  kind:
    ok         no interleaving races, deadlocks or leaves a semaphore set
    race       a buffer touched while a DMA into/out of it is in flight, or a
               device writing into a peer that has left (or not entered) the
               kernel
    deadlock   some process waits forever (SPIN: invalid end state)
    semaphore  a semaphore is not back at zero when the kernel ends (a DMA
               never waited, unbalanced signal/wait)
    bound      the search hit its depth, memory or time limit before finishing
               (`message` says which and how far it got); nothing was found
               up to there
    error      the model itself went wrong (e.g. a device id out of range)
  """
  kind: str
  kernel: str = ""
  message: str = ""
  states: int = 0            # states stored
  transitions: int = 0
  depth: int = 0             # depth reached
  max_depth: int = 0
  time_s: float = 0.0        # whole run: spin -a, C compile, search, replay
  search_s: float = 0.0      # the pan search alone
  error_line: Optional[str] = None
  trail: list = dataclasses.field(default_factory=list)
  blocked: list = dataclasses.field(default_factory=list)
  notes: list = dataclasses.field(default_factory=list)
  model_path: Optional[str] = None
  num_devices: int = 1
  pan_output: str = dataclasses.field(default="", repr=False)

  @property
  def ok(self) -> bool:
    return self.kind == "ok"

  def __bool__(self):
    return self.ok

  def summary(self) -> str:
    head = f"{self.kernel or 'kernel'}: {self.kind}"
    stats = (f"{self.states} states, {self.transitions} transitions, depth "
             f"{self.depth}, search {self.search_s:.2f} s, total "
             f"{self.time_s:.2f} s")
    return f"{head} ({stats})"

  def __str__(self):
    lines = [self.summary()]
    if self.message:
      lines.append(self.message)
    if self.blocked:
      lines.append("blocked:")
      lines += [f"  {s}" for s in self.blocked]
    if self.trail:
      lines.append("trail:")
      lines += [f"  {k + 1:3d}. {s}" for k, s in enumerate(self.trail)]
    for n in self.notes:
      lines.append(f"note: {n}")
    if self.model_path:
      lines.append(f"model: {self.model_path}")
    return "\n".join(lines)


class Reports(list):
  """Reports of several kernels; `kind` is the first one that is not ok."""

  @property
  def kind(self) -> str:
    for r in self:
      if r.kind != "ok":
        return r.kind
    return "ok"

  @property
  def ok(self) -> bool:
    return self.kind == "ok"

  def __str__(self):
    return "\n\n".join(str(r) for r in self)
