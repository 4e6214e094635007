"""Operands of backend "mosaic_gpu" beyond one plain TMA copy and one
bf16 wgmma: blocks wider than a TMA box (one tiled, 128-byte swizzled
copy), long vectors and unit-row blocks (several copies), float32 dots
(tf32), dot operands computed in registers (staged through shared memory),
transposes (of a dot's result: the product of the transposed operands),
and reductions across warps (through a shared scratch)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl.core.errors import BackendError
from benchmarks import mosaic_gpu_kernels as mgpu_samples
from lowering_mosaic.gpu.plan import REDUCTION_SCRATCH
from benchmarks.mosaic_gpu_kernels import matmul
from tests.pallas.mosaic_gpu_testing import (
    BF, count_tma_loads, gpu_module, kernel_module, lower_cuda, mlir_ops)

# ------------------------------------------------------------ wide blocks

def test_blocks_wider_than_a_tma_box_move_as_one_tiled_copy():
  x = BF(256, 512)
  m = gpu_module(lambda a: pl.pallas_call(
      mgpu_samples._softmax_kernel, jax.ShapeDtypeStruct(a.shape, a.dtype),
      grid=(4,), in_specs=[pl.BlockSpec((64, 512), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((64, 512), lambda i: (i, 0)),
      backend="mosaic_gpu")(a), x)
  blk = m.plan.blocks[0]
  assert blk.tiling == (8, 64) and blk.copies() == [(0, 64)]
  text = m.dialect_text
  assert text.count("mosaic_gpu.async_load") == 1
  assert "slice_lengths = array<i64: 64, 512>" in text
  assert "#mosaic_gpu.tile<[8, 64]>" in text
  assert "#mosaic_gpu.swizzle<128 : i32>" in text
  lowered = m.module.operation.get_asm()        # one TMA each way
  assert count_tma_loads(lowered) == 1
  assert lowered.count("cp.async.bulk.tensor.global.shared") == 1


def test_long_vectors_and_unit_row_blocks_move_in_several_copies():
  def k(w_ref, r_ref, o_ref):
    o_ref[...] = r_ref[...] * w_ref[...]
  m = kernel_module(k, jnp.ones((512,), jnp.float32), jnp.ones((1, 512)),
                    out=(1, 512))
  w_blk, r_blk, o_blk = m.plan.blocks
  assert w_blk.copies() == r_blk.copies() == [(0, 256), (256, 256)]
  assert r_blk.split_dim == 1 and r_blk.tiling is None
  assert m.dialect_text.count("mosaic_gpu.async_load") == 4
  assert m.dialect_text.count("mosaic_gpu.async_store") == 2


def test_a_wide_block_off_the_tile_grid_is_a_clear_error():
  x = BF(128, 520)
  spec = pl.BlockSpec((64, 520), lambda i: (i, 0))
  with pytest.raises(BackendError, match=r"multiple of \(8, 64\)"):
    lower_cuda(lambda a: pl.pallas_call(
        lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
        jax.ShapeDtypeStruct(a.shape, a.dtype), grid=(2,), in_specs=[spec],
        out_specs=spec, backend="mosaic_gpu")(a), x)


# ------------------------------------------- operands staged through SMEM

def test_a_dot_of_a_computed_right_operand_stages_it():
  def k(x_ref, y_ref, o_ref):
    y = jnp.exp(y_ref[...].astype(jnp.float32))          # in registers
    o_ref[...] = jnp.dot(x_ref[...], y.astype(jnp.bfloat16),
                         preferred_element_type=jnp.float32).astype(
                             o_ref.dtype)
  m = kernel_module(k, BF(128, 64), BF(64, 128), out=(128, 128))
  ((_, bufs),) = m.plan.scoped                 # one staging buffer
  assert bufs == (((64, 128), np.dtype(jnp.bfloat16)),)
  text = m.dialect_text
  store = text.index("mosaic_gpu.vector_store")
  assert store < text.index("mosaic_gpu.wgmma")
  assert "nvvm.fence.proxy" in text[store:text.index("mosaic_gpu.wgmma")]


def test_a_transposed_dot_result_is_the_product_of_transposes():
  def k(x_ref, y_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], y_ref[...],
                         preferred_element_type=jnp.float32).T.astype(
                             o_ref.dtype)
  m = kernel_module(k, BF(64, 64), BF(64, 128), out=(128, 64))
  assert m.plan.scoped == ()                   # nothing staged
  assert mlir_ops(m.dialect_text).count("mosaic_gpu.wgmma") == 2
  lowered = m.module.operation.get_asm()
  assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in lowered


def test_a_transposed_tile_computed_in_registers_is_staged():
  def k(x_ref, y_ref, o_ref):
    y = (y_ref[...] * 2).T                       # (128, 64) from registers
    o_ref[...] = jnp.dot(x_ref[...], y, preferred_element_type=jnp.float32
                         ).astype(o_ref.dtype)
  m = kernel_module(k, BF(64, 128), BF(64, 128), out=(64, 64))
  ((_, bufs),) = m.plan.scoped
  assert bufs == (((64, 128), np.dtype(jnp.bfloat16)),)
  assert "memref.transpose" in m.dialect_text


# ------------------------------------------------------------ dot types

def _dot_nt_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = jax.lax.dot_general(x_ref[...], y_ref[...],
                                   (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)


def test_f32_dot_is_a_tf32_wgmma_at_default_precision():
  x, y = jnp.ones((128, 32), jnp.float32), jnp.ones((64, 32), jnp.float32)
  m = kernel_module(_dot_nt_kernel, x, y, out=(128, 64))
  lowered = m.module.operation.get_asm()
  assert "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32" in lowered


def test_f32_dot_with_an_n_major_operand_is_a_clear_error():
  x, y = jnp.ones((128, 64), jnp.float32), jnp.ones((64, 64), jnp.float32)
  with pytest.raises(BackendError, match="K-major"):
    lower_cuda(lambda a, b: matmul(a, b, bm=128, bn=64, bk=32), x, y)


def test_f32_dot_at_full_precision_is_a_clear_error():
  x, y = jnp.ones((128, 32), jnp.float32), jnp.ones((64, 32), jnp.float32)
  with jax.default_matmul_precision("float32"):
    with pytest.raises(BackendError, match="tf32.*full float32"):
      kernel_module(_dot_nt_kernel, x, y, out=(128, 64))


# ------------------------------------------------------------ reductions

@pytest.mark.parametrize("axes,op", [((1,), "vector.multi_reduction"),
                                     ((0,), "vector.multi_reduction"),
                                     ((0, 1), "vector.reduction")])
def test_reductions_across_warps_use_the_reduction_scratch(axes, op):
  def k(x_ref, o_ref):
    o_ref[...] = jnp.broadcast_to(jnp.max(x_ref[...], axis=axes,
                                          keepdims=True), (64, 128))
  m = kernel_module(k, jnp.ones((64, 128), jnp.float32))
  assert op in mlir_ops(m.dialect_text)
  if axes == (1,):            # rows stay inside warps: no scratch
    assert m.plan.reduction_bytes == 0
    assert "scratch_size" not in m.dialect_text
    return
  assert m.plan.reduction_bytes == REDUCTION_SCRATCH
  # The reduction points at the last shared-memory buffer: the scratch.
  offset = int(re.search(r"offset = (\d+) : i32", m.dialect_text.split(
      op)[1]).group(1))
  starts = [int(o) for o in re.findall(r"slice_smem\"\(\) <\{offset = (\d+)"
                                       r" : i32\}> : \(\) -> memref<4096xi8",
                                       m.dialect_text)]
  assert starts == [offset]
  assert f"scratch_size = {REDUCTION_SCRATCH} : i32" in m.dialect_text


def test_reductions_of_tiles_off_the_wgmma_rows_are_clear_errors():
  def k(x_ref, o_ref):
    o_ref[...] = jnp.sum(x_ref[...], axis=1)
  with pytest.raises(BackendError, match="rows in multiples of 64.*\\(8, 128\\)"):
    kernel_module(k, jnp.ones((8, 128), jnp.float32), out=(8,))
