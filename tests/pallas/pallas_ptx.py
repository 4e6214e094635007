"""Pallas's own Triton lowering of a kernel, compiled for sm_90 on a CPU.

`jax.experimental.pallas` lowers a `pallas_call` for CUDA to Triton IR
(TTIR) inside a `__gpu$xla.gpu.triton` custom call; its lowering asks the
device for a compute capability, so the function is lowered under an
abstract mesh whose device is an H100. The TTIR is then compiled by the
`triton` package for sm_90 exactly as our generated source is (first
Triton's front-end passes, `make_ttir`: canonicalization, the dot/add
combiner, CSE; XLA's Triton pipeline runs them on every Pallas kernel, and
`triton.compile` skips them for IR read from a file), and the two PTX
outputs can be compared (tests only: dsl never imports Pallas):
`worse_than(ours, theirs)` says where ours is worse, `figures` gives the
totals a table reports.
"""
from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import warnings

import jax
from dsl.core.jax_internals import ir, mesh as mesh_lib
from tests.pallas.pallas_internals import triton_lowering as pallas_triton_lowering
from lowering_triton.ptx_stats import blocks_per_sm, ptx_stats
import triton
from triton._C.libtriton import ir as triton_ir
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import IRSource, make_backend

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
  launch: tuple[int, int, int]    # programs along x, y, z


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


def front_end_passes(path: str, arch: int, options: dict) -> str:
  """The TTIR in file `path` after Triton's front-end passes (`make_ttir`),
  as a GPU run of Pallas compiles it: XLA's Triton pipeline starts with
  them, where `triton.compile` of a .ttir file starts after them."""
  target = GPUTarget("cuda", arch, 32)
  backend = make_backend(target)
  context = triton_ir.context()
  source = IRSource(path, context, backend)
  options = backend.parse_options(options)
  module = source.make_ir(target, options,
                          backend.get_codegen_implementation(options),
                          backend.get_module_map(), context)
  return str(backend.make_ttir(module, {}, options, arch))


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
      # FP fusion stated as ours compiles it (on by default), not left to
      # Triton's default, which Triton 3.10 turns off.
      options = dict(num_warps=num_warps, num_stages=num_stages,
                     sanitize_overflow=False, enable_fp_fusion=True)
      with open(path, "w") as f:
        f.write(text)
      text = front_end_passes(path, arch, options)
      with open(path, "w") as f:
        f.write(text)
      compiled = triton.compile(path, target=GPUTarget("cuda", arch, 32),
                                options=options)
    launch = tuple(ir.IntegerAttr(config[f"grid_{a}"]).value for a in "xyz")
    out.append(PallasKernel(
        ir.StringAttr(config["name"]).value, num_warps, num_stages, text,
        compiled.asm["ptx"], compiled.asm["cubin"],
        int(compiled.metadata.shared), launch))
  return out


def worse_than(ours, theirs) -> list[str]:
  """Where our kernel's PTX is worse than Pallas's (a KernelReport and a
  PallasKernel of the same source and config)."""
  stats = ptx_stats(theirs.ptx, theirs.cubin)
  their_hot = [lp.mix for lp in stats.hot_loops] or [stats.kernel]
  out = []
  if (ours.num_warps, ours.num_stages) != (theirs.num_warps,
                                           theirs.num_stages):
    out.append(f"launch config differs: ours w{ours.num_warps} "
               f"s{ours.num_stages}, Pallas's w{theirs.num_warps} "
               f"s{theirs.num_stages}")
  if math.prod(ours.launch) < math.prod(theirs.launch):
    out.append(f"fewer programs: ours launches {ours.launch}, Pallas's "
               f"{theirs.launch}")
  for k in ("wgmma", "cp_async", "cp_async_bulk"):
    if getattr(ours.kernel, k) < getattr(stats.kernel, k):
      out.append(f"{k}: ours {getattr(ours.kernel, k)}, Pallas's "
                 f"{getattr(stats.kernel, k)}")
  if ours.kernel.bar > stats.kernel.bar:
    out.append(f"barriers: ours {ours.kernel.bar}, Pallas's {stats.kernel.bar}")
  if len(ours.hot) != len(their_hot):
    out.append(f"{len(ours.hot)} hot loops, Pallas's {len(their_hot)}")
  for j, (a, b) in enumerate(zip(ours.hot, their_hot)):
    for k in ("selp", "st_shared", "ld_global", "ld_global_predicated",
              "ld_local", "st_local"):
      if getattr(a, k) > getattr(b, k):
        out.append(f"hot loop {j}: {k} ours {getattr(a, k)}, Pallas's "
                   f"{getattr(b, k)}")
  if ours.local_bytes and not stats.local_bytes:
    out.append(f"ours spills ({ours.local_bytes} bytes), Pallas's does not")
  theirs_occupancy = blocks_per_sm(stats.registers, theirs.num_warps,
                                   theirs.shared)
  if ours.occupancy < theirs_occupancy:
    out.append(f"programs per SM: ours {ours.occupancy} ({ours.registers} "
               f"registers, {ours.shared} B shared), Pallas's "
               f"{theirs_occupancy} ({stats.registers} registers, "
               f"{theirs.shared} B shared)")
  return out


def figures(ptx: str, cubin: bytes | None) -> dict:
  """What a table reports of one kernel's PTX: its lines, instructions,
  selects and registers, and the instructions of each hot loop."""
  stats = ptx_stats(ptx, cubin)
  return {"lines": len(ptx.splitlines()),
          "instructions": stats.kernel.instructions,
          "selp": stats.kernel.selp, "registers": stats.registers,
          "hot": ", ".join(str(lp.mix.instructions)
                           for lp in stats.hot_loops) or "-"}
