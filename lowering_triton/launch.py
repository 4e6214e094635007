"""Backend "triton": compile the generated source with `triton` and launch it
inside `jax.jit` through the Triton kernel-call custom call of jaxlib's GPU
plugin (the mechanism jax-triton wraps).

The lowering builds a `TritonKernelCall` (kernel image, grid, one parameter
per buffer: inputs, constants, outputs), serializes it into the custom
call's opaque attribute, and lets XLA pass the buffers. Compiled kernels are
cached by source, parameters and compute capability.
"""
from __future__ import annotations

import threading
import zlib

import jax
import numpy as np
from dsl.core.jax_internals import core, mlir

from dsl.core.errors import BackendError
from lowering_triton.compile import cache_key, compile_kernel
from lowering_triton.kernel import GeneratedKernel, generate

FFI_TARGET = "triton_kernel_call_ffi"
LEGACY_TARGET = "triton_kernel_call"
POINTER_ALIGNMENT = 16

_KERNELS: dict = {}
_LOCK = threading.Lock()


def _library(kernel: str, where: str):
  try:
    from dsl.core.jax_internals import gpu_triton as lib
  except ImportError:
    lib = None
  if lib is None or not hasattr(lib, "TritonKernelCall"):
    raise BackendError(
        kernel, "backend 'triton' needs jaxlib's GPU Triton support (the CUDA "
        "plugin, e.g. `pip install jax[cuda12]`), which is not installed; use "
        "backend='triton_interpret' to run the generated source on CPU",
        where)
  return lib


def compute_capability(lib) -> int:
  try:
    dev = jax.local_devices(backend="gpu")[0]
    cc = getattr(dev, "compute_capability", None)
    if cc:
      major, _, minor = str(cc).partition(".")
      return int(major) * 10 + int(minor or 0)
  except RuntimeError:
    pass
  return int(lib.get_compute_capability(0))


class ScratchUnsupported(BackendError):
  """This jaxlib's TritonKernel takes no global scratch buffer."""


def _triton_kernel(lib, gk: GeneratedKernel, compiled, arch: int):
  md = compiled.metadata
  name = md.name
  shared = int(md.shared)
  ptx = compiled.asm["ptx"]
  ttir = compiled.asm.get("ttir", "")
  scratch = int(getattr(md, "global_scratch_size", 0) or 0)
  scratch_align = int(getattr(md, "global_scratch_align", 1) or 1)
  if int(getattr(md, "profile_scratch_size", 0) or 0):
    raise BackendError(gk.name, "the compiled kernel needs a profiling scratch "
                       "buffer, which the kernel-call custom call cannot "
                       "provide", gk.where)
  # jaxlib's constructor changed across versions; try the known forms.
  attempts = []
  if scratch:
    attempts.append((name, gk.num_warps, gk.num_ctas, shared, ptx, ttir, arch,
                     scratch, scratch_align))
  else:
    attempts.append((name, gk.num_warps, gk.num_ctas, shared, ptx, ttir, arch))
    attempts.append((name, gk.num_warps, shared, ptx, ttir, arch, 1, 1, 1))
  errors = []
  for args in attempts:
    try:
      return lib.TritonKernel(*args)
    except TypeError as e:
      errors.append(str(e))
  error = ScratchUnsupported if scratch else BackendError
  raise error(gk.name, "this jaxlib's TritonKernel does not accept the "
              "compiled kernel" + (" (it needs a global scratch buffer)"
                                   if scratch else "") + ": "
              + "; ".join(errors), gk.where)


def kernel_for(lib, gk: GeneratedKernel, arch: int):
  """The jaxlib TritonKernel for `gk` on `arch` (compiled once)."""
  key = cache_key(gk, arch)
  with _LOCK:
    hit = _KERNELS.get(key)
  if hit is not None:
    return hit
  compiled = compile_kernel(gk, arch)
  kernel = _triton_kernel(lib, gk, compiled, arch)
  with _LOCK:
    _KERNELS[key] = kernel
  return kernel


def _custom_call_target(lib) -> str:
  plugin = getattr(lib, "_cuda_triton", None)
  registrations = getattr(plugin, "registrations", None)
  if registrations is not None:
    try:
      if FFI_TARGET not in registrations():
        return LEGACY_TARGET
    except Exception:
      pass
  return FFI_TARGET


def kernel_call_proto(lib, gk: GeneratedKernel, kernel) -> bytes:
  # No buffer is zeroed first: output memory a kernel never writes holds
  # whatever it held (poison on the host backends).
  params = [lib.create_array_parameter(0, POINTER_ALIGNMENT)
            for _ in gk.params]
  call = lib.TritonKernelCall(kernel, *gk.launch_grid, params)
  return zlib.compress(call.to_proto(gk.fn_name, b""))


def _lowering(ctx, *args, spec):
  platforms = tuple(getattr(ctx.module_context, "platforms", ()) or ())
  if platforms and not set(platforms) & {"cuda", "gpu"}:
    raise BackendError(
        spec.name, f"backend 'triton' runs on CUDA GPUs, but this kernel is "
        f"lowered for {', '.join(platforms)}; use backend='triton_interpret' "
        "to run the generated Triton source on CPU", spec.where)
  lib = _library(spec.name, spec.where)
  gk = generate(spec)
  arch = compute_capability(lib)
  try:
    kernel = kernel_for(lib, gk, arch)
  except ScratchUnsupported:
    # Tensor descriptors live in a global scratch buffer that only newer
    # jaxlibs allocate: load through pointers instead.
    gk = generate(spec, tensor_descriptors=False)
    kernel = kernel_for(lib, gk, arch)
  opaque = kernel_call_proto(lib, gk, kernel)
  consts = [mlir.ir_constant(np.asarray(c)) for c in gk.consts]
  avals_in = list(ctx.avals_in) + [core.ShapedArray(c.shape, c.dtype)
                                   for c in gk.consts]
  ctx = ctx.replace(avals_in=avals_in)
  aliases = dict(gk.aliases)
  target = _custom_call_target(lib)
  if target == FFI_TARGET:
    rule = jax.ffi.ffi_lowering(FFI_TARGET, api_version=4,
                                operand_output_aliases=aliases,
                                has_side_effect=gk.has_side_effects)
    return rule(ctx, *args, *consts, opaque=opaque)
  out_types = [mlir.aval_to_ir_type(a) for a in ctx.avals_out]
  layouts = lambda avals: [list(reversed(range(len(a.shape)))) for a in avals]
  return mlir.custom_call(
      LEGACY_TARGET, result_types=out_types, operands=[*args, *consts],
      backend_config=opaque, api_version=2,
      operand_layouts=layouts(avals_in), result_layouts=layouts(ctx.avals_out),
      operand_output_aliases=aliases,
      has_side_effect=gk.has_side_effects).results
