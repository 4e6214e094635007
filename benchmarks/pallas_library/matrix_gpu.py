"""The matrix of Pallas's GPU (Triton) ops on dsl: beyond each op's one
cheap case (cases.py), more shapes and dtypes, the ops' optional
features (segment ids, causal masks, soft caps, quantized KV caches, split
K) and their gradients: through the op's own custom_vjp where it has one
(attention, layer norm, rms norm), through dsl's automatic reverse mode
where it has none (compared with the reference's gradient only).

`MATRIX` maps "op [variant]" to (module of `jax.experimental.pallas.ops`,
the case); tests run every entry under `pytest -m slow`.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from benchmarks.pallas_library.case import NO_PALLAS_GRAD, Case, rand, vjp_case
from benchmarks.pallas_library.matrix_tpu import paged_dense

f32, bf16 = jnp.float32, jnp.bfloat16


def _case(op, reference, args, grad, argnums=None, tol=2e-3):
  """The op's values, or with `grad` its cotangents of `args[argnums]`."""
  if grad:
    return vjp_case(op, reference, args,
                    tuple(range(len(args))) if argnums is None else argnums,
                    tol=tol)
  return Case(op, reference, tol=tol, args=tuple(args))


def _attention(seq=128, heads=2, causal=True, segments=False, grad=False,
               sm_scale=1.0, dtype=f32):
  q, k, v = (rand(i, (1, seq, heads, 64), dtype) for i in range(3))
  ids = (jnp.arange(seq, dtype=jnp.int32) * 3 // seq)[None]
  seg = ids if segments else None

  def op(m, interpret, q, k, v):
    sizes = m.BlockSizes(block_q=64, block_k=64, block_q_dkv=32,
                         block_kv_dkv=32, block_q_dq=32, block_kv_dq=32)
    return m.mha(q, k, v, seg, sm_scale=sm_scale, causal=causal,
                 block_sizes=sizes, interpret=interpret)

  def reference(m, q, k, v):
    return m.mha_reference(q, k, v, seg, sm_scale=sm_scale, causal=causal)
  return _case(op, reference, (q, k, v), grad,
               tol=2e-2 if dtype == bf16 else 2e-3)


def _decode(mqa=False, lengths=False, grad=False, k_splits=4, **kw):
  q = rand(0, (2, 8, 64))
  kv_shape = (2, 256, 64) if mqa else (2, 256, 2, 64)
  k, v = rand(1, kv_shape), rand(2, kv_shape)
  extra = (dict(start_idx=jnp.array([3, 40], jnp.int32),
                kv_seq_len=jnp.array([200, 130], jnp.int32))
           if lengths else {})

  def op(m, interpret, q, k, v):
    f = m.mqa if mqa else m.gqa
    return f(q, k, v, block_h=16, block_k=64, k_splits=k_splits,
             interpret=interpret, **extra, **kw)

  def reference(m, q, k, v):
    f = m.mqa_reference if mqa else m.gqa_reference
    return f(q, k, v, **extra, **kw)
  return _case(op, reference, (q, k, v), grad)


def _paged(soft_cap=None, quantized=False, grad=False, k_splits=2):
  q = rand(0, (2, 8, 64))
  k_pages, v_pages = (rand(i, (2, 8, 16, 64)) for i in (1, 2))
  tables = jnp.array([[7, 1, 4, 2], [0, 6, 3, 5]], jnp.int32)
  lengths = jnp.array([20, 50], jnp.int32)

  def quantize(p):
    scale = jnp.max(jnp.abs(p), axis=-1) / 127.0
    return (jnp.round(p / scale[..., None]).astype(jnp.int8), scale)

  def op(m, interpret, q, k):
    v, scales = v_pages, {}
    if quantized:
      (k, ks), (v, vs) = quantize(k), quantize(v)
      scales = dict(k_scales_pages=ks, v_scales_pages=vs)
    return m.paged_attention(q, k, v, tables, lengths, **scales,
                             pages_per_compute_block=2, k_splits=k_splits,
                             attn_logits_soft_cap=soft_cap,
                             interpret=interpret)

  def reference(m, q, k):
    v = v_pages
    if quantized:
      (k, ks), (v, vs) = quantize(k), quantize(v)
      k, v = k * ks[..., None], v * vs[..., None]
    # [batch, kv_heads, seq, dim] -> [batch, seq, kv_heads, dim]
    dense = lambda p: paged_dense(p, tables).swapaxes(1, 2)
    return m.paged_attention_reference(q, dense(k), dense(v), lengths,
                                       attn_logits_soft_cap=soft_cap)
  return _case(op, reference, (q, k_pages), grad,
               argnums=(0,) if quantized else (0, 1),
               tol=1e-2 if quantized else 2e-3)


def _norm(name, shape=(2, 4, 256), grad=False, dtype=f32, eps=1e-5):
  x = rand(0, shape, dtype)
  w, b = rand(1, shape[-1:], dtype), rand(2, shape[-1:], dtype)

  def op(m, interpret, x, w, b):
    return getattr(m, name)(x, w, b, eps=eps, interpret=interpret)

  def reference(m, x, w, b):
    if eps == 1e-5:
      return getattr(m, f"{name}_reference")(x, w, b)
    # The op's reference maps its keywords too (jax.vmap): it cannot take
    # another eps. The same formula, over the features:
    mean = jnp.mean(x, -1, keepdims=True) if name == "layer_norm" else 0.0
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * w + b
  return _case(op, reference, (x, w, b), grad,
               tol=3e-2 if dtype == bf16 else 2e-3)


def _softmax(shape=(8, 300), grad=False, dtype=f32):
  x = rand(0, shape, dtype)
  return _case(lambda m, interpret, x: m.softmax(x, interpret=interpret),
               lambda m, x: jax.nn.softmax(x, axis=-1), (x,), grad,
               tol=2e-2 if dtype == bf16 else 2e-3)


_P = functools.partial
_VARIANTS: dict[str, tuple[str, Callable[[], Case]]] = {
    "gpu.attention [segment ids]": ("gpu.attention",
                                    _P(_attention, segments=True)),
    "gpu.attention [non-causal, sm_scale, 4 heads, 256 tokens]": (
        "gpu.attention", _P(_attention, seq=256, heads=4, causal=False,
                            sm_scale=0.125)),
    "gpu.attention [bfloat16]": ("gpu.attention",
                                 _P(_attention, dtype=bf16)),
    "gpu.attention [grad, causal]": ("gpu.attention",
                                     _P(_attention, grad=True)),
    "gpu.attention [grad, segment ids, non-causal]": (
        "gpu.attention", _P(_attention, grad=True, segments=True,
                            causal=False)),
    "gpu.decode_attention [multi-query]": ("gpu.decode_attention",
                                           _P(_decode, mqa=True)),
    "gpu.decode_attention [start_idx, kv_seq_len]": (
        "gpu.decode_attention", _P(_decode, lengths=True)),
    "gpu.decode_attention [grad]": ("gpu.decode_attention",
                                    _P(_decode, grad=True)),
    "gpu.decode_attention [sm_scale, unnormalized, residuals]": (
        "gpu.decode_attention", _P(_decode, sm_scale=0.5,
                                   normalize_output=False,
                                   return_residuals=True)),
    "gpu.decode_attention [multi-query, start_idx, kv_seq_len]": (
        "gpu.decode_attention", _P(_decode, mqa=True, lengths=True)),
    "gpu.paged_attention [soft cap]": ("gpu.paged_attention",
                                       _P(_paged, soft_cap=2.0)),
    "gpu.paged_attention [quantized KV cache]": (
        "gpu.paged_attention", _P(_paged, quantized=True)),
    "gpu.paged_attention [grad]": ("gpu.paged_attention",
                                   _P(_paged, grad=True)),
    "gpu.layer_norm [bfloat16, 4096 features]": (
        "gpu.layer_norm", _P(_norm, "layer_norm", (2, 2, 4096), dtype=bf16)),
    "gpu.layer_norm [grad]": ("gpu.layer_norm",
                              _P(_norm, "layer_norm", grad=True)),
    "gpu.layer_norm [eps 0.5]": ("gpu.layer_norm",
                                 _P(_norm, "layer_norm", eps=0.5)),
    "gpu.rms_norm [bfloat16, 4096 features]": (
        "gpu.rms_norm", _P(_norm, "rms_norm", (2, 2, 4096), dtype=bf16)),
    "gpu.rms_norm [grad]": ("gpu.rms_norm", _P(_norm, "rms_norm", grad=True)),
    "gpu.rms_norm [eps 0.5]": ("gpu.rms_norm", _P(_norm, "rms_norm", eps=0.5)),
    "gpu.softmax [3-D, 2 x 8 x 1000]": ("gpu.softmax",
                                        _P(_softmax, (2, 8, 1000))),
    "gpu.softmax [grad]": ("gpu.softmax", _P(_softmax, grad=True)),
}

MATRIX = _VARIANTS

# Variants compared with their reference only, and why.
NO_PALLAS = {v: NO_PALLAS_GRAD for v in ("gpu.decode_attention [grad]",
                                         "gpu.paged_attention [grad]",
                                         "gpu.softmax [grad]")}
