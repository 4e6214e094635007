"""all_gather / reduce_scatter kernels inside shard_map, against lax's own,
on the Mosaic interpreter and the interpret backend; gradients; and SPIN
verifies the ring protocol free of races and deadlocks."""
import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import kernels
from tests.pallas.testing import assert_close

BACKENDS = ["mosaic_interpret", "interpret"]


def _mesh(n):
  if len(jax.devices()) < n:
    pytest.fail("tests/conftest.py should provide 8 host devices")
  return Mesh(np.array(jax.devices()[:n]), ("x",))


def _sharded(fn, n, x):
  mesh = _mesh(n)
  f = jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                    check_vma=False)
  return jax.jit(f), jax.device_put(x, NamedSharding(mesh, P("x")))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_all_gather(n, backend, dtype):
  x = jax.random.normal(jax.random.key(n), (n * 8, 128)).astype(dtype)
  f, xs = _sharded(functools.partial(kernels.all_gather, axis_name="x",
                                     backend=backend), n, x)
  ref, _ = _sharded(functools.partial(kernels.collectives.reference_all_gather,
                                      axis_name="x"), n, x)
  np.testing.assert_array_equal(np.asarray(f(xs), np.float32),
                                np.asarray(ref(xs), np.float32))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_scatter(n, backend):
  x = jax.random.normal(jax.random.key(n), (n * n * 8, 128))
  f, xs = _sharded(functools.partial(kernels.reduce_scatter, axis_name="x",
                                     backend=backend), n, x)
  ref, _ = _sharded(functools.partial(
      kernels.collectives.reference_reduce_scatter, axis_name="x"), n, x)
  assert_close(f(xs), ref(xs))


def test_gradients_are_each_other():
  n = 4
  x = jax.random.normal(jax.random.key(0), (n * 8, 128))
  w = jax.random.normal(jax.random.key(1), (n * n * 8, 128))
  mesh = _mesh(n)

  def loss(gather):
    def body(x, w):
      return jnp.sum(gather(x) * w)[None]
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")),
                      out_specs=P("x"), check_vma=False)
    return lambda x, w: jnp.sum(f(x, w))

  ours = jax.grad(loss(functools.partial(kernels.all_gather, axis_name="x",
                                         backend="mosaic_interpret")))(x, w)
  want = jax.grad(loss(functools.partial(
      kernels.collectives.reference_all_gather, axis_name="x")))(x, w)
  assert_close(ours, want)


@pytest.mark.skipif(shutil.which("spin") is None,
                    reason="spin not installed (apt-get install spin)")
@pytest.mark.parametrize("which", ["all_gather", "reduce_scatter"])
def test_spin_verifies_the_ring(which):
  from lowering_mosaic import verify
  n = 3
  rows = n * 8 if which == "reduce_scatter" else 8
  fn = functools.partial(getattr(kernels, which), axis_name="x",
                         backend="mosaic_interpret")
  mesh = _mesh(n)
  f = jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"),
                    check_vma=False)
  report = verify.verify(f, jnp.zeros((n * rows, 128)), timeout_s=60)
  assert report.kind == "ok", str(report)
