"""Golden corpus: the kernels of kernels/ (see mosaic_corpus.py); Pallas
runs each module's twin (mosaic_twins.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tests.pallas.mosaic_corpus import CASES, f32
from tests.pallas.mosaic_corpus_dma import N_DEV, _mesh


# ------------------------------------------------------------ kernels/

def _library(modname, fn_name, make_args, **kw):
  """A kernel of kernels/, lowered for a TPU (backend="mosaic" picks the
  TPU blocks); Pallas runs the module's twin (tests/pallas/mosaic_twins.py)."""
  def build(pl, pltpu):
    import importlib
    from tests.pallas.mosaic_twins import twin
    mod = (importlib.import_module(modname) if pl.__name__.startswith("dsl")
           else twin(modname))
    fn = getattr(mod, fn_name)
    return functools.partial(fn, backend="mosaic", **kw), make_args()
  return build


def _qkv(b=1, s=256, h=2, d=128):
  return tuple(jnp.ones((b, s, h, d), jnp.float32) for _ in range(3))


CASES["lib_softmax"] = _library("kernels.softmax", "softmax_2d",
                                lambda: (f32(64, 256),))
CASES["lib_softmax_bwd"] = _library("kernels.softmax", "softmax_bwd_2d",
                                    lambda: (f32(64, 256), f32(64, 256)))
CASES["lib_layer_norm"] = _library(
    "kernels.layer_norm", "layer_norm",
    lambda: (f32(64, 256), f32(256), f32(256)))
CASES["lib_rms_norm"] = _library("kernels.rms_norm", "rms_norm",
                                 lambda: (f32(64, 256), f32(256)))
CASES["lib_matmul"] = _library("kernels.matmul", "matmul",
                               lambda: (f32(256, 512), f32(512, 256)))
CASES["lib_matmul_bias_gelu"] = _library(
    "kernels.matmul", "matmul", lambda: (f32(256, 256), f32(256, 256)),
    bias=f32(256), activation="gelu")
CASES["lib_flash_attention"] = _library("kernels.flash_attention",
                                        "flash_attention", _qkv)
CASES["lib_flash_attention_causal"] = _library(
    "kernels.flash_attention", "flash_attention", _qkv, causal=True)
CASES["lib_flash_attention_gqa_segments"] = _library(
    "kernels.flash_attention", "flash_attention",
    lambda: (f32(2, 256, 4, 128), f32(2, 256, 2, 128), f32(2, 256, 2, 128)),
    segment_ids=jnp.repeat(jnp.arange(2, dtype=jnp.int32)[None], 256,
                           axis=0).reshape(2, 256))
CASES["lib_decode_attention"] = _library(
    "kernels.decode_attention", "decode_attention",
    lambda: (f32(2, 2, 128), f32(2, 512, 2, 128), f32(2, 512, 2, 128),
             jnp.array([100, 512], jnp.int32)))
CASES["lib_paged_attention"] = _library(
    "kernels.paged_attention", "paged_attention",
    lambda: (f32(2, 2, 128), f32(2, 16, 64, 128), f32(2, 16, 64, 128),
             jnp.array([100, 256], jnp.int32),
             jnp.arange(8, dtype=jnp.int32).reshape(2, 4)))



def _collective(fn_name):
  def build(pl, pltpu):
    import importlib
    from jax.sharding import PartitionSpec as P
    from tests.pallas.mosaic_twins import twin
    mod = (importlib.import_module("kernels.collectives")
           if pl.__name__.startswith("dsl") else twin("kernels.collectives"))
    fn = functools.partial(getattr(mod, fn_name), axis_name="x",
                           backend="mosaic")
    f = jax.shard_map(fn, mesh=_mesh(), in_specs=P("x"), out_specs=P("x"),
                      check_vma=False)
    return f, (f32(N_DEV * 32, 128),)
  return build


CASES["lib_all_gather"] = _collective("all_gather")
CASES["lib_reduce_scatter"] = _collective("reduce_scatter")


def _library_grad(modname, fn_name, make_args, argnums=0, **kw):
  """The backward kernels of a kernels/ function: the gradient of the sum
  of its output."""
  fwd = _library(modname, fn_name, make_args, **kw)

  def build(pl, pltpu):
    f, args = fwd(pl, pltpu)
    return jax.grad(lambda *a: jnp.sum(f(*a)), argnums=argnums), args
  return build


CASES["lib_softmax_grad"] = _library_grad(
    "kernels.softmax", "softmax", lambda: (f32(64, 256),))
CASES["lib_layer_norm_grad"] = _library_grad(
    "kernels.layer_norm", "layer_norm",
    lambda: (f32(64, 256), f32(256), f32(256)), argnums=(0, 1, 2))
CASES["lib_rms_norm_grad"] = _library_grad(
    "kernels.rms_norm", "rms_norm", lambda: (f32(64, 256), f32(256)),
    argnums=(0, 1))
CASES["lib_matmul_grad"] = _library_grad(
    "kernels.matmul", "matmul", lambda: (f32(256, 256), f32(256, 256)),
    argnums=(0, 1), activation="gelu")
CASES["lib_flash_attention_grad"] = _library_grad(
    "kernels.flash_attention", "flash_attention", _qkv, argnums=(0, 1, 2),
    causal=True)
CASES["lib_flash_attention_gqa_grad"] = _library_grad(
    "kernels.flash_attention", "flash_attention",
    lambda: (f32(1, 256, 4, 128), f32(1, 256, 2, 128), f32(1, 256, 2, 128)),
    argnums=(0, 1, 2))
CASES["lib_matmul_2d_trans"] = _library(
    "kernels.matmul", "matmul_2d", lambda: (f32(256, 128), f32(256, 128)),
    trans_a=True, trans_b=False)
