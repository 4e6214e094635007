"""Undefined memory and JAX's Pallas options on the host backends: poison in
block padding, masked-off lanes and (with jax_pallas_poison_buffers) fresh
buffers; `pl.debug_check` with jax_pallas_enable_debug_checks; the options
taking effect when toggled between calls of the same kernel."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dsl.core.jax_internals import config as jax_config
from jax.experimental import checkify
from jax.experimental import pallas as jpl

import dsl as pl
from dsl import tpu as pltpu
from dsl import triton as plt
from dsl.core.errors import KernelCheckError, kernel_error_of
from dsl.core.poison import poison_value

HOST = ("interpret", "triton_interpret", "mosaic_interpret")
S = jax.ShapeDtypeStruct


def _as_f64(x):
  return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


# ------------------------------------------------------------ poison values

def test_poison_values():
  assert np.isnan(poison_value(jnp.float32))
  assert np.isnan(poison_value(jnp.bfloat16))
  assert poison_value(jnp.int32) == -2 ** 31 + 1
  assert poison_value(jnp.int8) == -127
  assert poison_value(jnp.uint8) == 255
  assert poison_value(jnp.uint32) == 2 ** 32 - 1
  assert poison_value(jnp.bool_) is True


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int16, jnp.int32, jnp.uint8,
                                   jnp.uint32])
@pytest.mark.parametrize("k", [1, 2, 4, 100])
def test_integer_poison_never_cancels_in_a_sum(dtype, k):
  """k poison elements added to a sum (wrapping in the dtype) change it:
  the dtype's minimum would not (two of them add up to 0)."""
  p = jnp.full((k,), poison_value(dtype), dtype)
  assert int(jnp.sum(p, dtype=dtype)) != 0


# ------------------------------------------------------------ block padding

def _copy_blocks(backend, dtype):
  """(8, 300) copied in (8, 256) blocks to an (8, 512) output: the output's
  columns 300.. show what the second block read past the input."""
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
  return pl.pallas_call(
      kernel, S((8, 512), dtype), grid=(2,),
      in_specs=[pl.BlockSpec((8, 256), lambda i: (0, i))],
      out_specs=pl.BlockSpec((8, 256), lambda i: (0, i)), backend=backend)


@pytest.mark.parametrize("backend", HOST)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_reads_past_the_array_see_poison_on_every_host_backend(backend,
                                                               dtype):
  x = (jnp.arange(8 * 300) % 1000).reshape(8, 300).astype(dtype)
  got = np.asarray(_copy_blocks(backend, dtype)(x))
  np.testing.assert_array_equal(got[:, :300], x)
  want = np.full((8, 212), poison_value(dtype), np.dtype(dtype))
  np.testing.assert_array_equal(got[:, 300:], want)


@pytest.mark.parametrize("backend", ["interpret", "triton_interpret"])
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.bool_,
                                   jnp.bfloat16])
def test_reads_past_the_array_see_poison_small_dtypes(backend, dtype):
  x = (jnp.arange(8 * 300) % 3).reshape(8, 300).astype(dtype)
  got = np.asarray(_copy_blocks(backend, dtype)(x))
  np.testing.assert_array_equal(_as_f64(got[:, :300]), _as_f64(x))
  want = np.full((8, 212), poison_value(dtype), np.dtype(dtype))
  np.testing.assert_array_equal(_as_f64(got[:, 300:]), _as_f64(want))


@pytest.mark.parametrize("backend", HOST)
def test_a_sum_over_padding_is_visibly_wrong(backend):
  """A kernel that wrongly sums a whole partial edge block: with zero
  padding (or INT_MIN, which cancels in pairs) it would pass on the CPU."""
  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.broadcast_to(jnp.sum(x_ref[...], axis=1, keepdims=True),
                                  o_ref.shape)
  x = jnp.ones((8, 300), jnp.int32)
  got = pl.pallas_call(
      kernel, S((8, 256), jnp.int32), grid=(2,),
      in_specs=[pl.BlockSpec((8, 256), lambda i: (0, i))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (0, i)), backend=backend)(x)
  np.testing.assert_array_equal(got[:, 0], 256)
  assert (np.asarray(got[:, 128]) != 44).all()       # 44 ones + 212 poison


@pytest.mark.parametrize("backend", ["interpret", "triton_interpret"])
def test_masked_off_lanes_without_other_read_poison(backend):
  def kernel(x_ref, o_ref):
    i = jnp.arange(8)
    o_ref[...] = plt.load(x_ref.at[pl.ds(0, 8)], mask=i < 5)
  x = jnp.arange(8, dtype=jnp.float32)
  got = np.asarray(pl.pallas_call(kernel, S((8,), jnp.float32),
                                  backend=backend)(x))
  np.testing.assert_array_equal(got[:5], np.arange(5))
  assert np.isnan(got[5:]).all()


@pytest.mark.parametrize("backend", HOST)
def test_partial_edge_block_written_and_read_back(backend):
  """The in-bounds part of a partial edge block keeps what the kernel
  wrote there when read back in the same step; writes past the array are
  dropped."""
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2
    o_ref[...] = o_ref[...] + 1
  x = jnp.arange(20 * 128, dtype=jnp.float32).reshape(20, 128)
  got = pl.pallas_call(
      kernel, S((20, 128), jnp.float32), grid=(3,),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), backend=backend)(x)
  np.testing.assert_array_equal(got, x * 2 + 1)


# ------------------------------------------------------------ poison buffers

def _fresh_buffers(backend):
  def kernel(o_ref, f_ref, i_ref, sem):
    def scoped(r):
      o_ref[:, 256:] = r[...]
    o_ref[:, :128] = f_ref[...]
    o_ref[:, 128:256] = i_ref[...].astype(jnp.float32)
    pl.run_scoped(scoped, pltpu.VMEM((8, 128), jnp.float32))
    pltpu.semaphore_signal(sem, 1)      # semaphores start at 0 whatever
    pltpu.semaphore_wait(sem, 1)
  return pl.pallas_call(
      kernel, S((8, 384), jnp.float32),
      scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32),
                      pltpu.VMEM((8, 128), jnp.int32),
                      pltpu.SemaphoreType.REGULAR], backend=backend)


@pytest.mark.parametrize("backend", ["interpret", "mosaic_interpret"])
def test_poison_buffers_option_toggles_between_calls(backend):
  """Scratch and run_scoped buffers start as poison with JAX's
  jax_pallas_poison_buffers on, zeros off; the same pallas_call follows the
  option at each call (it is part of the kernel's cache key)."""
  f = _fresh_buffers(backend)
  poisoned = [np.nan, np.float32(poison_value(jnp.int32)), np.nan]
  for on in (False, True, False, True):
    with jax_config.jax_pallas_poison_buffers(on):
      got = np.asarray(f())
    np.testing.assert_array_equal(got[0, ::128],
                                  poisoned if on else [0.0, 0.0, 0.0])


def test_poison_buffers_on_triton_interpret():
  def kernel(o_ref, f_ref, i_ref):
    def scoped(r):
      o_ref[2] = r[...]
    o_ref[0] = f_ref[...]
    o_ref[1] = i_ref[...].astype(jnp.float32)
    pl.run_scoped(scoped, pltpu.VMEM((16,), jnp.float32))
  f = pl.pallas_call(kernel, S((3, 16), jnp.float32),
                     scratch_shapes=[pltpu.VMEM((16,), jnp.float32),
                                     pltpu.VMEM((16,), jnp.int32)],
                     backend="triton_interpret")
  for on in (False, True, False):
    with jax_config.jax_pallas_poison_buffers(on):
      got = np.asarray(f())
    want = [np.nan, np.float32(poison_value(jnp.int32)), np.nan] if on else 0
    np.testing.assert_array_equal(got[:, 0], np.broadcast_to(want, (3,)))


# ------------------------------------------------------------ debug checks

def _positive(x_ref, o_ref):
  pl.debug_check(jnp.all(x_ref[...] > 0), "x must be positive")
  o_ref[...] = x_ref[...] * 2


def _positive_checkify(x_ref, o_ref):
  checkify.check(jnp.all(x_ref[...] > 0), "x must be positive")
  o_ref[...] = x_ref[...] * 2


X = jnp.ones((8, 128), jnp.float32)


def _raises_check(f, x):
  with pytest.raises(Exception) as e:
    jax.block_until_ready(f(x))
  err = kernel_error_of(e.value)
  assert isinstance(err, KernelCheckError), e.value
  assert "x must be positive" in str(err)


@pytest.mark.parametrize("backend", HOST)
@pytest.mark.parametrize("jit", [False, True])
def test_debug_checks_option_checks_debug_check(backend, jit):
  """jax_pallas_enable_debug_checks: `pl.debug_check` is checked when on and
  ignored when off, as in Pallas; toggling it between calls of the same
  pallas_call takes effect."""
  f = pl.pallas_call(_positive, S(X.shape, X.dtype), backend=backend)
  call = lambda x: (jax.jit(f) if jit else f)(x)
  for on in (True, False, True):
    with jax_config.jax_pallas_enable_debug_checks(on):
      np.testing.assert_array_equal(call(X), 2 * X)
      if on:
        _raises_check(call, -X)
      else:
        np.testing.assert_array_equal(call(-X), -2 * X)


@pytest.mark.parametrize("backend", HOST)
def test_debug_checks_option_leaves_checkify_check_alone(backend):
  """`checkify.check` is a run-time check only with
  jax_pallas_enable_runtime_assert; that option checks `pl.debug_check`
  too."""
  f = pl.pallas_call(_positive_checkify, S(X.shape, X.dtype), backend=backend)
  with jax_config.jax_pallas_enable_debug_checks(True):
    np.testing.assert_array_equal(f(-X), -2 * X)
  with pl.config.enable_runtime_assert_option(True):
    _raises_check(f, -X)
    g = pl.pallas_call(_positive, S(X.shape, X.dtype), backend=backend)
    _raises_check(g, -X)


def test_pallas_debug_checks_agree():
  """Pallas's interpret mode ignores `pl.debug_check` when the option is
  off; so do we."""
  def kernel(x_ref, o_ref):
    jpl.debug_check(jnp.all(x_ref[...] > 0), "x must be positive")
    o_ref[...] = x_ref[...] * 2
  got = jpl.pallas_call(kernel, S(X.shape, X.dtype), interpret=True)(-X)
  ours = pl.pallas_call(_positive, S(X.shape, X.dtype))(-X)
  np.testing.assert_array_equal(got, ours)


@pytest.mark.parametrize("backend,kept", [("interpret", True),
                                          ("mosaic_interpret", True),
                                          ("triton_interpret", False)])
def test_written_padding_read_back_is_backend_defined(backend, kept):
  """A value written past the array and read back in the same step is
  undefined (docs/interpret.md): kept where the block is a buffer, poison
  on Triton, whose stores past the array are masked off."""
  def kernel(o_ref, s_ref):
    o_ref[...] = jnp.full(o_ref.shape, 7.0, o_ref.dtype)
    s_ref[...] = jnp.broadcast_to(jnp.sum(o_ref[...], axis=0, keepdims=True),
                                  s_ref.shape)
  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  o, s = pl.pallas_call(kernel, (S((20, 128), jnp.float32),
                                 S((24, 128), jnp.float32)), grid=(3,),
                        out_specs=[spec, spec], backend=backend)()
  np.testing.assert_array_equal(o, 7.0)
  np.testing.assert_array_equal(s[:16], 56.0)
  if kept:
    np.testing.assert_array_equal(s[16:], 56.0)
  else:
    assert np.isnan(s[16:]).all()


# ------------------------------------------------------------ reverse mode

def test_automatic_gradient_never_sees_the_poison():
  """Reverse mode without a custom_vjp over partial column blocks: the
  cotangent of a row scale sums over the block's columns, padding included;
  the padding counts as zeros, not poison (0 * NaN)."""
  def kernel(x_ref, m_ref, o_ref):
    o_ref[...] = jnp.exp(x_ref[...]) * m_ref[...][:, None]

  def f(x, m):
    return pl.pallas_call(
        kernel, S(x.shape, x.dtype), grid=(3,),
        in_specs=[pl.BlockSpec((8, 128), lambda j: (0, j)),
                  pl.BlockSpec((8,), lambda j: (0,))],
        out_specs=pl.BlockSpec((8, 128), lambda j: (0, j)))(x, m)

  x = jnp.linspace(-1, 1, 8 * 300, dtype=jnp.float32).reshape(8, 300)
  m = jnp.arange(1, 9, dtype=jnp.float32)
  loss = lambda f: (lambda x, m: jnp.sum(jnp.sin(f(x, m))))
  ref = lambda x, m: jnp.exp(x) * m[:, None]
  got = jax.grad(loss(f), argnums=(0, 1))(x, m)
  want = jax.grad(loss(ref), argnums=(0, 1))(x, m)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
