"""Tensor descriptors: loads of whole, aligned tiles inside loops through
Hopper's tensor memory accelerator (TMA).

A load inside a loop (a sequential grid dim, `fori_loop`, a counted `while`)
of a window that needs no mask becomes `x_desc.load([c0, c1, ...])` on a
descriptor of the operand's whole array, made once at the top of the
kernel with `tl.make_tensor_descriptor` (Triton 3.6's device-side
descriptors). On sm_90 Triton then copies each tile with one
`cp.async.bulk.tensor` instruction instead of a `cp.async` per thread and
vector (the 4096³ bf16 benchmark matmul's K loop: 106 -> 76 instructions
per iteration; the flash attention KV loop: 573 -> 528); before sm_90 it
rewrites descriptors back into pointers. The descriptors live in a global
scratch buffer of 128 bytes each per program, which jaxlib's Triton kernel
call allocates per launch (`TritonKernel(..., global_scratch_size,
global_scratch_align)`, jaxlib > 0.11.0; docs/triton.md).

A window qualifies when TMA can copy it and nothing about it needs a mask:

- no padded lanes, no partial edge block, no run-time coordinate the range
  analysis does not prove inside, no block placed by data;
- unit steps, the array's last dim visible (contiguous), two visible dims
  or more, at most 5 array dims, each box dim at most 256 elements;
- 16-byte alignment: the box's last dim, every array stride but the last,
  and the window's start on the last dim (a static offset, or one known to
  be a multiple: a block start, `i * bk`, `pl.multiple_of`);
- a dtype TMA copies (8-, 16- and 32-bit floats and integers).

`jax_pallas_triton_tensor_descriptors=False` turns them off; the GPU
lowering turns them off by itself for a jaxlib that cannot pass the global
scratch buffer.
"""
from __future__ import annotations

import math

import numpy as np
from jax import lax
from dsl.core.jax_internals import core, state_indexing as indexing

from dsl.core import primitives as dsl_primitives
from dsl.core.access import RefAccess
from dsl.core.operand_layout import eqn_ref_operands
from lowering_triton.kernel_refs import MemRef, has_padding_or_bounds
from lowering_triton.values import TVal

MAX_BOX = 256          # elements per box dim
MAX_RANK = 5
ALIGN = 16             # bytes
_DTYPES = {np.dtype(t) for t in ("float16", "float32", "int8", "int16",
                                 "int32", "uint8", "uint16", "uint32")}
UNKNOWN = 1            # what a multiple we know nothing about is a multiple of


def _tma_dtype(dtype: np.dtype) -> bool:
  return np.dtype(dtype) in _DTYPES or dtype.name in (
      "bfloat16", "float8_e4m3fn", "float8_e5m2")


# ------------------------------------------------------------ divisibility

def _literal_int(atom) -> int | None:
  if isinstance(atom, core.Literal):
    v = np.asarray(atom.val)
    if v.shape == () and np.issubdtype(v.dtype, np.integer):
      return int(v)
  return None


def known_multiple(jaxpr: core.Jaxpr, atom, producers: dict,
                   depth: int = 8) -> int:
  """A number `atom` (a scalar of `jaxpr`) is known to be a multiple of
  (0: it is 0), from the equations that compute it: literals, products,
  sums, `pl.multiple_of`, casts. Anything else: 1."""
  lit = _literal_int(atom)
  if lit is not None:
    return abs(lit)
  eqn = producers.get(atom)
  if eqn is None or depth == 0:
    return UNKNOWN
  of = lambda a: known_multiple(jaxpr, a, producers, depth - 1)
  p = eqn.primitive
  if p is lax.mul_p:
    return of(eqn.invars[0]) * of(eqn.invars[1])
  if p in (lax.add_p, lax.sub_p):
    return math.gcd(of(eqn.invars[0]), of(eqn.invars[1]))
  if p is dsl_primitives.multiple_of_p:
    return max(of(eqn.invars[0]), *(int(v) for v in eqn.params["values"]))
  if p is lax.convert_element_type_p:
    return of(eqn.invars[0])
  return UNKNOWN


def index_multiples(ctx) -> list[list[int]] | None:
  """Per ref transform of the current equation (a ref access), per index:
  a number the start is known to be a multiple of; None when the
  transforms are not indexers."""
  if ctx.jaxpr is None:
    return None
  try:
    transforms = eqn_ref_operands(ctx.eqn).transforms
  except ValueError:    # then nothing is known
    return None
  known = ctx.host.producers(ctx.jaxpr)
  out = []
  for t in transforms:
    if not isinstance(t, indexing.NDIndexer):
      return None
    row = []
    for w in RefAccess.of(t).dims:
      start = w.start
      row.append(1 if isinstance(start, int)
                 else known_multiple(ctx.jaxpr, start, known))
    out.append(row)
  return out


# ------------------------------------------------------------ eligibility

def _aligned(start, align: int, itemsize: int) -> bool:
  if isinstance(start, int):
    return (start * itemsize) % ALIGN == 0
  return (align * itemsize) % ALIGN == 0     # align 0: the start is 0


def box(view: MemRef) -> tuple[int, ...] | None:
  """The box (per array dim) TMA would copy `view` with, or None when the
  window does not qualify (see the module docstring)."""
  rank = len(view.array_shape)
  itemsize = np.dtype(view.dtype).itemsize
  if (not _tma_dtype(view.dtype) or view.wide or rank > MAX_RANK
      or len(view.axes) < 2 or has_padding_or_bounds(view)
      or any(a.step != 1 or a.lanes is not None for a in view.axes)):
    return None
  last = view.axes[-1]
  if last.dim != rank - 1 or view.strides[-1] != 1:
    return None
  if any((s * itemsize) % ALIGN for s in view.strides[:-1]):
    return None
  sizes = {a.dim: a.size for a in view.axes}
  shape = tuple(sizes.get(d, 1) for d in range(rank))
  if max(shape) > MAX_BOX or (shape[-1] * itemsize) % ALIGN:
    return None
  if not _aligned(last.start, last.align, itemsize):
    return None
  return shape


def load(ctx, view: MemRef, hint: str) -> TVal | None:
  """`view` loaded through a tensor descriptor, or None where a pointer
  load it stays: outside loops, with descriptors off, or a window that does
  not qualify."""
  lowering = ctx.host
  if not lowering.tensor_descriptors or not lowering.loop_depth:
    return None
  shape = box(view)
  if shape is None:
    return None
  key = (view.ptr, shape)
  if key not in lowering.descriptors:
    name = lowering.fresh(f"{view.base}_desc")
    lowering.descriptors[key] = (
        name, f"tl.make_tensor_descriptor({view.ptr}, "
        f"shape={list(view.array_shape)}, strides={list(view.strides)}, "
        f"block_shape={list(shape)})")
  name = lowering.descriptors[key][0]
  coords = {f.dim: f.start for f in view.fixed}
  coords.update({a.dim: a.start for a in view.axes})
  expr = f"{name}.load([{', '.join(str(coords[d]) for d in range(len(shape)))}])"
  if shape != view.shape:
    expr = f"tl.reshape({expr}, {tuple(view.shape)})"
  lowering.before_read(view.ptr)
  return ctx.bind(expr, view.shape, view.dtype, hint)
