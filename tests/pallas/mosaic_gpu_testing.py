"""Helpers shared by the tests of backend "mosaic_gpu" (test_mosaic_gpu*.py):
building and lowering its modules on a CPU, reading their text (ops, the
regions of a warpgroup switch), a kernel whose ring depth is set by its
block size, the feature kernels that build today, and the library kernels
the GPU check runs."""
import importlib
import re

import jax
import jax.numpy as jnp

import dsl as pl
from lowering_mosaic.gpu import to_gpu_modules

BF = lambda *s: jnp.ones(s, jnp.bfloat16)


def normal_arrays(seed, *shapes, dtype=jnp.bfloat16):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return [jax.random.normal(k, s, jnp.float32).astype(dtype)
          for k, s in zip(keys, shapes)]


# ------------------------------------------------------------ building

def lower_cuda(f, *args) -> str:
  """The StableHLO text of `f` lowered for "cuda" (no GPU needed)."""
  return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def gpu_module(f, *args):
  """The one Mosaic GPU module `f`'s pallas_call builds."""
  (m,) = to_gpu_modules(f, *args)
  return m


def kernel_module(body, *args, out=None, **kw):
  """The module of `body` as a pallas_call on "mosaic_gpu" whose output is
  shaped like the first operand (or `out`), of its dtype."""
  f = lambda *xs: pl.pallas_call(
      body, jax.ShapeDtypeStruct(out or xs[0].shape, xs[0].dtype),
      backend="mosaic_gpu", **kw)(*xs)
  return gpu_module(f, *args)


# ------------------------------------------------------------ module text

def mlir_ops(text: str) -> list[str]:
  return re.findall(r'"?((?:mosaic_gpu|nvvm|scf|vector|memref)\.[\w.]+)', text)


# A TMA copy GMEM -> SMEM in a lowered module: jaxlib 0.11 lowers it to the
# NVVM op (`nvvm.cp.async.bulk.tensor.shared.cluster.global`), jaxlib 0.12 to
# inline PTX (`cp.async.bulk.tensor.2d.shared::cta.global.mbarrier::...`).
TMA_LOAD = re.compile(r"cp\.async\.bulk\.tensor(?:\.\dd)?\.shared"
                      r"(?:\.cluster|::cta)\.global")


def count_tma_loads(lowered: str) -> int:
  return len(TMA_LOAD.findall(lowered))


def count_op(text: str, op: str) -> int:
  return len(re.findall(re.escape(op) + r"\b", text))


def mlir_region(text: str, start: int) -> str:
  """The region that opens on the line at `start` (up to its closing
  brace, by indentation)."""
  lines = text[text.rfind("\n", 0, start) + 1:].splitlines()
  indent = len(lines[0]) - len(lines[0].lstrip())
  for i, line in enumerate(lines[1:], 1):
    if line.strip() == "}" and len(line) - len(line.lstrip()) == indent:
      return "\n".join(lines[:i + 1])
  raise AssertionError("unclosed region")


def warpgroup_roles(text: str) -> tuple[str, str]:
  """(consumer region, producer region) of the warpgroup switch: the first
  `scf.index_switch` after the warpgroup index is computed."""
  at = text.index("scf.index_switch", text.index("nvvm.shfl.sync"))
  case = text.index("case 0 {", at)
  consumer = mlir_region(text, case)
  producer = mlir_region(text, text.index("default {", case + len(consumer)))
  return consumer, producer


# ------------------------------------------------------------ kernels

def _deep_kernel(x_ref, o_ref):
  @pl.when(pl.program_id(1) == 0)
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)
  o_ref[...] += x_ref[...].astype(jnp.float32)


def deep_ring(rows, cols, steps, **params):
  """A row sum over `steps` sequential steps of (rows, cols) bf16 blocks
  (the ring depth follows from the block size): (function, its input)."""
  def f(x):
    return pl.pallas_call(
        _deep_kernel, jax.ShapeDtypeStruct((rows * 2, cols), jnp.float32),
        grid=(2, steps),
        in_specs=[pl.BlockSpec((rows, cols), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((rows, cols), lambda i, j: (i, 0)),
        compiler_params=pl.mosaic_gpu.CompilerParams(**params),
        backend="mosaic_gpu")(x)
  return f, BF(rows * 2, cols * steps)


# The feature kernels (test_features.py) that lower on this backend today:
# test_mosaic_gpu.py guards it, test_mosaic_gpu_device.py runs them on a GPU.
FEATURES_THAT_BUILD = {
    "test_add_partial_edge_blocks", "test_aliased_output_keeps_unwritten_blocks",
    "test_fori_loop_ds_and_at_views", "test_grad_and_vmap",
    "test_input_output_aliases", "test_integer_ops",
    "test_kernel_decorator_in_jit_and_make_jaxpr",
    "test_loop_cond_while_and_casts",
    "test_multiple_of_and_max_contiguous_are_identity",
    "test_pytree_operands_and_out_shape", "test_reversed_index_map",
    "test_run_scoped_scratch", "test_scalar_prefetch_index_map",
    "test_scalars_in_smem", "test_scratch_accumulator_persists_over_sequential_"
    "steps", "test_squeezed_dims_and_2d_grid",
    "test_squeezed_leading_dims_and_2d_grid", "test_zero_d_refs_and_int_dtypes",
}


# ------------------------------------------------------ the library kernels

def _lib(name):
  return importlib.import_module(f"kernels.{name}")


def _attention(causal):
  q, k, v = normal_arrays(7, (2, 256, 4, 128), (2, 256, 2, 128),
                          (2, 256, 2, 128))
  fa = _lib("flash_attention")
  return (lambda q, k, v: fa.flash_attention(q, k, v, causal=causal,
                                             backend="mosaic_gpu"),
          lambda q, k, v: fa.reference(q, k, v, causal=causal), (q, k, v))


# The library kernels on "mosaic_gpu" at GPU-sized shapes:
# name -> () -> (kernel on mosaic_gpu, jnp reference, inputs)
LIBRARY = {
    "softmax": lambda: (
        lambda x: _lib("softmax").softmax(x, backend="mosaic_gpu"),
        _lib("softmax").reference, normal_arrays(1, (512, 1024))),
    "softmax_two_pass": lambda: (
        lambda x: _lib("softmax").softmax(x, backend="mosaic_gpu"),
        _lib("softmax").reference, normal_arrays(2, (256, 4096))),
    "layer_norm": lambda: (
        lambda x, w, b: _lib("layer_norm").layer_norm(x, w, b,
                                                      backend="mosaic_gpu"),
        _lib("layer_norm").reference,
        normal_arrays(3, (512, 512), (512,), (512,))),
    "rms_norm": lambda: (
        lambda x, w: _lib("rms_norm").rms_norm(x, w, backend="mosaic_gpu"),
        _lib("rms_norm").reference, normal_arrays(4, (512, 512), (512,))),
    "matmul": lambda: (
        lambda x, y, c: _lib("matmul").matmul(x, y, bias=c, activation="relu",
                                              backend="mosaic_gpu"),
        lambda x, y, c: _lib("matmul").reference(x, y, bias=c,
                                                 activation="relu"),
        normal_arrays(5, (512, 512), (512, 256), (256,))),
    "attention": lambda: _attention(False),
    "causal_attention": lambda: _attention(True),
}
