"""The kernel library picks its backend and blocks for the platform a call
is lowered for, not for the platform of this process: exported from this
CPU host for CUDA or TPU, each kernel carries that platform's blocks."""
import functools
import re

import jax
import jax.numpy as jnp
import pytest

import dsl as pl
import kernels
from kernels import blocking

F32 = jnp.float32
Q = jnp.ones((1, 256, 2, 64), F32)
LIBRARY = {
    "softmax": (kernels.softmax, (jnp.ones((256, 1024), F32),)),
    "layer_norm": (kernels.layer_norm, (jnp.ones((256, 1024), F32),
                                        jnp.ones(1024, F32),
                                        jnp.zeros(1024, F32))),
    "rms_norm": (kernels.rms_norm, (jnp.ones((256, 1024), F32),
                                    jnp.ones(1024, F32))),
    "matmul": (kernels.matmul, (jnp.ones((512, 512), F32),
                                jnp.ones((512, 512), F32))),
    "flash_attention": (kernels.flash_attention, (Q, Q, Q)),
    "decode_attention": (kernels.decode_attention, (
        jnp.ones((2, 4, 64), F32), jnp.ones((2, 512, 2, 64), F32),
        jnp.ones((2, 512, 2, 64), F32), jnp.array([100, 512], jnp.int32))),
    "paged_attention": (kernels.paged_attention, (
        jnp.ones((2, 4, 128), F32), jnp.ones((2, 16, 16, 128), F32),
        jnp.ones((2, 16, 16, 128), F32), jnp.array([100, 256], jnp.int32),
        jnp.arange(32, dtype=jnp.int32).reshape(2, 16))),
}


def _specs(jaxpr):
  """The KernelSpecs of the pallas_calls in a jaxpr, in order."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive is pl.pallas_call_p:
      out.append(eqn.params["spec"])
    for v in eqn.params.values():
      for x in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(x, "jaxpr", x)
        if hasattr(inner, "eqns"):
          out += _specs(inner)
  return out


def _blocks(specs):
  return [(s.name, tuple(tuple(bm.block_sizes)
                         for bm in s.grid_mapping.block_mappings))
          for s in specs]


def _branches(fn, args):
  """platform -> the specs of the version `fn` traces for it."""
  jaxpr = jax.make_jaxpr(jax.jit(fn))(*args).jaxpr
  conds = [e for e in _inner_eqns(jaxpr) if e.primitive.name == "cond"]
  index = [e for e in _inner_eqns(jaxpr) if e.primitive.name == "platform_index"]
  assert conds and index, jaxpr
  platforms = index[0].params["platforms"]
  branches = conds[0].params["branches"]
  return {p: _specs(branches[k].jaxpr) for k, names in enumerate(platforms)
          for p in names}


def _inner_eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for v in eqn.params.values():
      for x in (v if isinstance(v, (tuple, list)) else (v,)):
        inner = getattr(x, "jaxpr", x)
        if hasattr(inner, "eqns") and eqn.primitive.name != "cond":
          yield from _inner_eqns(inner)


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_each_platform_gets_the_blocks_of_its_backend(name):
  fn, args = LIBRARY[name]
  branches = _branches(fn, args)
  assert {"cpu", "cuda", "tpu"} <= set(branches)
  for platform in ("cpu", "cuda", "tpu"):
    backend = blocking.platform_backend(name, platform)
    alone = _specs(jax.make_jaxpr(functools.partial(fn, backend=backend))(
        *args).jaxpr)
    assert _blocks(branches[platform]) == _blocks(alone), platform
    assert {spec.backend for spec in branches[platform]} == {backend}
  assert blocking.platform_backend(name, "tpu") == "mosaic"
  assert blocking.platform_backend(name, "cpu") == "interpret"


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_export_for_tpu_from_a_cpu_host(name):
  fn, args = LIBRARY[name]
  text = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
  assert "tpu_custom_call" in text
  both = jax.export.export(jax.jit(fn), platforms=["cpu", "tpu"])(*args)
  assert both.platforms == ("cpu", "tpu")
  assert "tpu_custom_call" in both.mlir_module()


@pytest.mark.parametrize("name", ["softmax", "flash_attention"])
def test_export_for_cuda_gets_gpu_blocks(name):
  fn, args = LIBRARY[name]
  args = tuple(a.astype(jnp.bfloat16) for a in args)
  with pl.config.use_mosaic_gpu_option(True):
    assert blocking.platform_backend(name, "cuda") == "mosaic_gpu"
    # the CPU's blocks need more shared memory than a GPU has: these fit
    text = jax.export.export(jax.jit(fn), platforms=["cuda"])(
        *args).mlir_module()
  assert "mosaic_gpu" in text and "tpu_custom_call" not in text


def test_cpu_calls_run_as_before():
  x = LIBRARY["softmax"][1][0]
  text = jax.jit(kernels.softmax).lower(x).as_text()
  assert "custom_call" not in text or not re.search(
      r"tpu_custom_call|mosaic_gpu", text)
  assert jnp.allclose(jax.jit(kernels.softmax)(x), kernels.softmax(x))
