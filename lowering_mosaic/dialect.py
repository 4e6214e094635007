"""MLIR context, types and attributes for Mosaic modules.

Everything that spells a type or an attribute of the Mosaic `tpu` dialect
lives here, so the lowering rules and the interpreter agree on them.
"""
from __future__ import annotations

import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from dsl.core.jax_internals import ir, mlir as jax_mlir, tpu

from dsl.core.kernel_layout import KernelLayout
from dsl.core.memory import MemorySpace
from dsl.core.semaphores import SemaphoreSpace

# MLIR's dynamic size (`ShapedType::kDynamic`): an `iteration_bounds` entry
# of a grid dim whose size the custom call passes as a leading operand.
DYNAMIC_SIZE = -(1 << 63)

# Memory-space attribute names of the tpu dialect.
VMEM, SMEM, ANY, HBM, SEMAPHORE_MEM = "vmem", "smem", "any", "hbm", "semaphore_mem"


def make_context() -> ir.Context:
  """A fresh MLIR context with the upstream and `tpu` dialects loaded."""
  ctx = jax_mlir.make_ir_context()
  tpu.register_dialect(ctx)
  return ctx


def space_name(memory_space, default: str = VMEM) -> str:
  """The tpu memory space of a dsl memory space (None -> `default`)."""
  if isinstance(memory_space, SemaphoreSpace):
    return SEMAPHORE_MEM
  if memory_space is None:
    return default
  if isinstance(memory_space, MemorySpace):
    return {MemorySpace.ANY: ANY, MemorySpace.VMEM: VMEM,
            MemorySpace.SMEM: SMEM, MemorySpace.HBM: HBM,
            MemorySpace.SEMAPHORE: SEMAPHORE_MEM,
            MemorySpace.GLOBAL: ANY}[memory_space]
  return str(memory_space)


def block_space(bm) -> str:
  """Where a blocked operand lives in the kernel: ANY for a whole array left
  in HBM (`memory_space=ANY`), else its memory space (VMEM by default)."""
  if bm.whole_array and space_name(bm.memory_space) == ANY:
    return ANY
  return space_name(bm.memory_space, VMEM)


def memory_space_attr(name: str) -> ir.Attribute:
  return ir.Attribute.parse(f"#tpu.memory_space<{name}>")


def element_type(dtype) -> ir.Type:
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32:
    return ir.F32Type.get()
  if dtype == jnp.bfloat16:
    return ir.BF16Type.get()
  if dtype == jnp.float16:
    return ir.F16Type.get()
  if dtype == jnp.bool_:
    return ir.IntegerType.get_signless(1)
  if jnp.issubdtype(dtype, jnp.integer):
    return ir.IntegerType.get_signless(dtype.itemsize * 8)
  raise NotImplementedError(f"Mosaic has no type for {dtype}")


def value_type(shape, dtype) -> ir.Type:
  """Scalars for shape (), vectors otherwise."""
  elt = element_type(dtype)
  if tuple(shape) == ():
    return elt
  return ir.VectorType.get(list(shape), elt)


def semaphore_type(kind: str) -> ir.Type:
  return ir.Type.parse("!tpu.dma_semaphore" if kind == "dma"
                       else "!tpu.semaphore")


def memref_type(shape, dtype, space: str) -> ir.MemRefType:
  """Booleans live in memory as i32 (as Pallas: the custom call passes
  them as int32; loads compare with 0, stores extend)."""
  dtype = jnp.int32 if jnp.dtype(dtype) == jnp.bool_ else dtype
  return ir.MemRefType.get(list(shape), element_type(dtype),
                           memory_space=memory_space_attr(space))


def semaphore_memref_type(shape, kind: str) -> ir.MemRefType:
  return ir.MemRefType.get(list(shape), semaphore_type(kind),
                           memory_space=memory_space_attr(SEMAPHORE_MEM))


def ref_memref_type(aval, default_space: str = VMEM) -> ir.MemRefType:
  """The memref type of a ref aval (semaphores included)."""
  ms = getattr(aval, "memory_space", None)
  inner = aval.inner_aval
  if isinstance(ms, SemaphoreSpace):
    return semaphore_memref_type(inner.shape, ms.kind)
  return memref_type(inner.shape, inner.dtype, space_name(ms, default_space))


def i32() -> ir.Type:
  return ir.IntegerType.get_signless(32)


def index_type() -> ir.Type:
  return ir.IndexType.get()


# ------------------------------------------------------------ reading types

_ELT = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16,
        "i1": np.bool_, "i8": np.int8, "i16": np.int16, "i32": np.int32,
        "i64": np.int64, "index": np.int64}


def numpy_dtype(t: ir.Type):
  """The numpy dtype of an MLIR element type."""
  return np.dtype(_ELT[str(t)])


def memref_space(t) -> str:
  """'vmem', 'smem', 'any', 'semaphore_mem', ... of a memref type."""
  ms = ir.MemRefType(t).memory_space
  if ms is None:
    return ANY
  m = re.match(r"#tpu\.memory_space<(\w+)>", str(ms))
  return m.group(1) if m else str(ms)


def semaphore_kind_of(t) -> str | None:
  """'dma' / 'regular' for semaphore memrefs, else None."""
  s = str(ir.MemRefType(t).element_type)
  if s == "!tpu.dma_semaphore":
    return "dma"
  if s == "!tpu.semaphore":
    return "regular"
  return None


_LOC = re.compile(r'"(?P<file>[^"]+)":(?P<line>\d+):\d+')


def location_line(loc) -> str | None:
  """'file:line' of an MLIR location: its first file location (in a
  callsite chain, the innermost frame)."""
  m = _LOC.search(str(loc))
  if not m:
    return None
  return f"{m.group('file')}:{m.group('line')}"


def entry_layout(attrs, num_refs: int) -> KernelLayout:
  """Where a TPU kernel's `num_refs` refs (its entry's arguments after the
  grid ids) sit, read from the entry's attributes `attrs`: groups
  `prefetch`, `inputs`, `outputs`, `scratch`. Without `dsl.num_inputs` (a
  module lowered elsewhere) every operand but the last is an input."""
  def count(name):
    return int(ir.IntegerAttr(attrs[name]).value) if name in attrs else 0
  n_pf, n_sc = count("scalar_prefetch"), count("scratch_operands")
  n_ops = num_refs - n_pf - n_sc
  n_in = (count("dsl.num_inputs") if "dsl.num_inputs" in attrs
          else max(n_ops - 1, 0))
  return KernelLayout.of(prefetch=n_pf, inputs=n_in, outputs=n_ops - n_in,
                         scratch=n_sc)
