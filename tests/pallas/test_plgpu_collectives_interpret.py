"""`plgpu.kernel`s that talk to other devices, run by the interpret
backend inside `shard_map` over the CPU devices of the test run: every
device's blocks and warpgroups run together (dsl/interpret/devices.py,
dsl/interpret/semaphores.py), each primitive compared with numpy.
Pallas's GPU interpret mode cannot run these kernels (it fails on their
semaphores: tests/pallas/test_pallas_ops_limits.py holds that for the
library's collectives), so numpy is the only reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import dsl as pl
from dsl import mosaic_gpu as plgpu
from dsl.core.errors import KernelDeadlockError, KernelError, kernel_error_of
from tests.pallas import test_plgpu_collectives as lowered

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
    fn()
  err = kernel_error_of(info.value)
  assert err is not None, info.value
  return err


# ------------------------------------------------------ each primitive

def test_axis_index_is_the_devices_coordinate():
  got, x = on_devices(interpreted(lowered.device_index), data())
  np.testing.assert_array_equal(got, x + np.arange(8)[:, None])


def test_multimem_load_reduce_adds_every_devices_copy():
  got, x = on_devices(interpreted(lowered.multimem_load_reduce), data())
  np.testing.assert_array_equal(got, np.broadcast_to(x.sum(0), x.shape))


def test_multimem_load_reduce_max_of_int32():
  got, x = on_devices(interpreted(lowered.multimem_load_max),
                      data(jnp.int32))
  np.testing.assert_array_equal(got, np.broadcast_to(x.max(0), x.shape))


@pytest.mark.parametrize("op,reduce", [("min", np.minimum.reduce),
                                       ("xor", np.bitwise_xor.reduce)])
def test_multimem_load_reduce_along_one_axis_of_two(op, reduce):
  """Along `y` of a (2, 4) mesh: the 4 devices of each row."""
  def body(x_ref, o_ref):
    o_ref[...] = plgpu.multimem_load_reduce(x_ref, collective_axes="y",
                                            reduction_op=op)
  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,),
                                                            jnp.int32),
                        backend="interpret")
  got, x = on_devices(kernel, data(jnp.int32), (2, 4), ("x", "y"))
  rows = x.reshape(2, 4, 128)
  want = np.repeat(reduce(rows, axis=1)[:, None], 4, axis=1).reshape(8, 128)
  np.testing.assert_array_equal(got, want)


def gather_slices(pl, plgpu, **extra):
  """Each device stores its 16 values into its slice of every device's
  output, then waits for every device's stores (a multicast signal)."""
  def body(x_ref, o_ref, done):
    me = lax.axis_index("x")
    plgpu.multimem_store(x_ref[...], o_ref.at[pl.ds(me * 16, 16)], "x")
    plgpu.semaphore_signal_multicast(done, collective_axes="x")
    pl.semaphore_wait(done, 8, decrement=False)
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), F32),
                      scratch_types=[plgpu.SemaphoreType.REGULAR], **extra)


def test_multimem_store_writes_every_devices_copy():
  got, x = on_devices(interpreted(gather_slices), data(n=1)[:128])
  np.testing.assert_array_equal(got, np.broadcast_to(x.reshape(-1),
                                                     (8, 128)))


def test_multimem_store_of_a_scalar():
  """Every device stores x[3] into element 3 of every copy; the last
  device's store lands last."""
  got, x = on_devices(interpreted(lowered.multimem_store_scalar),
                      data(jnp.int32))
  np.testing.assert_array_equal(got[:, 3], np.full(8, x[7, 3]))


def test_remote_copy_lands_in_the_next_devices_output():
  got, x = on_devices(interpreted(lowered.remote_copy), data())
  np.testing.assert_array_equal(got, np.roll(x, 1, axis=0))


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
