"""CTA clusters of `plgpu.kernel` on the interpret backend: the blocks of a
cluster run together (dsl/interpret/cluster.py). `lax.axis_index` of a
cluster axis, `ClusterBarrier`s, TMA copies along cluster axes (multicast,
partitioned, replicated) and the collective tcgen05 MMA of a pair of
blocks, each compared with jax.numpy (Pallas's GPU interpret mode cannot
run collective copies or MMAs: 'collective_axis not supported yet'); a
missing cluster barrier wait is a `KernelRaceError`, a block that never
arrives a deadlock. The op itself (`blackwell_ragged_dot_mgpu`,
collective=True) runs in tests/pallas/test_pallas_ops.py.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import dsl as pl
from dsl import mosaic_gpu as plgpu
from dsl.core.errors import (BackendError, KernelDeadlockError, KernelError,
                             KernelRaceError)
from benchmarks.pallas_library.cases_mgpu import simulated_gpu
from tests.pallas import pallas_ops_swap as swap

HERE = os.path.basename(__file__)
F16, F32 = jnp.float16, jnp.float32
PAIR = dict(grid=(1,), grid_names=("sm",), cluster=(2,), cluster_names=("x",))


def _run(body, out, *args, **mesh):
  with pl.default_backend("interpret"):
    return jax.tree.map(np.asarray, plgpu.kernel(
        body, out_type=out, **{**PAIR, **mesh})(*args))


def _f16(seed, shape):
  return jax.random.uniform(jax.random.key(seed), shape, F16, -1, 1)


def test_axis_index_of_grid_and_cluster_axes():
  def body(o_gmem):
    sm, x, y = (lax.axis_index(n) for n in ("sm", "x", "y"))
    o_gmem[sm, x, y] = jnp.stack([sm, x, y, lax.axis_size("x")])
  got = _run(body, jax.ShapeDtypeStruct((3, 2, 2, 4), jnp.int32),
             grid=(3,), cluster=(2, 2), cluster_names=("x", "y"))
  sm, x, y = np.meshgrid(*map(np.arange, (3, 2, 2)), indexing="ij")
  np.testing.assert_array_equal(got, np.stack([sm, x, y, 0 * sm + 2], -1))


def _exchange(arrive_from=(0, 1)):
  """Each block doubles its row, the blocks meet at a ClusterBarrier, then
  each reads the other's doubled row (only blocks in `arrive_from`
  arrive)."""
  def body(x_gmem, dbl_gmem, swapped_gmem, met):
    b = lax.axis_index("x")
    dbl_gmem[b] = x_gmem[b] * 2

    @pl.when(jnp.isin(b, jnp.array(arrive_from)))
    def _():
      plgpu.barrier_arrive(met)
    plgpu.barrier_wait(met)
    swapped_gmem[b] = dbl_gmem[1 - b]
  out = jax.ShapeDtypeStruct((2, 128), F32)
  x = jax.random.normal(jax.random.key(0), (2, 128), F32)
  with pl.default_backend("interpret"):
    return x, jax.tree.map(np.asarray, plgpu.kernel(
        body, out_type=(out, out), scratch_types=[
            plgpu.ClusterBarrier(collective_axes=("x",))], **PAIR)(x))


def test_a_cluster_barrier_waits_for_every_block():
  x, (dbl, swapped) = _exchange()
  np.testing.assert_array_equal(dbl, 2 * np.asarray(x))
  np.testing.assert_array_equal(swapped, 2 * np.asarray(x)[::-1])


def test_a_block_that_never_arrives_on_a_cluster_barrier_deadlocks():
  with pytest.raises(KernelDeadlockError, match=rf"waits on .*{HERE}"):
    _exchange(arrive_from=(0,))


def _leader_sums(waiter):
  """Each block writes its row + 1 and arrives on a leader-tracked
  ClusterBarrier; block `waiter` waits on it and writes the sum."""
  def body(x_gmem, o_gmem, met):
    b = lax.axis_index("x")
    o_gmem[b] = x_gmem[b] + 1
    plgpu.barrier_arrive(met)

    @pl.when(b == waiter)
    def _():
      plgpu.barrier_wait(met)
      o_gmem[2] = o_gmem[0] + o_gmem[1]
  x = jax.random.normal(jax.random.key(3), (2, 128), F32)
  with pl.default_backend("interpret"):
    return x, np.asarray(plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((3, 128), F32), scratch_types=[
            plgpu.ClusterBarrier(collective_axes=("x",),
                                 leader_tracked=True)], **PAIR)(x))


def test_a_leader_tracked_cluster_barrier_counts_on_the_leader_only():
  x, got = _leader_sums(waiter=0)
  x = np.asarray(x)
  np.testing.assert_array_equal(got, np.concatenate([x + 1, [(x[0] + 1) +
                                                          (x[1] + 1)]]))
  with pytest.raises(KernelDeadlockError, match=rf"block \(0, 1\) waits on "
                     rf"met.*{HERE}"):
    _leader_sums(waiter=1)


def test_a_multicast_copy_lands_in_every_block():
  def body(x_gmem, o_gmem, smem, landed):
    b = lax.axis_index("x")
    plgpu.copy_gmem_to_smem(x_gmem, smem, landed, collective_axes="x")
    plgpu.barrier_wait(landed)
    o_gmem[b] = smem[...] * (b + 1).astype(F32)
  x = jax.random.normal(jax.random.key(1), (64, 128), F32)
  with pl.default_backend("interpret"):
    got = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((2, 64, 128), F32),
                       scratch_types=[plgpu.SMEM((64, 128), F32),
                                      plgpu.Barrier()], **PAIR)(x)
  np.testing.assert_array_equal(got, np.stack([x, 2 * x]))


@pytest.mark.parametrize("how,shape", [
    (plgpu.CopyPartition.PARTITIONED(0), (64, 128)),
    (plgpu.CopyPartition.PARTITIONED(1), (128, 64)),
    (plgpu.CopyPartition.REPLICATED, (128, 128))])
def test_leader_tracked_copies_split_or_replicate_the_source(how, shape):
  """Only the leader's barrier tracks the copy: it tells the other block
  at a ClusterBarrier that every part has landed."""
  def body(x_gmem, o_gmem, smem, landed, met):
    b = lax.axis_index("x")
    plgpu.copy_gmem_to_smem(x_gmem, smem, landed, collective_axes="x",
                            leader_tracked=how)

    @pl.when(b == 0)
    def _():
      plgpu.barrier_wait(landed)
    plgpu.barrier_arrive(met)
    plgpu.barrier_wait(met)
    o_gmem[b] = smem[...]
  x = jax.random.normal(jax.random.key(2), (128, 128), F32)
  with pl.default_backend("interpret"):
    got = np.asarray(plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((2, *shape), F32),
        scratch_types=[plgpu.SMEM(shape, F32), plgpu.Barrier(),
                       plgpu.ClusterBarrier(collective_axes=("x",))],
        **PAIR)(x))
  x = np.asarray(x)
  want = (np.stack([x, x]) if shape == x.shape else
          np.stack(np.split(x, 2, axis=how.axis)))
  np.testing.assert_array_equal(got, want)


M, N, K = 128, 64, 128     # per block: a (M, K), b (K, N), acc (M, 2N)


def _pair_mma(partitioned=True, wait_ready=True):
  """The pair MMA: a (2M, K) @ b (K, 2N), each block holding its rows of
  a and of the result and its columns of b. Partitioned: both halves
  come with leader-tracked copies; else each block loads its own halves
  and tells the leader at a ClusterBarrier (which it skips without
  `wait_ready`)."""
  def body(a_gmem, b_gmem, o_gmem, a_smem, b_smem, acc, loaded, ready, done):
    x = lax.axis_index("x")
    if partitioned:
      for src, dst, axis in ((a_gmem, a_smem, 0), (b_gmem, b_smem, 1)):
        plgpu.copy_gmem_to_smem(
            src, dst, loaded, collective_axes="x",
            leader_tracked=plgpu.CopyPartition.PARTITIONED(axis))
    else:
      plgpu.copy_gmem_to_smem(a_gmem.at[pl.ds(x * M, M)], a_smem, loaded)
      plgpu.copy_gmem_to_smem(b_gmem.at[:, pl.ds(x * N, N)], b_smem, loaded)
      plgpu.barrier_wait(loaded)
      plgpu.barrier_arrive(ready)

    @pl.when(x == 0)
    def _():
      if partitioned:
        plgpu.barrier_wait(loaded)
      elif wait_ready:
        plgpu.barrier_wait(ready)
      plgpu.tcgen05_mma(acc, a_smem, b_smem, done, accumulate=False,
                        collective_axis="x")
    plgpu.barrier_wait(done)
    o_gmem[pl.ds(x * M, M)] = plgpu.async_load_tmem(acc)
    plgpu.wait_load_tmem()
  scratch = [plgpu.SMEM((M, K), F16), plgpu.SMEM((K, N), F16),
             plgpu.TMEM((M, 2 * N), F32, collective=True),
             plgpu.Barrier(num_arrivals=2),
             plgpu.ClusterBarrier(collective_axes=("x",)),
             plgpu.Barrier(orders_tensor_core=True)]
  a, b = _f16(0, (2 * M, K)), _f16(1, (K, 2 * N))
  with pl.default_backend("interpret"):
    got = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((2 * M, 2 * N),
                                                           F32),
                       scratch_types=scratch, **PAIR)(a, b)
  return np.asarray(got), np.asarray(jnp.dot(a, b, preferred_element_type=F32))


@pytest.mark.parametrize("partitioned", [True, False])
def test_the_collective_mma_computes_both_halves_of_the_pair(partitioned):
  got, want = _pair_mma(partitioned)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_missing_cluster_barrier_wait_is_a_race():
  """The leader issues the pair MMA before the other block has loaded
  its halves: that block's copy then lands under the MMA in flight."""
  with pytest.raises(KernelRaceError, match=rf"block \(0, 1\) writes "
                     rf".*tcgen05_mma of .*block \(0, 0\).*ClusterBarrier"
                     rf".*{HERE}"):
    _pair_mma(partitioned=False, wait_ready=False)


def test_the_collective_mma_is_issued_by_the_pair_leader():
  def body(a_gmem, b_gmem, o_gmem, a_smem, b_smem, acc, done):
    @pl.when(lax.axis_index("x") == 1)
    def _():
      plgpu.tcgen05_mma(acc, a_smem, b_smem, done, collective_axis="x")
  scratch = [plgpu.SMEM((M, K), F16), plgpu.SMEM((K, N), F16),
             plgpu.TMEM((M, 2 * N), F32, collective=True),
             plgpu.Barrier(orders_tensor_core=True)]
  with pytest.raises(BackendError, match=rf"collective_axis: .*block "
                     rf"\(0, 1\).*only the leader .*{HERE}"):
    _run(body, jax.ShapeDtypeStruct((M, N), F32), jnp.zeros((M, K), F16),
         jnp.zeros((K, N), F16), scratch_types=scratch)


def test_the_op_without_collective_reads_an_unbound_cluster_axis():
  """blackwell_ragged_dot_mgpu's collective=False reads lax.axis_index('x')
  of the cluster axis it declares only with collective=True: the op's own
  bug, a NameError on dsl as in Pallas (its case runs collective=True)."""
  m = swap.swapped("gpu.blackwell_ragged_dot_mgpu")
  config = m.TuningConfig(
      tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=2,
      collective=False, grid_tile_width=1,
      grid_minor_dim=m.blackwell_matmul_mgpu.MatmulDimension.N)
  a, b = jnp.ones((256, 256), F16), jnp.ones((2, 256, 256), F16)
  with simulated_gpu(m), pl.default_backend("interpret"), pytest.raises(
      KernelError, match="NameError: .*unbound axis name: x"):
    m.ragged_dot_kernel(a, b, jnp.array([128, 128], jnp.int32), config)
