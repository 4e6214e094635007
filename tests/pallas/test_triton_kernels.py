"""The kernel library (kernels/) on the Triton backends: every kernel that a
kernels test module's `test_other_cpu_backends` lowers for
"triton_interpret" compiles ahead of time for sm_90 (and sm_80 with
`-m slow`). The module's own test checks those values under
triton_interpret; here its kernels run on interpret (fast) while they are
recorded."""
import glob
import importlib
import os

import pytest

import lowering_triton
from lowering_triton.compile import compile_kernel
from tests.pallas.testing import TRITON_ARCHS, default_backend

BACKEND = "triton_interpret"

_HERE = os.path.dirname(__file__)
# The collectives use remote DMAs and semaphores: the Mosaic path only.
MODULES = sorted(os.path.basename(p)[:-3] for p in
                 glob.glob(os.path.join(_HERE, "test_kernels_*.py"))
                 if not p.endswith("test_kernels_collectives.py"))


def _run(name):
  try:
    module = importlib.import_module(f"tests.pallas.{name}")
  except ImportError as e:
    pytest.skip(f"{name} does not import: {e}")
  fn = getattr(module, "test_other_cpu_backends")
  with default_backend(BACKEND, run_on="interpret") as lowered:
    fn(BACKEND)
  return lowered


@pytest.mark.parametrize("arch", TRITON_ARCHS)
@pytest.mark.parametrize("name", MODULES)
def test_kernels_compile_ahead_of_time(name, arch):
  lowered = _run(name)
  assert lowered, f"{name} lowered nothing through {BACKEND}"
  seen = set()
  for spec in lowered:
    gk = lowering_triton.generate(spec)
    if gk.source in seen:
      continue
    seen.add(gk.source)
    compiled = compile_kernel(gk, int(arch[3:]))
    assert compiled.asm["cubin"], (spec.name, arch)
