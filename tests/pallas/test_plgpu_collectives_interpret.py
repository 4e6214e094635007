"""`plgpu.kernel`s that talk to other devices, run by the interpret
backend inside `shard_map` over the CPU devices of the test run: every
device's blocks and warpgroups run together (dsl/interpret/devices.py,
dsl/interpret/semaphores.py), each primitive compared with numpy.
Pallas's GPU interpret mode runs only the kernel that reads the device's
index (compared with it too) and fails on the others (held below; and
for the library's collectives by tests/pallas/test_pallas_ops_limits.py),
so numpy is their reference.
"""
from __future__ import annotations

import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as jpl
from jax.experimental.pallas import mosaic_gpu as jplgpu

import dsl as pl
from dsl import mosaic_gpu as plgpu
from dsl.core.errors import (KernelDeadlockError, KernelError,
                             KernelRaceError, kernel_error_of)
from benchmarks.pallas_library import swap
from benchmarks.pallas_library.cases import dsl_context, make_case
from tests.pallas import plgpu_collective_kernels as lowered

F32 = jnp.float32
HERE = r"test_plgpu_collectives_interpret\.py:\d+"


def on_devices(kernel, x, shape=(8,), names=("x",)):
  """`kernel` per device of a mesh of the CPU devices, `x` split along its
  first dim over every mesh axis; every device's output, stacked."""
  mesh = jax.make_mesh(shape, names)
  spec = jax.P(names)
  x = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
  f = jax.jit(jax.shard_map(kernel, mesh=mesh, in_specs=spec, out_specs=spec,
                            check_vma=False))
  n = int(np.prod(shape))
  out = np.asarray(f(x))
  return out.reshape(n, -1), np.asarray(x).reshape(n, -1)


def interpreted(make, **extra):
  return make(pl, plgpu, backend="interpret", **extra)


def data(dtype=F32, n=8):
  rng = np.random.default_rng(0)
  x = rng.integers(-50, 50, size=(n * 128,))
  return jnp.asarray(x, dtype)


def failure(fn) -> KernelError:
  """The KernelError `fn()` fails with (behind JAX's runtime error)."""
  with pytest.raises(Exception) as info:
    jax.block_until_ready(fn())
    jax.effects_barrier()
  err = kernel_error_of(info.value)
  assert err is not None, info.value
  return err


# ------------------------------------------------------ each primitive

def on_pallas(make, x):
  """`make`'s kernel built by Pallas, in its GPU interpret mode."""
  with jplgpu.force_gpu_interpret_mode(jplgpu.InterpretGPUParams()):
    return on_devices(make(jpl, jplgpu), x)


def test_axis_index_is_the_devices_coordinate():
  """The one of these kernels Pallas's GPU interpret mode runs."""
  got, x = on_devices(interpreted(lowered.device_index), data())
  np.testing.assert_array_equal(got, x + np.arange(8)[:, None])
  np.testing.assert_array_equal(got, on_pallas(lowered.device_index,
                                               data())[0])


@pytest.mark.parametrize("make,error", [
    (lowered.multimem_load_reduce, "ref must be a reference"),
    (lowered.multimem_store, "ref must be a reference"),
    (lowered.signal_and_wait, "No ir_type_handler for aval type"),
    (lowered.multicast_signal, "nan \\+ semaphore")])
def test_pallas_interpret_mode_cannot_run_the_others(make, error):
  """So numpy is their reference (a Pallas release that runs one shows
  up here). Each fails as it is traced or lowered; the remote copy fails
  in a callback while it runs, which leaves JAX's runtime holding the
  error, so it is not run here."""
  with pytest.raises(Exception, match=error):
    on_pallas(make, data())


def done(pl, plgpu, sem, axes="x", n=8):
  """The collectives' end: a multicast signal, and a wait for every
  device's (the accesses of each device's memory are over)."""
  plgpu.semaphore_signal_multicast(sem, collective_axes=axes)
  pl.semaphore_wait(sem, n, decrement=False)


def reduce_all(op, dtype=F32, axes="x", n=8):
  def body(x_ref, o_ref, sem):
    o_ref[...] = plgpu.multimem_load_reduce(x_ref, collective_axes=axes,
                                            reduction_op=op)
    done(pl, plgpu, sem, axes, n)
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), dtype),
                      scratch_types=[plgpu.SemaphoreType.REGULAR],
                      backend="interpret")


def test_multimem_load_reduce_adds_every_devices_copy():
  got, x = on_devices(reduce_all("add"), data())
  np.testing.assert_array_equal(got, np.broadcast_to(x.sum(0), x.shape))


def test_multimem_load_reduce_max_of_int32():
  got, x = on_devices(reduce_all("max", jnp.int32), data(jnp.int32))
  np.testing.assert_array_equal(got, np.broadcast_to(x.max(0), x.shape))


@pytest.mark.parametrize("op,reduce", [("min", np.minimum.reduce),
                                       ("xor", np.bitwise_xor.reduce)])
def test_multimem_load_reduce_along_one_axis_of_two(op, reduce):
  """Along `y` of a (2, 4) mesh: the 4 devices of each row."""
  kernel = reduce_all(op, jnp.int32, "y", 4)
  got, x = on_devices(kernel, data(jnp.int32), (2, 4), ("x", "y"))
  rows = x.reshape(2, 4, 128)
  want = np.repeat(reduce(rows, axis=1)[:, None], 4, axis=1).reshape(8, 128)
  np.testing.assert_array_equal(got, want)


def gather_slices(pl, plgpu, **extra):
  """Each device stores its 16 values into its slice of every device's
  output, then waits for every device's stores (a multicast signal)."""
  def body(x_ref, o_ref, sem):
    me = lax.axis_index("x")
    plgpu.multimem_store(x_ref[...], o_ref.at[pl.ds(me * 16, 16)], "x")
    done(pl, plgpu, sem)
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), F32),
                      scratch_types=[plgpu.SemaphoreType.REGULAR], **extra)


def test_multimem_store_writes_every_devices_copy():
  got, x = on_devices(interpreted(gather_slices), data(n=1)[:128])
  np.testing.assert_array_equal(got, np.broadcast_to(x.reshape(-1),
                                                     (8, 128)))


def test_multimem_store_of_a_scalar():
  """Device d stores its x[3] into element d of every device's copy."""
  def body(x_ref, o_ref, sem):
    plgpu.multimem_store(x_ref[3], o_ref.at[lax.axis_index("x")], "x")
    done(pl, plgpu, sem)
  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,),
                                                            jnp.int32),
                        scratch_types=[plgpu.SemaphoreType.REGULAR],
                        backend="interpret")
  got, x = on_devices(kernel, data(jnp.int32))
  np.testing.assert_array_equal(got[:, :8], np.broadcast_to(x[:, 3],
                                                            (8, 8)))


def remote_copy(wait_first=True):
  """A TMA store into the next device's output and a signal of its
  semaphore; the next device waits for it (or, `wait_first=False`, reads
  its output before it waits)."""
  def body(x_ref, o_ref, y_ref):
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
    nxt = lax.rem(lax.axis_index("x") + 1, 8)

    def scope(smem, barrier):
      plgpu.copy_gmem_to_smem(x_ref, smem, barrier)
      plgpu.barrier_wait(barrier)
      plgpu.copy_smem_to_gmem(smem, plgpu.remote_ref(o_ref, {"x": nxt}))
      plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(scope, plgpu.SMEM((128,), F32), plgpu.Barrier())
    pl.semaphore_signal(sem, device_id={"x": nxt})
    if wait_first:
      pl.semaphore_wait(sem, 1)
      y_ref[...] = o_ref[...] * 2
    else:
      y_ref[...] = o_ref[...] * 2
      pl.semaphore_wait(sem, 1)
  shape = jax.ShapeDtypeStruct((128,), F32)
  return plgpu.kernel(body, out_type=(shape, shape), backend="interpret")


def test_remote_copy_lands_in_the_next_devices_output():
  kernel = remote_copy()
  got, x = on_devices(lambda s: kernel(s)[1], data())
  np.testing.assert_array_equal(got, 2 * np.roll(x, 1, axis=0))


def signal_counts(pl, plgpu, **extra):
  """Device d signals device d+1 (a global semaphore), d + 1 times, then
  waits for its predecessor's signals; its output reads the count."""
  def body(x_ref, o_ref):
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
    me = lax.axis_index("x")
    nxt = lax.rem(me + 1, 8)
    prev = lax.rem(me + 7, 8)

    @pl.loop(0, me + 1)
    def _(i):
      pl.semaphore_signal(sem, device_id={"x": nxt})
    pl.semaphore_wait(sem, prev + 1, decrement=False)
    o_ref[...] = x_ref[...] + pl.semaphore_read(sem).astype(F32)
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), F32),
                      **extra)


def test_signal_to_a_peer_and_a_wait_that_keeps_the_count():
  got, x = on_devices(interpreted(signal_counts), data())
  counts = (np.arange(8) + 7) % 8 + 1
  np.testing.assert_array_equal(got, x + counts[:, None])


def test_wait_that_decrements_takes_the_count_back():
  def body(x_ref, o_ref):
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
    pl.semaphore_signal(sem, 3, device_id=lax.rem(lax.axis_index("x") + 1,
                                                  8),
                        device_id_type=pl.DeviceIdType.LOGICAL)
    pl.semaphore_wait(sem, 2)
    o_ref[...] = x_ref[...] + pl.semaphore_read(sem).astype(F32)
  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), F32),
                        backend="interpret")
  got, x = on_devices(kernel, data())
  np.testing.assert_array_equal(got, x + 1)


def test_a_device_id_of_one_axis_keeps_the_others():
  """On a (2, 4) mesh, `device_id={"y": ...}` names the device of the same
  row: each device stores into the next one's output along y."""
  def body(x_ref, o_ref):
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
    nxt = {"y": lax.rem(lax.axis_index("y") + 1, 4)}
    plgpu.remote_ref(o_ref, nxt)[...] = (
        x_ref[...] + 100 * lax.axis_index("x").astype(F32))
    pl.semaphore_signal(sem, device_id=nxt)
    pl.semaphore_wait(sem, 1)
  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), F32),
                        backend="interpret")
  got, x = on_devices(kernel, data(), (2, 4), ("x", "y"))
  rows = (x + 100 * (np.arange(8) // 4)[:, None]).reshape(2, 4, 128)
  np.testing.assert_array_equal(got, np.roll(rows, 1, axis=1).reshape(8,
                                                                      128))


def test_a_signal_through_a_remote_ref_of_the_semaphore():
  """`pl.semaphore_signal(plgpu.remote_ref(sem, peer))` signals the peer's
  copy, as `device_id=peer` does: it orders the store before it."""
  def body(x_ref, o_ref):
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
    nxt = {"x": lax.rem(lax.axis_index("x") + 1, 8)}
    plgpu.remote_ref(o_ref, nxt)[...] = x_ref[...]
    pl.semaphore_signal(plgpu.remote_ref(sem, nxt))
    pl.semaphore_wait(sem, 1)
    o_ref[...] = o_ref[...] * 2
  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), F32),
                        backend="interpret")
  got, x = on_devices(kernel, data())
  np.testing.assert_array_equal(got, 2 * np.roll(x, 1, axis=0))


def test_multicast_signal_reaches_each_blocks_semaphore():
  """Two blocks per device: each block's semaphore counts the 8 signals of
  the same block of every device."""
  def body(x_ref, o_ref, sem):
    b = lax.axis_index("blocks")
    plgpu.semaphore_signal_multicast(sem, collective_axes="x")
    pl.semaphore_wait(sem, 8, decrement=False)
    o_ref[pl.ds(b * 64, 64)] = (x_ref[pl.ds(b * 64, 64)]
                                + pl.semaphore_read(sem).astype(F32))
  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), F32),
                        scratch_types=(plgpu.SemaphoreType.REGULAR,),
                        grid=(2,), grid_names=("blocks",),
                        backend="interpret")
  got, x = on_devices(kernel, data())
  np.testing.assert_array_equal(got, x + 8)


# ------------------------------------------------------ seeded bugs

def test_a_signal_to_the_wrong_device_is_a_deadlock_naming_the_wait():
  """Every device signals itself, but waits for its predecessor's signal
  too: the devices' waits never end."""
  def body(x_ref, o_ref):
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
    pl.semaphore_signal(sem, device_id={"x": lax.axis_index("x")})
    pl.semaphore_wait(sem, 2, decrement=False)
    o_ref[...] = x_ref[...]
  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), F32),
                        backend="interpret")
  err = failure(lambda: on_devices(kernel, data()))
  assert isinstance(err, KernelDeadlockError)
  assert err.kernel == "body"
  assert "deadlock" in str(err) and "on device 0" in str(err)
  assert "waits for get_global at" in err.short
  assert "to reach 2 (it holds 1)" in err.short
  assert err.where and err.where.split(":")[0].endswith(
      "test_plgpu_collectives_interpret.py")


def test_a_device_id_outside_the_mesh_names_the_kernel_and_line():
  def body(x_ref, o_ref):
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
    pl.semaphore_signal(sem, device_id={"x": lax.axis_index("x") + 1})
    o_ref[...] = x_ref[...]
  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), F32),
                        backend="interpret")
  err = failure(lambda: on_devices(kernel, data()))
  assert err.kernel == "body"
  assert "names device 8, outside the 8 devices" in str(err)
  assert err.where and "test_plgpu_collectives_interpret.py" in err.where


def test_collective_axes_outside_the_mesh_are_refused_by_name():
  def body(x_ref, o_ref):
    plgpu.multimem_store(x_ref[...], o_ref, "y")
  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), F32),
                        backend="interpret")
  err = failure(lambda: on_devices(kernel, data()))
  assert err.kernel == "body"
  assert "plgpu.multimem_store names the device axes ['y']" in str(err)
  assert "('x',)" in str(err)


@pytest.mark.parametrize("make,owner,verb,peer", [
    (lowered.remote_copy, 1, "store", 0),
    (lowered.multimem_load_reduce, 0, "read", 7)])
def test_a_missing_wait_is_a_race_naming_the_access(make, owner, verb, peer):
  """The kernels that test_plgpu_collectives.py lowers do not wait:
  the access of the peer's memory is not ordered before the peer's kernel
  ends (the last read of each element is the one named)."""
  err = failure(lambda: on_devices(interpreted(make), data()))
  assert isinstance(err, KernelRaceError)
  assert err.kernel == "body"
  assert (f"the kernel ends on device {owner} before the {verb} of "
          f"warpgroup (0,) of block () on device {peer} at ") in err.short
  assert "plgpu_collective_kernels.py" in err.where


def test_a_read_before_the_wait_that_orders_it_is_a_race():
  kernel = remote_copy(wait_first=False)
  err = failure(lambda: on_devices(lambda s: kernel(s)[1], data()))
  assert isinstance(err, KernelRaceError)
  assert ("on device 1 reads it, but the store of warpgroup (0,) of block () "
          "on device 0 at") in err.short
  assert ("is not ordered before (signal a semaphore after it and wait for "
          "that signal first)") in err.short
  assert re.search(HERE, err.where)


def test_stores_of_two_devices_into_one_element_are_a_race():
  """Every device stores its x[3] into element 3 of every copy."""
  err = failure(lambda: on_devices(
      interpreted(lowered.multimem_store_scalar), data(jnp.int32)))
  assert isinstance(err, KernelRaceError)
  assert ("stores into it, but the store of warpgroup (0,) of block () on "
          "device 0") in err.short


# ---------------------------------------------- the library's collectives

def without_waits(name: str, folder) -> types.ModuleType:
  """Pallas's op `name` swapped onto dsl, with each `pl.semaphore_wait`
  line made a `pass` (a seeded bug: the same lines otherwise), run from a
  copy in `folder` (errors name the copy's lines)."""
  swap.install()
  path = os.path.join(swap.ops_dir(), *name.split(".")) + ".py"
  with open(path, encoding="utf-8") as f:
    source = swap.rewrite(f.read(), path)
  source = re.sub(r"^(\s*)pl\.semaphore_wait\(.*$", r"\1pass", source,
                  flags=re.M)
  copy = folder / os.path.basename(path)
  copy.write_text(source)
  module = types.ModuleType(f"{swap.PREFIX}.{name}_without_waits")
  exec(compile(source, str(copy), "exec"), module.__dict__)  # noqa: S102
  return module, source


@pytest.mark.parametrize("op,access", [
    ("gpu.all_gather_mgpu", "plgpu.multimem_store("),
    ("gpu.reduce_scatter_mgpu", "plgpu.multimem_load_reduce("),
    ("gpu.collective_matmul_mgpu", "plgpu.copy_smem_to_gmem(a_smem")])
def test_the_collectives_without_their_waits_race(op, access, tmp_path):
  """The library's case of each collective passes (test_pallas_ops.py);
  with its waits gone, the accesses of peers' memory race, named at the
  op's own line of the access."""
  module, source = without_waits(op, tmp_path)
  line = next(i for i, text in enumerate(source.splitlines(), 1)
              if access in text)
  case = make_case(op)
  with dsl_context(op, "interpret"):
    err = failure(lambda: case.run(module, False, *case.args))
  assert isinstance(err, KernelRaceError)
  assert err.where == f"{tmp_path / (op.split('.')[1] + '.py')}:{line}"
  assert re.search(r"race on \S+ of device \d: ", err.short)


def handed_on(wait_for_barrier: bool):
  """Warpgroup 0 stores the device's slice into every device's output and
  waits for every device's stores; it hands the output on to warpgroup 1
  through an mbarrier, whose wait orders warpgroup 1's read after them."""
  def body(x_ref, o_ref, y_ref, sem, bar):
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _():
      me = lax.axis_index("x")
      plgpu.multimem_store(x_ref[...], o_ref.at[pl.ds(me * 16, 16)], "x")
      done(pl, plgpu, sem)
      plgpu.barrier_arrive(bar)

    @pl.when(wg == 1)
    def _():
      if wait_for_barrier:
        plgpu.barrier_wait(bar)
      y_ref[...] = o_ref[...] + 1
  shape = jax.ShapeDtypeStruct((128,), F32)
  return plgpu.kernel(body, out_type=(shape, shape), num_threads=2,
                      thread_name="wg",
                      scratch_types=[plgpu.SemaphoreType.REGULAR,
                                     plgpu.Barrier(num_arrivals=1)],
                      backend="interpret")


def test_an_mbarrier_hands_on_what_a_semaphore_wait_ordered():
  kernel = handed_on(wait_for_barrier=True)
  got, x = on_devices(lambda s: kernel(s)[1], data(n=1)[:128])
  np.testing.assert_array_equal(got, np.broadcast_to(x.reshape(-1) + 1,
                                                     (8, 128)))


def test_a_read_the_mbarrier_does_not_order_is_a_race():
  kernel = handed_on(wait_for_barrier=False)
  err = failure(lambda: on_devices(lambda s: kernel(s)[1], data(n=1)[:128]))
  assert isinstance(err, KernelRaceError)
  assert re.search(r"on device \d stores into it, but the read of warpgroup "
                   r"\(1,\) of block \(\) on device 0 at \S+:\d+ is not "
                   "ordered before", err.short)
