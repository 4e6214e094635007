"""Kernels as a newcomer writes them, each beside the plain-jnp version a
newcomer would compare against: a linear scan with its state in scratch
over a long sequential grid, a segment sum whose output block comes from
scalar prefetch, a depthwise 1-D convolution reading halos (`Element`
blocks), and RoPE."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from benchmarks.suite.base import KernelBench, random_inputs

DECAY = 0.9


class _Fixed(KernelBench):
  """A kernel with fixed blocks (nothing to tune) and 2-D sizes."""
  tunable = False
  dims_doc = "ROWSxCOLS"
  sizes = ((1024, 256),)

  def normalize(self, dims):
    self.check_dims(dims, (2,))
    return tuple(dims)

  def default_sizes(self, platform):
    return list(self.sizes)

  def quick_sizes(self, platform):
    return []   # not in --quick: name them with --kernels

  def tolerance(self, dtype):
    return 1e-4 if jnp.dtype(dtype).itemsize >= 4 else 5e-2


# ------------------------------------------------------------ linear scan

@functools.lru_cache(maxsize=None)
def scan_kernel(pl):
  def linear_scan(x_ref, o_ref, h_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      h_ref[...] = jnp.zeros_like(h_ref)
    h = DECAY * h_ref[...] + x_ref[...].astype(jnp.float32)
    h_ref[...] = h
    o_ref[...] = h.astype(o_ref.dtype)
  return linear_scan


def _tpu(pl):
  """`pl.tpu` (dsl) or `jax.experimental.pallas.tpu` (Pallas)."""
  tpu = getattr(pl, "tpu", None)
  if tpu is None:
    from jax.experimental.pallas import tpu
  return tpu


def _vmem(pl, shape):
  return _tpu(pl).VMEM(shape, jnp.float32)


class LinearScan(_Fixed):
  name = "linear_scan"
  summary = ("h[t] = 0.9 h[t-1] + x[t], state in scratch, one row per step "
             "(a long sequential grid: T steps)")
  dims_doc = "TxD"
  sizes = ((1024, 256),)

  def inputs(self, size, dtype):
    return random_inputs([size], dtype)

  def reference(self, x):
    def body(h, xt):
      h = DECAY * h + xt.astype(jnp.float32)
      return h, h.astype(x.dtype)
    return jax.lax.scan(body, jnp.zeros(x.shape[1:], jnp.float32), x)[1]

  def build(self, pl, size, dtype, config, **call_kw):
    t, d = size
    bd = min(d, 128)
    spec = pl.BlockSpec((1, bd), lambda j, i: (i, j))
    return pl.pallas_call(
        scan_kernel(pl), jax.ShapeDtypeStruct(size, dtype),
        grid=(d // bd, t), in_specs=[spec], out_specs=spec,
        scratch_shapes=[_vmem(pl, (1, bd))], name="bench_linear_scan",
        **call_kw)

  def grid_points(self, size, config):
    return size[0] * (size[1] // min(size[1], 128))

  def io_bytes(self, size, dtype):
    return 2.0 * size[0] * size[1] * jnp.dtype(dtype).itemsize


# ------------------------------------------------------------ segment sum

SEG_ROWS = 8          # rows per grid step, all in one segment


@functools.lru_cache(maxsize=None)
def segment_kernel(pl):
  def segment_sum(seg_ref, x_ref, o_ref):
    i = pl.program_id(0)
    fresh = (i == 0) | (seg_ref[i] != seg_ref[jnp.maximum(i - 1, 0)])

    @pl.when(fresh)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += jnp.sum(x_ref[...].astype(jnp.float32), axis=0,
                          keepdims=True).astype(o_ref.dtype)
  return segment_sum


class SegmentSum(_Fixed):
  name = "segment_sum"
  summary = ("sorted segment sum, segment of each 8-row block from scalar "
             "prefetch (a long sequential grid: ROWS/8 steps)")
  sizes = ((4096, 128),)    # 512 steps

  def segments(self, size):
    return size[0] // SEG_ROWS // 4

  def inputs(self, size, dtype):
    n_blocks = size[0] // SEG_ROWS
    # every segment non-empty (rows of an empty one are never written)
    seg = (jnp.arange(n_blocks, dtype=jnp.int32) * self.segments(size)
           // n_blocks)
    return (seg,) + random_inputs([size], dtype)

  def reference(self, seg, x):
    rows = jnp.repeat(seg, SEG_ROWS, total_repeat_length=x.shape[0])
    return jax.ops.segment_sum(x, rows, self.segments(x.shape))

  def build(self, pl, size, dtype, config, **call_kw):
    n, d = size
    return pl.pallas_call(
        segment_kernel(pl),
        jax.ShapeDtypeStruct((self.segments(size), d), dtype),
        grid_spec=_tpu(pl).PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(n // SEG_ROWS,),
            in_specs=[pl.BlockSpec((SEG_ROWS, d), lambda i, s: (i, 0))],
            out_specs=pl.BlockSpec((1, d), lambda i, s: (s[i], 0))),
        name="bench_segment_sum", **call_kw)

  def grid_points(self, size, config):
    return size[0] // SEG_ROWS

  def io_bytes(self, size, dtype):
    return float(size[0] + self.segments(size)) * size[1] * jnp.dtype(
        dtype).itemsize


# ------------------------------------------------------------ depthwise conv

TAPS = 7
HALO = TAPS // 2


@functools.lru_cache(maxsize=None)
def conv_kernel(pl, rows: int, length: int):
  def depthwise_conv(x_ref, w_ref, o_ref):
    start = pl.program_id(0) * rows - HALO     # row of x_ref[0] in x
    pos = start + jax.lax.broadcasted_iota(jnp.int32, x_ref.shape, 0)
    # the halo past either end of x is padding: zero it
    x = jnp.where((pos >= 0) & (pos < length), x_ref[...], 0)
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    for k in range(TAPS):
      acc += x[k:k + rows].astype(jnp.float32) * w_ref[k:k + 1, :]
    o_ref[...] = acc.astype(o_ref.dtype)
  return depthwise_conv


class DepthwiseConv(_Fixed):
  name = "depthwise_conv"
  summary = ("1-D depthwise conv, 7 taps, 'same' zero padding; each block "
             "reads a 3-row halo on both sides (Element blocks)")
  dims_doc = "LENGTHxCHANNELS"
  sizes = ((4096, 256),)
  rows = 256

  def inputs(self, size, dtype):
    return random_inputs([size, (TAPS, size[1])], dtype)

  def reference(self, x, w):
    xp = jnp.pad(x, ((HALO, HALO), (0, 0)))
    return sum(xp[k:k + x.shape[0]] * w[k] for k in range(TAPS))

  def build(self, pl, size, dtype, config, **call_kw):
    length, c = size
    rows = min(self.rows, length)
    bc = min(c, 128)
    x_spec = pl.BlockSpec((pl.Element(rows + 2 * HALO, (HALO, HALO)), bc),
                          lambda i, j: (i * rows, j))
    return pl.pallas_call(
        conv_kernel(pl, rows, length), jax.ShapeDtypeStruct(size, dtype),
        grid=(pl.cdiv(length, rows), c // bc),
        in_specs=[x_spec, pl.BlockSpec((TAPS, bc), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((rows, bc), lambda i, j: (i, j)),
        name="bench_depthwise_conv", **call_kw)

  def grid_points(self, size, config):
    return -(-size[0] // self.rows) * (size[1] // min(size[1], 128))

  def flops(self, size):
    return 2.0 * TAPS * size[0] * size[1]

  def io_bytes(self, size, dtype):
    return 2.0 * size[0] * size[1] * jnp.dtype(dtype).itemsize


# ------------------------------------------------------------ RoPE

@functools.lru_cache(maxsize=None)
def rope_kernel(pl):
  def rope(x_ref, cos_ref, sin_ref, o_ref):
    x = x_ref[...].astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x[:, :half], x[:, half:]
    c, s = cos_ref[...], sin_ref[...]
    o_ref[...] = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s],
                                 axis=-1).astype(o_ref.dtype)
  return rope


class Rope(_Fixed):
  name = "rope"
  summary = "rotary position embedding (rotate-half) of SEQxDIM, 256-row blocks"
  dims_doc = "SEQxDIM"
  sizes = ((4096, 128),)
  rows = 256

  def inputs(self, size, dtype):
    seq, d = size
    pos = jnp.arange(seq, dtype=jnp.float32)[:, None]
    freq = 10000.0 ** (-jnp.arange(d // 2, dtype=jnp.float32) / (d // 2))
    angle = pos * freq[None, :]
    return random_inputs([size], dtype) + (jnp.cos(angle), jnp.sin(angle))

  def reference(self, x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[:, :half], x[:, half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                           axis=-1).astype(x.dtype)

  def build(self, pl, size, dtype, config, **call_kw):
    seq, d = size
    rows = min(self.rows, seq)
    row = lambda i: (i, 0)
    return pl.pallas_call(
        rope_kernel(pl), jax.ShapeDtypeStruct(size, dtype),
        grid=(pl.cdiv(seq, rows),),
        in_specs=[pl.BlockSpec((rows, d), row),
                  pl.BlockSpec((rows, d // 2), row),
                  pl.BlockSpec((rows, d // 2), row)],
        out_specs=pl.BlockSpec((rows, d), row), name="bench_rope", **call_kw)

  def grid_points(self, size, config):
    return -(-size[0] // self.rows)

  def io_bytes(self, size, dtype):
    return 3.0 * size[0] * size[1] * jnp.dtype(dtype).itemsize


NEWCOMER = (LinearScan(), SegmentSum(), DepthwiseConv(), Rope())
