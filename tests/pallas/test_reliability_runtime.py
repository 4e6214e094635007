"""Run-time failures on the host backends: failed checks and deadlocks report
the same way everywhere (class, first line: kernel, message, user's line),
eagerly and inside jax.jit; kernels run under sharded jax.jit
(tests/conftest.py asks XLA for 8 host devices)."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import dsl as pl
from dsl import tpu as pltpu
from dsl import triton as plt
from dsl.core.errors import (KernelCheckError, KernelDeadlockError,
                             KernelError, KernelRuntimeError, KernelTypeError,
                             kernel_error_of)

HOST = ["interpret", "triton_interpret", "mosaic_interpret"]
TPU_HOST = ["interpret", "mosaic_interpret"]
ANY = pl.BlockSpec(memory_space=pl.ANY)
X = jnp.ones((8, 128), jnp.float32)


def _line(marker: str) -> str:
  """'this file:line' of the line holding `marker`."""
  lines = open(__file__).read().splitlines()
  n = next(k for k, text in enumerate(lines, 1)
           if marker in text and "_line(" not in text)
  return f"{__file__}:{n}"


def _failure(f, *args, jit: bool):
  """Runs f (jitted or not); returns (what was raised, the KernelError)."""
  g = jax.jit(f) if jit else f
  with pytest.raises(Exception) as info:
    jax.block_until_ready(g(*args))
  raised = info.value
  err = kernel_error_of(raised)
  assert err is not None, raised
  if jit:    # what JAX makes of it, whose text ends with the kernel error
    assert isinstance(raised, (jax.errors.JaxRuntimeError, ValueError))
    assert f"{type(err).__name__}: {err}" in str(raised)
  else:      # the KernelError itself
    assert raised is err
  return raised, err


# ------------------------------------------------------------ deadlocks

def dma_never_started(x_hbm, o_ref, buf, sem):
  pltpu.make_async_copy(x_hbm, buf, sem).wait()      # wait-never-started
  o_ref[...] = buf[...]


def signalled_too_little(x_ref, o_ref, sem):
  pltpu.semaphore_signal(sem, 1)
  pltpu.semaphore_wait(sem, 2)                       # wait-for-two
  o_ref[...] = x_ref[...]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("backend", TPU_HOST)
def test_wait_for_a_dma_never_started_is_a_deadlock(backend, jit):
  f = pl.pallas_call(
      dma_never_started, jax.ShapeDtypeStruct(X.shape, X.dtype),
      in_specs=[ANY], scratch_shapes=[pltpu.VMEM(X.shape, X.dtype),
                                      pltpu.SemaphoreType.DMA],
      backend=backend)
  _, err = _failure(f, X, jit=jit)
  assert isinstance(err, KernelDeadlockError)
  first = str(err).splitlines()[0]
  assert first.startswith("kernel 'dma_never_started': a wait can never "
                          "finish"), first
  assert "a DMA of 4096 bytes on semaphore sem (now 0)" in first
  assert first.endswith(f"(at {_line('# wait-never-started')})"), first


@pytest.mark.parametrize("backend", TPU_HOST)
def test_wait_for_more_than_was_signalled_is_a_deadlock(backend):
  f = pl.pallas_call(signalled_too_little,
                     jax.ShapeDtypeStruct(X.shape, X.dtype),
                     scratch_shapes=[pltpu.SemaphoreType.REGULAR],
                     backend=backend)
  _, err = _failure(f, X, jit=False)
  assert isinstance(err, KernelDeadlockError)
  first = str(err).splitlines()[0]
  assert "semaphore sem (now 1) to reach 2" in first, first
  assert first.endswith(f"(at {_line('# wait-for-two')})"), first


def test_deadlock_names_the_grid_point_and_the_semaphore_slot():
  def kernel(x_ref, o_ref, sems):
    i = pl.program_id(0)
    pltpu.semaphore_signal(sems.at[0], 1)

    @pl.when(i == 2)
    def _():
      pltpu.semaphore_wait(sems.at[1], 1)     # waits on the wrong slot

    pltpu.semaphore_wait(sems.at[0], 1)
    o_ref[...] = x_ref[...] + 1
  x = jnp.zeros((32, 128))
  f = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                     grid=(4,), in_specs=[pl.BlockSpec((8, 128),
                                                       lambda i: (i, 0))],
                     out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                     scratch_shapes=[pltpu.SemaphoreType.REGULAR((2,))],
                     backend="interpret")
  _, err = _failure(f, x, jit=True)
  assert "semaphore sems[1] (now 0) to reach 1" in str(err)
  assert "at grid point (2,)" in str(err)


def test_waits_that_finish_raise_nothing_on_a_parallel_grid():
  # Under pl.when on a vectorized grid both branches are evaluated; only the
  # points that take the branch may count.
  def kernel(x_hbm, o_ref, buf, sem, flag):
    i = pl.program_id(0)

    @pl.when(i % 2 == 1)
    def _():
      c = pltpu.make_async_copy(x_hbm.at[pl.ds(i * 8, 8)], buf, sem)
      c.start()
      c.wait()
      pltpu.semaphore_signal(flag, 3)
      pltpu.semaphore_wait(flag, 3)
      o_ref[...] = buf[...] * 2

    @pl.when(i % 2 == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)

    @pl.when(i == 100)                          # never taken
    def _():
      pltpu.semaphore_wait(flag, 1)
  x = jnp.arange(32 * 128, dtype=jnp.float32).reshape(32, 128)
  f = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                     grid=(4,), in_specs=[ANY],
                     out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                     scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32),
                                     pltpu.SemaphoreType.DMA,
                                     pltpu.SemaphoreType.REGULAR],
                     compiler_params=pltpu.CompilerParams(
                         dimension_semantics=("parallel",)),
                     backend="interpret")
  want = jnp.where((jnp.arange(32) // 8 % 2 == 1)[:, None], x * 2, 0.)
  np.testing.assert_array_equal(jax.jit(f)(x), want)


def test_remote_wait_that_no_device_satisfies_names_the_device():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))

  def kernel(x_ref, o_ref, send, recv):
    me = jax.lax.axis_index("x")
    copy = pltpu.make_async_remote_copy(x_ref, o_ref, send, recv,
                                        device_id=((me + 1) % 4,))
    copy.wait_recv()                          # never started

  def per_device(x):
    return pl.pallas_call(
        kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA],
        backend="interpret")(x)
  f = jax.shard_map(per_device, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
  _, err = _failure(f, jnp.ones((32, 128)), jit=True)
  assert isinstance(err, KernelDeadlockError)
  assert "a remote DMA of 4096 bytes on semaphore recv" in str(err)
  assert "on device 0" in str(err) and "lockstep" in str(err)


# ------------------------------------------------------------ failed checks

def positive_kernel(x_ref, o_ref):
  pl.debug_check(jnp.all(x_ref[...] > 0), "x must be positive")   # the-check
  o_ref[...] = x_ref[...] * 2


@pytest.mark.parametrize("jit", [False, True])
def test_failed_check_reads_the_same_on_every_host_backend(runtime_asserts,
                                                           jit):
  firsts = set()
  for backend in HOST:
    f = pl.pallas_call(positive_kernel, jax.ShapeDtypeStruct(X.shape, X.dtype),
                       backend=backend)
    np.testing.assert_array_equal(f(X), 2 * X)
    raised, err = _failure(f, -X, jit=jit)
    assert type(err) is KernelCheckError, backend
    assert isinstance(raised, jax.errors.JaxRuntimeError)
    firsts.add(str(err).splitlines()[0])
  assert firsts == {"kernel 'positive_kernel': x must be positive "
                    f"(at {_line('# the-check')})"}


def test_checks_are_ignored_without_runtime_asserts():
  for backend in HOST:
    f = pl.pallas_call(positive_kernel, jax.ShapeDtypeStruct(X.shape, X.dtype),
                       backend=backend)
    np.testing.assert_array_equal(jax.jit(f)(-X), -2 * X)


def test_check_under_when_counts_only_where_the_branch_is_taken(
    runtime_asserts):
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)

    @pl.when(i == 0)
    def _():
      pl.debug_check(x_ref[0, 0] == 0, "block 0 starts at 0, got {}",
                     x_ref[0, 0])
    o_ref[...] = x_ref[...]
  x = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)
  for backend in HOST:
    f = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                       grid=(2,), in_specs=[pl.BlockSpec((8, 128),
                                                         lambda i: (i, 0))],
                       out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                       backend=backend)
    np.testing.assert_array_equal(jax.jit(f)(x), x)
    _, err = _failure(f, x + 5, jit=False)
    # The first line is the message as written, on every backend; the
    # interpret backend adds the values and the grid point.
    assert str(err).splitlines()[0].startswith(
        "kernel 'kernel': block 0 starts at 0, got {} (at "), backend
    if backend == "interpret":
      assert "with its values: block 0 starts at 0, got 5.0" in str(err)
      assert "at grid point (0,)" in str(err)


def test_checkify_counts_a_check_only_where_it_runs():
  from jax.experimental import checkify

  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      checkify.check(x_ref[0, 0] == 0, "block 0 starts at 0, got {}",
                     x_ref[0, 0])
    o_ref[...] = x_ref[...]
  x = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)
  f = pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                     grid=(2,), in_specs=[pl.BlockSpec((8, 128),
                                                       lambda i: (i, 0))],
                     out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)))
  err, out = jax.jit(checkify.checkify(f))(x)
  assert err.get() is None
  np.testing.assert_array_equal(out, x)
  err, _ = jax.jit(checkify.checkify(f))(x + 5)
  assert err.get().startswith("block 0 starts at 0, got 5.0")


def test_failed_check_inside_a_loop_and_run_scoped(runtime_asserts):
  def kernel(x_ref, o_ref):
    def row(r, carry):
      pl.debug_check(x_ref[r, 0] < 100, "row too big")
      return carry
    jax.lax.fori_loop(0, 8, row, 0)

    def scoped(buf):
      buf[...] = x_ref[...]
      pl.debug_check(jnp.all(buf[...] >= 0), "negative")
      o_ref[...] = buf[...]
    pl.run_scoped(scoped, pltpu.VMEM((8, 128), jnp.float32))
  f = pl.pallas_call(kernel, jax.ShapeDtypeStruct(X.shape, X.dtype),
                     backend="interpret")
  np.testing.assert_array_equal(f(X), X)
  assert kernel_error_of(_failure(f, X.at[3, 0].set(500.),
                                  jit=True)[0]).short == "row too big"
  assert _failure(f, -X, jit=False)[1].short == "negative"


def test_no_callback_log_and_no_stale_error_after_a_failure(runtime_asserts,
                                                            caplog):
  f = pl.pallas_call(positive_kernel, jax.ShapeDtypeStruct(X.shape, X.dtype),
                     backend="triton_interpret")
  with caplog.at_level(logging.ERROR):
    _failure(f, -X, jit=False)
  assert not [r for r in caplog.records if "callback failed" in r.message]
  jax.effects_barrier()           # the failed run is not raised again
  np.testing.assert_array_equal(f(X), 2 * X)


# ------------------------------------------------------------ kernel names

def test_trace_time_mask_and_dma_errors_name_the_kernel():
  def bad_mask(x_ref, o_ref):
    o_ref[...] = plt.load(x_ref, mask=jnp.ones(X.shape, jnp.int32))
  with pytest.raises(KernelTypeError, match="kernel 'bad_mask': .*mask must "
                     "be bool"):
    pl.pallas_call(bad_mask, jax.ShapeDtypeStruct(X.shape, X.dtype))(X)

  def bad_dma(x_hbm, o_ref, buf, sem):
    pltpu.make_async_copy(x_hbm, buf, sem).start()
  with pytest.raises(KernelError, match="kernel 'bad_dma': make_async_copy: "
                     "source"):
    pl.pallas_call(bad_dma, jax.ShapeDtypeStruct(X.shape, X.dtype),
                   in_specs=[ANY], scratch_shapes=[
                       pltpu.VMEM((4, 128), X.dtype),
                       pltpu.SemaphoreType.DMA])(X)


# ------------------------------------------------------------ sharded jit

def add_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = x_ref[...] + y_ref[...]


def _add(backend):
  return pl.pallas_call(
      add_kernel, jax.ShapeDtypeStruct((64, 128), jnp.float32), grid=(8,),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))] * 2,
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), backend=backend)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("backend", HOST)
def test_sharded_jit_over_a_make_mesh_mesh(backend, axis_type):
  mesh = jax.make_mesh((8,), ("d",), axis_types=(axis_type,))
  x = jnp.arange(64 * 128, dtype=jnp.float32).reshape(64, 128)
  y = jnp.ones_like(x)
  s = NamedSharding(mesh, P("d"))
  xs, ys = jax.device_put(x, s), jax.device_put(y, s)
  f = _add(backend)
  np.testing.assert_array_equal(jax.jit(f)(xs, ys), x + y)
  g = jax.jit(lambda a, b: f(a, b) * 2 + a)
  np.testing.assert_array_equal(g(xs, ys), (x + y) * 2 + x)
  with jax.set_mesh(mesh):
    np.testing.assert_array_equal(g(xs, ys), (x + y) * 2 + x)


def test_grad_and_vmap_under_sharded_jit_with_explicit_axes():
  mesh = jax.make_mesh((8,), ("d",))
  assert mesh.axis_types == (AxisType.Explicit,)
  x = jax.random.normal(jax.random.key(0), (64, 128))
  y = jax.random.normal(jax.random.key(1), (64, 128))
  s = NamedSharding(mesh, P("d"))
  xs, ys = jax.device_put(x, s), jax.device_put(y, s)
  f = _add("interpret")
  loss = lambda a, b: jnp.sum(jnp.sin(f(a, b)) ** 2)
  gx = jax.jit(jax.grad(loss))(xs, ys)
  np.testing.assert_allclose(gx, jax.grad(loss)(x, y), rtol=1e-5, atol=1e-5)
  assert gx.sharding.is_equivalent_to(xs.sharding, 2)
  v = jax.jit(jax.vmap(f, (0, None)))(jnp.stack([xs, 2 * xs]), ys)
  np.testing.assert_allclose(v[1], 2 * x + y, rtol=1e-6)


@pytest.mark.parametrize("backend", HOST)
def test_failed_check_under_sharded_jit_raises_on_every_device(
    runtime_asserts, backend):
  # A device that failed alone would leave the others waiting at the sum's
  # all-reduce until XLA aborts the process.
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
  x = jax.device_put(-jnp.ones((64, 128)), NamedSharding(mesh, P("d")))
  f = pl.pallas_call(positive_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                     grid=(8,), in_specs=[pl.BlockSpec((8, 128),
                                                       lambda i: (i, 0))],
                     out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
                     backend=backend)
  _, err = _failure(lambda a: jnp.sum(f(a)), x, jit=True)
  assert isinstance(err, KernelCheckError) and err.short == "x must be positive"


def test_failed_check_on_one_device_inside_shard_map(runtime_asserts):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))

  def per_device(x):
    y = pl.pallas_call(positive_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                       backend="interpret")(x)
    return jax.lax.psum(y, "x")
  f = jax.shard_map(per_device, mesh=mesh, in_specs=P("x"), out_specs=P())
  x = jnp.ones((32, 128)).at[16].set(-1.)         # device 2's block
  _, err = _failure(f, x, jit=True)
  assert err.short == "x must be positive" and "on device 2" in str(err)
  np.testing.assert_array_equal(jax.jit(f)(jnp.ones((32, 128))), 8.)


def _waits_in_a_while_loop(n_ref, x_hbm, o_ref, buf, sem):
  def body(i, acc):
    c = pltpu.make_async_copy(x_hbm.at[pl.ds(i * 8, 8)], buf, sem)
    c.start()
    c.wait()
    return acc + buf[...]
  # Bounds read from data: a while loop, which JAX's own checkify rule
  # re-traces (binding each wait with its params) before the waits' rules.
  o_ref[...] = jax.lax.fori_loop(0, n_ref[0], body, jnp.zeros((8, 128)))


def test_waits_inside_a_while_loop_are_checked():
  x = jnp.arange(4 * 8 * 128, dtype=jnp.float32).reshape(32, 128)
  n = jnp.array([3], jnp.int32)
  f = pl.pallas_call(
      _waits_in_a_while_loop, jax.ShapeDtypeStruct((8, 128), jnp.float32),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), ANY],
      scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32),
                      pltpu.SemaphoreType.DMA], backend="interpret")
  np.testing.assert_array_equal(f(n, x), x[:24].reshape(3, 8, 128).sum(0))
