"""Hand-written Triton kernels: the natural GPU peer of add, matmul, softmax.

They are launched with `jax_triton.triton_call` when jax-triton is installed
(it is not a dependency of this project); otherwise the column says so. Only
imported on GPU machines.
"""
from __future__ import annotations

import functools


class PeerUnavailable(Exception):
  """The peer cannot run here; the message goes into its column."""


@functools.lru_cache(maxsize=None)
def _kernels():
  try:
    import jax_triton as jt
  except ImportError:
    raise PeerUnavailable("n/a: jax-triton not installed")
  import triton
  import triton.language as tl

  @triton.jit
  def add_kernel(x_ptr, y_ptr, n, o_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(o_ptr + offs, x + y, mask=mask)

  @triton.jit
  def matmul_kernel(a_ptr, b_ptr, M, N, K, c_ptr, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a = a_ptr + rm[:, None] * K + rk[None, :]
    b = b_ptr + rk[:, None] * N + rn[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
      a_blk = tl.load(a, mask=(rm[:, None] < M) & (rk[None, :] + k < K), other=0.)
      b_blk = tl.load(b, mask=(rk[:, None] + k < K) & (rn[None, :] < N), other=0.)
      acc += tl.dot(a_blk, b_blk)
      a += BK
      b += BK * N
    c = c_ptr + rm[:, None] * N + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))

  @triton.jit
  def softmax_kernel(x_ptr, n_cols, o_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * n_cols + offs, mask=mask,
                other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    y = e / tl.sum(e, axis=0)
    tl.store(o_ptr + row * n_cols + offs, y.to(o_ptr.dtype.element_ty),
             mask=mask)

  return jt, triton, add_kernel, matmul_kernel, softmax_kernel


def add(size, dtype, config):
  import jax
  jt, _, add_kernel, _, _ = _kernels()
  n, block = size[0], max(config.get("block", 1024), 128)

  def run(x, y):
    return jt.triton_call(x, y, n, kernel=add_kernel,
                          out_shape=jax.ShapeDtypeStruct((n,), dtype),
                          grid=(-(-n // block),), BLOCK=block,
                          num_warps=config.get("num_warps", 4))
  return run


def matmul(size, dtype, config):
  import jax
  jt, _, _, matmul_kernel, _ = _kernels()
  m, k, n = size
  bm, bn, bk = 64, 64, 32

  def run(x, y):
    return jt.triton_call(x, y, m, n, k, kernel=matmul_kernel,
                          out_shape=jax.ShapeDtypeStruct((m, n), dtype),
                          grid=(-(-m // bm), -(-n // bn)), BM=bm, BN=bn, BK=bk,
                          num_warps=4, num_stages=3)
  return run


def softmax(size, dtype, config):
  import jax
  jt, triton, _, _, softmax_kernel = _kernels()
  rows, cols = size
  block = triton.next_power_of_2(cols)

  def run(x):
    return jt.triton_call(x, cols, kernel=softmax_kernel,
                          out_shape=jax.ShapeDtypeStruct((rows, cols), dtype),
                          grid=(rows,), BLOCK=block,
                          num_warps=4 if block <= 2048 else 8)
  return run
