"""Mosaic lowering: verified modules, their structure, inspection, the TPU
custom call, unsupported primitives and the TPU rule checker."""
import os
import re

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

import dsl as pl
from dsl import tpu as pltpu
from dsl import triton as plt
from dsl.core.errors import BackendError, KernelError
import lowering_mosaic
from tests.pallas.testing import matmul_call

THIS_FILE = os.path.basename(__file__)


def add_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = x_ref[...] + y_ref[...]


def blocked_add(x, y, block=(8, 128), backend="mosaic_interpret", **kw):
  return pl.pallas_call(
      add_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(pl.cdiv(x.shape[0], block[0]), pl.cdiv(x.shape[1], block[1])),
      in_specs=[pl.BlockSpec(block, lambda i, j: (i, j))] * 2,
      out_specs=pl.BlockSpec(block, lambda i, j: (i, j)), backend=backend,
      **kw)(x, y)


def matmul(x, y, backend="mosaic"):
  return matmul_call(
      pl, pltpu, x.shape[0], x.shape[1], y.shape[1], (128, 128, 128),
      scratch=True, dtype=x.dtype,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=32 * 1024 * 1024),
      backend=backend)(x, y)


def test_module_records_windows_bounds_and_semantics():
  x = jnp.ones((256, 256), jnp.bfloat16)
  text = lowering_mosaic.to_mlir(matmul, x, x)
  assert "func.func @matmul_kernel(%arg0: i32, %arg1: i32, %arg2: i32" in text
  assert "iteration_bounds = array<i64: 2, 2, 2>" in text
  assert ("dimension_semantics = [#tpu.dimension_semantics<parallel>, "
          "#tpu.dimension_semantics<parallel>, "
          "#tpu.dimension_semantics<arbitrary>]") in text
  assert "scratch_operands = 1 : i64" in text
  assert ("{transform_indices = @transform_0, window_bounds = array<i64: 128, "
          "128>}") in text
  assert "memref<128x128xbf16, #tpu.memory_space<vmem>>" in text
  assert "tpu.matmul" in text
  # the index map of in_specs[1] returns (k, j)
  m = re.search(r"func.func private @transform_1\(%arg0: i32, %arg1: i32, "
                r"%arg2: i32\) -> \(i32, i32\) \{\s*return %arg2, %arg1", text)
  assert m, text


def test_every_module_verifies_and_carries_source_lines():
  x = jnp.ones((16, 256))
  (module,) = lowering_mosaic.to_modules(blocked_add, x, x)
  assert module.operation.verify()
  text = lowering_mosaic.to_mlir(blocked_add, x, x, debug_info=True)
  assert THIS_FILE in text   # the kernel's own lines are the op locations


def test_to_mlir_finds_every_kernel_in_f():
  x = jnp.ones((16, 256))

  def f(x):
    return blocked_add(blocked_add(x, x), x) * 2
  text = lowering_mosaic.to_mlir(f, x)
  assert text.count("func.func @add_kernel") == 2


def test_dump_mlir_to_directory(tmp_path):
  x = jnp.ones((16, 256))
  d = tmp_path / "mlir"
  with _config_ctx("jax_pallas_dump_mlir_to", str(d)):
    jax.block_until_ready(jax.jit(blocked_add)(x, x))
  files = list(d.glob("add_kernel-*.mlir"))
  assert files
  assert "tpu.memory_space<vmem>" in files[0].read_text()


def _config_ctx(name, value):
  from dsl.core.jax_internals import config as jax_config
  return jax_config.config._value_holders[name](value)


def test_tpu_lowering_is_a_tpu_custom_call_with_our_module():
  x = jnp.ones((256, 256), jnp.float32)
  lowered = jax.jit(matmul).trace(x, x).lower(lowering_platforms=("tpu",))
  text = lowered.as_text()
  assert "stablehlo.custom_call @tpu_custom_call" in text
  assert 'kernel_name = "matmul_kernel"' in text
  import base64, json
  cfg = re.search(r'backend_config = "(.*?)", kernel_name', text).group(1)
  cfg = json.loads(cfg.replace('\\22', '"'))
  body = base64.b64decode(cfg["custom_call_config"]["body"])
  assert body.startswith(b"ML\xefR")       # MLIR bytecode
  assert b"tpu.matmul" in body and b"transform_indices" in body
  assert cfg["scoped_memory_configs"][0]["size"] == 32 * 1024 * 1024


def test_metadata_is_the_calls_kernel_metadata():
  x = jnp.ones((16, 256), jnp.float32)
  f = lambda x: blocked_add(x, x, backend="mosaic",
                            metadata={"block_q": "8", "kind": "add"})
  text = jax.jit(f).trace(x).lower(lowering_platforms=("tpu",)).as_text()
  assert re.search(r'kernel_metadata = "\{.*block_q.*8.*kind.*add.*\}"',
                   text), text
  with pytest.raises(KernelError, match="metadata must be a dict of str"):
    blocked_add(x, x, metadata={"block_q": 8})


def test_mosaic_backend_refuses_cpu():
  x = jnp.ones((16, 256))
  with pytest.raises(BackendError, match="mosaic_interpret"):
    jax.jit(lambda x, y: blocked_add(x, y, backend="mosaic"))(x, x)


def test_unsupported_primitive_names_primitive_kernel_and_line():
  def kernel(x_ref, o_ref):
    o_ref[...] = lax.sort(x_ref[...], dimension=1)   # the offending line
  x = jnp.ones((8, 128))
  f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                     backend="mosaic_interpret")
  with pytest.raises(BackendError) as e:
    jax.jit(f)(x)
  msg = str(e.value)
  assert "sort" in msg and "kernel 'kernel'" in msg
  assert f"{THIS_FILE}:" in msg and "the offending line" not in msg
  line = e.value.where.rsplit(":", 1)[1]
  src = open(__file__).read().splitlines()[int(line) - 1]
  assert "the offending line" in src


def test_atomics_are_unsupported_on_tpu():
  def kernel(x_ref, o_ref):
    plt.atomic_add(o_ref, 0, x_ref[0])
  with pytest.raises(BackendError, match="atomic.*TPU"):
    lowering_mosaic.to_mlir(
        pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32)),
        jnp.ones((8, 128)))


def test_reading_an_hbm_ref_directly_is_an_error():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]
  f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                     in_specs=[pl.BlockSpec(memory_space=pl.ANY)])
  with pytest.raises(BackendError, match="pl.ANY.*make_async_copy"):
    lowering_mosaic.to_mlir(f, jnp.ones((8, 128)))


# ------------------------------------------------------------ TPU rules

@pytest.mark.parametrize("dtype,block,msg,fix", [
    (jnp.float32, (8, 100), r"last dim 100 is neither a multiple of 128",
     "(8, 128)"),
    (jnp.float32, (4, 128), r"second-minor dim 4 is neither a multiple of 8 "
     r"\(32-bit float32 tiles are \(8, 128\)\)", "(8, 128)"),
    (jnp.bfloat16, (8, 128), r"second-minor dim 8 .* multiple of 16 \(16-bit",
     "(16, 128)"),
    (jnp.int8, (16, 256), r"second-minor dim 16 .* multiple of 32 \(8-bit",
     "(32, 256)"),
])
def test_tiling_rule(dtype, block, msg, fix):
  x = jnp.ones((64, 512), dtype)
  with pytest.raises(KernelError) as e:
    lowering_mosaic.to_mlir(lambda a: blocked_add(a, a, block), x)
  text = str(e.value)
  assert e.value.operand == "in_specs[0]"
  assert "TPU tiling rule" in text
  assert re.search(msg, text), text
  assert f"A block shape that passes: {fix}" in text
  # and that suggestion does pass
  lowering_mosaic.to_mlir(lambda a: blocked_add(
      a, a, tuple(int(v) for v in fix.strip("()").split(","))), x)


def squeezed_rows_copy(x, backend="mosaic_interpret"):
  """Copies (b, h, n) in blocks (None, None, n): h squeezed, second-minor."""
  spec = pl.BlockSpec((None, None, x.shape[2]), lambda i, j: (i, j, 0))
  return pl.pallas_call(
      lambda x_ref, o_ref: o_ref.__setitem__(Ellipsis, x_ref[...]),
      jax.ShapeDtypeStruct(x.shape, x.dtype), grid=x.shape[:2],
      in_specs=[spec], out_specs=spec, backend=backend)(x)


def test_tiling_rule_rejects_squeezed_second_minor_dim():
  with pytest.raises(KernelError) as e:
    lowering_mosaic.to_mlir(squeezed_rows_copy, jnp.ones((2, 4, 128)))
  text = str(e.value)
  assert e.value.operand == "in_specs[0]" and "TPU tiling rule" in text
  assert "second-minor dim is squeezed" in text, text
  assert "A block shape that passes: (None, 4, 128)" in text, text
  # a squeezed dim of size 1 is its whole array dim
  lowering_mosaic.to_mlir(squeezed_rows_copy, jnp.ones((2, 1, 128)))


def test_tiling_rule_allows_full_array_dims():
  x = jnp.ones((10, 100))
  lowering_mosaic.to_mlir(lambda a: blocked_add(a, a, (10, 100)), x)


def test_vmem_budget_rule():
  x = jnp.ones((4096, 1024), jnp.float32)   # 3 x 2 x 4 MiB blocks > 16 MiB
  with pytest.raises(KernelError) as e:
    lowering_mosaic.to_mlir(lambda a: blocked_add(a, a, (1024, 1024)), x)
  text = str(e.value)
  assert "TPU VMEM budget" in text and "25165824 bytes" in text
  assert "limit is 16777216 bytes" in text and "vmem_limit_bytes" in text
  assert "in_specs[0] 2 x 4194304 (double-buffered block (1024, 1024)" in text
  fix = re.search(r"Block shapes that pass: in_specs\[0\]: \((\d+), (\d+)\)",
                  text)
  assert fix, text
  block = (int(fix.group(1)), int(fix.group(2)))
  lowering_mosaic.to_mlir(lambda a: blocked_add(a, a, block), x)
  # raising the limit lets it through
  lowering_mosaic.to_mlir(lambda a: blocked_add(
      a, a, (1024, 1024), compiler_params=pltpu.CompilerParams(
          vmem_limit_bytes=64 * 1024 * 1024)), x)


def test_vmem_budget_counts_scratch():
  def kernel(x_ref, o_ref, s_ref):
    o_ref[...] = x_ref[...]
  f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                     scratch_shapes=[pltpu.VMEM((4096, 1024), jnp.float32)],
                     compiler_params=pltpu.CompilerParams(
                         vmem_limit_bytes=8 * 1024 * 1024))
  with pytest.raises(KernelError, match=r"scratch_shapes\[0\] 16777216"):
    lowering_mosaic.to_mlir(f, jnp.ones((8, 128)))


def test_scalars_must_live_in_smem():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 3 + 1
  f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((), jnp.int32))
  with pytest.raises(KernelError, match="scalars must live in SMEM") as e:
    lowering_mosaic.to_mlir(f, jnp.int32(5))
  assert e.value.operand == "in_specs[0]"
  smem = pl.BlockSpec(memory_space=pltpu.SMEM)
  g = pl.pallas_call(kernel, jax.ShapeDtypeStruct((), jnp.int32),
                     in_specs=[smem], out_specs=smem,
                     backend="mosaic_interpret")
  assert int(g(jnp.int32(5))) == 16


def test_dimension_semantics_must_match_grid():
  x = jnp.ones((16, 256))
  with pytest.raises(KernelError, match="dimension_semantics has 1 entries"):
    lowering_mosaic.to_mlir(lambda a: blocked_add(
        a, a, compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",))), x)


def test_rule_checker_runs_before_interpret_backend():
  x = jnp.ones((64, 512))
  with pytest.raises(KernelError, match="TPU tiling rule"):
    jax.jit(lambda a: blocked_add(a, a, (8, 100)))(x)


def test_automatic_backend_for_tpu_is_mosaic():
  x = jnp.ones((16, 256))
  text = jax.jit(lambda a: blocked_add(a, a, backend=None)).trace(x).lower(
      lowering_platforms=("tpu",)).as_text()
  assert "tpu_custom_call" in text and 'kernel_name = "add_kernel"' in text
  # the same function on CPU runs the interpret backend
  np.testing.assert_array_equal(blocked_add(x, x, backend=None), 2 * x)
