"""Kernels that talk to other devices (remote DMAs, device ids, barrier
semaphores) inside shard_map over 4 CPU devices (tests/conftest.py asks XLA
for 8 host devices)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import dsl as pl
from dsl.core import host_failures
from dsl import tpu as pltpu
import lowering_mosaic
from lowering_mosaic import KernelRaceError, interpreter_options
from lowering_mosaic.tpu.rules import tpu_ops
from lowering_mosaic.verification import interpreter
from tests.pallas.testing import assert_close

N = 4
pytestmark = pytest.mark.skipif(len(jax.devices()) < N,
                                reason=f"needs {N} devices")
BACKENDS = ["mosaic_interpret", "interpret"]


def _mesh():
  return Mesh(np.array(jax.devices()[:N]), ("x",))


def _barrier(me):
  """Signal both ring neighbours and wait for theirs."""
  barrier = pltpu.get_barrier_semaphore()
  pltpu.semaphore_signal(barrier, 1, device_id=((me + 1) % N,))
  pltpu.semaphore_signal(barrier, 1, device_id=((me - 1) % N,))
  pltpu.semaphore_wait(barrier, 2)


def all_gather_kernel(x_ref, o_ref, *sems, racy=False):
  # One receive semaphore per ring step: DMAs complete in any order, so a
  # fast left neighbour's next copy must not satisfy this step's wait.
  if len(sems) == 1:            # one DMA semaphore array for both ends
    send_sem, recv_sems = sems[0].at[0], [sems[0].at[1 + s] for s in range(N - 1)]
  else:
    send_sem, recv_sems = sems[0], [sems[1].at[s] for s in range(N - 1)]
  me = jax.lax.axis_index("x")
  right = (me + 1) % N
  _barrier(me)
  o_ref[pl.ds(me * 8, 8)] = x_ref[...]
  for step in range(N - 1):
    chunk = (me - step) % N                       # the chunk I forward
    copy = pltpu.make_async_remote_copy(
        o_ref.at[pl.ds(chunk * 8, 8)], o_ref.at[pl.ds(chunk * 8, 8)],
        send_sem, recv_sems[step], device_id=(right,),
        device_id_type=pltpu.DeviceIdType.MESH)
    copy.start()
    if racy:
      copy.wait_send()
      got = (me - step - 1) % N
      o_ref[pl.ds(got * 8, 8)] = o_ref[pl.ds(got * 8, 8)] + 0   # too early
      copy.wait_recv()
    else:
      copy.wait()


def ring_all_gather(x, backend, racy=False, shared_sems=False):
  kernel = functools.partial(all_gather_kernel, racy=racy)
  sems = ([pltpu.SemaphoreType.DMA((N,))] if shared_sems else
          [pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA((N - 1,))])
  call = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((N * 8, 128), x.dtype),
      in_specs=[pl.BlockSpec((8, 128), lambda: (0, 0))],
      out_specs=pl.BlockSpec((N * 8, 128), lambda: (0, 0)),
      scratch_shapes=sems,
      compiler_params=pltpu.CompilerParams(collective_id=0),
      backend=backend)
  mesh = _mesh()
  f = jax.shard_map(call, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                    check_vma=False)
  x = jax.device_put(x, NamedSharding(mesh, P("x")))
  return jax.jit(f)(x)


@pytest.mark.parametrize("shared_sems", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_all_gather(backend, shared_sems):
  x = jnp.arange(N * 8 * 128, dtype=jnp.float32).reshape(N * 8, 128)
  out = ring_all_gather(x, backend, shared_sems=shared_sems)
  np.testing.assert_array_equal(out, jnp.tile(x, (N, 1)))


def _shift_right_by_core(x, cores):
  """Each grid point (one per core on a megacore chip) sends its 8 rows to
  the right neighbour, on its own semaphores."""
  def kernel(x_hbm, o_hbm, send_sem, recv_sem):
    c, me = pl.program_id(0), jax.lax.axis_index("x")
    _barrier(me)
    copy = pltpu.make_async_remote_copy(
        x_hbm.at[pl.ds(c * 8, 8)], o_hbm.at[pl.ds(c * 8, 8)], send_sem,
        recv_sem, device_id=((me + 1) % N,),
        device_id_type=pltpu.DeviceIdType.MESH)
    copy.start()
    copy.wait()
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  call = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((16, 128), x.dtype), grid=(2,),
      in_specs=[any_spec], out_specs=any_spec,
      scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA],
      compiler_params=pltpu.CompilerParams(
          collective_id=0, dimension_semantics=("parallel",)),
      backend="mosaic_interpret")
  mesh = _mesh()
  f = jax.shard_map(call, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                    check_vma=False)
  with interpreter_options(num_cores=cores):
    return jax.jit(f)(jax.device_put(x, NamedSharding(mesh, P("x"))))


@pytest.mark.parametrize("cores", [1, 2])
def test_remote_copies_reach_the_same_core_of_the_peer(cores):
  x = jnp.arange(N * 16 * 128, dtype=jnp.float32).reshape(N * 16, 128)
  out = _shift_right_by_core(x, cores)
  np.testing.assert_array_equal(out, jnp.roll(x, 16, axis=0))


def reduce_scatter_kernel(x_ref, o_ref, acc, recv, send_sem, recv_sems,
                          credit, *, with_credits=True):
  """Ring reduce-scatter: device d ends with sum over devices of chunk d.

  Partial sums travel right; a receiver double-buffers them and, once it
  has added a slot, gives its left neighbour a credit to refill it.
  """
  me = jax.lax.axis_index("x")
  right, left = (me + 1) % N, (me - 1) % N
  _barrier(me)
  acc[...] = x_ref[...]
  for step in range(N - 1):
    slot = step % 2
    send_chunk = (me - step - 1) % N
    if with_credits and step >= 2:
      pltpu.semaphore_wait(credit, 1)            # right has drained the slot
    copy = pltpu.make_async_remote_copy(
        acc.at[pl.ds(send_chunk * 8, 8)], recv.at[slot], send_sem,
        recv_sems.at[step], device_id=(right,),
        device_id_type=pltpu.DeviceIdType.MESH)
    copy.start()
    copy.wait()
    got = (me - step - 2) % N
    acc[pl.ds(got * 8, 8)] += recv[slot]
    if with_credits and step + 2 <= N - 2:
      pltpu.semaphore_signal(credit, 1, device_id=(left,))
  o_ref[...] = acc[pl.ds(me * 8, 8)]


def ring_reduce_scatter(x, backend, with_credits=True):
  kernel = functools.partial(reduce_scatter_kernel, with_credits=with_credits)
  call = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((8, 128), x.dtype),
      in_specs=[pl.BlockSpec((N * 8, 128), lambda: (0, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda: (0, 0)),
      scratch_shapes=[pltpu.VMEM((N * 8, 128), x.dtype),
                      pltpu.VMEM((2, 8, 128), x.dtype),
                      pltpu.SemaphoreType.DMA,
                      pltpu.SemaphoreType.DMA((N - 1,)),
                      pltpu.SemaphoreType.REGULAR],
      backend=backend)
  mesh = _mesh()
  f = jax.shard_map(call, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                    check_vma=False)
  x = jax.device_put(x, NamedSharding(mesh, P("x")))
  return jax.jit(f)(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ring_reduce_scatter(backend):
  # device d holds rows [d*32, (d+1)*32): N chunks of 8 rows
  x = jax.random.normal(jax.random.key(0), (N * N * 8, 128))
  out = ring_reduce_scatter(x, backend)
  want = x.reshape(N, N * 8, 128).sum(0)      # chunk d of the sum on device d
  assert_close(out, want)


def test_reduce_scatter_correct_in_any_order():
  x = jax.random.normal(jax.random.key(0), (N * N * 8, 128))
  want = x.reshape(N, N * 8, 128).sum(0)
  for seed in range(5):
    with interpreter_options(seed=seed, dma_completion_prob=0.1 + 0.2 * seed):
      out = ring_reduce_scatter(x, "mosaic_interpret")
      assert_close(out, want)


def _races(fn, seeds):
  found = []
  for seed in seeds:
    interpreter.clear_reports()
    with interpreter_options(seed=seed):
      try:
        jax.block_until_ready(fn())
      except Exception:   # noqa: BLE001 - the callback's error
        err = interpreter.last_failure()
        assert err is not None
        found.append(err)
  # The failed runs' runtime tokens would raise again at the next
  # jax.effects_barrier() (in a later test).
  host_failures.forget_failed_runs()
  return found


def test_reading_before_wait_recv_is_a_race():
  x = jnp.arange(N * 8 * 128, dtype=jnp.float32).reshape(N * 8, 128)
  found = _races(lambda: ring_all_gather(x, "mosaic_interpret", racy=True),
                 range(4))
  assert found and all(isinstance(e, KernelRaceError) for e in found)
  assert any("too early" in open(__file__).read().splitlines()[
      int(e.lines[0].rsplit(":", 1)[1]) - 1] for e in found)
  assert "on device" in str(found[0])


def test_reduce_scatter_without_credits_overwrites_a_busy_buffer():
  x = jax.random.normal(jax.random.key(0), (N * N * 8, 128))
  found = _races(lambda: ring_reduce_scatter(x, "mosaic_interpret",
                                             with_credits=False), range(8))
  assert found, "the missing handshake was never caught"
  assert all(isinstance(e, KernelRaceError) for e in found), found
  text = " ".join(str(e) for e in found)
  assert "recv[" in text and "scratch_shapes" not in text, text


def test_remote_module_structure():
  mesh = _mesh()
  x = jnp.zeros((N * 8, 128))
  call = functools.partial(ring_all_gather, backend="mosaic_interpret")
  del call
  kernel = pl.pallas_call(
      all_gather_kernel, jax.ShapeDtypeStruct((N * 8, 128), jnp.float32),
      in_specs=[pl.BlockSpec((8, 128), lambda: (0, 0))],
      out_specs=pl.BlockSpec((N * 8, 128), lambda: (0, 0)),
      scratch_shapes=[pltpu.SemaphoreType.DMA,
                      pltpu.SemaphoreType.DMA((N - 1,))])
  f = jax.shard_map(kernel, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                    check_vma=False)
  text = lowering_mosaic.to_mlir(f, x)
  assert "tpu.sem_barrier" in text and "tpu.device_id" in text
  assert text.count("tpu.enqueue_dma") == N - 1
  assert "source_semaphore" in text and "device_id(" in text
  assert 'dsl.mesh_axes = ["x"]' in text


@pytest.mark.parametrize("names_copy", [True, False])
def test_both_dma_wait_forms_run(monkeypatch, names_copy):
  """The interpreter runs a remote copy's waits in either form a Pallas
  release emits (`DMA_WAIT_NAMES_COPY`): `tpu.wait_dma` naming the copy and
  its awaited end (jax 0.12), or `tpu.wait_dma2` naming the semaphore
  (jax 0.11); both jaxlibs have both operations."""
  monkeypatch.setattr(tpu_ops, "DMA_WAIT_NAMES_COPY", names_copy)
  x = jnp.arange(N * 8 * 128, dtype=jnp.float32).reshape(N * 8, 128)
  np.testing.assert_array_equal(ring_all_gather(x, "mosaic_interpret"),
                                jnp.tile(x, (N, 1)))
  found = _races(lambda: ring_all_gather(x, "mosaic_interpret", racy=True),
                 range(4))
  assert found and all(isinstance(e, KernelRaceError) for e in found)
  kernel = pl.pallas_call(
      all_gather_kernel, jax.ShapeDtypeStruct((N * 8, 128), jnp.float32),
      in_specs=[pl.BlockSpec((8, 128), lambda: (0, 0))],
      out_specs=pl.BlockSpec((N * 8, 128), lambda: (0, 0)),
      scratch_shapes=[pltpu.SemaphoreType.DMA,
                      pltpu.SemaphoreType.DMA((N - 1,))])
  text = lowering_mosaic.to_mlir(
      jax.shard_map(kernel, mesh=_mesh(), in_specs=P("x"), out_specs=P("x"),
                    check_vma=False), x)
  # each copy is waited for at both ends
  wait = "tpu.wait_dma " if names_copy else "tpu.wait_dma2 "
  assert text.count(wait) == 2 * (N - 1)


def test_tpu_lowering_of_a_collective_kernel():
  mesh = _mesh()
  kernel = pl.pallas_call(
      all_gather_kernel, jax.ShapeDtypeStruct((N * 8, 128), jnp.float32),
      in_specs=[pl.BlockSpec((8, 128), lambda: (0, 0))],
      out_specs=pl.BlockSpec((N * 8, 128), lambda: (0, 0)),
      scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA((N - 1,))],
      backend="mosaic")
  f = jax.shard_map(kernel, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                    check_vma=False)
  x = jnp.zeros((N * 8, 128))
  text = jax.jit(f).trace(x).lower(lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" in text and "has_communication" in text


def ring_accumulate(x, backend):
  """Each device starts from its own block and a remote DMA with add=True
  adds its left neighbour's block onto it: device d ends with x_d + x_{d-1}."""
  def kernel(x_ref, o_ref, send_sem, recv_sem):
    me = jax.lax.axis_index("x")
    o_ref[...] = x_ref[...]
    _barrier(me)                  # every o_ref holds its start value
    copy = pltpu.make_async_remote_copy(
        x_ref, o_ref, send_sem, recv_sem, device_id=((me + 1) % N,),
        device_id_type=pltpu.DeviceIdType.MESH)
    copy.start(add=True)
    copy.wait()
  call = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((8, 128), x.dtype),
      in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
      out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
      scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA],
      compiler_params=pltpu.CompilerParams(collective_id=0),
      backend=backend)
  mesh = _mesh()
  f = jax.shard_map(call, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                    check_vma=False)
  return jax.jit(f)(jax.device_put(x, NamedSharding(mesh, P("x"))))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_remote_accumulating_dma(dtype):
  x = jnp.arange(N * 8 * 128).reshape(N * 8, 128).astype(dtype)
  blocks = x.reshape(N, 8, 128)
  want = (blocks + jnp.roll(blocks, 1, axis=0)).reshape(N * 8, 128)
  out = ring_accumulate(x, "interpret")
  assert out.dtype == want.dtype
  np.testing.assert_array_equal(out, want)


def test_remote_accumulating_dma_is_rejected_on_mosaic():
  x = jnp.zeros((N * 8, 128))
  with pytest.raises(pl.BackendError, match="accumulating DMA"):
    ring_accumulate(x, "mosaic_interpret")


@pytest.mark.parametrize("case,scale", [("barrier_in_control_flow", 1.0),
                                        ("barrier_with_tag", 2.0)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_barrier_corpus_kernels_run(backend, case, scale):
  # barrier_in_control_flow reads the barrier semaphore before a fori_loop
  # of remote signals and a pl.when holding the wait; barrier_with_tag
  # names its collective with get_barrier_semaphore(tag=...).
  from tests.pallas.mosaic_corpus import CASES
  f, (x,) = CASES[case](pl, pltpu)
  x = jax.random.normal(jax.random.key(1), x.shape)
  out = jax.jit(functools.partial(_with_backend, f, backend))(x)
  np.testing.assert_array_equal(out, x * scale)


def _with_backend(f, backend, x):
  from dsl.core import backends
  saved = backends.DEFAULT_FOR_PLATFORM["cpu"]
  backends.DEFAULT_FOR_PLATFORM["cpu"] = backend
  try:
    return f(x)
  finally:
    backends.DEFAULT_FOR_PLATFORM["cpu"] = saved


def test_unhashable_barrier_tag_is_a_type_error():
  def kernel(x_ref, o_ref):
    pltpu.get_barrier_semaphore(tag=["ring"])
    o_ref[...] = x_ref[...]
  f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                     backend="interpret")
  with pytest.raises(TypeError, match="tag=.*hashable") as e:
    f(jnp.ones((8, 128)))
  assert "kernel 'kernel'" in str(e.value) and __file__ in str(e.value)
