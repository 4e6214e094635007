"""TPU rules checked before a kernel is lowered to Mosaic.

1. Tiling: the last two dims of every VMEM block are divisible by the tile of
   its dtype, (8, 128) for 32-bit, (16, 128) for 16-bit, (32, 128) for 8-bit
   types, or equal the array's dims. A squeezed (None) dim counts as 1 there,
   as in Pallas's lowering: it passes only where the array dim is 1. (Rank-1
   blocks need only the 128 rule.)
2. VMEM budget: double-buffered VMEM blocks plus VMEM scratch (each padded
   to whole tiles) fit in `vmem_limit_bytes` (default 16 MiB).
3. Scalars in SMEM: a 0-d operand or scratch cannot live in VMEM.
4. Output blocks: a block already written back is never visited again (the
   pipeline does not read output blocks from HBM;
   dsl/core/output_revisits.py), where the index maps can be evaluated at
   trace time.

A violation raises `KernelError` naming the operand, the rule, the numbers
and a block shape that would pass.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from dsl.core.jax_internals import core

from dsl.core import checks
from dsl.core.blockspec import squeezed
from dsl.core.errors import BackendError, KernelError
from dsl.core.output_revisits import check_output_revisits
from dsl.core.semaphores import SemaphoreSpace
from lowering_mosaic import dialect

DEFAULT_VMEM_LIMIT_BYTES = 16 * 1024 * 1024
LANES = 128


def sublane_tile(dtype) -> int:
  """Rows per tile: 8 for 32-bit types, 16 for 16-bit, 32 for 8-bit."""
  bits = jnp.dtype(dtype).itemsize * 8
  return {32: 8, 16: 16, 8: 32}.get(bits, 8)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _fit(block: int, array: int, tile: int) -> int:
  """The nearest dim >= block that passes: a tile multiple or the array dim."""
  up = _round_up(block, tile)
  return array if up >= array else up


def padded_bytes(shape, dtype) -> int:
  """Bytes a buffer of `shape` takes in VMEM, padded to whole tiles."""
  shape = list(shape)
  if len(shape) >= 1:
    shape[-1] = _round_up(shape[-1], LANES)
  if len(shape) >= 2:
    shape[-2] = _round_up(shape[-2], sublane_tile(dtype))
  return math.prod(shape) * jnp.dtype(dtype).itemsize


def _fmt(shape) -> str:
  return "(" + ", ".join("None" if d is squeezed else str(getattr(
      d, "block_size", d)) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _tiling_violation(bm):
  """(message, suggested block shape) or None."""
  if dialect.block_space(bm) != dialect.VMEM:
    return None
  arr = bm.array_aval.shape
  dtype = bm.array_aval.dtype
  rank = len(arr)
  if rank == 0:
    return None
  sizes = list(bm.block_sizes)
  tile = sublane_tile(dtype)
  bits = jnp.dtype(dtype).itemsize * 8
  problems, suggestion = [], list(bm.block_shape)
  last = rank - 1
  if bm.block_shape[last] is squeezed and arr[last] != 1:
    problems.append(f"the last dim is squeezed (size 1) but must be a "
                    f"multiple of {LANES} or the array dim {arr[last]}")
    suggestion[last] = min(LANES, arr[last])
  elif sizes[last] % LANES and sizes[last] != arr[last]:
    problems.append(f"last dim {sizes[last]} is neither a multiple of "
                    f"{LANES} nor the array dim {arr[last]}")
    suggestion[last] = _fit(sizes[last], arr[last], LANES)
  if rank >= 2:
    d = rank - 2
    if bm.block_shape[d] is squeezed and arr[d] != 1:
      # Pallas counts a squeezed dim as 1: in the last two dims it is a
      # partial tile, which the TPU's (8, 128) layout cannot window.
      problems.append(f"the second-minor dim is squeezed (size 1) but must "
                      f"be a multiple of {tile} or the array dim {arr[d]}; "
                      "lay the operand out so a squeezed dim comes before "
                      "the last two (e.g. (batch, heads, seq, dim))")
      suggestion[d] = min(tile, arr[d])
    elif bm.block_shape[d] is not squeezed and sizes[d] % tile and \
        sizes[d] != arr[d]:
      problems.append(f"second-minor dim {sizes[d]} is neither a multiple of "
                      f"{tile} ({bits}-bit {jnp.dtype(dtype).name} tiles are "
                      f"({tile}, {LANES})) nor the array dim {arr[d]}")
      suggestion[d] = _fit(sizes[d], arr[d], tile)
  if not problems:
    return None
  return "; ".join(problems), tuple(suggestion)


def _vmem_limit(spec) -> int:
  limit = getattr(spec.compiler_params, "vmem_limit_bytes", None)
  return int(limit) if limit else DEFAULT_VMEM_LIMIT_BYTES


def vmem_footprint(spec) -> list[tuple[str, int, str]]:
  """(operand, bytes, how) of every VMEM buffer the kernel needs."""
  gm = spec.grid_mapping
  items = []
  for bm in gm.block_mappings:
    if dialect.block_space(bm) != dialect.VMEM:
      continue
    b = padded_bytes(bm.block_sizes, bm.array_aval.dtype)
    items.append((bm.origin, 2 * b, f"2 x {b} (double-buffered block "
                  f"{tuple(bm.block_sizes)} {jnp.dtype(bm.array_aval.dtype).name})"))
  check_output_revisits(spec.name, gm, spec.where, skip=tuple(
      bm for bm in gm.block_mappings if dialect.block_space(bm) == dialect.ANY))
  for i, a in enumerate(gm.scratch_avals):
    ms = a.memory_space
    if isinstance(ms, SemaphoreSpace) or dialect.space_name(
        ms, dialect.VMEM) != dialect.VMEM:
      continue
    b = padded_bytes(a.inner_aval.shape, a.inner_aval.dtype)
    items.append((f"scratch_shapes[{i}]", b, f"{b} (scratch "
                  f"{tuple(a.inner_aval.shape)} {a.inner_aval.dtype.name})"))
  return items


def _halve(bm, sizes) -> bool:
  """Halves one dim of a block, keeping it legal; False if it cannot."""
  shape = bm.block_shape
  tile = sublane_tile(bm.array_aval.dtype)
  rank = len(sizes)
  lead = [d for d in range(max(rank - 2, 0)) if shape[d] is not squeezed
          and sizes[d] > 1]
  if lead:
    d = max(lead, key=lambda k: sizes[k])
    sizes[d] = max(1, sizes[d] // 2)
  elif rank >= 2 and shape[-2] is not squeezed and sizes[-2] > tile:
    sizes[-2] = max(tile, _round_up(sizes[-2] // 2, tile))
  elif sizes[-1] > LANES:
    sizes[-1] = max(LANES, _round_up(sizes[-1] // 2, LANES))
  else:
    return False
  return True


def _shrunk_blocks(spec, limit: int):
  """{origin: block shape} of smaller legal blocks that fit in `limit`,
  halving the largest block first; None if even the smallest do not fit."""
  gm = spec.grid_mapping
  blocked = [bm for bm in gm.block_mappings
             if dialect.block_space(bm) == dialect.VMEM]
  sizes = {bm.origin: list(bm.block_sizes) for bm in blocked}
  fixed = sum(b for o, b, _ in vmem_footprint(spec)
              if o.startswith("scratch"))
  stuck = set()
  for _ in range(256):
    use = {bm.origin: 2 * padded_bytes(sizes[bm.origin], bm.array_aval.dtype)
           for bm in blocked}
    if fixed + sum(use.values()) <= limit:
      changed = {bm.origin: tuple(None if bm.block_shape[d] is squeezed
                                  else sizes[bm.origin][d]
                                  for d in range(len(sizes[bm.origin])))
                 for bm in blocked
                 if list(bm.block_sizes) != sizes[bm.origin]}
      return changed or None
    cands = [bm for bm in blocked if bm.origin not in stuck]
    if not cands:
      return None
    bm = max(cands, key=lambda m: use[m.origin])
    if not _halve(bm, sizes[bm.origin]):
      stuck.add(bm.origin)
  return None


def _windowed_without_grid(gm):
  """The first blocked operand of a grid-free kernel whose block is not the
  whole array at index 0 (a grid-free Mosaic kernel has no windows)."""
  if gm.grid:
    return None
  return next((bm for bm in gm.block_mappings
               if dialect.block_space(bm) != dialect.ANY
               and not has_trivial_window(bm)), None)


def has_trivial_window(bm) -> bool:
  """The block is the whole array at block index 0 at every grid point."""
  outs = bm.index_map_jaxpr.jaxpr.outvars
  return (tuple(bm.block_sizes) == tuple(bm.array_aval.shape)
          and all(isinstance(v, core.Literal) and v.val == 0 for v in outs))


def _check_closed_over(spec, bm) -> None:
  """An index map that closes over an array cannot run on a TPU, whose
  index maps read only grid ids and scalar prefetch (SMEM)."""
  arrays = [np.shape(c) for c in bm.index_map_jaxpr.consts if np.ndim(c)]
  if arrays:
    raise BackendError(
        spec.name, f"{bm.origin}: the index map closes over an array (of "
        f"shape {arrays[0]}); a TPU's index maps read only the grid ids and "
        "scalar prefetch: pass the array as a scalar-prefetch operand "
        "(tpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, ...)), whose "
        "index maps take it after the grid ids (`lambda i, table: "
        "(table[i], 0)`), or run the kernel on backend='interpret'",
        checks.index_map_at(bm) or spec.where)


def check_tpu_rules(spec) -> None:
  """Raises KernelError for the first TPU rule `spec` breaks."""
  gm = spec.grid_mapping
  bm = _windowed_without_grid(gm)
  if bm is not None:
    raise KernelError(
        spec.name, f"a kernel without a grid sees whole operands on a TPU, "
        f"but block {_fmt(bm.block_shape)} of {bm.array_aval.str_short()} is "
        "a window of it; give the call grid=(1,) (or a block of the whole "
        "array at index 0)", spec.where, operand=bm.origin)
  for bm in gm.block_mappings:
    _check_closed_over(spec, bm)
    space = dialect.block_space(bm)
    if space == dialect.VMEM and len(bm.kernel_shape) == 0:
      raise KernelError(
          spec.name, "scalars must live in SMEM: the block is 0-d, and VMEM "
          "holds vectors; use BlockSpec(memory_space=tpu.SMEM) (or a block "
          "of shape (1,) ... padded to tiles)", spec.where, operand=bm.origin)
    v = _tiling_violation(bm)
    if v is not None:
      msg, suggestion = v
      raise KernelError(
          spec.name, f"TPU tiling rule: block {_fmt(bm.block_shape)} of "
          f"{bm.array_aval.str_short()}: {msg}. A block shape that passes: "
          f"{_fmt(suggestion)}", spec.where, operand=bm.origin)
  check_output_revisits(spec.name, gm, spec.where, skip=tuple(
      bm for bm in gm.block_mappings if dialect.block_space(bm) == dialect.ANY))
  for i, a in enumerate(gm.scratch_avals):
    ms = a.memory_space
    if isinstance(ms, SemaphoreSpace):
      continue
    if dialect.space_name(ms) == dialect.SEMAPHORE_MEM:
      raise KernelError(spec.name, "semaphores are made with "
                        "tpu.SemaphoreType.REGULAR / DMA (called with a shape "
                        "for arrays), not tpu.SEMAPHORE(shape, dtype)",
                        spec.where, operand=f"scratch_shapes[{i}]")
    if dialect.space_name(ms, dialect.VMEM) == dialect.VMEM and \
        a.inner_aval.shape == ():
      raise KernelError(spec.name, "scalars must live in SMEM: a 0-d scratch "
                        "buffer cannot be in VMEM; use tpu.SMEM((1,), dtype)",
                        spec.where, operand=f"scratch_shapes[{i}]")
  limit = _vmem_limit(spec)
  items = vmem_footprint(spec)
  total = sum(b for _, b, _ in items)
  if total > limit:
    uses = ", ".join(f"{o} {how}" for o, _, how in items)
    big = max(items, key=lambda t: t[1])
    hint = ""
    smaller = _shrunk_blocks(spec, limit)
    if smaller:
      hint = " Block shapes that pass: " + ", ".join(
          f"{o}: {_fmt(b)}" for o, b in smaller.items()) + "."
    raise KernelError(
        spec.name, f"TPU VMEM budget: the kernel needs {total} bytes "
        f"({total / 2**20:.2f} MiB) of VMEM but the limit is {limit} bytes "
        f"({limit / 2**20:.2f} MiB; raise it with tpu.CompilerParams("
        f"vmem_limit_bytes=...)). VMEM use: {uses}.{hint}", spec.where,
        operand=big[0])
