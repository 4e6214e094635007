"""The mistakes a new user makes, each answered by a message that says what
is wrong, where (the user's line) and how to fix it."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl import tpu as pltpu
from dsl.core.jax_internals import state_indexing
from tests.pallas.testing import CPU_BACKENDS, no_rule

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
    o_ref[...] = no_rule(x_ref[...])
  jax.config.update("jax_pallas_verbose_errors", True)
  try:
    msg = _message(lambda: pl.pallas_call(kernel, OUT,
                                          backend="mosaic_interpret")(X),
                   pl.BackendError)
  finally:
    jax.config.update("jax_pallas_verbose_errors", False)
  assert "primitive 'no_rule_for_tests' is not supported" in msg
  assert ">>>" in msg and "no_rule_for_tests" in msg


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_python_list_is_not_an_array(backend):
  spec = pl.BlockSpec((2048,), lambda: (0,))
  f = pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
                     jax.ShapeDtypeStruct((2048,), jnp.float32),
                     in_specs=[spec], out_specs=spec, backend=backend)
  msg = _message(lambda: f([0.5] * 2048), pl.KernelTypeError)
  assert "argument 0" in msg and "list is not an array" in msg, msg
  assert "jnp.asarray" in msg and "2048 inputs" not in msg, msg
  # arrays, and pytrees of arrays, stay operands
  np.testing.assert_array_equal(f(jnp.asarray([0.5] * 2048)), 0.5)


def window_ending_at_its_start(x_ref, o_ref):
  o_ref[pl.ds(8, -8)] = x_ref[pl.ds(0, 8)]


def window_of_negative_size(x_ref, o_ref):
  o_ref[...] = x_ref[pl.ds(0, -8)]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kernel,operand,text", [
    (window_ending_at_its_start, "o_ref", "pl.ds(8, -8)"),
    (window_of_negative_size, "x_ref", "pl.ds(0, -8)")])
def test_a_negative_window_size_names_the_ref_and_line(backend, kernel,
                                                       operand, text):
  out = jax.ShapeDtypeStruct((8,), jnp.float32)
  with pytest.raises(pl.KernelError) as info:
    pl.pallas_call(kernel, out, backend=backend)(jnp.ones(8))
  msg = str(info.value)
  line = kernel.__code__.co_firstlineno + 1
  assert msg.endswith(f"(at {THIS_FILE}:{line})"), msg
  assert f"kernel '{kernel.__name__}', {operand}" in msg, msg
  assert f"{text} on dim 0 has a negative size" in msg, msg
  assert "Out of bound" not in msg and "Invalid shape" not in msg, msg


def jax_dataclass_fails(x_ref, o_ref):
  # JAX builds one of its dataclasses, whose generated `__init__` (code of
  # file `<string>`) fails: the error stands at this line, not at <string>.
  make = functools.partial(state_indexing.NDIndexer,
                           (state_indexing.Slice(9, 1),), (8,), ())
  jax.tree_util.tree_map(make, [True])
  o_ref[...] = x_ref[...]


def test_errors_inside_jax_generated_code_point_at_the_user_line():
  out = jax.ShapeDtypeStruct((8,), jnp.float32)
  with pytest.raises(pl.KernelError) as info:
    pl.pallas_call(jax_dataclass_fails, out)(jnp.ones(8))
  line = jax_dataclass_fails.__code__.co_firstlineno + 5
  assert str(info.value).endswith(f"(at {THIS_FILE}:{line})"), info.value
  assert "<string>" not in str(info.value)
