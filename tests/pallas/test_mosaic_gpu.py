"""The Mosaic GPU lowering, checked on a CPU: modules are built, verified
and layout-inferred by jaxlib's library when lowering for "cuda"; the
structure (TMA, mbarriers, wgmma, the sequential loop) is asserted on the
dialect-level and on the lowered module. Numerics need a GPU and are not
checked here."""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl.core.errors import BackendError
from lowering_mosaic.gpu.plan import SMEM_LIMIT
from benchmarks.mosaic_gpu_kernels import (add, attention_tile as attention,
                                          flash_attention as flash, matmul)
from tests.pallas.mosaic_gpu_testing import (
    BF, FEATURES_THAT_BUILD, count_tma_loads, gpu_module, kernel_module,
    lower_cuda, mlir_ops)
from tests.pallas.testing import no_rule


def _indent(text: str, op: str) -> int:
  """The indentation of the first line holding `op` (nesting depth)."""
  line = next(l for l in text.splitlines() if op in l)
  return len(line) - len(line.lstrip())


# ------------------------------------------------------------------ kernels

def _masked_softmax_kernel(x_ref, o_ref):
  x = x_ref[...].astype(jnp.float32)
  e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  col = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
  e = jnp.where(col < 100, e, 0.0)
  o_ref[...] = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(o_ref.dtype)


def masked_softmax(x, rows=64):
  spec = pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0))
  return pl.pallas_call(_masked_softmax_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(x.shape[0] // rows,), in_specs=[spec],
                        out_specs=spec, backend="mosaic_gpu")(x)


F32 = jnp.ones((512, 64), jnp.float32)


# ------------------------------------------------------------------ routing

def test_custom_call_is_mosaic_gpu_not_triton():
  text = lower_cuda(add, F32, F32)
  assert "stablehlo.custom_call @mosaic_gpu_v2" in text
  assert "triton_kernel_call" not in text


def test_option_routes_automatic_backend_on_cuda_only():
  f = lambda x, y: add(x, y, backend=None)
  with pl.config.use_mosaic_gpu_option(True):
    assert "mosaic_gpu_v2" in lower_cuda(f, F32, F32)
    # On CPU the automatic backend stays the interpreter.
    cpu = jax.jit(f).trace(F32, F32).lower(lowering_platforms=("cpu",))
    assert "mosaic_gpu_v2" not in cpu.as_text()


def test_backend_name_is_known():
  assert "mosaic_gpu" in pl.BACKENDS


def test_mosaic_gpu_backend_refuses_non_cuda_platforms():
  with pytest.raises(BackendError, match="NVIDIA GPUs"):
    jax.jit(add).trace(F32, F32).lower(lowering_platforms=("cpu",))


# ------------------------------------------------------------------ structure

def test_elementwise_tile_is_tma_in_math_tma_out():
  m = gpu_module(add, F32, F32)
  ops = mlir_ops(m.dialect_text)
  assert ops.count("mosaic_gpu.async_load") == 2
  assert ops.count("mosaic_gpu.async_store") == 1
  assert "mosaic_gpu.arrive_expect_tx" in ops and "mosaic_gpu.wgmma" not in ops
  assert m.plan.parallel == (0,) and m.plan.cuda_grid == 4
  assert m.plan.steps == 1
  lowered = m.module.operation.get_asm()
  assert count_tma_loads(lowered) == 2                              # TMA in
  assert re.search(r"cp\.async\.bulk(\.tensor)?\.global\.shared", lowered)
  assert "mbarrier.try_wait.parity" in lowered
  # 128 threads (one warpgroup) per CTA; 4 CTAs.
  assert re.search(r"blocks in \(%\w+, %\w+, %\w+\) = \(%\w+, %\w+, %\w+\)",
                   lowered) or "gpu.launch" in lowered


def test_expect_tx_counts_both_blocks():
  m = gpu_module(add, F32, F32)
  # 2 blocks of 128x64 f32.
  assert re.search(r"arrive_expect_tx.*%c65536_i32", m.dialect_text)


def test_matmul_is_wgmma_over_a_sequential_tma_loop():
  m = gpu_module(matmul, BF(256, 256), BF(256, 256))
  assert m.plan.parallel == (0, 1) and m.plan.sequential == (2,)
  # Two consumer warpgroups share a CTA: 2 of the 4 output tiles each.
  assert m.plan.cuda_grid == 2 and m.plan.steps == 4
  ops = mlir_ops(m.dialect_text)
  assert "mosaic_gpu.wgmma" in ops and "scf.for" in ops
  assert "nvvm.wgmma.wait.group.sync.aligned" in ops
  lowered = m.module.operation.get_asm()
  assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in lowered
  assert "mosaic_gpu.swizzle" in lowered      # inferred smem swizzle for wgmma


def test_one_warpgroup_double_buffers_sequential_inputs():
  m = gpu_module(lambda x, y: matmul(x, y, warp_specialize=False),
                 BF(256, 256), BF(256, 256))
  assert not m.plan.schedule.warp_specialized and m.plan.cuda_grid == 4
  ins = [b for b in m.plan.blocks if not b.is_output]
  assert all(b.moves and b.slots == 2 for b in ins)
  assert ins[0].buffer_shape == (2, 128, 64)
  text = m.dialect_text
  loop = text.index("scf.for")
  loads = [mt.start() for mt in re.finditer(r"mosaic_gpu\.async_load", text)]
  # Step 0's blocks before the loop; step s + 1's inside it, predicated, into
  # the other slot (a subview of the two-slot buffer).
  assert len(loads) == 4 and sum(p < loop for p in loads) == 2
  inner = text[loop:]
  assert "memref.subview" in inner and "arith.select" in inner
  # In the loop the copies carry a predicate (i1): none after the last step.
  assert len(re.findall(r"async_load.*, i1\) -> \(\)", inner)) == 2
  assert inner.count("nvvm.mbarrier.try_wait.parity") >= 1
  assert m.plan.smem_bytes >= 2 * (2 * 128 * 64 * 2) + 128 * 128 * 4


def test_blocks_that_stay_put_are_loaded_once():
  def k(x_ref, w_ref, o_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += x_ref[...] * w_ref[...]
  f = lambda x, w: pl.pallas_call(
      k, jax.ShapeDtypeStruct((128, 64), jnp.float32), grid=(2, 4),
      in_specs=[pl.BlockSpec((64, 64), lambda i, j: (i, j)),
                pl.BlockSpec((64, 64), lambda i, j: (i, 0))],
      out_specs=pl.BlockSpec((64, 64), lambda i, j: (i, 0)),
      backend="mosaic_gpu")(x, w)
  m = gpu_module(f, jnp.ones((128, 256), jnp.float32),
                 jnp.ones((128, 64), jnp.float32))
  x_blk, w_blk, _ = m.plan.blocks
  assert x_blk.slots == m.plan.schedule.depth == 4
  assert w_blk.slots == 1 and not w_blk.moves


def test_output_moves_while_inputs_stay_put():
  def k(x_ref, o_ref):
    o_ref[...] = x_ref[...] * (pl.program_id(0) + 1).astype(jnp.float32)
  f = lambda x: pl.pallas_call(
      k, jax.ShapeDtypeStruct((256, 64), jnp.float32), grid=(4,),
      in_specs=[pl.BlockSpec((64, 64), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((64, 64), lambda i: (i, 0)), backend="mosaic_gpu",
      compiler_params=pl.tpu.CompilerParams(
          dimension_semantics=("arbitrary",)))(x)
  m = gpu_module(f, jnp.ones((64, 64), jnp.float32))
  assert m.plan.sequential == (0,)
  text = m.dialect_text
  # One load before the loop, one store inside it, none after.
  loop = text.index("scf.for")
  assert text.count("mosaic_gpu.async_load") == 1
  assert text.index("mosaic_gpu.async_load") < loop
  assert text.count("mosaic_gpu.async_store") == 1
  assert text.index("mosaic_gpu.async_store") > loop
  assert _indent(text, "scf.for") + 2 == _indent(text, "mosaic_gpu.async_store")


def test_revisited_output_block_stays_on_chip_until_the_loop_ends():
  m = gpu_module(matmul, BF(256, 256), BF(256, 256))
  (out,) = [b for b in m.plan.blocks if b.is_output]
  assert not out.moves
  text = m.dialect_text
  # The only store comes after the loop, outside it.
  assert text.count("mosaic_gpu.async_store") == 1
  assert text.index("mosaic_gpu.async_store") > text.index("scf.for")
  assert _indent(text, "mosaic_gpu.async_store") == _indent(text, "scf.for")


def test_output_that_moves_along_sequential_dim_is_stored_every_step():
  def k(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0
  spec = pl.BlockSpec((64, 64), lambda i, j: (i, j))
  f = lambda x: pl.pallas_call(
      k, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2, 4),
      in_specs=[spec], out_specs=spec, backend="mosaic_gpu",
      compiler_params=pl.tpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary")))(x)
  m = gpu_module(f, jnp.ones((128, 256), jnp.float32))
  assert m.plan.sequential == (1,) and m.plan.steps == 4
  (out,) = [b for b in m.plan.blocks if b.is_output]
  assert out.moves
  text = m.dialect_text
  assert text.count("mosaic_gpu.async_store") == 1
  assert _indent(text, "mosaic_gpu.async_store") == _indent(text, "scf.for") + 2


def test_softmax_row_reductions_broadcasts_iota_where_casts():
  m = gpu_module(masked_softmax, BF(256, 128))
  ops = mlir_ops(m.dialect_text)
  for op in ("vector.multi_reduction", "mosaic_gpu.broadcast_in_dim",
             "mosaic_gpu.broadcasted_iota", "mosaic_gpu.layout_cast"):
    assert op in ops, op
  assert "arith.select" in m.dialect_text and "arith.extf" in m.dialect_text


def test_attention_tile_two_wgmmas_with_transposed_keys():
  q = BF(256, 128)
  kv = BF(128, 128)
  m = gpu_module(attention, q, kv, kv)
  assert mlir_ops(m.dialect_text).count("mosaic_gpu.wgmma") == 2
  assert "memref.transpose" in m.dialect_text
  assert "vector.multi_reduction" in mlir_ops(m.dialect_text)
  assert "mosaic_gpu_v2" in lower_cuda(attention, q, kv, kv)


def test_flash_attention_online_softmax_over_a_pipelined_kv_loop():
  q, k = BF(256, 128), BF(512, 128)
  m = gpu_module(flash, q, k, k)
  assert m.plan.parallel == (0,) and m.plan.sequential == (1,)
  # Two consumers per CTA, each on its own query block, sharing K and V.
  assert m.plan.steps == 8 and m.plan.cuda_grid == 2
  q_blk, k_blk, v_blk, o_blk = m.plan.blocks
  assert (q_blk.replicas, k_blk.replicas, v_blk.replicas, o_blk.replicas) \
      == (2, 1, 1, 2)
  depth = m.plan.schedule.depth
  assert (q_blk.slots, k_blk.slots, v_blk.slots) == (1, depth, depth)
  assert depth >= 2
  assert not o_blk.moves                             # written once, at the end
  ops = mlir_ops(m.dialect_text)
  assert ops.count("mosaic_gpu.wgmma") == 2
  assert ops.count("vector.multi_reduction") == 2    # row max, row sum
  assert ops.count("mosaic_gpu.async_store") == 1
  lowered = m.module.operation.get_asm()
  assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in lowered
  assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in lowered
  assert "mosaic_gpu_v2" in lower_cuda(flash, q, k, k)


def test_control_flow_fori_loop_and_cond():
  def k(x_ref, o_ref):
    def body(i, acc):
      return acc + x_ref[...]
    acc = jax.lax.fori_loop(0, 3, body, jnp.zeros((64, 128), jnp.float32))
    o_ref[...] = jax.lax.cond(pl.program_id(0) == 0, lambda a: a * 2.0,
                              lambda a: a, acc)
  spec = pl.BlockSpec((64, 128), lambda i: (i, 0))
  f = lambda x: pl.pallas_call(k, jax.ShapeDtypeStruct(x.shape, x.dtype),
                               grid=(2,), in_specs=[spec], out_specs=spec,
                               backend="mosaic_gpu")(x)
  m = gpu_module(f, jnp.ones((128, 128), jnp.float32))
  ops = mlir_ops(m.dialect_text)
  assert "scf.for" in ops and "scf.index_switch" in m.dialect_text
  assert "mosaic_gpu_v2" in lower_cuda(f, jnp.ones((128, 128), jnp.float32))


def test_scratch_lives_in_shared_memory():
  def k(x_ref, o_ref, s_ref):
    s_ref[...] = x_ref[...] + 1.0
    o_ref[...] = s_ref[...] * 2.0
  f = lambda x: pl.pallas_call(
      k, jax.ShapeDtypeStruct(x.shape, x.dtype),
      scratch_shapes=[pl.tpu.VMEM((64, 128), jnp.float32)],
      backend="mosaic_gpu")(x)
  m = gpu_module(f, jnp.ones((64, 128), jnp.float32))
  assert m.plan.scratch == (((64, 128), np.dtype(np.float32)),)
  assert m.plan.smem_bytes >= 3 * 64 * 128 * 4


def test_export_for_cuda_serializes():
  exp = jax.export.export(jax.jit(add), platforms=("cuda",))(F32, F32)
  assert exp.platforms == ("cuda",)
  assert "mosaic_gpu_v2" in exp.mlir_module()
  assert len(exp.mlir_module_serialized) > 0


def test_dump_writes_the_dialect_and_the_lowered_module(tmp_path):
  x = jnp.ones((256, 64), jnp.float32)   # a shape not lowered before
  with pl.config.dump_mlir_to_option(str(tmp_path)):
    lower_cuda(add, x, x)
  names = sorted(os.listdir(tmp_path))
  assert len(names) == 2
  first = (tmp_path / [n for n in names if "lowered" not in n][0]).read_text()
  assert "mosaic_gpu.async_load" in first and "_add_kernel" in first
  assert "CUDA grid 2" in first
  lowered = (tmp_path / [n for n in names if "lowered" in n][0]).read_text()
  assert "cp.async.bulk.tensor" in lowered


# ------------------------------------------------------------------ limits

def test_shared_memory_limit_is_a_clear_error():
  x = jnp.ones((256, 256), jnp.float32)            # 256 KiB per block
  with pytest.raises(BackendError, match=r"bytes of shared memory.*"
                     + str(SMEM_LIMIT)):
    lower_cuda(lambda a, b: add(a, b, block=(256, 256)), x, x)


def test_unaligned_tma_box_is_a_clear_error():
  x = jnp.ones((64, 64), jnp.float32)
  with pytest.raises(BackendError, match="16 bytes.*unaligned TMA box.*triton"):
    lower_cuda(lambda a, b: add(a, b, block=(64, 2)), x, x)


def test_unaligned_array_stride_is_a_clear_error():
  x = jnp.ones((64, 6), jnp.float32)               # 24-byte rows
  with pytest.raises(BackendError, match="stride of 24 bytes"):
    lower_cuda(lambda a, b: add(a, b, block=(64, 6)), x, x)


def test_dot_shape_wgmma_cannot_take_is_a_clear_error():
  x = BF(32, 64)
  with pytest.raises(BackendError, match="M=32 is not a multiple of 64"):
    lower_cuda(lambda a, b: matmul(a, b, bm=32, bn=64, bk=64), x, BF(64, 64))


def test_int_dot_is_a_clear_error():
  x = jnp.ones((128, 64), jnp.int8)
  with pytest.raises(BackendError, match="wgmma takes"):
    lower_cuda(lambda a, b: matmul(a, b, bm=128, bn=64, bk=64), x,
               jnp.ones((64, 64), jnp.int8))


@pytest.mark.parametrize("what", ["atomic", "masked_load", "small_rows"])
def test_what_cannot_be_expressed_suggests_triton(what):
  def k(x_ref, o_ref):
    if what == "atomic":
      pl.atomic_add(o_ref, (0, 0), 1.0)
    elif what == "masked_load":
      mask = jax.lax.broadcasted_iota(jnp.int32, (64, 128), 1) < 5
      o_ref[...] = pl.load(x_ref, (slice(None), slice(None)), mask=mask)
    else:
      o_ref[...] = jnp.broadcast_to(jnp.sum(x_ref[...], axis=1,
                                            keepdims=True), x_ref.shape)
  rows = 8 if what == "small_rows" else 64
  f = lambda x: pl.pallas_call(k, jax.ShapeDtypeStruct(x.shape, x.dtype),
                               backend="mosaic_gpu")(x)
  with pytest.raises(BackendError, match=r"triton") as e:
    lower_cuda(f, jnp.ones((rows, 128), jnp.float32))
  assert "test_mosaic_gpu.py" in str(e.value)       # the user's line


def test_unsupported_primitive_names_it():
  def k(x_ref, o_ref):
    o_ref[...] = no_rule(x_ref[...])
  f = lambda x: pl.pallas_call(k, jax.ShapeDtypeStruct(x.shape, x.dtype),
                               backend="mosaic_gpu")(x)
  with pytest.raises(BackendError, match="no_rule_for_tests"):
    lower_cuda(f, jnp.ones((64, 128), jnp.float32))


# ------------------------------------------------------------------ operands

def test_scalar_prefetch_drives_the_index_maps():
  def k(idx_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] * idx_ref[0].astype(jnp.float32)
  gs = pl.PrefetchScalarGridSpec(
      num_scalar_prefetch=1, grid=(4,),
      in_specs=[pl.BlockSpec((64, 64), lambda i, idx: (idx[i], 0))],
      out_specs=pl.BlockSpec((64, 64), lambda i, idx: (i, 0)))
  f = lambda idx, x: pl.pallas_call(
      k, jax.ShapeDtypeStruct(x.shape, x.dtype), grid_spec=gs,
      backend="mosaic_gpu")(idx, x)
  idx = jnp.array([3, 2, 1, 0], jnp.int32)
  x = jnp.ones((256, 64), jnp.float32)
  m = gpu_module(f, idx, x)
  assert m.plan.prefetch[0].shape == (4,)
  # The index map reads the prefetch array in global memory.
  assert re.search(r"memref\.load %\w+\[.*\] : memref<(1x)?i32, strided",
                   m.dialect_text) or "memref<4xi32>" in m.dialect_text
  assert "mosaic_gpu_v2" in lower_cuda(f, idx, x)


def test_input_output_aliases_reach_the_custom_call():
  def k(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0
  spec = pl.BlockSpec((64, 64), lambda i: (i, 0))
  f = lambda x: pl.pallas_call(k, jax.ShapeDtypeStruct(x.shape, x.dtype),
                               grid=(2,), in_specs=[spec], out_specs=spec,
                               input_output_aliases={0: 0},
                               backend="mosaic_gpu")(x)
  text = lower_cuda(f, jnp.ones((128, 64), jnp.float32))
  assert "mosaic_gpu_v2" in text and "output_operand_aliases" in text


# ------------------------------------------------------------------ more

def test_blocks_longer_than_a_tma_box_move_in_several_copies():
  def k(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2
  m = kernel_module(k, BF(512, 64))
  assert m.plan.blocks[0].copies() == [(0, 256), (256, 256)]
  assert m.dialect_text.count("mosaic_gpu.async_load") == 2
  assert m.dialect_text.count("mosaic_gpu.async_store") == 2
  assert "slice_lengths = array<i64: 256, 64>" in m.dialect_text


def test_buffers_start_on_swizzle_aligned_offsets():
  def k(x_ref, o_ref, s_ref):
    s_ref[...] = x_ref[...]
    o_ref[...] = s_ref[...] + 1
  m = kernel_module(k, jnp.ones((32, 36), jnp.float32),   # 4608-byte buffers
                    scratch_shapes=[pl.tpu.VMEM((32, 36), jnp.float32)])
  starts = [int(o) for o in re.findall(
      r"slice_smem\"\(\) <\{offset = (\d+) : i32\}> : \(\) -> memref<32x36xf32",
      m.dialect_text)]
  assert starts == [0, 5120, 10240], starts          # padded to 1024 bytes


def test_integer_math_clamp_switch_while():
  def k(x_ref, o_ref):
    x = x_ref[...]
    y = ((x << 2) ^ (x >> 1)) + jnp.clip(x, 0, 7) % 3
    def cond(s):
      return s[0] < 3
    def body(s):
      return s[0] + 1, s[1] + y
    _, y = jax.lax.while_loop(cond, body, (0, y))
    o_ref[...] = jax.lax.switch(pl.program_id(0) % 3,
                                [lambda a: a, lambda a: a * 2,
                                 lambda a: a + 3], y)
  spec = pl.BlockSpec((64, 128), lambda i: (i, 0))
  m = kernel_module(k, jnp.ones((192, 128), jnp.int32), grid=(3,),
                    in_specs=[spec], out_specs=spec)
  text = m.dialect_text
  for op in ("arith.shli", "arith.shrsi", "arith.xori", "arith.maxsi",
             "arith.minsi", "arith.remsi", "scf.while", "scf.index_switch"):
    assert op in text, op
  assert "case 1" in text


def test_scalars_and_any_space_arrays_are_used_in_global_memory():
  def k(x_ref, o_ref):
    o_ref[0] = x_ref[0] * 3 + 1
    o_ref[1] = jnp.sign(x_ref[1])
  smem = pl.BlockSpec(memory_space=pl.tpu.SMEM)
  f = lambda x: pl.pallas_call(k, jax.ShapeDtypeStruct((2,), jnp.int32),
                               in_specs=[smem], out_specs=smem,
                               backend="mosaic_gpu")(x)
  m = gpu_module(f, jnp.array([5, -9], jnp.int32))
  assert all(b.in_gmem for b in m.plan.blocks)
  assert "mosaic_gpu.async_load" not in m.dialect_text
  assert "memref.store" in m.dialect_text and "memref<2xi32>" in m.dialect_text


def test_run_scoped_buffers_are_planned_in_shared_memory():
  def k(x_ref, o_ref):
    def scope(tmp_ref):
      tmp_ref[...] = x_ref[...] * 2.0
      o_ref[...] = tmp_ref[...] + 1.0
    pl.run_scoped(scope, pl.tpu.VMEM((64, 128), jnp.float32))
  m = kernel_module(k, jnp.ones((64, 128), jnp.float32))
  ((_, bufs),) = m.plan.scoped
  assert bufs == (((64, 128), np.dtype(np.float32)),)
  assert m.plan.smem_bytes >= 3 * 64 * 128 * 4
  assert m.dialect_text.count("memref<64x128xf32, #gpu.address_space"
                              "<workgroup>>") >= 3


# ------------------------------------------------------------------ corpus
#
# Every kernel of the feature suite either builds (module verified, layouts
# inferred) or is refused with a BackendError that names the reason and
# suggests Triton; never another exception. Built, not run: the numerics of
# the ones that build are test_mosaic_gpu_device.py's, on a GPU.

# The feature suite's test functions, run again here to build their kernels.
from tests.pallas import test_features as features  # noqa: E402
from tests.pallas.testing import parametrize_cases  # noqa: E402


class _Built(Exception):
  pass


def _first_cases():
  for name in sorted(dir(features)):
    fn = getattr(features, name)
    if not name.startswith("test_") or not callable(fn):
      continue
    params = __import__("inspect").signature(fn).parameters
    if "backend" not in params or "capfd" in params:
      continue
    for kw in parametrize_cases(fn):
      if kw.pop("backend", "interpret") in ("interpret", "mosaic_interpret"):
        yield name, kw
        break


def _outcome(exc):
  while exc is not None and not isinstance(exc, (_Built, BackendError)):
    exc = exc.__cause__ or exc.__context__
  return exc


@pytest.fixture
def build_only():
  """backend "mosaic_gpu" builds the module, then stops (a CPU cannot run
  it); lowering for CPU is allowed for that purpose."""
  from dsl.core import backends
  from lowering_mosaic.gpu.kernel import build_gpu_module
  real = backends.lowering_rule("mosaic_gpu", "<test>", None)

  def rule(ctx, *args, spec):
    build_gpu_module(spec)
    raise _Built(spec.name)
  backends.register_backend("mosaic_gpu", rule)
  jax.clear_caches()
  yield
  backends.register_backend("mosaic_gpu", real)
  jax.clear_caches()


@pytest.mark.parametrize("name,kwargs", list(_first_cases()))
def test_feature_kernels_build_or_are_refused_clearly(name, kwargs,
                                                      build_only):
  try:
    getattr(features, name)(backend="mosaic_gpu", **kwargs)
  except Exception as e:  # noqa: BLE001 (classified below)
    got = _outcome(e)
    if got is None:
      raise
  else:
    pytest.fail("the kernel ran on the CPU")
  if name in FEATURES_THAT_BUILD:
    assert isinstance(got, _Built), str(got)
  else:
    assert isinstance(got, BackendError), got
    assert "triton" in str(got) and "kernel '" in str(got)

