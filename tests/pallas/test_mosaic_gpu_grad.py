"""Transformations of kernels on backend "mosaic_gpu", checked on a CPU: the
jvp, reverse-mode (recording and transposed) and batched kernels that JAX's
rules derive are built as Mosaic GPU modules (verified, layouts inferred)
when lowering for "cuda", for the grad corpus's cases (grad_corpus.py)
and for GPU-shaped library kernels. Their numerics are the corpus's (the
same derived kernels on the CPU backends) and, on a GPU,
test_mosaic_gpu_device.py's."""
import functools
import importlib

import jax
import jax.numpy as jnp
import pytest

import dsl as pl
from dsl import tpu as pltpu
from tests.pallas import grad_corpus as corpus
from tests.pallas import mosaic_gpu_testing
from tests.pallas.mosaic_gpu_testing import lower_cuda
from tests.pallas.testing import uniform_arrays

fa = importlib.import_module("kernels.flash_attention")
mm = importlib.import_module("kernels.matmul")

BACKEND = "mosaic_gpu"


def _loss(f):
  return lambda *xs: sum(jnp.sum(o.astype(jnp.float32))
                         for o in jax.tree_util.tree_leaves(f(*xs)))


def _transformed(mode, f, args):
  """(function, arguments) of `f` under transformation `mode`."""
  if mode == "fwd":
    return f, args
  if mode == "jvp":
    return (lambda *a: jax.jvp(f, a, a)), args
  if mode == "grad":
    return jax.grad(_loss(f), tuple(range(len(args)))), args
  return jax.vmap(f), tuple(jnp.stack([a, a * 0.5]) for a in args)


def _built(tmp_path, mode, f, args) -> list[str]:
  """The names of the kernels `f` under `mode` lowers for "cuda" (each a
  Mosaic GPU custom call whose module was built and layout-inferred)."""
  g, gargs = _transformed(mode, f, args)
  jax.clear_caches()          # every kernel is lowered (and dumped) anew
  with pl.config.dump_mlir_to_option(str(tmp_path)):
    text = lower_cuda(g, *gargs)
  names = sorted(p.name.rsplit("-", 1)[0] for p in tmp_path.iterdir()
                 if p.name.endswith(".mosaic_gpu.mlir"))
  assert text.count("stablehlo.custom_call @mosaic_gpu_v2") == len(names)
  assert names and "triton_kernel_call" not in text
  return names


# The kernels JAX's rules derive, by the suffix of their names.
DERIVED = {"jvp": "_jvp", "grad": "_transpose"}


# ------------------------------------------------------------ the corpus

CORPUS = ["softmax", "layer_norm", "rms_norm", "cond", "input_output_aliases",
          "scalar_prefetch"]


@pytest.mark.parametrize("mode", ["fwd", "jvp", "grad", "vmap"])
@pytest.mark.parametrize("case", CORPUS)
def test_corpus_kernels_and_their_derived_kernels_lower(case, mode, tmp_path):
  f, _, args = corpus.CASES[case](BACKEND)
  names = _built(tmp_path, mode, f, args)
  if mode in DERIVED and case in ("cond", "input_output_aliases",
                                  "scalar_prefetch"):   # no custom_vjp
    assert any(n.endswith(DERIVED[mode]) for n in names), names


@pytest.mark.parametrize("mode", ["fwd", "jvp", "vmap"])
def test_row_loop_and_its_jvp_lower(mode, tmp_path):
  f, _, args = corpus.CASES["fori_loop_rows"](BACKEND)
  _built(tmp_path, mode, f, args)


# ------------------------------------------------- GPU-shaped library kernels

def _bf16(*shapes, seed=0):
  return tuple(x.astype(jnp.bfloat16)
               for x in uniform_arrays(*shapes, seed=seed))


def _matmul():
  a, b, bias = _bf16((64, 256), (256, 128), (128,))
  f = functools.partial(mm.matmul_2d, activation="relu", backend=BACKEND)
  return (lambda a, b, c: f(a, b, c)), (a, b, bias)


def _scratch_accumulator():
  x, y = _bf16((128, 128), (128, 64))

  def f(x, y):
    return pl.pallas_call(
        corpus.acc_kernel, jax.ShapeDtypeStruct((128, 64), jnp.bfloat16),
        grid=(2, 1, 2), backend=BACKEND,
        in_specs=[pl.BlockSpec((64, 64), lambda i, j, k: (i, k)),
                  pl.BlockSpec((64, 64), lambda i, j, k: (k, j))],
        out_specs=pl.BlockSpec((64, 64), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((64, 64), jnp.float32)])(x, y)
  return f, (x, y)


def _attention(causal):
  # GQA: 2 query heads per kv head; 128 keys: two 64-key steps backward.
  q, k, v = _bf16((1, 128, 2, 128), (1, 128, 1, 128), (1, 128, 1, 128))
  f = functools.partial(fa.flash_attention, causal=causal, backend=BACKEND)
  return f, (q, k, v)


LIBRARY = {
    "matmul": _matmul,
    "scratch_accumulator": _scratch_accumulator,
    "attention": functools.partial(_attention, False),
    "causal_attention": functools.partial(_attention, True),
}


@pytest.mark.parametrize("mode", ["fwd", "grad", "vmap"])
@pytest.mark.parametrize("case", sorted(LIBRARY))
def test_library_kernels_and_their_backward_lower(case, mode, tmp_path):
  f, args = LIBRARY[case]()
  names = _built(tmp_path, mode, f, args)
  if mode == "grad" and case.endswith("attention"):   # the hand-written ones
    assert {"flash_attention_fwd", "flash_attention_bwd_delta",
            "flash_attention_bwd_dkdv", "flash_attention_bwd_dq"} <= set(names)
  elif mode == "grad":                                 # derived
    assert any(n.endswith("_transpose") for n in names), names


def test_accumulator_jvp_kernel_lowers(tmp_path):
  f, args = _scratch_accumulator()
  assert any(n.endswith("_jvp") for n in _built(tmp_path, "jvp", f, args))


@pytest.mark.parametrize("name", ["softmax", "softmax_two_pass", "layer_norm"])
def test_the_gpu_checks_library_cases_lower(name, tmp_path):
  """test_mosaic_gpu_device.py's library cases (wider rows: tiled copies,
  split vector blocks, the two-pass softmax) build, with their backward."""
  f, _, args = mosaic_gpu_testing.LIBRARY[name]()
  _built(tmp_path, "grad", f, args)
