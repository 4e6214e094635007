"""The feature suite (test_features.py) ahead of time on the Triton backend:
every kernel that its triton_interpret cases lower compiles for sm_90 (the
first case of each test in the default suite; every case, and sm_80, with
`-m slow`). (The suite itself checks their values under triton_interpret.)"""
import pytest

import lowering_triton
from lowering_triton.compile import compile_kernel
# The feature suite's test functions, run again here to compile their kernels.
from tests.pallas import test_features as features
from tests.pallas.testing import TRITON_ARCHS, default_backend, test_cases


@pytest.mark.parametrize("arch", TRITON_ARCHS)
@pytest.mark.parametrize("name,kwargs", list(test_cases(
    features, backend="triton_interpret", slow_after_first=True,
    every=3)))
def test_feature_kernels_compile_ahead_of_time(name, kwargs, arch):
  # Recorded as lowered for triton_interpret, run on interpret (fast).
  with default_backend("triton_interpret", run_on="interpret") as lowered:
    getattr(features, name)(backend="triton_interpret", **kwargs)
  assert lowered, f"{name} lowered no kernel for triton_interpret"
  seen = set()
  for spec in lowered:
    gk = lowering_triton.generate(spec)
    if gk.source in seen:
      continue
    seen.add(gk.source)
    compiled = compile_kernel(gk, int(arch[3:]))
    assert compiled.asm["cubin"] and ".entry" in compiled.asm["ptx"]
