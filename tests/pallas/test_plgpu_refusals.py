"""The `*_mgpu` ops of Pallas's kernel library that dsl's Mosaic GPU
lowering does not take yet, the Blackwell ops: Pallas lowers each for CUDA
on a CPU; dsl refuses each by name. And what the lowering of the
collectives (tests/pallas/test_plgpu_collectives.py) still refuses, by
name.
"""
from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import pytest

import dsl as pl
from dsl import mosaic_gpu as plgpu
from dsl.core.errors import BackendError, KernelError
from benchmarks.pallas_library.cases_mgpu import simulated_gpu
from benchmarks.pallas_library.swap import ops_dir, original, swapped
from tests.pallas.plgpu_modules import captured  # noqa: F401 -- a fixture

F32 = jnp.float32


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


# What the collectives' lowering still refuses, each by name, in a kernel of
# its own: (kernel body, scratch types, device mesh, what the error names).
def _partial_multicast(x_ref, o_ref):
  plgpu.multimem_store(x_ref[...], o_ref, "x")


def _dma_semaphore(x_ref, o_ref, sem):
  pl.semaphore_signal(sem)


_STILL_REFUSED = {
    # Pallas's lowering refuses it too: multicast reaches every device.
    "multicast over some axes": (
        _partial_multicast, (), ((4, 2), ("x", "y")),
        r"plgpu\.multimem_store takes collective_axes naming every axis of "
        r"the device mesh \('x', 'y'\), got \('x',\)"),
    "DMA semaphores": (_dma_semaphore, (plgpu.SemaphoreType.DMA,),
                       ((8,), ("x",)), r"allocations in semaphore<dma>"),
}


@pytest.mark.parametrize("case", sorted(_STILL_REFUSED))
def test_what_the_collectives_lowering_lacks_is_refused_by_name(case):
  body, scratch, (sizes, names), message = _STILL_REFUSED[case]
  kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), F32),
                        scratch_types=scratch, backend="mosaic_gpu")
  mesh = jax.make_mesh(sizes, names)
  x = jax.ShapeDtypeStruct((8 * 128,), F32, sharding=jax.sharding.NamedSharding(
      mesh, jax.P(names)))
  f = jax.jit(jax.shard_map(kernel, mesh=mesh, in_specs=jax.P(names),
                            out_specs=jax.P(names), check_vma=False))
  with pytest.raises(BackendError, match=rf"kernel '{body.__name__}'.*"
                     rf"{message}"):
    f.trace(x).lower(lowering_platforms=("cuda",))


def test_every_mgpu_op_is_compared_or_refused():
  """Each `*_mgpu` op of the installed JAX is compared with Pallas's module
  in test_plgpu_lowering.py or test_plgpu_collectives.py, or refused by
  name here."""
  ops = {f"gpu.{name[:-3]}" for name in os.listdir(os.path.join(
      ops_dir(), "gpu")) if name.endswith("_mgpu.py")}
  compared = set()
  for test in ("test_plgpu_lowering.py", "test_plgpu_collectives.py"):
    with open(os.path.join(os.path.dirname(__file__), test),
              encoding="utf-8") as f:
      compared |= set(re.findall(r'\("(gpu\.\w+)", _\w+|lower_op_both\(\s*'
                                 r'[^"]*"(gpu\.\w+)"', f.read()))
  compared = {a or b for a, b in compared}
  assert compared == {"gpu.hopper_matmul_mgpu", "gpu.attention_mgpu",
                      "gpu.hopper_mixed_type_matmul_mgpu",
                      "gpu.ragged_dot_mgpu", "gpu.transposed_ragged_dot_mgpu",
                      "gpu.all_gather_mgpu", "gpu.reduce_scatter_mgpu",
                      "gpu.collective_matmul_mgpu"}
  assert ops == compared | set(_BLACKWELL)



def _scaled_copy():
  """x * 2 through a plgpu.kernel."""
  def body(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128,), F32))

def test_differentiating_a_plgpu_kernel_is_an_error_naming_it():
  """Explicit warpgroup programs (barriers, TMA, WGMMA) have no derivative
  rule: jax.grad and jax.jvp name the kernel and the user's line, and point
  at jax.custom_vjp (Pallas cannot differentiate one either)."""
  x = jnp.arange(128, dtype=jnp.float32)
  with pl.default_backend("interpret"):
    f = _scaled_copy()
    assert jnp.array_equal(f(x), x * 2)
    for transform in (lambda: jax.grad(lambda x: f(x).sum())(x),
                      lambda: jax.jvp(f, (x,), (x,))):
      with pytest.raises(KernelError, match=(
          r"cannot differentiate a plgpu.kernel.*custom_vjp.*"
          r"test_plgpu_refusals.py")):
        transform()
