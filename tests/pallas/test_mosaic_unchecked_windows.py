"""Windows placed at run time on the Mosaic targets (lowering_mosaic/
unchecked_windows.py): neither the TPU nor the Mosaic GPU lowering checks a
window when the kernel runs, so with runtime asserts on they refuse one the
range analysis does not prove inside its ref (naming the ref, the dim and
side, and the user's line), keep the ones it proves, and without runtime
asserts lower both unchanged; the Mosaic interpreter checks every lane."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl import tpu as pltpu
from dsl.core.errors import BackendError
from tests.pallas import testing
from tests.pallas.mosaic_gpu_testing import kernel_module

SMEM = pl.BlockSpec(memory_space=pltpu.SMEM)
X = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)
START = jnp.array([3], jnp.int32)


def free_kernel(i_ref, x_ref, o_ref):
  o_ref[...] = x_ref[pl.ds(i_ref[0], 8), :]   # FREE-LINE


def clipped_kernel(i_ref, x_ref, o_ref):
  o_ref[...] = x_ref[pl.ds(jnp.clip(i_ref[0], 0, 8), 8), :]


def _call(kernel, backend):
  return lambda i, x: pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
      in_specs=[SMEM, None], backend=backend)(i, x)


def _lower_tpu(kernel):
  f = _call(kernel, "mosaic")
  return jax.jit(f).trace(START, X).lower(
      lowering_platforms=("tpu",)).as_text()


def test_the_tpu_refuses_an_unproven_window_under_runtime_asserts(
    runtime_asserts):
  with pytest.raises(BackendError) as e:
    _lower_tpu(free_kernel)
  message = str(e.value)
  assert "x_ref" in message
  assert "dim 0 below 0" in message and "dim 0 past its end" in message
  assert "mosaic_interpret" in message
  line = testing.line_of(__file__, "# FREE-LINE")
  assert f"test_mosaic_unchecked_windows.py:{line}" in message


def test_the_tpu_lowers_a_window_the_analysis_proves(runtime_asserts):
  assert "tpu_custom_call" in _lower_tpu(clipped_kernel)


def test_without_runtime_asserts_the_tpu_lowers_the_window():
  assert "tpu_custom_call" in _lower_tpu(free_kernel)


def test_the_mosaic_interpreter_checks_what_the_tpu_refuses(runtime_asserts):
  f = _call(free_kernel, "mosaic_interpret")
  got = np.asarray(f(START, X))
  np.testing.assert_array_equal(got, np.asarray(X)[3:11])
  with pytest.raises(pl.KernelCheckError, match=re.escape("x_ref[12:20, :]")):
    jax.block_until_ready(f(jnp.array([12], jnp.int32), X))


def _gpu_module(start_of):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[pl.ds(start_of(pl.program_id(0)), 64), :]
  x = jnp.ones((128, 128), jnp.float32)
  return kernel_module(kernel, x, out=(128, 128), grid=(2,),
                       in_specs=[pl.BlockSpec((128, 128), lambda i: (0, 0))],
                       out_specs=pl.BlockSpec((64, 128), lambda i: (i, 0)))


def test_the_mosaic_gpu_lowering_refuses_an_unproven_window(runtime_asserts):
  with pytest.raises(BackendError, match="dim 0 past its end"):
    _gpu_module(lambda i: i * 96)           # 96 + 64 > 128: may leave


def test_the_mosaic_gpu_lowering_keeps_a_window_proven_inside(
    runtime_asserts):
  assert _gpu_module(lambda i: i * 64) is not None
