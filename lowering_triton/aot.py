"""Ahead-of-time use without a GPU: the kernels a function calls, their
source, and their compilation for a CUDA architecture."""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from dsl.core.inspection import as_lowered, traced_kernels
from lowering_triton.compile import compile_kernel
from lowering_triton.kernel import generate
from lowering_triton.ptx_stats import PtxStats, ptx_stats


@dataclasses.dataclass(frozen=True)
class AotKernel:
  """One kernel compiled ahead of time."""
  name: str            # the kernel's name
  fn_name: str         # the function in `source`
  target: str          # e.g. "sm_90"
  cubin: bytes
  ptx: str
  shared: int          # bytes of shared memory
  num_warps: int
  num_stages: int
  source: str
  launch: tuple[int, int, int] = (1, 1, 1)   # programs along x, y, z
  asm: dict = dataclasses.field(repr=False, default_factory=dict)
  metadata: Any = dataclasses.field(repr=False, default=None)
  spec: Any = dataclasses.field(repr=False, default=None)   # its KernelSpec

  def stats(self) -> PtxStats:
    """What the PTX says about speed: hot-loop instruction mixes, registers,
    local memory (lowering_triton.ptx_stats)."""
    return ptx_stats(self.ptx, self.cubin)


def kernel_specs(f, *args, **kwargs) -> list:
  """The KernelSpecs of the pallas_calls `f(*args)` makes, in program order,
  as the Triton lowering receives them (normalized: the primitives JAX's
  transformations leave in derived kernels rewritten)."""
  return [as_lowered(spec, "triton", mesh_axes)
          for spec, mesh_axes in traced_kernels(f, *args, **kwargs)]


def to_source(f, *args, **kwargs) -> list[str]:
  """The generated Triton source of each pallas_call in `f(*args)`."""
  return [generate(spec).source
          for spec in kernel_specs(f, *args, **kwargs)]


def parse_target(target) -> int:
  """"sm_90", "sm_90a", "90", 90 or "9.0" -> 90."""
  if isinstance(target, int):
    return target
  m = re.fullmatch(r"(?:sm_?)?(\d+)\.?(\d)a?", str(target).strip().lower())
  if not m:
    raise ValueError(f"unknown CUDA target {target!r}; use e.g. 'sm_80' or "
                     "'sm_90'")
  return int(m.group(1)) * 10 + int(m.group(2))


def compile_aot(f, *args, target="sm_90", **kwargs) -> list[AotKernel]:
  """Compiles the kernels of `f(*args)` for a CUDA arch; no GPU needed."""
  arch = parse_target(target)
  result = []
  for spec in kernel_specs(f, *args, **kwargs):
    gk = generate(spec)
    compiled = compile_kernel(gk, arch)
    md = compiled.metadata
    result.append(AotKernel(
        name=gk.name, fn_name=gk.fn_name, target=f"sm_{arch}",
        cubin=compiled.asm["cubin"], ptx=compiled.asm["ptx"],
        shared=int(md.shared), num_warps=int(md.num_warps),
        num_stages=int(md.num_stages), source=gk.source,
        launch=tuple(gk.grid_plan.launch),
        asm=dict(compiled.asm), metadata=md, spec=spec))
  return result
