"""Manual DMAs and semaphores: correct kernels under `mosaic_interpret` (and
the plain `interpret` backend), and broken ones caught by the race checker."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl import tpu as pltpu
import lowering_mosaic
from lowering_mosaic import (KernelDeadlockError, KernelRaceError,
                             KernelSimulationError, interpreter_options)
from lowering_mosaic.verification import interpreter
from dsl.core.errors import KernelRuntimeError, kernel_error_of
from dsl.core.jax_internals import DMA_WAIT_NAMES_COPY

BACKENDS = ["mosaic_interpret", "interpret"]
ANY = pl.BlockSpec(memory_space=pl.ANY)


def _run_failing(f, *args):
  """Runs f; returns the KernelSimulationError the interpreter raised."""
  interpreter.clear_reports()
  with pytest.raises(Exception) as e:
    jax.block_until_ready(f(*args))
  err = interpreter.last_failure()
  assert err is not None, e.value
  # The user gets a KernelRuntimeError (inside jax.jit: the JaxRuntimeError
  # XLA makes of it) whose message is the simulator's.
  reported = kernel_error_of(e.value)
  assert isinstance(reported, KernelRuntimeError), e.value
  assert reported.short in str(err) and str(reported) in str(e.value)
  return err


# ------------------------------------------------------------ copy via VMEM

def copy_through_vmem(x, backend, racy=False):
  def kernel(x_hbm, o_hbm, buf, sem):
    inc = pltpu.make_async_copy(x_hbm, buf, sem.at[0])
    inc.start()
    if not racy:
      inc.wait()
    buf[...] = buf[...] * 2 + 1                       # the racy line
    if racy:
      inc.wait()
    out = pltpu.make_async_copy(buf, o_hbm, sem.at[1])
    out.start()
    out.wait()
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), in_specs=[ANY],
      out_specs=ANY, scratch_shapes=[pltpu.VMEM(x.shape, x.dtype),
                                     pltpu.SemaphoreType.DMA((2,))],
      backend=backend)(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_through_vmem(backend):
  x = jnp.arange(16 * 128.).reshape(16, 128)
  np.testing.assert_array_equal(
      jax.jit(functools.partial(copy_through_vmem, backend=backend))(x),
      x * 2 + 1)


def test_copy_through_vmem_read_before_wait_is_a_race():
  x = jnp.arange(16 * 128.).reshape(16, 128)
  err = _run_failing(jax.jit(functools.partial(
      copy_through_vmem, backend="mosaic_interpret", racy=True)), x)
  assert isinstance(err, KernelRaceError)
  msg = str(err)
  assert "race on buf[0:16, 0:128]" in msg
  assert "read at" in msg and "is writing" in msg
  src = open(__file__).read().splitlines()
  read_line, start_line = [int(l.rsplit(":", 1)[1]) for l in err.lines]
  assert "the racy line" in src[read_line - 1]
  assert "inc.start()" in src[start_line - 1]


# ------------------------------------------------------------ double buffering

def double_buffered(x, backend, bug=None):
  """out = 2 x + 1 chunk by chunk: the next chunk is fetched while the
  current one is computed and the previous one written back."""
  n = x.shape[0] // 8

  def kernel(x_hbm, o_hbm, inbuf, outbuf, in_sem, out_sem):
    def fetch(i, slot):
      return pltpu.make_async_copy(x_hbm.at[pl.ds(i * 8, 8)], inbuf.at[slot],
                                   in_sem.at[slot])

    def store(i, slot):
      return pltpu.make_async_copy(outbuf.at[slot], o_hbm.at[pl.ds(i * 8, 8)],
                                   out_sem.at[slot])

    fetch(0, 0).start()

    @pl.loop(0, n)
    def _(i):
      slot = i % 2

      @pl.when(i + 1 < n)
      def _():
        fetch(i + 1, 1 - slot if bug != "same_slot" else slot).start()

      if bug != "read_before_wait":
        fetch(i, slot).wait()

      if bug != "no_store_wait":
        @pl.when(i >= 2)
        def _():
          store(i - 2, slot).wait()        # outbuf[slot] is free again
      outbuf[slot] = inbuf[slot] * 2 + 1
      if bug == "read_before_wait":
        fetch(i, slot).wait()
      store(i, slot).start()

    if bug != "no_drain":
      if bug != "no_store_wait":
        store(n - 2, (n - 2) % 2).wait()
      store(n - 1, (n - 1) % 2).wait()

  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), in_specs=[ANY],
      out_specs=ANY,
      scratch_shapes=[pltpu.VMEM((2, 8, 128), x.dtype),
                      pltpu.VMEM((2, 8, 128), x.dtype),
                      pltpu.SemaphoreType.DMA((2,)),
                      pltpu.SemaphoreType.DMA((2,))],
      backend=backend)(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_double_buffered_loop_over_hbm_chunks(backend):
  x = jax.random.normal(jax.random.key(0), (48, 128))
  got = jax.jit(functools.partial(double_buffered, backend=backend))(x)
  np.testing.assert_allclose(got, x * 2 + 1, rtol=1e-6)


def test_double_buffered_is_correct_in_any_dma_order():
  x = jax.random.normal(jax.random.key(0), (48, 128))
  for seed in range(4):
    for p in (0.05, 0.9):
      with interpreter_options(seed=seed, dma_completion_prob=p):
        got = jax.jit(functools.partial(double_buffered,
                                        backend="mosaic_interpret"))(x)
        np.testing.assert_allclose(got, x * 2 + 1, rtol=1e-6)


@pytest.mark.parametrize("bug,kind,text", [
    ("read_before_wait", KernelRaceError, "is writing"),
    ("same_slot", KernelRaceError, "two writers"),
    ("no_store_wait", KernelRaceError, "while the DMA started at .* is "
     "reading"),
    ("no_drain", KernelSimulationError, "was never waited for"),
])
def test_double_buffered_bugs_are_reported(bug, kind, text):
  x = jax.random.normal(jax.random.key(0), (48, 128))
  f = jax.jit(functools.partial(double_buffered, backend="mosaic_interpret",
                                bug=bug))
  for seed in (0, 1, 2):   # caught whatever order the DMAs land in
    with interpreter_options(seed=seed):
      err = _run_failing(f, x)
    assert isinstance(err, kind), err
    import re
    assert re.search(text, str(err)), err
    assert all(l.startswith(__file__) for l in err.lines), err.lines


def test_race_warn_mode_records_and_continues():
  x = jnp.arange(16 * 128.).reshape(16, 128)
  f = jax.jit(functools.partial(copy_through_vmem, backend="mosaic_interpret",
                                racy=True))
  interpreter.clear_reports()
  with interpreter_options(on_race="warn"):
    with pytest.warns(RuntimeWarning, match="race on"):
      out = jax.block_until_ready(f(x))
  assert out.shape == x.shape
  reports = interpreter.reports()
  assert reports and all(isinstance(r, KernelRaceError) for r in reports)


# ------------------------------------------------------------ semaphores

def semaphores(backend):
  def kernel(o_ref, sem, dsem):
    pltpu.semaphore_signal(sem.at[0], 3)
    pltpu.semaphore_signal(sem.at[1])
    a = pltpu.semaphore_read(sem.at[0])
    pltpu.semaphore_wait(sem.at[0], 2)
    b = pltpu.semaphore_read(sem.at[0])
    pltpu.semaphore_wait(sem.at[0], 1)
    pltpu.semaphore_wait(sem.at[1])
    o_ref[0] = a
    o_ref[1] = b
    o_ref[2] = pltpu.semaphore_read(sem.at[1])
  smem = pl.BlockSpec(memory_space=pltpu.SMEM)
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((3,), jnp.int32), out_specs=smem,
      scratch_shapes=[pltpu.SemaphoreType.REGULAR((2,)),
                      pltpu.SemaphoreType.DMA], backend=backend)()


@pytest.mark.parametrize("backend", BACKENDS)
def test_semaphore_signal_wait_read(backend):
  np.testing.assert_array_equal(semaphores(backend), [3, 1, 0])


def test_wait_that_never_finishes_is_a_deadlock():
  def kernel(o_ref, sem):
    pltpu.semaphore_signal(sem, 1)
    pltpu.semaphore_wait(sem, 2)          # only one signal ever comes
    o_ref[...] = jnp.zeros_like(o_ref)
  f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                     scratch_shapes=[pltpu.SemaphoreType.REGULAR],
                     backend="mosaic_interpret")
  err = _run_failing(jax.jit(f))
  assert isinstance(err, KernelDeadlockError)
  assert "can never finish" in str(err) and "to reach 2" in str(err)
  assert err.lines[0].startswith(__file__)


def test_wait_on_the_wrong_semaphore_is_a_deadlock():
  def kernel(x_hbm, o_ref, sem):
    c = pltpu.make_async_copy(x_hbm, o_ref, sem.at[0])
    c.start()
    pltpu.make_async_copy(x_hbm, o_ref, sem.at[1]).wait()   # wrong one
  x = jnp.ones((8, 128))
  f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                     in_specs=[ANY],
                     scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
                     backend="mosaic_interpret")
  err = _run_failing(jax.jit(f), x)
  assert isinstance(err, KernelDeadlockError)
  assert "on semaphore sem[1] (now 0)" in str(err)


def test_unbalanced_signal_is_reported_at_kernel_end():
  def kernel(o_ref, sem):
    pltpu.semaphore_signal(sem, 2)
    pltpu.semaphore_wait(sem, 1)
    o_ref[...] = jnp.zeros_like(o_ref)
  f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                     scratch_shapes=[pltpu.SemaphoreType.REGULAR],
                     backend="mosaic_interpret")
  err = _run_failing(jax.jit(f))
  assert err.kind == "semaphore" and "at 1" in str(err)


def test_run_scoped_buffers_and_semaphores():
  def kernel(x_hbm, o_ref):
    def body(buf, sem):
      c = pltpu.make_async_copy(x_hbm.at[pl.ds(8, 8)], buf, sem)
      c.start()
      c.wait()
      o_ref[...] = buf[...] + 1
    pl.run_scoped(body, pltpu.VMEM((8, 128), jnp.float32),
                  pltpu.SemaphoreType.DMA)
  x = jnp.arange(16 * 128.).reshape(16, 128)
  for backend in BACKENDS:
    out = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                         in_specs=[ANY], backend=backend)(x)
    np.testing.assert_array_equal(out, x[8:] + 1)


def test_dma_structure_of_the_module():
  x = jnp.ones((48, 128))
  text = lowering_mosaic.to_mlir(
      functools.partial(double_buffered, backend="mosaic_interpret"), x)
  assert text.count("tpu.enqueue_dma") == 3
  # the wait in the installed Pallas's form (DMA_WAIT_NAMES_COPY)
  wait = "tpu.wait_dma " if DMA_WAIT_NAMES_COPY else "tpu.wait_dma2 "
  assert text.count(wait) == 4
  assert "memref<2x!tpu.dma_semaphore, #tpu.memory_space<semaphore_mem>>" \
      in text
  assert "tpu.memref_slice" in text and "tpu.memref_squeeze" in text


# ------------------------------------------------------------ accumulating DMAs

def accumulate(x, y, backend, how):
  """o = y, then x[0:8] and x[8:16] are both DMA'd onto o[0:8] with
  add=True: o[0:8] ends as y[0:8] + x[0:8] + x[8:16], o[8:] as y[8:]."""
  def kernel(x_hbm, y_ref, o_ref, sems):
    o_ref[...] = y_ref[...]
    halves = [x_hbm.at[pl.ds(0, 8)], x_hbm.at[pl.ds(8, 8)]]
    if how == "sync_copy":
      for half in halves:
        pltpu.sync_copy(half, o_ref.at[pl.ds(0, 8)], add=True)
      return
    copies = [pltpu.make_async_copy(half, o_ref.at[pl.ds(0, 8)], sems.at[k])
              for k, half in enumerate(halves)]
    copies[0].start(add=True)
    if how == "async_copy":
      pltpu.async_copy(halves[1], o_ref.at[pl.ds(0, 8)], sems.at[1], add=True)
    else:
      copies[1].start(add=True)
    for c in copies:
      c.wait()
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct(y.shape, y.dtype),
      in_specs=[ANY, pl.BlockSpec(memory_space=pltpu.VMEM)],
      scratch_shapes=[pltpu.SemaphoreType.DMA((2,))], backend=backend)(x, y)


def _accumulate_inputs(dtype):
  x = jnp.arange(16 * 128).reshape(16, 128).astype(dtype)
  y = (jnp.arange(16 * 128).reshape(16, 128) % 7 - 3).astype(dtype)
  want = y.at[:8].add(x[:8] + x[8:])
  return x, y, want


@pytest.mark.parametrize("how", ["start", "async_copy", "sync_copy"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_accumulating_dma_adds_to_the_destination(how, dtype):
  x, y, want = _accumulate_inputs(dtype)
  got = jax.jit(functools.partial(accumulate, backend="interpret",
                                  how=how))(x, y)
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("how", ["start", "sync_copy"])
def test_accumulating_dma_is_rejected_on_mosaic_as_by_pallas(how):
  # Pallas's TPU lowering raises NotImplementedError for add=True (the
  # TensorCore DMA only copies); both Mosaic backends say so at the line.
  x, y, _ = _accumulate_inputs(jnp.float32)
  for backend in ("mosaic_interpret", "mosaic"):
    with pytest.raises(NotImplementedError, match="accumulating DMA") as e:
      jax.jit(functools.partial(accumulate, backend=backend, how=how)).trace(
          x, y).lower(lowering_platforms=("tpu",) if backend == "mosaic"
                      else None)
    assert isinstance(e.value, pl.BackendError)
    assert __file__ in str(e.value)
