import os
import sys

import pytest

# Set before jax loads (subprocesses of the tests inherit them): several CPU
# devices for the shard_map / sharding tests; and XLA's CPU code generated
# without LLVM's optimizations, as the tests compile thousands of small
# computations and run each briefly (a fifth less CPU time for the suite;
# speed is measured by the benchmarks, which keep the default).
_XLA_TEST_FLAGS = {"--xla_force_host_platform_device_count": "8",
                   "--xla_backend_optimization_level": "0"}
for _flag, _value in _XLA_TEST_FLAGS.items():
  if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" {_flag}={_value}").strip()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402 (after XLA_FLAGS)

import dsl as pl  # noqa: E402 (needs ROOT on the path)
from tests.pallas.suite_budget import SLOW  # noqa: E402


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """Marks the tests of tests/pallas/suite_budget.py slow, before `-m`
  deselects."""
  for item in items:
    if item.nodeid.split("tests/pallas/", 1)[-1] in SLOW:
      item.add_marker(pytest.mark.slow)


@pytest.fixture
def runtime_asserts():
  """jax_pallas_enable_runtime_assert on for the test."""
  with pl.config.enable_runtime_assert_option(True):
    yield


@pytest.fixture
def verbose_errors():
  """jax_pallas_verbose_errors on for the test."""
  old = pl.config.verbose_errors()
  jax.config.update("jax_pallas_verbose_errors", True)
  yield
  jax.config.update("jax_pallas_verbose_errors", old)
