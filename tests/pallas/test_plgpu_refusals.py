"""The `*_mgpu` ops of Pallas's kernel library that dsl's Mosaic GPU
lowering does not take yet: the collectives (all_gather_mgpu,
reduce_scatter_mgpu, collective_matmul_mgpu) and the Blackwell ops. Pallas
lowers each for CUDA on a CPU (the collectives over an abstract mesh of 8
devices); dsl refuses each by name, and each piece of the collectives that
its lowering lacks is refused by name too.
"""
from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import dsl as pl
from dsl import mosaic_gpu as plgpu
from dsl.core.errors import BackendError, KernelError
from benchmarks.pallas_library.cases_mgpu import simulated_gpu
from benchmarks.pallas_library.swap import ops_dir, original, swapped
from tests.pallas.plgpu_modules import captured  # noqa: F401 -- a fixture

F32 = jnp.float32


def _on_mesh(fn, shape, dtype, out_spec):
  """`fn` per device of an abstract mesh of 8 devices along "x" (no device
  is needed to lower), lowered for CUDA."""
  mesh = jax.sharding.AbstractMesh((8,), ("x",))
  x = jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(
      mesh, jax.P("x")))
  jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=jax.P("x"),
                        out_specs=out_spec, check_vma=False)).trace(x).lower(
                            lowering_platforms=("cuda",))


def _all_gather(m):
  _on_mesh(lambda s: m.all_gather(s, axis_name="x", num_blocks=2),
           (8 * 16, 128), F32, jax.P())


def _reduce_scatter(m):
  _on_mesh(lambda s: m.reduce_scatter(s, axis_name="x", scatter_dimension=0,
                                      num_blocks=2),
           (8 * 64, 128), F32, jax.P("x"))


def _collective_matmul(m):
  rhs = jnp.ones((128, 128), jnp.float16)
  config = m.hopper_matmul_mgpu.TuningConfig(tile_m=64, tile_n=64, tile_k=64,
                                             max_concurrent_steps=2)
  _on_mesh(lambda s: m.all_gather_lhs_matmul(s, rhs, "x", config=config),
           (8 * 64, 128), jnp.float16, jax.P())


# op -> (its lowering, an instruction of Pallas's module only it has)
_COLLECTIVES = {
    "gpu.all_gather_mgpu": (_all_gather, "multimem.st.relaxed.sys.global"),
    "gpu.reduce_scatter_mgpu": (_reduce_scatter,
                                "multimem.ld_reduce.relaxed.sys.global.add"),
    "gpu.collective_matmul_mgpu": (_collective_matmul, "mosaic_gpu.wgmma"),
}


@pytest.mark.parametrize("op", sorted(_COLLECTIVES))
def test_collectives_lower_on_pallas_and_are_refused_by_name(captured, op):
  lower, instruction = _COLLECTIVES[op]
  with simulated_gpu(original(op)):
    lower(original(op))
  ((dialect, lowered),) = captured
  # Pallas's module loads the device id and signals a peer's semaphore.
  assert "mosaic_gpu.device_id_load" in dialect
  assert "red.release.sys.global.add.u32" in lowered
  assert instruction in dialect + lowered
  # dsl stops at the wait that keeps the count, naming it and the op's line.
  with pl.default_backend("mosaic_gpu"), simulated_gpu(swapped(op)), \
      pytest.raises(KernelError, match=r"semaphore_wait\(decrement=False\)"
                    r".*\(at \S+\.py:\d+\)"):
    lower(swapped(op))


def _blackwell_matmul(m):
  a = jnp.ones((256, 256), jnp.float16)
  config = m.TuningConfig(tile_m=128, tile_n=128, tile_k=64,
                          max_concurrent_steps=2, collective=False)
  with simulated_gpu(m):
    jax.jit(lambda a, b: m.matmul_kernel(a, b, config)).trace(a, a).lower(
        lowering_platforms=("cuda",))


def _blackwell_ragged_dot(m):
  a, b = jnp.ones((256, 256), jnp.float16), jnp.ones((2, 256, 256),
                                                     jnp.float16)
  sizes = jnp.array([128, 128], jnp.int32)
  # collective=False reads the unbound cluster axis "x" (in Pallas too).
  config = m.TuningConfig(
      tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=2,
      collective=True, grid_tile_width=1,
      grid_minor_dim=m.blackwell_matmul_mgpu.MatmulDimension.N)
  with simulated_gpu(m):
    jax.jit(lambda a, b, s: m.ragged_dot_kernel(a, b, s, config)).trace(
        a, b, sizes).lower(lowering_platforms=("cuda",))


_BLACKWELL = {"gpu.blackwell_matmul_mgpu": _blackwell_matmul,
              "gpu.blackwell_ragged_dot_mgpu": _blackwell_ragged_dot}


@pytest.mark.parametrize("op,lower", sorted(_BLACKWELL.items()))
def test_blackwell_ops_lower_on_pallas_and_are_refused_by_name(captured, op,
                                                               lower):
  lower(original(op))
  ((dialect, lowered),) = captured
  assert "tcgen05.mma" in lowered and "tcgen05.alloc" in lowered
  with pl.default_backend("mosaic_gpu"), pytest.raises(
      KernelError, match=r"TMEM \(tensor memory\) and the tcgen05 MMA .* "
      r"Blackwell's .*\(at \S+\.py:\d+\)"):
    lower(swapped(op))


# The pieces of the collectives dsl's Mosaic GPU lowering lacks, each in a
# kernel of its own: (kernel body, scratch types, what the error names).
def _multimem_store(x_ref, o_ref):
  plgpu.multimem_store(x_ref[...], o_ref, "x")


def _multimem_load_reduce(x_ref, o_ref):
  o_ref[...] = plgpu.multimem_load_reduce(x_ref, collective_axes="x",
                                          reduction_op="add")


def _device_index(x_ref, o_ref):
  o_ref[...] = x_ref[...] + lax.axis_index("x").astype(F32)


def _remote_ref(x_ref, o_ref):
  plgpu.remote_ref(o_ref, {"x": 0})[...] = x_ref[...]


def _signal_multicast(x_ref, o_ref, sem):
  plgpu.semaphore_signal_multicast(sem, collective_axes="x")


_PIECES = {
    "multimem_store": (_multimem_store, (), "'multimem_store'"),
    "multimem_load_reduce": (_multimem_load_reduce, (),
                             "'multimem_load_reduce'"),
    "device_index": (_device_index, (), "'axis_index'"),
    "remote_ref": (_remote_ref, (), "PeerMemRef"),
    "semaphores": (_signal_multicast, (plgpu.SemaphoreType.REGULAR,),
                   r"semaphore<regular>"),
}


@pytest.mark.parametrize("piece", sorted(_PIECES))
def test_each_missing_piece_of_the_collectives_is_refused_by_name(piece):
  body, scratch, name = _PIECES[piece]
  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), F32),
                        scratch_types=scratch, backend="mosaic_gpu")
  # dsl's kernels lower through custom partitioning under a sharded jit,
  # which needs the devices: the 8 CPU devices of the test run.
  mesh = jax.make_mesh((8,), ("x",))
  x = jax.ShapeDtypeStruct((8 * 128,), F32, sharding=jax.sharding.NamedSharding(
      mesh, jax.P("x")))
  f = jax.jit(jax.shard_map(kernel, mesh=mesh, in_specs=jax.P("x"),
                            out_specs=jax.P("x"), check_vma=False))
  with pytest.raises(BackendError, match=rf"kernel '{body.__name__}'.*{name}"):
    f.trace(x).lower(lowering_platforms=("cuda",))


def test_every_mgpu_op_is_compared_or_refused():
  """Each `*_mgpu` op of the installed JAX is compared with Pallas's module
  in test_plgpu_lowering.py or refused by name here."""
  ops = {f"gpu.{name[:-3]}" for name in os.listdir(os.path.join(
      ops_dir(), "gpu")) if name.endswith("_mgpu.py")}
  with open(os.path.join(os.path.dirname(__file__),
                         "test_plgpu_lowering.py"), encoding="utf-8") as f:
    compared = set(re.findall(r'lower_op_both\(\s*[^"]*"(gpu\.\w+)"',
                              f.read()))
  assert compared == {"gpu.hopper_matmul_mgpu", "gpu.attention_mgpu",
                      "gpu.hopper_mixed_type_matmul_mgpu",
                      "gpu.ragged_dot_mgpu", "gpu.transposed_ragged_dot_mgpu"}
  assert ops == compared | set(_COLLECTIVES) | set(_BLACKWELL)
