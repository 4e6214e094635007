"""jax.jvp and jax.grad of kernels that move data with DMAs and `run_scoped`
buffers: the brief DMA-then-compute kernel, a double-buffered manual DMA
loop over row blocks, `pl.run_scoped` scratch, accumulating DMAs, a DMA
from an input that is not differentiated, and `tpu.emit_pipeline` over
operands in HBM (which streams blocks through scoped VMEM buffers).

Each case is checked as the grad corpus checks its cases (values against a
jnp reference, `check_grads` of order 1 in both modes, jvp and vjp against
the reference's) on `interpret` and `mosaic_interpret` (and
`triton_interpret` for the kernels without DMAs of their own); the derived
kernels also lower for a TPU without loading from HBM.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import dsl as pl
from dsl import tpu as pltpu
from dsl.core.errors import KernelError
from lowering_mosaic.verification import promela
from lowering_mosaic.verify import verify
from tests.pallas import mosaic_golden as golden
from tests.pallas import tpu_pipeline_kernels as pipe
from tests.pallas.testing import check_values_and_grads as _check
from tests.pallas.testing import uniform_arrays as _data

BACKENDS = ["interpret", "mosaic_interpret"]
f32 = jnp.float32


def _any():
  return pl.BlockSpec(memory_space=pl.ANY)


# ------------------------------------------------------------ kernels

def dma_sin(x, backend):
  """A DMA from HBM into VMEM scratch, then sin of the buffer."""
  def kernel(x_hbm, o_ref, buf, sem):
    c = pltpu.make_async_copy(x_hbm, buf, sem)
    c.start()
    c.wait()
    o_ref[...] = jnp.sin(buf[...])
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(x.shape, f32),
      in_specs=[_any()],
      scratch_shapes=[pltpu.VMEM(x.shape, f32), pltpu.SemaphoreType.DMA],
      backend=backend)(x)


def double_buffered(x, w, backend, bm=8):
  """Row blocks of x fetched into two VMEM slots (the next one while the
  current one is used), y = sin(block) * w written back by DMA."""
  n = x.shape[0] // bm

  def kernel(x_hbm, w_ref, o_hbm, buf, obuf, sem, osem):
    def fetch(i, slot):
      return pltpu.make_async_copy(x_hbm.at[pl.ds(i * bm, bm)], buf.at[slot],
                                   sem.at[slot])
    fetch(0, 0).start()

    def body(i, carry):
      slot = i % 2

      @pl.when(i + 1 < n)
      def _():
        fetch(i + 1, 1 - slot).start()
      fetch(i, slot).wait()
      obuf[...] = jnp.sin(buf[slot]) * w_ref[...]
      out = pltpu.make_async_copy(obuf, o_hbm.at[pl.ds(i * bm, bm)], osem)
      out.start()
      out.wait()
      return carry
    jax.lax.fori_loop(0, n, body, 0)

  cols = x.shape[1]
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct(x.shape, f32),
      in_specs=[_any(), pl.BlockSpec((bm, cols), lambda: (0, 0))],
      out_specs=_any(),
      scratch_shapes=[pltpu.VMEM((2, bm, cols), f32), pltpu.VMEM((bm, cols), f32),
                      pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA],
      backend=backend)(x, w)


def _double_buffered_want(x, w):
  return jnp.sin(x) * jnp.tile(w, (x.shape[0] // w.shape[0], 1))


def scoped(x, backend):
  """A `pl.run_scoped` VMEM buffer holding an intermediate."""
  def kernel(x_ref, o_ref):
    def body(tmp):
      tmp[...] = x_ref[...] * x_ref[...]
      o_ref[...] = jnp.exp(tmp[...] * 0.5) + tmp[...]
    pl.run_scoped(body, pltpu.VMEM(x.shape, f32))
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, f32),
                        backend=backend)(x)


def accumulate(x, y, backend):
  """Accumulating DMAs (`start(add=True)`) into a scoped buffer: x + y^2."""
  def kernel(x_hbm, y_ref, o_ref):
    def body(acc, sq, sem):
      pltpu.make_async_copy(x_hbm, acc, sem).start().wait()
      sq[...] = y_ref[...] * y_ref[...]
      pltpu.make_async_copy(sq, acc, sem).start(add=True).wait()
      o_ref[...] = acc[...]
    pl.run_scoped(body, pltpu.VMEM(x.shape, f32), pltpu.VMEM(x.shape, f32),
                  pltpu.SemaphoreType.DMA)
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, f32),
                        in_specs=[_any(), pl.BlockSpec(x.shape, lambda: (0, 0))],
                        backend=backend)(x, y)


def prefetch_next_step(x, backend):
  """Paged attention's pattern: each grid step starts the DMA of the next
  step's block (into the other slot) and waits for its own, which the step
  before started; the slot and an "initialized" flag are SMEM state (scalar
  prefetch the kernel writes). The row blocks accumulate over steps k."""
  def kernel(flag_ref, slot_ref, x_hbm, o_ref, buf, sem):
    n_k = pl.num_programs(1)
    t = pl.program_id(0) * n_k + pl.program_id(1)
    slot = slot_ref[0]

    def fetch(step, into):
      return pltpu.make_async_copy(x_hbm.at[pl.ds(step * 8, 8)],
                                   buf.at[into], sem.at[into])

    @pl.when(flag_ref[0] == 1)
    def _():
      fetch(t, slot).start()
      flag_ref[0] = 0

    @pl.when(t + 1 < pl.num_programs(0) * n_k)
    def _():
      fetch(t + 1, 1 - slot).start()
      slot_ref[0] = 1 - slot
    fetch(t, slot).wait()

    @pl.when(pl.program_id(1) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] = o_ref[...] * jnp.cos(buf[slot]) + jnp.sin(buf[slot])

  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((x.shape[0] // 2, 128), f32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(x.shape[0] // 16, 2),
          in_specs=[_any()],
          out_specs=pl.BlockSpec((8, 128), lambda i, k, *_: (i, 0)),
          scratch_shapes=[pltpu.VMEM((2, 8, 128), f32),
                          pltpu.SemaphoreType.DMA((2,))]),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("arbitrary", "arbitrary")),
      backend=backend)(jnp.ones((1,), jnp.int32), jnp.zeros((1,), jnp.int32),
                       x)


def _prefetch_next_step_want(x):
  x = x.reshape(-1, 2, 8, 128)
  return (jnp.sin(x[:, 0]) * jnp.cos(x[:, 1]) + jnp.sin(x[:, 1])).reshape(
      -1, 128)


def pipeline_matmul(x, y, backend):
  return pipe.matmul(pl, x, y, bm=8, bk=128, bn=128, backend=backend)


def pipeline_elementwise(x, y, backend):
  return pipe.elementwise(pl, x, y, bm=8, bn=128, backend=backend)


CASES = {   # name -> (kernel, reference, argument shapes)
    "dma_sin": (dma_sin, jnp.sin, [(16, 128)]),
    "double_buffered": (double_buffered, _double_buffered_want,
                        [(32, 128), (8, 128)]),
    "prefetch_next_step": (prefetch_next_step, _prefetch_next_step_want,
                           [(32, 128)]),
    "run_scoped": (scoped, lambda x: jnp.exp(x * x * 0.5) + x * x,
                   [(8, 256)]),
    "accumulating_dma": (accumulate, lambda x, y: x + y * y,
                         [(8, 128), (8, 128)]),
    "emit_pipeline_matmul": (
        pipeline_matmul, lambda x, y: jnp.dot(x, y, precision="highest"),
        [(16, 256), (256, 256)]),
    "emit_pipeline_elementwise": (pipeline_elementwise, lambda x, y: 2 * x + y,
                                  [(24, 256), (24, 256)]),
}


# An accumulating DMA has no TensorCore form (the Mosaic backends refuse it).
INTERPRET_ONLY = {"accumulating_dma"}
# Triton has no DMAs or semaphores; these run there (its pipeline's blocks
# are views of the operands).
ON_TRITON = ["emit_pipeline_elementwise", "emit_pipeline_matmul", "run_scoped"]


@pytest.mark.parametrize("backend,name", [
    (b, n) for b in BACKENDS for n in sorted(CASES)
    if b == "interpret" or n not in INTERPRET_ONLY] + [
        ("triton_interpret", n) for n in ON_TRITON])
def test_grads(backend, name):
  kernel, want, shapes = CASES[name]
  _check(functools.partial(kernel, backend=backend), want, tuple(_data(*shapes)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_source_without_tangent_gives_zero_tangent(backend):
  """A DMA from an input that is not differentiated writes zeros into the
  tangent of its destination (poisoned buffers would show it missing)."""
  x, w = _data((32, 128), (8, 128))
  f = lambda w: double_buffered(x, w, backend)
  with pl.config.poison_buffers_option(True):
    _, t = jax.jvp(f, (w,), (jnp.ones_like(w),))
    g = jax.grad(lambda w: jnp.sum(f(w)))(w)
  np.testing.assert_allclose(t, jnp.sin(x), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(g, jnp.sin(x).reshape(4, 8, 128).sum(0),
                             rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_with_poisoned_buffers(backend):
  """With jax_pallas_poison_buffers the scratch buffers start as NaN, in the
  transposed kernel too: the cotangent of the scratch the kernel leaves is
  zero, not the poison."""
  x, w = _data((32, 128), (8, 128))
  with pl.config.poison_buffers_option(True):
    gx, gw = jax.grad(lambda x, w: jnp.sum(double_buffered(x, w, backend)),
                      argnums=(0, 1))(x, w)
  np.testing.assert_allclose(gx, jnp.cos(x) * jnp.tile(w, (4, 1)),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(gw, jnp.sin(x).reshape(4, 8, 128).sum(0),
                             rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_user_semaphores_count_the_primal_dma_only(backend):
  """The tangent copies signal semaphores of their own: under jvp, the
  user's DMA semaphore holds the bytes of the primal copy alone."""
  def kernel(x_hbm, o_ref, n_ref, buf, sem):
    c = pltpu.make_async_copy(x_hbm, buf, sem)
    c.start()
    n_ref[...] = jnp.full(n_ref.shape, pltpu.semaphore_read(sem), jnp.int32)
    c.wait()
    o_ref[...] = jnp.sin(buf[...])

  def f(x):
    return pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct(x.shape, f32),
                           jax.ShapeDtypeStruct((8, 128), jnp.int32)),
        in_specs=[_any()],
        scratch_shapes=[pltpu.VMEM(x.shape, f32), pltpu.SemaphoreType.DMA],
        backend=backend)(x)

  (x,) = _data((8, 128))
  (_, count), (t, _) = jax.jvp(f, (x,), (x,))
  np.testing.assert_array_equal(count, 8 * 128 * 4)
  np.testing.assert_allclose(t, jnp.cos(x) * x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["double_buffered", "emit_pipeline_matmul"])
def test_derived_kernels_lower_for_tpu(name):
  """jax.grad's kernels (jvp, recording, transposed) lower for a TPU: the
  tangents move by DMA and no kernel loads from HBM."""
  kernel, _, shapes = CASES[name]
  args = tuple(_data(*shapes))
  f = functools.partial(kernel, backend="mosaic")
  g = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1))
  calls = golden.lower_tpu(g, *args)
  assert len(calls) >= 2
  for call in calls:
    accesses = re.findall(
        r"(?:vector\.|tpu\.vector_|tpu\.)(?:load|store) [^\n]*", call.module)
    assert accesses
    assert not [a for a in accesses if re.search(
        r"memory_space<(any|hbm)>", a)], call.module
  assert any("tpu.enqueue_dma" in c.module for c in calls)


def test_remote_dma_is_refused_with_a_clear_error():
  n = 2
  mesh = Mesh(np.array(jax.devices()[:n]), ("x",))

  def kernel(x_ref, o_ref, send, recv):
    me = jax.lax.axis_index("x")
    copy = pltpu.make_async_remote_copy(x_ref, o_ref, send, recv,
                                        device_id=((me + 1) % n,))
    copy.start()
    copy.wait()

  def f(x):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((8, 128), f32),
        scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA],
        backend="interpret")(x)

  g = jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                    check_vma=False)
  x = jnp.ones((8 * n, 128), f32)
  with pytest.raises(KernelError, match=r"kernel 'kernel'.*remote DMA"):
    jax.jvp(g, (x,), (x,))


@pytest.mark.parametrize("config", [((8, 0, 0), (0, 0, 0)),
                                    ((0, 8, 0), (128, 0, 0)),
                                    ((-8, 16, 0), (0, 0, 0))])
def test_pad_on_mosaic(config):
  """`lax.pad` (the transpose of a static slice) runs on Mosaic as a buffer
  round trip, negative padding included."""
  (x,) = _data((16, 128))

  def kernel(x_ref, o_ref):
    o_ref[...] = jax.lax.pad(x_ref[...], jnp.float32(1.5), config)

  want = jax.lax.pad(x, jnp.float32(1.5), config)
  got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(want.shape, f32),
                       backend="mosaic_interpret")(x)
  np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(not promela.spin_available()[0],
                    reason=str(promela.spin_available()[1]))
@pytest.mark.parametrize("name", ["double_buffered",
                                  "emit_pipeline_elementwise"])
def test_spin_finds_no_race_or_deadlock_in_derived_kernels(name):
  """SPIN explores every order of the DMAs of the jvp, recording and
  transposed kernels' TPU modules (the tangent copies next to the
  pipeline's, the staging copies of the transposed kernel)."""
  kernel, _, shapes = CASES[name]
  args = tuple(_data(*shapes))
  f = functools.partial(kernel, backend="mosaic")
  jvp = verify(lambda *a: jax.jvp(f, a, a), *args)
  grad = verify(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1)), *args)
  for report in [jvp, *grad]:
    assert report.kind == "ok", str(report)
