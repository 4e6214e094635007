"""The mistakes a new user makes, each answered by a message that says what
is wrong, where (the user's line) and how to fix it."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl import tpu as pltpu
from tests.pallas.testing import CPU_BACKENDS

THIS_FILE = __file__
X = jnp.ones((16, 256), jnp.float32)
OUT = jax.ShapeDtypeStruct((16, 256), jnp.float32)
SPEC = pl.BlockSpec((8, 256), lambda i: (i, 0))


def add_one(x_ref, o_ref):
  o_ref[...] = x_ref[...] + 1


def _message(fn, exc=pl.KernelError):
  with pytest.raises(exc) as info:
    jax.block_until_ready(fn())
  msg = str(info.value)
  assert THIS_FILE in msg, msg            # the user's line
  return msg


def test_blockspec_in_the_older_argument_order():
  msg = _message(lambda: pl.pallas_call(
      add_one, OUT, grid=(2,),
      in_specs=[pl.BlockSpec(lambda i: (i, 0), (8, 256))],
      out_specs=SPEC)(X), pl.KernelTypeError)
  assert "in_specs[0]" in msg and "block shape first" in msg
  assert "pl.BlockSpec((8, 256), index_map)" in msg


def python_if(x_ref, o_ref):
  if x_ref[0, 0] > 0:
    o_ref[...] = x_ref[...]
  else:
    o_ref[...] = -x_ref[...]


def python_range(n_ref, o_ref):
  for i in range(n_ref[0]):
    o_ref[i] = jnp.zeros((256,), jnp.float32)


def test_python_control_flow_on_traced_values():
  msg = _message(lambda: pl.pallas_call(python_if, OUT)(X), TypeError)
  assert "pl.when" in msg and "lax.cond" in msg and "jnp.where" in msg
  assert "Attempted boolean conversion" in msg            # JAX's own words
  assert "errors.html#jax.errors.TracerBoolConversionError" in msg
  msg = _message(lambda: pl.pallas_call(
      python_range, OUT, in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)])(
          jnp.array([3], jnp.int32)), TypeError)
  assert "fori_loop" in msg


@pytest.mark.parametrize("kw", [{"out_shape": (16, 256)},
                                {"out_shape": [OUT, (16, 256)]}])
def test_a_shape_given_as_out_shape(kw):
  msg = _message(lambda: pl.pallas_call(add_one, **kw)(X), TypeError)
  assert "got the shape (16, 256) alone" in msg
  assert "jax.ShapeDtypeStruct((16, 256), dtype)" in msg
  assert "got 16" not in msg


def test_a_shape_given_as_scratch_shape():
  msg = _message(lambda: pl.pallas_call(
      add_one, OUT, scratch_shapes=[(16, 256)])(X), TypeError)
  assert "scratch_shapes[0]" in msg and "tpu.VMEM((16, 256)" in msg


def test_an_empty_input_names_the_zero_size_array():
  e = jnp.ones((0, 128), jnp.float32)
  msg = _message(lambda: pl.pallas_call(
      add_one, jax.ShapeDtypeStruct((0, 128), jnp.float32),
      grid=(pl.cdiv(0, 8),), in_specs=[pl.BlockSpec((8, 128),
                                                    lambda i: (i, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)))(e))
  assert "argument[0] has shape (0, 128)" in msg and "pl.cdiv(0, 8)" in msg
  assert "Skip the call for empty inputs" in msg


@pytest.mark.parametrize("value,fix", [
    (lambda v: v.sum(axis=0), "keepdims=True"),
    (lambda v: v.reshape(16, 128), ".reshape((8, 256))"),
    (lambda v: v[:4], "pl.ds(start, 4)"),
])
def test_a_store_of_the_wrong_shape_says_the_fix(value, fix):
  def kernel(x_ref, o_ref):
    o_ref[...] = value(x_ref[...])
  msg = _message(lambda: pl.pallas_call(kernel, OUT, grid=(2,),
                                        in_specs=[SPEC], out_specs=SPEC)(X))
  assert "window it is stored into has shape (8, 256)" in msg
  assert fix in msg


def test_a_narrow_dot_accumulates_in_32_bits_on_mosaic():
  def dot(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...])
  r = np.random.default_rng(0)
  for dtype in (jnp.int8, jnp.bfloat16):
    a = jnp.asarray(r.integers(-9, 9, (128, 128))).astype(dtype)
    b = jnp.asarray(r.integers(-9, 9, (128, 128))).astype(dtype)
    got = pl.pallas_call(dot, jax.ShapeDtypeStruct((128, 128), dtype),
                         backend="mosaic_interpret")(a, b)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(jnp.dot(a, b), np.float32))


def test_index_map_closing_over_an_array_on_mosaic():
  table = jnp.array([1, 0])
  msg = _message(lambda: pl.pallas_call(
      add_one, OUT, grid=(2,),
      in_specs=[pl.BlockSpec((8, 256), lambda i: (table[i], 0))],
      out_specs=SPEC, backend="mosaic_interpret")(X), pl.BackendError)
  assert "in_specs[0]: the index map closes over an array" in msg
  assert "PrefetchScalarGridSpec(num_scalar_prefetch=1" in msg


def negative(x_ref, o_ref):
  pl.debug_check(x_ref[0, 0] < 0, "x must be negative")
  o_ref[...] = x_ref[...]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_run_time_failures_under_jit_show_the_user_line_first(backend):
  jax.config.update("jax_pallas_enable_runtime_assert", True)
  try:
    f = jax.jit(pl.pallas_call(negative, OUT, backend=backend))
    with pytest.raises(Exception) as info:
      jax.block_until_ready(f(X))
  finally:
    jax.config.update("jax_pallas_enable_runtime_assert", False)
  text = str(info.value)
  frames = re.findall(r'File "([^"]+)", line (\d+)', text)
  # one frame, the kernel's check; no frame of JAX or of dsl
  assert frames == [(THIS_FILE, str(negative.__code__.co_firstlineno + 1))], \
      text
  assert text.rstrip().endswith("KernelCheckError: kernel 'negative': x must "
                                f"be negative (at {THIS_FILE}:"
                                f"{negative.__code__.co_firstlineno + 1})")
  assert isinstance(pl.kernel_error_of(info.value), pl.KernelCheckError)


def test_verbose_errors_show_the_jaxpr_for_mosaic():
  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.cumsum(x_ref[...], axis=0)
  jax.config.update("jax_pallas_verbose_errors", True)
  try:
    msg = _message(lambda: pl.pallas_call(kernel, OUT,
                                          backend="mosaic_interpret")(X),
                   pl.BackendError)
  finally:
    jax.config.update("jax_pallas_verbose_errors", False)
  assert "primitive 'cumsum' is not supported" in msg
  assert ">>>" in msg and "cumsum[axis=0" in msg
