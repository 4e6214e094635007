"""`dsl.errors`, the public module of the error classes, and kernel errors
that reach the caller of a jitted function as their own class."""
import functools

import jax
import jax.numpy as jnp
import pytest

import dsl as pl
import dsl.errors
from dsl import tpu as pltpu
from dsl.errors import KernelCheckError, KernelError, KernelRaceError
from dsl.tools import timing
from tests.pallas.testing import CPU_BACKENDS

X = jnp.ones((8, 128), jnp.float32)
OUT = jax.ShapeDtypeStruct(X.shape, X.dtype)
ANY = pl.BlockSpec(memory_space=pl.ANY)


def test_dsl_errors_names_the_error_classes():
  for name in dsl.errors.__all__:
    assert getattr(dsl.errors, name) is getattr(dsl.core.errors, name, None) \
        or name == "raising_kernel_errors", name
  for name in ("KernelError", "KernelTypeError", "BackendError",
               "KernelRuntimeError", "KernelCheckError", "KernelDeadlockError",
               "KernelRaceError", "KernelWarning", "kernel_error_of"):
    assert name in dsl.errors.__all__
  assert pl.errors is dsl.errors and pl.KernelError is KernelError


def test_except_clauses_on_dsl_errors_catch_trace_time_errors():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[pl.ds(0, -8)]
  with pytest.raises(dsl.errors.KernelError):
    pl.pallas_call(kernel, OUT)(X)


def negative(x_ref, o_ref):
  pl.debug_check(jnp.all(x_ref[...] < 0), "x must be negative")
  o_ref[...] = x_ref[...]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_runtime_check_under_jit_raises_its_class(backend):
  f = dsl.errors.raising_kernel_errors(
      jax.jit(pl.pallas_call(negative, OUT, backend=backend)))
  with pl.config.enable_runtime_assert_option(True):
    with pytest.raises(KernelCheckError) as info:
      f(X)
  err = info.value
  assert str(err).startswith("kernel 'negative': x must be negative (at ")
  assert isinstance(err.__cause__, (jax.errors.JaxRuntimeError, ValueError))
  assert pl.kernel_error_of(err) is err
  # the same function runs again, and a kernel that passes returns values
  with pl.config.enable_runtime_assert_option(True):
    assert (f(-X) == -X).all()


def racy_copy(x_hbm, o_hbm, buf, sem):
  inc = pltpu.make_async_copy(x_hbm, buf, sem.at[0])
  inc.start()
  buf[...] = buf[...] * 2 + 1                  # read while the DMA writes
  inc.wait()
  out = pltpu.make_async_copy(buf, o_hbm, sem.at[1])
  out.start()
  out.wait()


def test_a_race_under_jit_raises_its_class():
  f = jax.jit(pl.pallas_call(
      racy_copy, OUT, in_specs=[ANY], out_specs=ANY,
      scratch_shapes=[pltpu.VMEM(X.shape, X.dtype),
                      pltpu.SemaphoreType.DMA((2,))],
      backend="mosaic_interpret"))
  with pytest.raises(KernelRaceError) as info:
    dsl.errors.raising_kernel_errors(f)(X)
  assert "race on buf" in str(info.value)
  assert isinstance(info.value.__cause__, (jax.errors.JaxRuntimeError,
                                           ValueError))


def test_the_timer_reports_the_kernel_error():
  f = pl.pallas_call(negative, OUT, backend="interpret")
  with pl.config.enable_runtime_assert_option(True):
    with pytest.raises(KernelCheckError, match="x must be negative"):
      timing.measure(f, (X,), warmup=0, repeats=1)
