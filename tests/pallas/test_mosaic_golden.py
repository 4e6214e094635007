"""Golden tests: our "mosaic" backend against JAX's own Pallas TPU lowering.

Every kernel of mosaic_corpus.py is lowered for a TPU (on the CPU) by
`jax.experimental.pallas` and by `dsl`; the Mosaic modules in the two
`tpu_custom_call`s are decoded, canonicalized and compared op for op (see
mosaic_golden.py for what is normalized), and so are the calls' configs and
attributes.
"""
import jax
import pytest
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu

import dsl
from dsl import tpu as dtpu
from tests.pallas import mosaic_golden as golden
from tests.pallas.mosaic_corpus import CASES


def lower_both(name):
  build = CASES[name]
  f, args = build(jpl, jpltpu)
  theirs = golden.lower_tpu(f, *args)
  f, args = build(dsl, dtpu)
  ours = golden.lower_tpu(f, *args)
  return ours, theirs


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_pallas(name):
  ours, theirs = lower_both(name)
  assert theirs, "Pallas emitted no tpu_custom_call"
  problems = golden.compare(ours, theirs)
  assert not problems, "\n".join(problems)
