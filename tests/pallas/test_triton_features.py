"""The core-DSL feature tests (test_interpret_features.py), run again with
the Triton backends: every kernel runs in Triton's interpreter (backend
"triton_interpret") against the same jnp references, and compiles ahead of
time for sm_80 and sm_90. (The property tests, test_feature_properties.py,
take the backend as a parameter.)"""
import pytest

import lowering_triton
from lowering_triton.compile import compile_kernel
from tests.pallas import test_interpret_features as features
from tests.pallas.testing import (TRITON_ARCHS, default_backend,
                                  parametrize_cases, test_cases)

# test_debug_print checks the interpret backend's print format; the Triton
# format (tl.device_print) is checked in test_triton_source.py.
_OWN_FORMAT = {"test_debug_print"}


FEATURE_CASES = list(test_cases(features, skip=_OWN_FORMAT))
_LOWERED: dict[str, list] = {}


@pytest.mark.parametrize("name,kwargs", FEATURE_CASES)
def test_feature_kernel_matches_reference_in_triton_interpreter(name, kwargs):
  with default_backend() as lowered:
    getattr(features, name)(**kwargs)
  assert lowered, f"{name} lowered no kernel through triton_interpret"
  _LOWERED.setdefault(name, []).extend(lowered)


def _feature_specs(name):
  if name not in _LOWERED:
    fn = getattr(features, name)
    kwargs = next(iter(parametrize_cases(fn)))
    with default_backend() as lowered:
      fn(**kwargs)
    _LOWERED[name] = lowered
  return _LOWERED[name]


FEATURE_NAMES = sorted({c.values[0] for c in FEATURE_CASES})


@pytest.mark.parametrize("arch", TRITON_ARCHS)
@pytest.mark.parametrize("name", FEATURE_NAMES)
def test_feature_kernel_compiles_ahead_of_time(name, arch):
  specs = _feature_specs(name)
  assert specs
  seen = set()
  for spec in specs:
    gk = lowering_triton.generate(spec)
    if gk.source in seen:
      continue
    seen.add(gk.source)
    compiled = compile_kernel(gk, int(arch[3:]))
    assert compiled.asm["cubin"] and ".entry" in compiled.asm["ptx"]
