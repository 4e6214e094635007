"""The Mosaic GPU modules lowered while a test runs, caught where both
dsl's and Pallas's lowerings hand them to jaxlib's Mosaic GPU library
(`core.lower_mgpu_module`: layout inference, dialect lowering)."""
from __future__ import annotations

import pytest
from jax.experimental.mosaic.gpu import core as mgpu_core


@pytest.fixture
def captured(monkeypatch):
  """The (dialect text, lowered text) of each module the library lowers
  while the test runs."""
  out = []
  lower = mgpu_core.lower_mgpu_module

  def capture(module, *args, **kwargs):
    before = module.operation.get_asm(enable_debug_info=False)
    result = lower(module, *args, **kwargs)
    out.append((before, module.operation.get_asm(enable_debug_info=False)))
    return result
  monkeypatch.setattr(mgpu_core, "lower_mgpu_module", capture)
  return out
