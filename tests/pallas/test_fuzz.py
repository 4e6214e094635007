"""The differential fuzzer (tests/pallas/fuzz, docs/fuzzing.md) on a fixed
seed: random kernels run on every CPU backend, on Pallas's interpret mode and
on a numpy reference; no backend may disagree or crash. Combinations listed
in tests/pallas/fuzz/known_failures.py are skipped and counted."""
import jax.numpy as jnp
import numpy as np
import pytest

from tests.pallas.fuzz import driver
from tests.pallas.fuzz.expr import dt, safe_cast
from tests.pallas.fuzz.families import generate_case
from tests.pallas.fuzz.runner import ORACLE, mismatch

SEED = 13
N_CASES = 200


# The default suite runs the first 20 cases of the seed; `-m slow` all 200.
@pytest.mark.parametrize("n", [20, pytest.param(N_CASES,
                                                marks=pytest.mark.slow)])
def test_fixed_seed_no_disagreement_no_crash(n):
  results = driver.run_batch([(SEED, i) for i in range(n)])
  text = driver.summary(results)
  print(text)
  assert len(results) == n, text
  assert not driver.failures(results), text
  table = driver.counts(results)
  # the run checks something: the oracle and the reference agree on most
  # cases, and every backend agrees on a fair share of them
  assert table[ORACLE]["agree"] >= 0.8 * n, text
  assert table["interpret"]["agree"] >= 0.5 * n, text
  assert table["triton_interpret"]["agree"] >= 0.3 * n, text
  assert table["mosaic_interpret"]["agree"] >= 0.1 * n, text


def test_cases_are_reproducible():
  for i in range(20):
    assert generate_case(SEED, i) == generate_case(SEED, i)
  families = {generate_case(SEED, i).family for i in range(N_CASES)}
  assert families == {"map", "reduce", "matmul", "carry", "tail", "dma",
                      "window", "strided", "order", "prng"}


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


def test_an_output_revisited_after_write_back_is_a_refusal_on_mosaic():
  # A generated kernel whose output block comes back after other blocks is
  # refused by the Mosaic backends (a TPU would lose the earlier writes):
  # at trace time for static index maps, at run time for scalar prefetch.
  import types

  import jax
  import jax.numpy as jnp

  import dsl as pl
  from dsl import tpu as pltpu
  from tests.pallas.fuzz.runner import classify_error

  def kernel(s_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...]
  name = "fuzz_revisit_0_0"
  case = types.SimpleNamespace(name=name)
  for out_map in (lambda i, j, s: (j, 0), lambda i, j, s: (s[j], 0)):
    call = pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((16, 128), jnp.float32), name=name,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(2, 2),
            in_specs=[pl.BlockSpec((8, 128), lambda i, j, s: (j, 0))],
            out_specs=pl.BlockSpec((8, 128), out_map)),
        backend="mosaic_interpret")
    try:
      jax.block_until_ready(call(jnp.array([0, 1], jnp.int32),
                                 jnp.ones((16, 128), jnp.float32)))
    except Exception as e:    # noqa: BLE001 - what the runner catches
      outcome = classify_error(case, e, "mosaic_interpret")
    else:
      raise AssertionError("the revisit was not refused")
    assert outcome.status == "refused", outcome
    assert "visited again" in outcome.detail, outcome


def test_the_reference_clips_float_to_int_casts_as_the_kernels_do():
  """A bfloat16 value cast to int32 is clipped to bounds in bfloat16 (as
  JAX's weak typing gives them to the kernels), in numpy as in jnp: seed
  616:135 once disagreed by -1e9 against -998244352."""
  x = np.array([-3e9, 5.0, 3e9], dtype=dt("bfloat16"))
  want = np.asarray(safe_cast(jnp.asarray(x), "int32", jnp))
  got = safe_cast(x, "int32", np)
  np.testing.assert_array_equal(got, want)
  assert got[0] == -998244352


def test_the_dropout_check_holds_the_kernel_to_its_own_mask():
  """The `prng` family's results follow from the backend's forward mask:
  a gradient off that mask, or a mask no fair draw gives, disagrees."""
  from tests.pallas.fuzz.family_prng import derive
  from tests.pallas.fuzz.spec import make_inputs
  case = next(c for c in (generate_case(SEED, i) for i in range(400))
              if c.family == "prng")
  x, g = make_inputs(case)
  q = case.param("q")
  keep = (np.random.default_rng(0).random(x.shape) < q).astype(np.int32)
  good = [np.where(keep == 1, x / np.float32(q), 0).astype(np.float32), keep,
          np.where(keep == 1, g / np.float32(q), 0).astype(np.float32)]
  assert mismatch(case, good, derive(case, good)) is None
  other = good[:2] + [np.where(keep == 0, g / np.float32(q), 0)]
  assert "out2" in mismatch(case, other, derive(case, other))
  lopsided = [x / np.float32(q), np.ones_like(keep), g / np.float32(q)]
  assert "out1" in mismatch(case, lopsided, derive(case, lopsided))
