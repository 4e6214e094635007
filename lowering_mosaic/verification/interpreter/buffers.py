"""Buffers and memref views of the MLIR interpreter.

A `Buffer` is one allocation on one device (an HBM operand, a VMEM block
buffer, a scratch buffer, an SMEM array, a semaphore array). Buffers with
the same `key` on different devices are the same allocation of the SPMD
kernel: a remote DMA or remote signal names the local buffer and lands in
the peer's buffer of that key.

A `MemRef` is a rectangular window of a buffer: per buffer dim a start and a
size, and the buffer dims it shows (the others are squeezed away). Its
`box` is the window in buffer coordinates, which the race checker compares.
"""
from __future__ import annotations

import numpy as np
from dsl.core.jax_internals import ir

from dsl.core.poison import poison_value
from lowering_mosaic import dialect


class Buffer:
  __slots__ = ("name", "key", "array", "space", "device", "sem_kind",
               "block_index", "poison")

  def __init__(self, name, key, array, space, device, sem_kind=None):
    self.name = name          # for messages: "out_specs[0] block", ...
    self.key = key            # same allocation on every device
    self.array = array        # numpy array (semaphores: int64 counters)
    self.space = space        # "vmem", "smem", "any", "semaphore_mem", ...
    self.device = device
    self.block_index = None   # an operand's block buffer: the block it holds
    # the poison of the operand's dtype (the module's integers are
    # signless: an unsigned operand's poison has every bit set), in the
    # array's dtype; None: that of the array's dtype
    self.poison = None
    self.sem_kind = sem_kind  # "dma" / "regular" for semaphores

  def __repr__(self):
    return f"<{self.name} {self.space} dev{self.device} {self.array.shape}>"


class MemRef:
  __slots__ = ("buf", "base", "sizes", "dims")

  def __init__(self, buf: Buffer, base=None, sizes=None, dims=None):
    self.buf = buf
    shape = buf.array.shape
    self.base = tuple(base) if base is not None else (0,) * len(shape)
    self.sizes = tuple(sizes) if sizes is not None else tuple(shape)
    self.dims = tuple(dims) if dims is not None else tuple(range(len(shape)))

  @property
  def shape(self):
    return tuple(self.sizes[d] for d in self.dims)

  @property
  def box(self):
    """(starts, sizes) of the whole view in buffer coordinates."""
    return self.base, self.sizes

  def slice(self, starts, sizes) -> "MemRef":
    """A sub-window: `starts`/`sizes` per visible dim (tpu.memref_slice)."""
    base, full = list(self.base), list(self.sizes)
    for k, d in enumerate(self.dims):
      base[d] += int(starts[k])
      full[d] = int(sizes[k])
    return MemRef(self.buf, base, full, self.dims)

  def squeeze(self, keep_shape) -> "MemRef":
    """Drops unit visible dims so the view has `keep_shape`
    (tpu.memref_squeeze); leading unit dims go first."""
    keep_shape = tuple(keep_shape)
    out, j = [], 0
    dims = list(self.dims)
    for k, d in enumerate(dims):
      n = self.sizes[d]
      if n == 1 and len(dims) - k > len(keep_shape) - j:
        continue
      out.append(d)
      j += 1
    if tuple(self.sizes[d] for d in out) != keep_shape:
      raise ValueError(f"cannot squeeze {self.shape} to {keep_shape}")
    return MemRef(self.buf, self.base, self.sizes, out)

  def reshape(self, shape) -> "MemRef | None":
    """The view as a buffer of `shape` sharing its memory
    (tpu.memref_reshape), or None when the window is not contiguous in
    its buffer. The reshaped buffer is the same memory under another
    name: the race checker sees accesses through it as its own."""
    window = self.buf.array[self.whole_index()]
    try:
      array = np.reshape(window, tuple(shape), copy=False)
    except ValueError:                # the window is not contiguous
      return None
    buf = Buffer(f"{self.buf.name} reshaped to {tuple(shape)}",
                 (self.buf.key, "reshape", self.base, tuple(shape)), array,
                 self.buf.space, self.buf.device, self.buf.sem_kind)
    buf.poison = self.buf.poison
    return MemRef(buf)

  def access(self, idx, shape, strides=None):
    """(numpy index, box) of a `shape` access at visible indices `idx`.

    Raises IndexError when the access leaves the view.
    """
    idx = [int(i) for i in idx]
    strides = list(strides) if strides else [1] * len(idx)
    index, starts, sizes = [], list(self.base), [1] * len(self.base)
    vis = {d: k for k, d in enumerate(self.dims)}
    for d in range(len(self.base)):
      k = vis.get(d)
      if k is None:
        index.append(self.base[d])
        continue
      n, i, s = shape[k], idx[k], strides[k]
      extent = (n - 1) * s + 1 if n else 0
      if i < 0 or i + extent > self.sizes[d]:
        raise IndexError(
            f"access [{i}:{i + extent}] on dim {k} of a view of size "
            f"{self.sizes[d]}")
      start = self.base[d] + i
      index.append(slice(start, start + extent, s))
      starts[d] = start
      sizes[d] = extent
    return tuple(index), (tuple(starts), tuple(sizes))

  def access_padded(self, idx, shape, strides=None):
    """(numpy index, box, part) of a `shape` access that may run past the
    end of the buffer into the padding of its tiled VMEM allocation (see
    `padded_extent`): `index` selects the part inside the buffer, `part`
    where that part lies in the access (None when it is all of it).

    Raises IndexError when the access leaves the view otherwise.
    """
    try:
      index, box = self.access(idx, shape, strides)
      return index, box, None
    except IndexError:
      if self.buf.space != "vmem":
        raise
    idx = [int(i) for i in idx]
    strides = list(strides) if strides else [1] * len(idx)
    clipped, part = list(shape), []
    vis = {d: k for k, d in enumerate(self.dims)}
    for d in range(len(self.base)):
      k = vis.get(d)
      if k is None:
        continue
      n, i, s = shape[k], idx[k], strides[k]
      extent = (n - 1) * s + 1 if n else 0
      ends_buffer = self.base[d] + self.sizes[d] == self.buf.array.shape[d]
      if i + extent > self.sizes[d] and ends_buffer and i >= 0 and \
          self.base[d] + i + extent <= padded_extent(self.buf, d):
        clipped[k] = max(0, -(-(self.sizes[d] - i) // s))
      part.append(slice(0, clipped[k]))
    index, box = self.access(idx, clipped, strides)   # IndexError if still out
    return index, box, tuple(part)

  def access_clipped(self, idx, shape, strides=None):
    """(numpy index, box, part) of the lanes of an access that lie inside
    the view (`part`: where they lie in the access), or None when none
    does: a window placed at run time reads poison and writes nothing
    outside its ref."""
    idx = [int(i) for i in idx]
    strides = list(strides) if strides else [1] * len(idx)
    starts, counts, part = [], [], []
    for k, d in enumerate(self.dims):
      n, i, s = shape[k], idx[k], strides[k]
      first = max(0, -(-(-i) // s)) if i < 0 else 0
      stop = min(n, max(0, -(-(self.sizes[d] - i) // s)))
      if stop <= first:
        return None
      starts.append(i + first * s)
      counts.append(stop - first)
      part.append(slice(first, stop))
    index, box = self.access(starts, counts, strides)
    return index, box, tuple(part)

  def whole_index(self):
    index = []
    vis = set(self.dims)
    for d, (b, n) in enumerate(zip(self.base, self.sizes)):
      index.append(slice(b, b + n) if d in vis else b)
    return tuple(index)

  def read(self) -> np.ndarray:
    return self.buf.array[self.whole_index()]

  def write(self, value):
    self.buf.array[self.whole_index()] = value

  def __repr__(self):
    return f"<view of {self.buf.name} at {self.base} size {self.shape}>"


def padded_extent(buf: Buffer, d: int) -> int:
  """Elements of buffer dim `d` in its VMEM allocation, which holds whole
  (8 * packing, 128) tiles: the minor dim rounds up to 128 lanes, the
  second-minor to 8 sublanes of 32-bit words. Past the buffer's end a
  kernel reads padding (the interpreter shows poison) and a masked store
  may leave it untouched; beyond the padding nothing is allocated."""
  shape = buf.array.shape
  n = shape[d]
  if d == len(shape) - 1:
    return -(-n // 128) * 128
  if d == len(shape) - 2:
    rows = 8 * max(1, 4 // buf.array.dtype.itemsize)
    return -(-n // rows) * rows
  return n


def boxes_overlap(a, b) -> bool:
  (sa, na), (sb, nb) = a, b
  for x, n, y, m in zip(sa, na, sb, nb):
    if x + n <= y or y + m <= x:
      return False
  return True


def describe_box(buf: Buffer, box) -> str:
  starts, sizes = box
  parts = [f"{s}:{s + n}" for s, n in zip(starts, sizes)]
  return f"{buf.name}[{', '.join(parts)}]"


def poison_of(buf: Buffer):
  """What memory nobody defined holds in `buf` (see dsl/core/poison.py)."""
  if buf.poison is not None:
    return buf.poison
  return np.array(poison_value(buf.array.dtype)).astype(buf.array.dtype)


def poison_of_dtype(dtype, array_dtype):
  """The poison of `dtype` (an operand's own dtype, or None) in
  `array_dtype` (the buffer's signless one)."""
  if dtype is None:
    return None
  return np.array(poison_value(dtype)).astype(array_dtype)


def fresh_array(t, poison: bool = False) -> np.ndarray:
  """A new buffer of memref type `t`: zeros (semaphores always), or poison."""
  mt = ir.MemRefType(t)
  if dialect.semaphore_kind_of(t):
    return np.zeros(tuple(mt.shape), np.int64)
  dtype = dialect.numpy_dtype(mt.element_type)
  if poison:
    return np.full(tuple(mt.shape), poison_value(dtype), dtype)
  return np.zeros(tuple(mt.shape), dtype)
