"""A small transformer language model whose hot operations are dsl kernels.

    python examples/transformer.py            # ~300 steps, kernels vs jnp
    python examples/transformer.py --steps 50 --no-compare

Every matmul (with its bias and GELU fused), every norm (layer norm before
attention, RMS norm before the MLP and at the end) and the causal attention
(flash attention with grouped kv heads) is a kernel from `kernels/`; the
embedding lookup, residual adds and the cross-entropy stay in jnp. The whole
training step (forward, `jax.grad` through the kernels' hand-written backward
kernels, and a hand-written Adam update) is one `jax.jit` computation.

The same model is then trained with the kernels swapped for their plain-jnp
references (`kernels.REFERENCES`): same initialization, same batches; the two
loss curves agree to float32 rounding. Finally the trained model writes a
few characters greedily with a kv cache and `kernels.decode_attention`.

The data is character-level text from a small built-in grammar (no download).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

if __package__ in (None, ""):      # run as a script: make the repo importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))

import kernels  # noqa: E402


# ---------------------------------------------------------------- data

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the bird",
             "a small child", "the teacher", "our neighbour"]
_VERBS = ["sees", "likes", "finds", "follows", "paints", "watches", "helps"]
_OBJECTS = ["the red ball", "a green tree", "the quiet river", "a tall house",
            "the morning sun", "a wooden boat", "the busy market"]
_ENDINGS = [".", " today.", " again.", " in the rain.", " after dinner."]


def synthetic_text(n_sentences: int = 4000, seed: int = 0) -> str:
  """Sentences from a tiny grammar: learnable structure, no download."""
  rng = np.random.default_rng(seed)
  parts = []
  for _ in range(n_sentences):
    parts.append(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} "
                 f"{rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}")
  return " ".join(parts)


@dataclasses.dataclass
class Corpus:
  text: str
  chars: list[str]
  data: np.ndarray

  @classmethod
  def make(cls, text: str) -> "Corpus":
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    return cls(text, chars, np.array([index[c] for c in text], np.int32))

  @property
  def vocab(self) -> int:
    return len(self.chars)

  def encode(self, s: str) -> np.ndarray:
    return np.array([self.chars.index(c) for c in s], np.int32)

  def decode(self, ids) -> str:
    return "".join(self.chars[int(i)] for i in ids)

  def batches(self, n_steps: int, batch: int, seq: int, seed: int = 0):
    """(n_steps, batch, seq + 1) windows at random offsets, fixed by seed."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(self.data) - seq - 1, size=(n_steps, batch))
    return self.data[starts[..., None] + np.arange(seq + 1)]


# ---------------------------------------------------------------- model

@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 64
  seq: int = 128
  d_model: int = 128
  n_heads: int = 8
  n_kv_heads: int = 4
  n_layers: int = 2
  d_ff: int = 512
  batch: int = 16
  lr: float = 2e-3

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads


def kernel_ops(backend=None):
  """The model's hot operations as dsl kernels."""
  return SimpleNamespace(
      layer_norm=functools.partial(kernels.layer_norm, backend=backend),
      rms_norm=functools.partial(kernels.rms_norm, backend=backend),
      matmul=functools.partial(kernels.matmul, backend=backend),
      attention=functools.partial(kernels.flash_attention, causal=True,
                                  backend=backend),
      decode_attention=functools.partial(kernels.decode_attention,
                                         backend=backend))


def jnp_ops():
  """The same operations as plain jnp (the kernels' references)."""
  refs = kernels.REFERENCES
  return SimpleNamespace(
      layer_norm=refs["layer_norm"], rms_norm=refs["rms_norm"],
      matmul=refs["matmul"],
      attention=functools.partial(refs["flash_attention"], causal=True),
      decode_attention=refs["decode_attention"])


def init_params(cfg: Config, key):
  def dense(key, n_in, n_out, scale=1.0):
    return jax.random.normal(key, (n_in, n_out), jnp.float32) * (
        scale / np.sqrt(n_in))

  keys = iter(jax.random.split(key, 4 + 4 * cfg.n_layers))
  qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
  d, f = cfg.d_model, cfg.d_ff
  layers = []
  for _ in range(cfg.n_layers):
    layers.append({
        "ln_w": jnp.ones(d), "ln_b": jnp.zeros(d),
        "w_qkv": dense(next(keys), d, qkv),
        "w_o": dense(next(keys), cfg.n_heads * cfg.head_dim, d,
                     1 / np.sqrt(2 * cfg.n_layers)),
        "rms_w": jnp.ones(d),
        "w_1": dense(next(keys), d, f), "b_1": jnp.zeros(f),
        "w_2": dense(next(keys), f, d, 1 / np.sqrt(2 * cfg.n_layers)),
        "b_2": jnp.zeros(d),
    })
  return {
      "embed": jax.random.normal(next(keys), (cfg.vocab, d)) * 0.1,
      "pos": jax.random.normal(next(keys), (cfg.seq, d)) * 0.1,
      "layers": layers,
      "final_w": jnp.ones(d),
      "head": dense(next(keys), d, cfg.vocab),
  }


def _split_qkv(cfg: Config, qkv):
  hd, h, hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
  q = qkv[..., :h * hd].reshape(*qkv.shape[:-1], h, hd)
  k = qkv[..., h * hd:(h + hkv) * hd].reshape(*qkv.shape[:-1], hkv, hd)
  v = qkv[..., (h + hkv) * hd:].reshape(*qkv.shape[:-1], hkv, hd)
  return q, k, v


def _mlp(ops, layer, x):
  h = ops.rms_norm(x, layer["rms_w"])
  h = ops.matmul(h, layer["w_1"], bias=layer["b_1"], activation="gelu")
  return ops.matmul(h, layer["w_2"], bias=layer["b_2"])


def forward(cfg: Config, ops, params, tokens):
  """Logits (batch, seq, vocab) of a causal LM on tokens (batch, seq)."""
  b, t = tokens.shape
  x = params["embed"][tokens] + params["pos"][:t]
  for layer in params["layers"]:
    h = ops.layer_norm(x, layer["ln_w"], layer["ln_b"])
    q, k, v = _split_qkv(cfg, ops.matmul(h, layer["w_qkv"]))
    a = ops.attention(q, k, v).reshape(b, t, cfg.n_heads * cfg.head_dim)
    x = x + ops.matmul(a, layer["w_o"])
    x = x + _mlp(ops, layer, x)
  x = ops.rms_norm(x, params["final_w"])
  return ops.matmul(x, params["head"])


def loss_fn(cfg: Config, ops, params, batch):
  logits = forward(cfg, ops, params, batch[:, :-1])
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1)
  return jnp.mean(nll)


# ---------------------------------------------------------------- Adam

def adam_init(params):
  zeros = jax.tree.map(jnp.zeros_like, params)
  return {"m": zeros, "v": zeros, "t": jnp.zeros((), jnp.int32)}


def adam_update(params, grads, state, lr, b1=0.9, b2=0.99, eps=1e-8):
  t = state["t"] + 1
  m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
  v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
  c1 = 1 - b1 ** t.astype(jnp.float32)
  c2 = 1 - b2 ** t.astype(jnp.float32)
  params = jax.tree.map(
      lambda p, m, v: p - lr * (m / c1) / (jnp.sqrt(v / c2) + eps),
      params, m, v)
  return params, {"m": m, "v": v, "t": t}


def make_train_step(cfg: Config, ops):
  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(
        functools.partial(loss_fn, cfg, ops))(params, batch)
    params, opt_state = adam_update(params, grads, opt_state, cfg.lr)
    return params, opt_state, loss
  return train_step


def train(cfg: Config, ops, batches, *, seed: int = 0, log_every: int = 0,
          label: str = ""):
  """Trains from a fixed init over `batches`; returns (params, losses, s)."""
  params = init_params(cfg, jax.random.key(seed))
  opt_state = adam_init(params)
  step = make_train_step(cfg, ops)
  losses = []
  t0 = time.perf_counter()
  for i, batch in enumerate(batches):
    params, opt_state, loss = step(params, opt_state, jnp.asarray(batch))
    losses.append(loss)
    if log_every and (i % log_every == 0 or i == len(batches) - 1):
      print(f"  [{label}] step {i:4d}  loss {float(loss):.4f}  "
            f"({time.perf_counter() - t0:.1f}s)", flush=True)
  losses = np.asarray(jax.device_get(losses), np.float32)
  return params, losses, time.perf_counter() - t0


# ---------------------------------------------------------------- sampling

def generate(cfg: Config, ops, params, prompt, n_new: int):
  """Greedy decoding with a kv cache and `ops.decode_attention`."""
  total = len(prompt) + n_new
  if total > cfg.seq:
    raise ValueError(f"prompt + new tokens ({total}) exceed seq {cfg.seq}")
  hd, hkv = cfg.head_dim, cfg.n_kv_heads

  @jax.jit
  def run(params, tokens):
    empty = jnp.zeros((1, cfg.seq, hkv, hd))
    caches = [(empty, empty) for _ in params["layers"]]

    def step(pos, carry):
      tokens, caches = carry
      x = params["embed"][tokens[pos]][None] + params["pos"][pos][None]
      new_caches = []
      for layer, (kc, vc) in zip(params["layers"], caches):
        h = ops.layer_norm(x, layer["ln_w"], layer["ln_b"])
        q, k, v = _split_qkv(cfg, ops.matmul(h, layer["w_qkv"]))
        kc = jax.lax.dynamic_update_slice(kc, k[:, None], (0, pos, 0, 0))
        vc = jax.lax.dynamic_update_slice(vc, v[:, None], (0, pos, 0, 0))
        a = ops.decode_attention(q, kc, vc, jnp.reshape(pos + 1, (1,)))
        x = x + ops.matmul(a.reshape(1, -1), layer["w_o"])
        x = x + _mlp(ops, layer, x)
        new_caches.append((kc, vc))
      logits = ops.matmul(ops.rms_norm(x, params["final_w"]), params["head"])
      nxt = jnp.argmax(logits[0]).astype(tokens.dtype)
      keep = pos + 1 < len(prompt)      # inside the prompt: keep its token
      tokens = tokens.at[pos + 1].set(jnp.where(keep, tokens[pos + 1], nxt))
      return tokens, new_caches

    tokens, _ = jax.lax.fori_loop(0, total - 1, step, (tokens, caches))
    return tokens

  tokens = jnp.zeros((total,), jnp.int32).at[:len(prompt)].set(prompt)
  return np.asarray(run(params, tokens))


# ---------------------------------------------------------------- main

def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--log-every", type=int, default=25)
  p.add_argument("--backend", default=None,
                 help="dsl backend for the kernels (default: the platform's)")
  p.add_argument("--no-compare", action="store_true",
                 help="skip the plain-jnp run")
  p.add_argument("--rtol", type=float, default=2e-2,
                 help="loss-curve tolerance kernels vs jnp")
  args = p.parse_args(argv)

  corpus = Corpus.make(synthetic_text())
  cfg = Config(vocab=corpus.vocab)
  batches = corpus.batches(args.steps, cfg.batch, cfg.seq)
  print(f"config: {cfg}\ncorpus: {len(corpus.text)} chars, vocab "
        f"{corpus.vocab}; {args.steps} steps of {cfg.batch}x{cfg.seq} tokens")

  print("training with kernels:")
  params, k_losses, k_time = train(cfg, kernel_ops(args.backend), batches,
                                   log_every=args.log_every, label="kernels")
  print(f"  {k_time:.1f}s, loss {k_losses[0]:.4f} -> {k_losses[-1]:.4f}")

  ok = True
  if not args.no_compare:
    print("training the same model in plain jnp:")
    _, j_losses, j_time = train(cfg, jnp_ops(), batches,
                                log_every=args.log_every, label="jnp")
    print(f"  {j_time:.1f}s, loss {j_losses[0]:.4f} -> {j_losses[-1]:.4f}")
    rel = np.abs(k_losses - j_losses) / np.abs(j_losses)
    ok = bool(np.all(rel <= args.rtol))
    print(f"loss curves: max relative difference {rel.max():.2e} "
          f"(first 10 steps {rel[:10].max():.2e}); within {args.rtol}: {ok}")

  prompt = "the cat "
  out = generate(cfg, kernel_ops(args.backend), params, corpus.encode(prompt),
                 40)
  print(f"sample (greedy, kv cache + decode_attention): {corpus.decode(out)!r}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
