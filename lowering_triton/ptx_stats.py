"""What compiled PTX says about speed: instruction mixes of the hot loops,
register and local-memory use, shared memory and occupancy.

`ptx_stats(ptx, cubin=None)` parses the PTX of one kernel (what
`lowering_triton.aot.compile_aot` returns as `AotKernel.ptx`): it finds the
loops (a branch back to a label above it), keeps the innermost ones (the hot
loops: a kernel spends its time there), and counts instruction classes in
each and in the whole kernel (`Mix`). With the cubin, `resources` reads the
registers, stack and local memory per thread that ptxas allocated (its
spills show as stack) through `cuobjdump`, which Triton ships.

    stats = ptx_stats(kernel.ptx, kernel.cubin)
    stats.hot_loops[0].mix.selp       # selects per iteration of the K loop
    stats.registers, stats.spill_bytes

Why these predict speed on a GPU (docs/performance.md): selects (`selp`)
and shared-memory stores in a loop that only moves tiles mean masks and
fill values Triton could not drop; predicated global loads cannot be
vectorized the same way; `wgmma` (Hopper's warpgroup MMA) and `cp.async`
(pipelined copies) are what fast Triton matmuls are made of; local memory
is spilled registers.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import tempfile

# Instruction classes: name -> predicate on (opcode, operands, predicated).
CLASSES = {
    "selp": lambda op, args, pred: op.startswith("selp."),
    "st_global": lambda op, args, pred: op.startswith("st.global"),
    "st_shared": lambda op, args, pred: op.startswith(("st.shared",
                                                       "stmatrix")),
    "st_local": lambda op, args, pred: op.startswith("st.local"),
    "ld_global": lambda op, args, pred: op.startswith("ld.global"),
    "ld_global_predicated": lambda op, args, pred: (
        pred and op.startswith("ld.global")),
    "ld_shared": lambda op, args, pred: op.startswith(("ld.shared",
                                                       "ldmatrix")),
    "ld_local": lambda op, args, pred: op.startswith("ld.local"),
    "cp_async": lambda op, args, pred: op.startswith(("cp.async.ca.",
                                                      "cp.async.cg.")),
    "cp_async_bulk": lambda op, args, pred: op.startswith("cp.async.bulk"),
    "wgmma": lambda op, args, pred: op.startswith("wgmma.mma_async"),
    "mma": lambda op, args, pred: op.startswith("mma."),
    "bar": lambda op, args, pred: op.startswith(("bar.", "barrier.")),
    "mbarrier": lambda op, args, pred: op.startswith("mbarrier."),
}


@dataclasses.dataclass(frozen=True)
class Mix:
  """Counts of instruction classes (see CLASSES) in a stretch of PTX."""
  instructions: int = 0
  selp: int = 0
  st_global: int = 0
  st_shared: int = 0
  st_local: int = 0
  ld_global: int = 0
  ld_global_predicated: int = 0
  ld_shared: int = 0
  ld_local: int = 0
  cp_async: int = 0
  cp_async_bulk: int = 0
  wgmma: int = 0
  mma: int = 0
  bar: int = 0
  mbarrier: int = 0

  @property
  def stores(self) -> int:
    return self.st_global + self.st_shared + self.st_local

  def as_dict(self) -> dict[str, int]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Loop:
  """A loop of the PTX: from its header label to the branch back to it."""
  label: str
  first: int           # index of the header label's line
  last: int            # index of the back-edge branch's line
  mix: Mix


@dataclasses.dataclass(frozen=True)
class PtxStats:
  kernel: Mix                   # the whole kernel
  loops: tuple[Loop, ...]       # every loop, in program order
  hot_loops: tuple[Loop, ...]   # the innermost ones
  registers: int | None = None  # per thread, from the cubin
  stack_bytes: int | None = None
  local_bytes: int | None = None  # per thread: spills and local arrays

  @property
  def spill_bytes(self) -> int:
    """Bytes per thread of spilled registers: ptxas spills to the stack
    frame (a Triton kernel calls no function that would need one), and
    local memory holds what the PTX itself spills."""
    return (self.stack_bytes or 0) + (self.local_bytes or 0)

  @property
  def spills(self) -> bool:
    """Whether registers spill to local memory (in the PTX or the cubin)."""
    return bool(self.kernel.ld_local or self.kernel.st_local
                or self.spill_bytes)


_LABEL = re.compile(r"^(\$?[\w.$]+):")
_PRED = re.compile(r"^@!?%\w+\s+")


def instructions(ptx: str) -> list[tuple[int, str, str, bool]]:
  """(line index, opcode, operands, predicated) of every instruction."""
  out = []
  for i, raw in enumerate(ptx.splitlines()):
    line = raw.split("//", 1)[0].strip()
    if not line.endswith(";") or line.startswith("."):
      continue                  # labels, directives, braces, comments
    pred = bool(_PRED.match(line))
    line = _PRED.sub("", line)
    op, _, args = line.partition(" ")
    out.append((i, op.rstrip(";"), args.strip().rstrip(";"), pred))
  return out


def _mix(insts) -> Mix:
  counts = {name: 0 for name in CLASSES}
  for _, op, args, pred in insts:
    for name, test in CLASSES.items():
      if test(op, args, pred):
        counts[name] += 1
  return Mix(instructions=len(insts), **counts)


def loops(ptx: str) -> list[Loop]:
  """Every loop: a branch (`bra`) to a label defined above it."""
  labels = {}
  for i, raw in enumerate(ptx.splitlines()):
    m = _LABEL.match(raw.strip())
    if m:
      labels[m.group(1)] = i
  insts = instructions(ptx)
  found = []
  for i, op, args, _ in insts:
    if not op.startswith("bra"):
      continue
    target = args.split(",")[-1].strip()
    first = labels.get(target)
    if first is not None and first < i:
      body = [x for x in insts if first <= x[0] <= i]
      found.append(Loop(target, first, i, _mix(body)))
  return sorted(found, key=lambda lp: (lp.first, lp.last))


def innermost(all_loops: list[Loop]) -> list[Loop]:
  """The loops that contain no other loop."""
  def contains(a: Loop, b: Loop) -> bool:
    return a is not b and a.first <= b.first and b.last <= a.last
  return [a for a in all_loops if not any(contains(a, b) for b in all_loops)]


def ptx_stats(ptx: str, cubin: bytes | None = None) -> PtxStats:
  all_loops = loops(ptx)
  res = resources(cubin) if cubin else {}
  return PtxStats(_mix(instructions(ptx)), tuple(all_loops),
                  tuple(innermost(all_loops)), res.get("REG"),
                  res.get("STACK"), res.get("LOCAL"))


# ------------------------------------------------------------- the cubin

@functools.lru_cache(maxsize=1)
def cuobjdump() -> str | None:
  """Triton's bundled cuobjdump, or None."""
  try:
    import triton.backends.nvidia as nvidia
  except ImportError:
    return None
  path = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
  return path if os.access(path, os.X_OK) else None


def resources(cubin: bytes) -> dict[str, int]:
  """Per-thread resources of the cubin's (one) kernel: REG, STACK, SHARED,
  LOCAL, ... as `cuobjdump -res-usage` reports them ({} without it)."""
  tool = cuobjdump()
  if tool is None:
    return {}
  with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(cubin)
    f.flush()
    out = subprocess.run([tool, "-res-usage", f.name], capture_output=True,
                         text=True, check=False).stdout
  found = {}
  for line in out.splitlines():
    if "REG:" in line:
      found.update((k, int(v)) for k, v in re.findall(r"(\w+)(?:\[\d+\])?:(\d+)",
                                                      line))
  return found


# ------------------------------------------------------------- occupancy

SM90 = dict(registers=65536, shared=232448, max_blocks=32, max_warps=64)


def blocks_per_sm(registers: int | None, num_warps: int, shared: int,
                  limits: dict = SM90) -> int:
  """How many programs (CTAs) of this kernel fit on one SM at once: the
  tightest of the register file, shared memory and warp slots (registers
  are allocated per warp in units of 256)."""
  bounds = [limits["max_blocks"], limits["max_warps"] // max(num_warps, 1)]
  if registers:
    per_warp = -(-registers * 32 // 256) * 256
    bounds.append(limits["registers"] // (per_warp * num_warps))
  if shared:
    bounds.append(limits["shared"] // shared)
  return max(min(bounds), 0)
