"""The cases of Pallas's kernel library written against Pallas's Mosaic GPU
API (the `*_mgpu` ops, `plgpu`): one cheap shape per op, run on the
interpret backend's warpgroup interpreter on a simulated GPU of 2 SMs
(part of `cases.CASES`), and bigger variants (part of `cases.MATRIX`);
the collectives run over the CPU devices of the run.
"""
from __future__ import annotations

import contextlib
import types

import jax
import jax.numpy as jnp

from benchmarks.pallas_library.case import Case, vjp_case
from benchmarks.pallas_library.case import group_sizes as _group_sizes
from benchmarks.pallas_library.case import rand as _rand


class _SimulatedGpu:
  """What the `*_mgpu` ops ask of the GPU they run on, answered on a CPU:
  the default device has 2 SMs (so persistent kernels launch 2 blocks, which
  keeps the CPU run short) and the CUDA runtime is 13.0."""

  core_count = 2

  def get_default_device(self):
    return self

  def cuda_runtime_get_version(self):
    return 13000


_GPU = _SimulatedGpu()


class _JaxOnSimulatedGpu(types.ModuleType):
  """`jax` as the ops see it on the simulated GPU: `jax.devices()[0]` and
  `jax.local_devices()[0]` (where some ops read `core_count`) are `_GPU`;
  every other name is jax's own."""

  def __getattr__(self, name):
    return getattr(jax, name)

  def devices(self, *args, **kwargs):
    return [_GPU]

  def local_devices(self, *args, **kwargs):
    return [_GPU]


_JAX = _JaxOnSimulatedGpu("jax")


@contextlib.contextmanager
def simulated_gpu(module):
  """Points `module`'s `backend` and `cuda_versions` (where it has them) at
  `_GPU`, and its `jax` at `_JAX`, while the op runs; the op's source is
  unchanged."""
  saved = {name: getattr(module, name) for name in ("backend", "cuda_versions")
           if hasattr(module, name)}
  for name in saved:
    setattr(module, name, _GPU)
  if getattr(module, "jax", None) is jax:
    saved["jax"] = jax
    module.jax = _JAX
  try:
    yield
  finally:
    for name, value in saved.items():
      setattr(module, name, value)


def _on_gpu(run):
  """`run(m, interpret)` with `m` on the simulated GPU."""
  def wrapped(m, interpret):
    with simulated_gpu(m):
      return run(m, interpret)
  return wrapped


def _f16(seed, shape):
  return _rand(seed, shape, jnp.float16)


def _hopper_matmul():
  a, b = _f16(0, (128, 128)), _f16(1, (128, 128))

  def run(m, _):
    config = m.TuningConfig(tile_m=64, tile_n=64, tile_k=64,
                            max_concurrent_steps=2)
    return m.matmul(a, b, None, config)
  return Case(_on_gpu(run), lambda m: jnp.dot(
      a, b, preferred_element_type=jnp.float32).astype(jnp.float16),
      tol=2e-2)


def _hopper_mixed_type_matmul():
  a = jax.random.randint(jax.random.key(0), (128, 128), -128, 127, jnp.int8)
  b = _rand(1, (128, 128), jnp.bfloat16)

  def run(m, _):
    config = m.TuningConfig(tile_m=64, tile_n=64, tile_k=64,
                            max_concurrent_steps=2)
    return m.mixed_matmul_kernel(a, b, out_dtype=jnp.bfloat16, config=config)
  return Case(_on_gpu(run),
              lambda m: m.reference(a, b, out_dtype=jnp.bfloat16), tol=2e-2)


def _attention_mgpu(causal):
  q, k, v = (_f16(i, (1, 256, 1, 64)) for i in range(3))

  def run(m, _):
    config = m.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2,
                            causal=causal)
    return m.attention(q, k, v, config)
  return Case(_on_gpu(run),
              lambda m: m.attention_reference(q, k, v, causal=causal),
              tol=5e-3)


def _attention_mgpu_grad(causal):
  """The cotangents of q, k and v through the op's own custom_vjp: its
  plgpu backward kernels (dq, and dk/dv), against the reference's. (The op
  has no causal backward: "Causal attention not supported in the backwards
  pass yet", in Pallas too.)"""
  q, k, v = (_f16(i, (1, 256, 1, 64)) for i in range(3))

  def op(m, _, q, k, v):
    config = m.TuningConfig(
        block_q=64, block_kv=64, max_concurrent_steps=2, causal=causal,
        block_q_dq=64, block_kv_dq=64, block_q_dkv=64, block_kv_dkv=64)
    with simulated_gpu(m):
      return m.attention(q, k, v, config)

  def reference(m, q, k, v):
    # In float32: the reference's own float16 backward loses the digits
    # the comparison needs.
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return m.attention_reference(*f32, causal=causal).astype(q.dtype)
  return vjp_case(op, reference, (q, k, v), (0, 1, 2), tol=2e-2)


def _ragged_dot_mgpu():
  lhs, rhs = _f16(0, (256, 128)), _f16(1, (2, 128, 128))
  sizes = _group_sizes()

  def run(m, _):
    return m.ragged_dot(lhs, rhs, group_sizes=sizes, block_m=64, block_n=64,
                        block_k=64, max_concurrent_steps=2, grid_block_n=1)
  return Case(_on_gpu(run), lambda m: jax.lax.ragged_dot(
      lhs, rhs, sizes, preferred_element_type=jnp.float32).astype(
          jnp.float16), tol=2e-2)


def _transposed_ragged_dot_mgpu():
  lhs, rhs = _f16(0, (256, 128)), _f16(1, (256, 128))
  sizes = _group_sizes()

  def run(m, _):
    return m.transposed_ragged_dot(lhs, rhs, group_sizes=sizes, block_m=64,
                                   block_n=64, block_k=64,
                                   max_concurrent_steps=2, grid_block_n=1)
  return Case(_on_gpu(run), lambda m: m.ref_transposed_ragged_dot(
      lhs, rhs, sizes), tol=2e-2)


def _on_devices(fn, x, out_spec):
  """`fn` per device of a mesh over the CPU devices, `x` split along x."""
  mesh = jax.make_mesh((len(jax.devices()),), ("x",))
  x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P("x")))
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=jax.P("x"),
                               out_specs=out_spec, check_vma=False))(x)


def _all_gather_mgpu():
  x = _rand(0, (8 * 16, 128))

  def run(m, _):
    return _on_devices(lambda s: m.all_gather(s, axis_name="x", num_blocks=2),
                       x, jax.P())
  return Case(_on_gpu(run), lambda m: x)


def _reduce_scatter_mgpu():
  x = _rand(0, (8 * 64, 128))

  def run(m, _):
    return _on_devices(lambda s: m.reduce_scatter(
        s, axis_name="x", scatter_dimension=0, num_blocks=2), x, jax.P("x"))
  return Case(_on_gpu(run), lambda m: x.reshape(8, 64, 128).sum(0))


def _collective_matmul_mgpu():
  lhs, rhs = _f16(0, (8 * 64, 128)), _f16(1, (128, 128))

  def run(m, _):
    config = m.hopper_matmul_mgpu.TuningConfig(
        tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2)
    return _on_devices(lambda s: m.all_gather_lhs_matmul(
        s, rhs, "x", config=config), lhs, jax.P())
  return Case(_on_gpu(run), lambda m: jnp.dot(lhs, rhs))


def _all_gather_variant(gather_dimension=0, dtype=jnp.float32, blocks=2):
  """Every device's output (stacked along dim 0): the shards of x,
  concatenated along `gather_dimension`."""
  x = _rand(0, (8 * 16, 256), dtype)

  def run(m, _):
    return _on_devices(lambda s: m.all_gather(
        s, axis_name="x", gather_dimension=gather_dimension,
        num_blocks=blocks), x, jax.P("x"))

  def reference(m):
    full = jnp.concatenate(list(x.reshape(8, 16, 256)),
                           axis=gather_dimension)
    return jnp.concatenate([full] * 8)
  return Case(_on_gpu(run), reference)


_REDUCE = {"add": jnp.sum, "max": jnp.max,
           "xor": lambda a, axis: jnp.bitwise_xor.reduce(a, axis=axis)}


def _reduce_scatter_variant(reduction="add", scatter_dimension=0,
                            dtype=jnp.float32):
  """Every device's output (stacked along dim 0): its part of the
  reduction over devices (all of it without a scatter dimension)."""
  if jnp.issubdtype(dtype, jnp.integer):
    x = jax.random.randint(jax.random.key(0), (8 * 16, 1024), -1000, 1000,
                           dtype)
  else:
    x = _rand(0, (8 * 16, 1024), dtype)

  def run(m, _):
    return _on_devices(lambda s: m.reduce_scatter(
        s, axis_name="x", scatter_dimension=scatter_dimension,
        reduction=reduction, num_blocks=2), x, jax.P("x"))

  def reference(m):
    full = _REDUCE[reduction](x.reshape(8, 16, 1024), axis=0)
    if scatter_dimension is None:
      return jnp.concatenate([full] * 8)
    if scatter_dimension == 0:
      return full
    return full.reshape(16, 8, 128).transpose(1, 0, 2).reshape(128, 128)
  return Case(_on_gpu(run), reference)


def _collective_matmul_variant(m_shard=128, n=256, wg_dimension="N"):
  lhs, rhs = _f16(0, (8 * m_shard, 128)), _f16(1, (128, n))

  def run(m, _):
    config = m.hopper_matmul_mgpu.TuningConfig(
        tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2,
        wg_dimension=getattr(m.MatmulDimension, wg_dimension))
    return _on_devices(lambda s: m.all_gather_lhs_matmul(
        s, rhs, "x", config=config), lhs, jax.P())
  return Case(_on_gpu(run), lambda m: jnp.dot(lhs, rhs))


def _blackwell_matmul_mgpu():
  a, b = _f16(0, (256, 256)), _f16(1, (256, 256))

  def run(m, _):
    config = m.TuningConfig(tile_m=128, tile_n=128, tile_k=64,
                            max_concurrent_steps=2, collective=False)
    return m.matmul_kernel(a, b, config)
  return Case(_on_gpu(run), lambda m: jnp.dot(a, b))


def _blackwell_ragged_dot_mgpu(rows=256, cols=256, sizes=(100, 156)):
  """collective=True: a cluster of 2 blocks, each with half of every
  tile; the groups split the tiles' rows unevenly between the blocks."""
  a, b = _f16(0, (rows, 256)), _f16(1, (len(sizes), 256, cols))
  sizes = jnp.array(sizes, jnp.int32)

  def run(m, _):
    config = m.TuningConfig(tile_m=128, tile_n=128, tile_k=64,
                            max_concurrent_steps=2, collective=True,
                            grid_tile_width=1,
                            grid_minor_dim=m.blackwell_matmul_mgpu.
                            MatmulDimension.N)
    return m.ragged_dot_kernel(a, b, sizes, config)
  return Case(_on_gpu(run), lambda m: m.ragged_dot_reference(a, b, sizes))


# op -> (module of jax.experimental.pallas.ops, the case).
CASES = {
    "gpu.hopper_matmul_mgpu": ("gpu.hopper_matmul_mgpu", _hopper_matmul),
    "gpu.hopper_mixed_type_matmul_mgpu": ("gpu.hopper_mixed_type_matmul_mgpu",
                                          _hopper_mixed_type_matmul),
    "gpu.attention_mgpu": ("gpu.attention_mgpu",
                           lambda: _attention_mgpu(False)),
    "gpu.attention_mgpu (causal)": ("gpu.attention_mgpu",
                                    lambda: _attention_mgpu(True)),
    "gpu.ragged_dot_mgpu": ("gpu.ragged_dot_mgpu", _ragged_dot_mgpu),
    "gpu.transposed_ragged_dot_mgpu": ("gpu.transposed_ragged_dot_mgpu",
                                       _transposed_ragged_dot_mgpu),
    "gpu.collective_matmul_mgpu": ("gpu.collective_matmul_mgpu",
                                   _collective_matmul_mgpu),
    "gpu.reduce_scatter_mgpu": ("gpu.reduce_scatter_mgpu",
                                _reduce_scatter_mgpu),
    "gpu.all_gather_mgpu": ("gpu.all_gather_mgpu", _all_gather_mgpu),
    "gpu.blackwell_matmul_mgpu": ("gpu.blackwell_matmul_mgpu",
                                  _blackwell_matmul_mgpu),
    "gpu.blackwell_ragged_dot_mgpu": ("gpu.blackwell_ragged_dot_mgpu",
                                      _blackwell_ragged_dot_mgpu),
}

# "op [variant]" -> (module, the case): bigger shapes and the collectives'
# options, part of `cases.MATRIX` (under -m slow).
MATRIX = {
    "gpu.attention_mgpu [grad]": ("gpu.attention_mgpu",
                                  lambda: _attention_mgpu_grad(False)),
    "gpu.blackwell_ragged_dot_mgpu [3 groups, 512 x 512: 8 tiles]": (
        "gpu.blackwell_ragged_dot_mgpu",
        lambda: _blackwell_ragged_dot_mgpu(512, 512, (37, 300, 175))),
    "gpu.all_gather_mgpu [gather dim 1, bfloat16, 4 blocks]": (
        "gpu.all_gather_mgpu",
        lambda: _all_gather_variant(1, jnp.bfloat16, blocks=4)),
    "gpu.all_gather_mgpu [every device's output]": (
        "gpu.all_gather_mgpu", _all_gather_variant),
    "gpu.reduce_scatter_mgpu [all-reduce, max]": (
        "gpu.reduce_scatter_mgpu",
        lambda: _reduce_scatter_variant("max", None)),
    "gpu.reduce_scatter_mgpu [int32 xor, scatter dim 1]": (
        "gpu.reduce_scatter_mgpu",
        lambda: _reduce_scatter_variant("xor", 1, jnp.int32)),
    "gpu.collective_matmul_mgpu [m_shard 128, n 256, warpgroups along n]": (
        "gpu.collective_matmul_mgpu", _collective_matmul_variant),
}
