"""examples/transformer.py: the kernel model trains like the plain-jnp one."""
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "examples",
                     "transformer.py")


def _load():
  spec = importlib.util.spec_from_file_location("transformer_example", _PATH)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module      # dataclasses look their module up
  spec.loader.exec_module(module)
  return module


tr = _load()
CORPUS = tr.Corpus.make(tr.synthetic_text(200))
CFG = tr.Config(vocab=CORPUS.vocab, seq=16, d_model=32, n_heads=4,
                n_kv_heads=2, n_layers=1, d_ff=64, batch=4, lr=1e-2)


@pytest.mark.slow
def test_kernel_and_jnp_models_give_the_same_loss_curve():
  batches = CORPUS.batches(4, CFG.batch, CFG.seq, seed=1)
  pk, k_losses, _ = tr.train(CFG, tr.kernel_ops(), batches)
  pj, j_losses, _ = tr.train(CFG, tr.jnp_ops(), batches)
  np.testing.assert_allclose(k_losses, j_losses, rtol=1e-4)
  assert k_losses[-1] < k_losses[0]          # it learns
  for a, b in zip(jax.tree.leaves(pk), jax.tree.leaves(pj)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)


def test_the_training_step_is_one_jitted_computation_with_kernels():
  params = tr.init_params(CFG, jax.random.key(0))
  batch = jnp.asarray(CORPUS.batches(1, CFG.batch, CFG.seq)[0])
  grad_fn = jax.grad(lambda p: tr.loss_fn(CFG, tr.kernel_ops(), p, batch))
  text = str(jax.make_jaxpr(grad_fn)(params))
  assert text.count("pallas_call") >= 8      # forward and backward kernels


def test_generate_with_decode_attention_matches_jnp():
  params = tr.init_params(CFG, jax.random.key(0))
  prompt = CORPUS.encode("the ")
  a = tr.generate(CFG, tr.kernel_ops(), params, prompt, 6)
  b = tr.generate(CFG, tr.jnp_ops(), params, prompt, 6)
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(a[:4], prompt)
