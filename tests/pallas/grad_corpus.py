"""The grad corpus: kernels whose derived kernels (jvp, reverse mode,
batched) every backend must build and run. Each case is a function of the
backend giving (function, jnp reference, inputs): the forward kernels of
`kernels/` called without their hand-written backward passes, and the
patterns derived kernels must carry (scratch accumulators with a `pl.when`
init, row loops, `cond`, aliases, scalar prefetch). Shapes are the smallest
TPU-legal ones (8 x 128 float32 tiles) so that `mosaic_interpret` runs every
case the others run. test_grad_corpus.py checks them on the CPU backends,
test_mosaic_gpu_grad.py builds them for Mosaic GPU."""
import functools
import importlib

import jax
import jax.numpy as jnp
from jax import lax

import dsl as pl
from dsl import tpu as pltpu
from tests.pallas.testing import uniform_arrays as _data

# `kernels` exports functions under the names of its modules.
(fa, layer_norm, matmul, rms_norm, softmax, decode_attention,
 paged_attention) = (importlib.import_module(f"kernels.{m}") for m in (
     "flash_attention", "layer_norm", "matmul", "rms_norm", "softmax",
     "decode_attention", "paged_attention"))

# ------------------------------------------------- kernels/ forward kernels

def _softmax(backend):
  (x,) = _data((16, 128))
  f = functools.partial(softmax.softmax_2d, backend=backend)
  return f, softmax.reference, (x,)


def _softmax_two_pass(backend):
  """Running max and sum in revisited output blocks: a recording kernel."""
  (x,) = _data((8, 256))
  f = functools.partial(softmax.softmax_2d, backend=backend, block_rows=8,
                        block_cols=128)
  return f, softmax.reference, (x,)


def _layer_norm(backend):
  x, w, b = _data((16, 128), (128,), (128,))

  def want(x, w, b):
    mean = jnp.mean(x, axis=1)
    rstd = lax.rsqrt(jnp.var(x, axis=1) + 1e-5)
    return layer_norm.reference(x, w, b), mean, rstd
  f = functools.partial(layer_norm.forward, eps=1e-5, backend=backend)
  return f, want, (x, w, b)


def _rms_norm(backend):
  x, w = _data((16, 128), (128,))

  def want(x, w):
    rstd = lax.rsqrt(jnp.mean(x * x, axis=1) + 1e-6)
    return rms_norm.reference(x, w), rstd
  f = functools.partial(rms_norm.forward, eps=1e-6, backend=backend)
  return f, want, (x, w)


def _matmul(backend):
  a, b, bias = _data((16, 256), (256, 128), (128,))
  f = functools.partial(matmul.matmul_2d, activation="relu", backend=backend,
                        blocks=(8, 128, 128))
  return (lambda a, b, c: f(a, b, c),
          lambda a, b, c: matmul.reference(a, b, bias=c, activation="relu"),
          (a, b, bias))


def _flash_attention(backend):
  q, k, v = _data((1, 16, 1, 128), (1, 16, 1, 128), (1, 16, 1, 128))
  scale = 128 ** -0.5
  # The lse block's last dim is block_q: on a TPU a multiple of 128 or whole.
  block_q = 16 if backend.startswith("mosaic") else 8

  def f(q, k, v):
    return fa.forward(q, k, v, causal=True, sm_scale=scale, backend=backend,
                      block_q=block_q, block_k=8)[0]
  return f, lambda q, k, v: fa.reference(q, k, v, causal=True), (q, k, v)


_LENGTHS = jnp.array([5, 16], jnp.int32)


def _decode_attention(backend):
  q, kc, vc = _data((2, 8, 128), (2, 16, 1, 128), (2, 16, 1, 128))

  def f(q, kc, vc):
    return decode_attention.decode_attention(q, kc, vc, _LENGTHS,
                                             backend=backend, block_k=8)

  def want(q, kc, vc):
    return decode_attention.reference(q, kc, vc, _LENGTHS)
  return f, want, (q, kc, vc)


def _paged_attention(backend):
  q, kp, vp = _data((2, 8, 128), (1, 4, 8, 128), (1, 4, 8, 128))
  pages = jnp.array([[2, 0], [1, 3]], jnp.int32)

  def f(q, kp, vp):
    return paged_attention.paged_attention(q, kp, vp, _LENGTHS, pages,
                                           backend=backend)

  def want(q, kp, vp):
    return paged_attention.reference(q, kp, vp, _LENGTHS, pages)
  return f, want, (q, kp, vp)


# ------------------------------------------------------------ patterns

def acc_kernel(x_ref, y_ref, o_ref, acc_ref):
  """tanh(x @ y) over an (i, j, k) grid, accumulated in a float32 scratch
  (the Mosaic GPU grad tests run it in bfloat16 too)."""
  @pl.when(pl.program_id(2) == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)
  acc_ref[...] += jnp.dot(x_ref[...], y_ref[...],
                          preferred_element_type=jnp.float32)

  @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
  def _():
    o_ref[...] = jnp.tanh(acc_ref[...]).astype(o_ref.dtype)


def _scratch_accumulator(backend):
  x, y = _data((16, 256), (256, 128), lo=-0.2, hi=0.2)

  def f(x, y):
    return pl.pallas_call(
        acc_kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32),
        grid=(2, 1, 2), backend=backend,
        in_specs=[pl.BlockSpec((8, 128), lambda i, j, k: (i, k)),
                  pl.BlockSpec((128, 128), lambda i, j, k: (k, j))],
        out_specs=pl.BlockSpec((8, 128), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)])(x, y)
  return f, lambda x, y: jnp.tanh(x @ y), (x, y)


def _rows_kernel(x_ref, w_ref, o_ref):
  def body(i, carry):
    row = x_ref[pl.ds(i, 1), :]
    o_ref[pl.ds(i, 1), :] = jnp.sin(row) * w_ref[...] + carry
    return carry + jnp.sum(row * row)
  lax.fori_loop(0, x_ref.shape[0], body, jnp.float32(0))


def _rows_want(x, w):
  carry = jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(jnp.sum(x * x, 1))])
  return jnp.sin(x) * w + carry[:-1, None]


def _fori_loop_rows(backend):
  x, w = _data((8, 128), (1, 128))
  f = pl.pallas_call(_rows_kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                     backend=backend)
  return f, _rows_want, (x, w)


def _cond_kernel(x_ref, o_ref):
  x = x_ref[...]
  o_ref[...] = lax.cond(pl.program_id(0) % 2 == 0,
                        lambda v: jnp.sin(v) * v, lambda v: jnp.exp(v), x)


def _cond(backend):
  (x,) = _data((16, 128))

  def want(x):
    even = (jnp.arange(16) // 8 % 2 == 0)[:, None]
    return jnp.where(even, jnp.sin(x) * x, jnp.exp(x))
  f = pl.pallas_call(_cond_kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32),
                     grid=(2,), in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                     out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                     backend=backend)
  return f, want, (x,)


def _alias_kernel(x_ref, y_ref, o_ref):
  # The output's buffer is y's; its old values are read through y_ref (a
  # TPU never reads an output block in).
  o_ref[...] = y_ref[...] * jnp.cos(x_ref[...]) + y_ref[...]


def _input_output_aliases(backend):
  """Output 0 reuses input 1's buffer: y's cotangent comes through it."""
  x, y = _data((16, 128), (16, 128))
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  f = pl.pallas_call(_alias_kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32),
                     grid=(2,), in_specs=[spec, spec], out_specs=spec,
                     input_output_aliases={1: 0}, backend=backend)
  return f, lambda x, y: y * jnp.cos(x) + y, (x, y)


def _prefetch_kernel(idx_ref, x_ref, o_ref):
  o_ref[...] = jnp.sin(x_ref[...]) * (idx_ref[pl.program_id(0)] + 1)


_ORDER = jnp.array([1, 0], jnp.int32)


def _scalar_prefetch(backend):
  """Blocks read in the order of a prefetched table."""
  (x,) = _data((16, 128))

  def f(x):
    return pl.pallas_call(
        _prefetch_kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(2,),
            in_specs=[pl.BlockSpec((8, 128), lambda i, idx: (idx[i], 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i, idx: (i, 0))),
        backend=backend)(_ORDER, x)

  def want(x):
    blocks = x.reshape(2, 8, 128)[_ORDER]
    return (jnp.sin(blocks) * (_ORDER + 1)[:, None, None]).reshape(16, 128)
  return f, want, (x,)


def _max_pool_kernel(x_ref, o_ref):
  """2x2 max pooling: rows read with stride 2, column pairs maxed."""
  n = o_ref.shape[0]
  rows = jnp.maximum(x_ref[pl.ds(0, n, stride=2), :],
                     x_ref[pl.ds(1, n, stride=2), :])
  o_ref[...] = rows * jnp.tanh(rows)


def _strided_read(backend):
  """Strided ref reads: their transpose is a strided write (an interior
  pad of the discharged per-point function)."""
  (x,) = _data((32, 128))
  f = pl.pallas_call(
      _max_pool_kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32),
      grid=(2,), in_specs=[pl.BlockSpec((16, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), backend=backend)

  def want(x):
    rows = jnp.maximum(x[0::2], x[1::2])
    return rows * jnp.tanh(rows)
  return f, want, (x,)


def _dilated_kernel(x_ref, w_ref, o_ref):
  """A 3-tap window with dilation 2 along rows: o[i] = sum_k w[k] x[i + 2k],
  each tap a strided read, and a strided write of the even output rows."""
  n = o_ref.shape[0]
  acc = jnp.zeros((n, 128), jnp.float32)
  for k in range(3):
    acc = acc + w_ref[pl.ds(k, 1), :] * jnp.sin(x_ref[pl.ds(2 * k, n), :])
  o_ref[...] = acc
  o_ref[pl.ds(0, n // 2, stride=2), :] = acc[0::2] * acc[0::2]


def _dilated_window(backend):
  x, w = _data((12, 128), (8, 128))

  def want(x, w):
    acc = sum(w[k] * jnp.sin(x[2 * k:2 * k + 8]) for k in range(3))
    return acc.at[0::2].set(acc[0::2] ** 2)
  f = pl.pallas_call(_dilated_kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                     backend=backend)
  return f, want, (x, w)


def _cumulative_kernel(x_ref, o_ref, m_ref):
  x = x_ref[...]
  o_ref[...] = jnp.cumsum(jnp.sin(x), axis=0)
  m_ref[...] = lax.cummax(x, axis=0) * x


def _cumulative(backend):
  """cumsum and cummax along rows (their derivatives interleave strided
  slices and interior pads of values)."""
  (x,) = _data((8, 128))
  out = jax.ShapeDtypeStruct((8, 128), jnp.float32)
  f = pl.pallas_call(_cumulative_kernel, (out, out), backend=backend)
  return f, lambda x: (jnp.cumsum(jnp.sin(x), 0), lax.cummax(x, 0) * x), (x,)


def _prefetch_when_kernel(n_ref, x_ref, o_ref):
  o_ref[...] = jnp.zeros_like(o_ref)

  @pl.when(n_ref[pl.program_id(0)] > 0)
  def _():
    o_ref[...] = jnp.sin(x_ref[...]) * n_ref[pl.program_id(0)]


_COUNTS = jnp.array([2, 0], jnp.int32)


def _prefetch_when(backend):
  """A scalar-prefetch ref read under `pl.when` (a `cond` whose branch reads
  a ref that the transposed kernel keeps as a ref)."""
  (x,) = _data((16, 128))

  def f(x):
    return pl.pallas_call(
        _prefetch_when_kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(2,),
            in_specs=[pl.BlockSpec((8, 128), lambda i, n: (i, 0))],
            out_specs=pl.BlockSpec((8, 128), lambda i, n: (i, 0))),
        backend=backend)(_COUNTS, x)

  def want(x):
    scale = jnp.repeat(_COUNTS, 8)[:, None].astype(jnp.float32)
    return jnp.sin(x) * scale
  return f, want, (x,)


def _when_state_kernel(step_ref, x_ref, o_ref, acc_ref):
  """A recurrence over the grid's steps in order, kept in scratch; the step
  count is SMEM state (a scalar-prefetch ref the kernel writes) that the
  `pl.when`s read. Every `pl.when` body reads and writes refs."""
  t = step_ref[0]

  @pl.when(t == 0)
  def _():
    acc_ref[...] = jnp.sin(x_ref[...])
    step_ref[0] = 1

  @pl.when(t > 0)
  def _():
    acc_ref[...] = acc_ref[...] * jnp.cos(x_ref[...]) + 0.5 * x_ref[...]
    step_ref[0] = step_ref[0] + 1

  @pl.when(pl.program_id(1) == 0)
  def _():
    o_ref[...] = acc_ref[...]

  @pl.when(pl.program_id(1) > 0)
  def _():
    o_ref[...] = o_ref[...] + jnp.tanh(acc_ref[...])


def _when_state(backend):
  """`pl.when` bodies that read and write output, scratch and
  scalar-prefetch refs (the reverse pass replays the SMEM state each step
  found)."""
  (x,) = _data((16, 256))

  def f(x):
    return pl.pallas_call(
        _when_state_kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(2, 2),
            in_specs=[pl.BlockSpec((8, 128), lambda i, k, s: (i, k))],
            out_specs=pl.BlockSpec((8, 128), lambda i, k, s: (i, 0)),
            scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary")),
        backend=backend)(jnp.zeros((1,), jnp.int32), x)

  def want(x):
    blocks = [x[i * 8:(i + 1) * 8, k * 128:(k + 1) * 128]
              for i in range(2) for k in range(2)]
    acc = [jnp.sin(blocks[0])]
    for b in blocks[1:]:
      acc.append(acc[-1] * jnp.cos(b) + 0.5 * b)
    return jnp.concatenate([acc[0] + jnp.tanh(acc[1]),
                            acc[2] + jnp.tanh(acc[3])])
  return f, want, (x,)


CASES = {
    "softmax": _softmax,
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
    "matmul": _matmul,
    "scratch_accumulator": _scratch_accumulator,
    "fori_loop_rows": _fori_loop_rows,
    "cond": _cond,
    "input_output_aliases": _input_output_aliases,
    "scalar_prefetch": _scalar_prefetch,
    "strided_read": _strided_read,
    "dilated_window": _dilated_window,
    "cumulative": _cumulative,
    "prefetch_when": _prefetch_when,
    "when_state": _when_state,
}
SLOW_CASES = {
    "softmax_two_pass": _softmax_two_pass,
    "flash_attention": _flash_attention,
    "decode_attention": _decode_attention,
    "paged_attention": _paged_attention,
}
