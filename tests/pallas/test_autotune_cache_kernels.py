"""kernels/ use the autotuning cache when their caller gives no blocks."""
import jax
import jax.numpy as jnp
import numpy as np

import kernels
from dsl.tools import autotune_cache


def _block_rows_of_softmax(x):
  jaxpr = jax.make_jaxpr(lambda x: kernels.softmax(x, backend="interpret"))(x)
  found = []

  def walk(j):
    for e in j.eqns:
      if e.primitive.name == "pallas_call":
        found.append(e.params["spec"].grid_mapping.in_mappings[0].block_shape)
      for v in e.params.values():
        inner = getattr(v, "jaxpr", None)
        if inner is not None:
          walk(getattr(inner, "jaxpr", inner))
  walk(jaxpr.jaxpr)
  return found[0][0]


def test_cached_winner_is_used(tmp_path, monkeypatch):
  monkeypatch.setenv(autotune_cache.ENV_VAR, str(tmp_path / "cache.json"))
  x = jax.random.normal(jax.random.key(0), (64, 32))
  default_rows = _block_rows_of_softmax(x)
  autotune_cache.store("kernels.softmax",
                       autotune_cache.size_key((64, 32), x.dtype), "interpret",
                       {"block_rows": 16}, median_s=1e-3, candidates=3)
  assert _block_rows_of_softmax(x) == 16 != default_rows
  np.testing.assert_allclose(kernels.softmax(x, backend="interpret"),
                             jax.nn.softmax(x), rtol=1e-5, atol=1e-6)


def test_corrupt_cache_is_ignored(tmp_path, monkeypatch):
  path = tmp_path / "cache.json"
  path.write_text("{ not json")
  monkeypatch.setenv(autotune_cache.ENV_VAR, str(path))
  x = jnp.ones((8, 16))
  np.testing.assert_allclose(kernels.softmax(x, backend="interpret"),
                             jax.nn.softmax(x), rtol=1e-6)
