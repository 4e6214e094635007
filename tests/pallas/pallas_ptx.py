"""Pallas's own Triton lowering of a kernel, compiled for sm_90 on a CPU.

`jax.experimental.pallas` lowers a `pallas_call` for CUDA to Triton IR
(TTIR) inside a `__gpu$xla.gpu.triton` custom call; its lowering asks the
device for a compute capability, so the function is lowered under an
abstract mesh whose device is an H100. The TTIR is then compiled by the
`triton` package for sm_90 exactly as our generated source is, and the two
PTX outputs can be compared (tests only: dsl never imports Pallas).
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import warnings

import jax
from dsl.core.jax_internals import ir, mesh as mesh_lib
from tests.pallas.pallas_internals import triton_lowering as pallas_triton_lowering
import triton
from triton.backends.compiler import GPUTarget

H100 = mesh_lib.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3",
                               num_cores=132, platform="gpu")
CUSTOM_CALL = "__gpu$xla.gpu.triton"


@dataclasses.dataclass(frozen=True)
class PallasKernel:
  name: str
  num_warps: int
  num_stages: int
  ttir: str
  ptx: str
  cubin: bytes
  shared: int


def _custom_calls(op, out):
  for region in op.regions:
    for block in region.blocks:
      for inner in block.operations:
        if inner.operation.name == "stablehlo.custom_call" and str(
            inner.attributes["call_target_name"]).strip('"') == CUSTOM_CALL:
          out.append(inner)
        _custom_calls(inner.operation, out)
  return out


def _ttir(config) -> str:
  """The text of the TTIR module a custom call carries as bytecode."""
  code = ir.StringAttr(config["ir"]).value_bytes
  with pallas_triton_lowering._new_ir_context():
    return str(ir.Module.parse(code))


def compile_with_pallas(fn, *args, arch: int = 90) -> list[PallasKernel]:
  """The Triton kernels Pallas makes of `fn(*args)`, compiled for `arch`."""
  mesh = mesh_lib.AbstractMesh((1,), ("x",), abstract_device=H100)
  with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
    warnings.simplefilter("ignore")
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  out = []
  for call in _custom_calls(lowered.compiler_ir().operation, []):
    config = call.attributes["mhlo.backend_config"]
    num_warps = ir.IntegerAttr(config["num_warps"]).value
    num_stages = ir.IntegerAttr(config["num_stages"]).value
    text = _ttir(config)
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "kernel.ttir")
      with open(path, "w") as f:
        f.write(text)
      # FP fusion stated as ours compiles it (on by default), not left to
      # Triton's default, which Triton 3.10 turns off.
      compiled = triton.compile(
          path, target=GPUTarget("cuda", arch, 32),
          options=dict(num_warps=num_warps, num_stages=num_stages,
                       sanitize_overflow=False, enable_fp_fusion=True))
    out.append(PallasKernel(
        ir.StringAttr(config["name"]).value, num_warps, num_stages, text,
        compiled.asm["ptx"], compiled.asm["cubin"],
        int(compiled.metadata.shared)))
  return out
