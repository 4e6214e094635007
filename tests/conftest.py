import os
import sys

import pytest

# Several CPU devices for the shard_map / sharding tests; set before jax loads.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from tests.pallas.suite_budget import SLOW  # noqa: E402 (needs ROOT on the path)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """Marks the tests of tests/pallas/suite_budget.py slow, before `-m`
  deselects."""
  for item in items:
    if item.nodeid.split("tests/pallas/", 1)[-1] in SLOW:
      item.add_marker(pytest.mark.slow)
