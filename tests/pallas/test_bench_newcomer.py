"""The newcomer-style benchmark kernels (benchmarks/suite/newcomer.py) give
jnp's answer and Pallas's interpret mode's, at small sizes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl

import dsl
from benchmarks.suite.newcomer import NEWCOMER

SMALL = {"linear_scan": (64, 256), "segment_sum": (256, 128),
         "depthwise_conv": (600, 128), "rope": (512, 128)}


@pytest.mark.parametrize("bench", NEWCOMER, ids=lambda k: k.name)
def test_matches_jnp_and_pallas(bench):
  size = SMALL[bench.name]
  xs = bench.inputs(size, jnp.float32)
  got = jax.jit(bench.build(dsl, size, jnp.float32, {},
                            backend="interpret"))(*xs)
  want = bench.reference(*xs)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  theirs = bench.build(jpl, size, jnp.float32, {}, interpret=True)(*xs)
  np.testing.assert_allclose(got, theirs, rtol=1e-5, atol=1e-5)


def test_in_the_suite_but_not_quick():
  from benchmarks.suite import by_name
  names = by_name()
  for bench in NEWCOMER:
    assert names[bench.name] is bench
    assert bench.quick_sizes("cpu") == []
