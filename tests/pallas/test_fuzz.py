"""The differential fuzzer (tests/pallas/fuzz, docs/fuzzing.md) on a fixed
seed: random kernels run on every CPU backend, on Pallas's interpret mode and
on a numpy reference; no backend may disagree or crash. Combinations listed
in tests/pallas/fuzz/known_failures.py are skipped and counted."""
import numpy as np

from tests.pallas.fuzz import driver
from tests.pallas.fuzz.families import generate_case
from tests.pallas.fuzz.runner import ORACLE, mismatch

SEED = 13
N_CASES = 200


def test_fixed_seed_no_disagreement_no_crash():
  results = driver.run_batch([(SEED, i) for i in range(N_CASES)])
  text = driver.summary(results)
  print(text)
  assert len(results) == N_CASES, text
  assert not driver.failures(results), text
  table = driver.counts(results)
  # the run checks something: the oracle and the reference agree on most
  # cases, and every backend agrees on a fair share of them
  assert table[ORACLE]["agree"] >= 0.8 * N_CASES, text
  assert table["interpret"]["agree"] >= 0.5 * N_CASES, text
  assert table["triton_interpret"]["agree"] >= 0.3 * N_CASES, text
  assert table["mosaic_interpret"]["agree"] >= 0.1 * N_CASES, text


def test_cases_are_reproducible():
  for i in range(20):
    assert generate_case(SEED, i) == generate_case(SEED, i)
  families = {generate_case(SEED, i).family for i in range(N_CASES)}
  assert families == {"map", "reduce", "matmul", "carry", "tail", "dma"}


def test_a_dying_backend_is_a_crash_and_the_run_goes_on(monkeypatch):
  monkeypatch.setenv("DSL_FUZZ_ABORT", f"{SEED}:0:interpret")
  results = driver.run_batch([(SEED, 0), (SEED, 1)], backends=("interpret",))
  assert [r.case_id for r in results] == [f"{SEED}:0", f"{SEED}:1"]
  first = results[0].outcomes["interpret"]
  assert first.status == "crash" and "process died" in first.detail
  assert results[0].outcomes[ORACLE].status != "crash"
  assert results[1].outcomes["interpret"].status != "crash"


def _case_with_one_output(dtype):
  return next(c for c in (generate_case(SEED, i) for i in range(200))
              if len(c.outputs) == 1 and c.outputs[0].dtype == dtype)


def test_mismatch_sees_values_nan_positions_and_dtypes():
  case = _case_with_one_output("float32")
  shape = case.outputs[0].shape
  want = np.zeros(shape, np.float32)
  assert mismatch(case, [want.copy()], [want]) is None
  off = want.copy()
  off.reshape(-1)[0] = 1
  assert "differ" in mismatch(case, [off], [want])
  nan = want.copy()
  nan.reshape(-1)[0] = np.nan
  assert "differ" in mismatch(case, [want], [nan])
  assert "differ" in mismatch(case, [nan], [want])
  assert mismatch(case, [nan], [nan.copy()]) is None
  assert "expected float32" in mismatch(case, [want.astype(np.float16)],
                                        [want])
  ints = _case_with_one_output("int32")
  want = np.zeros(ints.outputs[0].shape, np.int32)
  off = want.copy()
  off.reshape(-1)[-1] = 1
  assert "differ" in mismatch(ints, [off], [want])
