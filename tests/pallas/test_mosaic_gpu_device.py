"""Backend "mosaic_gpu" on an NVIDIA Hopper GPU: numerics of the feature
kernels that build (test_mosaic_gpu.FEATURES_THAT_BUILD) and of the sample
kernels (benchmarks/mosaic_gpu_kernels.py: matmul, softmax, attention)
against jnp.

Also the library kernels on "mosaic_gpu" (forward and gradient against their
jnp references) and the sample kernels under every schedule the lowering can
emit (mosaic_gpu_kernels.SCHEDULES).

Run on a GPU machine with `pytest -m gpu tests/pallas/test_mosaic_gpu_device.py`.
Until that has run, the numerics of this backend are unmeasured.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# The feature suite's test functions, run again here on a GPU.
from tests.pallas import test_features as features
from benchmarks.mosaic_gpu_kernels import CASES
from tests.pallas.mosaic_gpu_testing import FEATURES_THAT_BUILD, LIBRARY
from tests.pallas.testing import parametrize_cases


def _has_hopper() -> bool:
  try:
    return any(d.platform == "gpu" and
               getattr(d, "compute_capability", "0").startswith("9")
               for d in jax.devices())
  except RuntimeError:
    return False


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _has_hopper(),
                                 reason="needs an sm_90 GPU (H100/H200)")]

def _cases():
  for name in sorted(FEATURES_THAT_BUILD):
    for kw in parametrize_cases(getattr(features, name)):
      if kw.pop("backend", "interpret") in ("interpret", "mosaic_interpret"):
        yield pytest.param(name, kw, id=f"{name}-{sorted(kw.items())}")


@pytest.fixture(autouse=True)
def _exact_f32_dots():
  with jax.default_matmul_precision("float32"):
    yield


@pytest.mark.parametrize("name,kwargs", list(_cases()))
def test_feature_kernels_on_mosaic_gpu(name, kwargs):
  getattr(features, name)(backend="mosaic_gpu", **kwargs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_script_kernels_match_jnp(case):
  fn, ref, make, atol = CASES[case]
  args = make()
  got = np.asarray(jax.jit(fn)(*args), np.float32)
  want = np.asarray(ref(*args), np.float32)
  np.testing.assert_allclose(got, want, atol=atol, rtol=atol)


# ------------------------------------------------------ the library kernels


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_library_kernels_and_their_gradients_match_jnp(name):
  f, ref, args = LIBRARY[name]()
  np.testing.assert_allclose(np.asarray(jax.jit(f)(*args), np.float32),
                             np.asarray(ref(*args), np.float32),
                             atol=5e-2, rtol=5e-2)
  loss = lambda g: (lambda *a: jnp.sum(g(*a).astype(jnp.float32) ** 2))
  got = jax.jit(jax.grad(loss(f), tuple(range(len(args)))))(*args)
  want = jax.grad(loss(ref), tuple(range(len(args))))(*args)
  for g, w in zip(got, want):
    scale = float(np.max(np.abs(np.asarray(w, np.float32)))) or 1.0
    np.testing.assert_allclose(np.asarray(g, np.float32) / scale,
                               np.asarray(w, np.float32) / scale,
                               atol=5e-2, rtol=5e-2)
