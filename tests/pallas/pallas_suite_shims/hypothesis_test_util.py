"""The two hypothesis helpers JAX's Pallas test files call.

`setup_hypothesis` loads a derandomized profile (no example database, no
deadline), so every run of the suite draws the same examples.
"""
import hypothesis as hp


def hypothesis_is_thread_safe() -> bool:
  """Whether the installed hypothesis may run tests on several threads
  (6.136.9 and later)."""
  version = tuple(int(x) for x in hp.__version__.split(".")[:3])
  return version >= (6, 136, 9)


def setup_hypothesis(max_examples: int = 30) -> None:
  """Loads the deterministic profile with `max_examples` examples a test."""
  suppressed = []
  if hasattr(hp.HealthCheck, "differing_executors"):
    suppressed.append(hp.HealthCheck.differing_executors)
  hp.settings.register_profile(
      "dsl_pallas_suite", database=None, derandomize=True, deadline=None,
      max_examples=max_examples, print_blob=True,
      suppress_health_check=suppressed)
  hp.settings.load_profile("dsl_pallas_suite")
