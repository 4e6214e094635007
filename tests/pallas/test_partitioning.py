"""A pallas_call under jax.jit with sharded operands partitions itself: each
device runs the kernel on its shards, with no all-gather of the operands and
outputs sharded as the inputs imply (tests/conftest.py asks XLA for 8 host
devices)."""
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import dsl as pl
from dsl import tpu as pltpu
from dsl.core import config, sharding
from tests.pallas.testing import assert_close, matmul_call

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
BACKENDS = ["interpret", "triton_interpret", "mosaic_interpret"]
AXIS_TYPES = [AxisType.Auto, AxisType.Explicit]


@pytest.fixture
def verbose():
  """Gathers are logged with jax_pallas_verbose_errors."""
  old = config.verbose_errors()
  jax.config.update("jax_pallas_verbose_errors", True)
  sharding.forget_logged()
  jax.clear_caches()      # the reason is logged when a kernel is compiled
  yield
  jax.config.update("jax_pallas_verbose_errors", old)


def _mesh(axis_type, shape=(8,), names=("x",)):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def _put(x, mesh, spec):
  return jax.device_put(x, NamedSharding(mesh, spec))


def _gathers(fn, *args):
  """The all-gathers of floating-point data in the compiled HLO of fn (the
  host backends also exchange an s32 failure flag, which is not data)."""
  text = jax.jit(fn).lower(*args).compile().as_text()
  return [l for l in text.splitlines() if "all-gather(" in l
          and not re.search(r"= (s32|u32|pred)\[", l)]


def _spec(x):
  spec = tuple(x.sharding.spec)
  return spec + (None,) * (x.ndim - len(spec))


def _rows(backend, n_rows=128, n_cols=128, block=(8, 128)):
  def kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + jnp.sin(y_ref[...])

  def f(x, y):
    return pl.pallas_call(
        kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(n_rows // block[0], n_cols // block[1]),
        in_specs=[pl.BlockSpec(block, lambda i, j: (i, j))] * 2,
        out_specs=pl.BlockSpec(block, lambda i, j: (i, j)),
        backend=backend)(x, y)
  return f


def _xy(shape=(128, 128)):
  x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) / 100
  return x, jnp.cos(x)


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_partition_without_gather(backend, axis_type):
  mesh = _mesh(axis_type)
  x, y = _xy()
  xs, ys = _put(x, mesh, P("x")), _put(y, mesh, P("x"))
  f = _rows(backend)
  assert _gathers(f, xs, ys) == []
  out = jax.jit(f)(xs, ys)
  assert _spec(out) == ("x", None)
  assert_close(out, x * 2 + jnp.sin(y))


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_mesh_axes_two_grid_dims(backend, axis_type):
  mesh = _mesh(axis_type, (4, 2), ("x", "y"))
  x, y = _xy((64, 512))
  xs, ys = _put(x, mesh, P("x", "y")), _put(y, mesh, P("x", "y"))
  f = _rows(backend, 64, 512)
  assert _gathers(f, xs, ys) == []
  out = jax.jit(f)(xs, ys)
  assert _spec(out) == ("x", "y")
  assert_close(out, x * 2 + jnp.sin(y))


def test_set_mesh_and_reshard_explicit():
  mesh = _mesh(AxisType.Explicit)
  x, y = _xy()
  f = _rows("interpret")

  def g(x, y):
    x = jax.sharding.reshard(x, P("x"))
    y = jax.sharding.reshard(y, P("x"))
    return f(x, y)

  with jax.set_mesh(mesh):
    xr, yr = _put(x, mesh, P()), _put(y, mesh, P())
    out = jax.jit(g)(xr, yr)
    assert _spec(out) == ("x", None)
    assert_close(out, x * 2 + jnp.sin(y))
    xs, ys = _put(x, mesh, P("x")), _put(y, mesh, P("x"))
    assert _gathers(f, xs, ys) == []


def _matmul(backend, bm=16, bn=128, bk=128):
  def f(x, y):
    return matmul_call(pl, pltpu, x.shape[0], x.shape[1], y.shape[1],
                       (bm, bk, bn), scratch=True, backend=backend)(x, y)
  return f


def _mm_operands():
  k1, k2 = jax.random.split(jax.random.key(0))
  return (jax.random.normal(k1, (128, 256), jnp.float32),
          jax.random.normal(k2, (256, 256), jnp.float32))


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matmul_rows_sharded(backend, axis_type):
  """Rows follow grid dim 0; y does not depend on it and is read whole."""
  mesh = _mesh(axis_type)
  x, y = _mm_operands()
  xs, yr = _put(x, mesh, P("x")), _put(y, mesh, P())
  f = _matmul(backend)
  assert _gathers(f, xs, yr) == []
  out = jax.jit(f)(xs, yr)
  assert _spec(out) == ("x", None)
  assert_close(out, x @ y, tol=1e-3)


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
def test_reduced_dim_is_gathered_and_logged(axis_type, caplog, verbose):
  """K is the dim the kernel accumulates over: it is gathered, once said."""
  mesh = _mesh(axis_type)
  x, y = _mm_operands()
  xs, ys = _put(x, mesh, P(None, "x")), _put(y, mesh, P("x"))
  f = _matmul("interpret")
  with caplog.at_level(logging.WARNING, logger="dsl.transforms.partitioning"):
    assert _gathers(f, xs, ys) != []
    out = jax.jit(f)(xs, ys)
    jax.jit(lambda a, b: f(a, b) + 0)(xs, ys)
  msgs = [r.getMessage() for r in caplog.records
          if r.name == "dsl.transforms.partitioning"]
  gathered = [m for m in msgs if "in_specs[0] is gathered along dim 1" in m]
  assert len(gathered) == 1, msgs
  assert "revisits output blocks" in gathered[0]
  assert _spec(out) == (None, None)
  assert_close(out, x @ y, tol=1e-3)


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_program_id_is_global_on_each_device(backend, axis_type):
  """A kernel that reads program_id of a partitioned dim sees the global
  index: each device's grid starts where its shard does."""
  def kernel(x_ref, o_ref):
    i, j = pl.program_id(0), pl.program_id(1)
    o_ref[...] = (x_ref[...] + (i * 10 + j).astype(jnp.float32)
                  + pl.num_programs(0) * 1000.0)

  spec = pl.BlockSpec((8, 128), lambda i, j: (i, j))
  f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((64, 256), jnp.float32),
                     grid=(8, 2), in_specs=[spec], out_specs=spec,
                     backend=backend)
  mesh = _mesh(axis_type, (4, 2), ("x", "y"))
  x = jnp.zeros((64, 256), jnp.float32)
  xs = _put(x, mesh, P("x", "y"))
  assert _gathers(f, xs) == []
  out = jax.jit(f)(xs)
  assert _spec(out) == ("x", "y")
  ids = (jnp.repeat(jnp.arange(8.0), 8)[:, None] * 10
         + jnp.repeat(jnp.arange(2.0), 128)[None, :])
  assert_close(out, ids + 8000)


def test_shards_smaller_than_a_block_are_gathered(caplog, verbose):
  mesh = _mesh(AxisType.Auto)
  x, y = _xy((32, 128))    # 4 blocks of 8 rows over 8 devices
  xs, ys = _put(x, mesh, P("x")), _put(y, mesh, P("x"))
  f = _rows("interpret", 32, 128)
  with caplog.at_level(logging.WARNING, logger="dsl.transforms.partitioning"):
    out = jax.jit(f)(xs, ys)
  assert any("whole" in r.getMessage() for r in caplog.records)
  assert_close(out, x * 2 + jnp.sin(y))


@pytest.mark.parametrize("backend", ["interpret", "mosaic_interpret"])
def test_inside_shard_map_not_partitioned_again(backend):
  mesh = _mesh(AxisType.Explicit)
  x, y = _xy()
  f = _rows(backend, 16, 128)     # the per-device shard: 16 rows
  g = jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P("x")),
                    out_specs=P("x"))
  xs, ys = _put(x, mesh, P("x")), _put(y, mesh, P("x"))
  # Under plain jit the kernel lowers through custom_partitioning...
  whole = _rows(backend)
  assert "CustomSPMDPartitioning" in jax.jit(whole).lower(xs, ys).as_text()
  # ... inside shard_map it is per device already.
  text = jax.jit(g).lower(xs, ys).as_text()
  assert "CustomSPMDPartitioning" not in text
  out = jax.jit(g)(xs, ys)
  assert_close(out, x * 2 + jnp.sin(y))


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
@pytest.mark.parametrize("backend", ["interpret", "triton_interpret"])
def test_grad_and_jvp_partition(backend, axis_type):
  mesh = _mesh(axis_type)
  x, y = _xy()
  xs, ys = _put(x, mesh, P("x")), _put(y, mesh, P("x"))
  f = _rows(backend)

  def loss(x, y):
    return jnp.sum(f(x, y) ** 2)

  gx, gy = jax.jit(jax.grad(loss, argnums=(0, 1)))(xs, ys)
  rx, ry = jax.grad(lambda a, b: jnp.sum((a * 2 + jnp.sin(b)) ** 2),
                    argnums=(0, 1))(x, y)
  assert_close(gx, rx, tol=1e-4)
  assert_close(gy, ry, tol=1e-4)
  assert _spec(gx) == ("x", None)
  jvp = lambda a, b: jax.jvp(f, (a, b), (a, b))
  assert _gathers(jvp, xs, ys) == []
  _, t = jax.jit(jvp)(xs, ys)
  assert_close(t, x * 2 + jnp.cos(y) * y, tol=1e-4)


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
def test_vmap_batch_dim_partitions(axis_type):
  mesh = _mesh(axis_type)
  x = jnp.arange(8 * 16 * 128, dtype=jnp.float32).reshape(8, 16, 128) / 1e3
  y = jnp.cos(x)
  xs, ys = _put(x, mesh, P("x")), _put(y, mesh, P("x"))
  f = jax.vmap(_rows("interpret", 16, 128))
  assert _gathers(f, xs, ys) == []
  out = jax.jit(f)(xs, ys)
  assert _spec(out)[0] == "x"
  assert_close(out, x * 2 + jnp.sin(y))


def test_sharding_rule_names_grid_factors():
  x, y = _mm_operands()
  f = _matmul("interpret")
  jaxpr = jax.make_jaxpr(f)(x, y)
  spec = jaxpr.eqns[0].params["spec"]
  layout = sharding.layout_of(spec)
  assert layout.partitionable == (0, 1)
  assert layout.dims == ((0, None), (None, 1), (0, 1))
  rule = str(sharding.sharding_rule(layout))
  assert "g0" in rule and "g1" in rule and "g2" not in rule


def test_gathers_are_quiet_without_verbose_errors(caplog):
  jax.config.update("jax_pallas_verbose_errors", False)
  sharding.forget_logged()
  jax.clear_caches()
  mesh = _mesh(AxisType.Auto)
  x, y = _mm_operands()
  xs, ys = _put(x, mesh, P(None, "x")), _put(y, mesh, P("x"))
  with caplog.at_level(logging.WARNING, logger="dsl.transforms.partitioning"):
    out = jax.jit(_matmul("interpret"))(xs, ys)
  assert not [r for r in caplog.records if r.name == "dsl.transforms.partitioning"]
  assert_close(out, x @ y, tol=1e-3)


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["auto", "explicit"])
def test_prefetch_alias_and_gridless_kernels(axis_type):
  mesh = _mesh(axis_type)
  x = jnp.arange(64 * 128, dtype=jnp.float32).reshape(64, 128)
  xs = _put(x, mesh, P("x"))

  def add_prefetched(idx_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] + idx_ref[0].astype(jnp.float32)

  row = pl.BlockSpec((8, 128), lambda i, s: (i, 0))
  f = pl.pallas_call(add_prefetched, jax.ShapeDtypeStruct(x.shape, x.dtype),
                     grid_spec=pl.PrefetchScalarGridSpec(
                         num_scalar_prefetch=1, grid=(8,), in_specs=[row],
                         out_specs=row), backend="interpret")
  idx = _put(jnp.array([3], jnp.int32), mesh, P())
  assert _gathers(f, idx, xs) == []
  out = jax.jit(f)(idx, xs)
  assert _spec(out) == ("x", None)
  assert_close(out, x + 3)

  def triple(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 3

  row = pl.BlockSpec((8, 128), lambda i: (i, 0))
  g = pl.pallas_call(triple, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(8,),
                     in_specs=[row], out_specs=row, input_output_aliases={0: 0},
                     backend="triton_interpret")
  out = jax.jit(g)(xs)
  assert _spec(out) == ("x", None)
  assert_close(out, x * 3)

  # No grid: the kernel reads whole arrays, so they are gathered.
  h = pl.pallas_call(triple, jax.ShapeDtypeStruct(x.shape, x.dtype),
                     backend="mosaic_interpret")
  assert _gathers(h, xs) != []
  out = jax.jit(h)(xs)
  assert _spec(out) == (None, None)
  assert_close(out, x * 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_and_vmap_of_a_kernel_reading_program_id(backend):
  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.sin(x_ref[...]) * (pl.program_id(0) + 1).astype(
        jnp.float32)

  spec = pl.BlockSpec((8, 128), lambda i: (i, 0))
  f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((64, 128), jnp.float32),
                     grid=(8,), in_specs=[spec], out_specs=spec,
                     backend=backend)
  mesh = _mesh(AxisType.Explicit)
  x = jax.random.normal(jax.random.key(0), (64, 128))
  xs = _put(x, mesh, P("x"))
  scale = jnp.repeat(jnp.arange(1.0, 9.0), 8)[:, None]
  g = jax.jit(jax.grad(lambda a: jnp.sum(f(a))))(xs)
  assert_close(g, jnp.cos(x) * scale, tol=1e-5)
  assert _spec(g) == ("x", None)
  v = jax.jit(jax.vmap(f))(jnp.stack([xs, 2 * xs]))
  assert_close(v[1], jnp.sin(2 * x) * scale, tol=1e-5)
