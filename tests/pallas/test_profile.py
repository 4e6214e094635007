"""Kernel names in lowered programs and profiler traces; `dsl.profile`."""
from __future__ import annotations

import glob
import gzip
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import dsl as pl
from dsl.core import host_failures
from dsl.tools import profiling

SPEC = pl.BlockSpec((256,), lambda i: (i,))


def _sine_kernel(x_ref, o_ref):
  o_ref[...] = jnp.sin(x_ref[...]) * 2.0


my_sine = pl.pallas_call(_sine_kernel, jax.ShapeDtypeStruct((1024,),
                                                            jnp.float32),
                         grid=(4,), in_specs=[SPEC], out_specs=SPEC,
                         name="my_sine", backend="interpret")


def model(x):
  return jnp.sum(my_sine(x) + 1.0)


X = jnp.linspace(0.0, 3.0, 1024, dtype=jnp.float32)
WANT = float(jnp.sum(jnp.sin(X) * 2.0 + 1.0))


def test_kernel_name_is_in_the_op_metadata():
  lowered = jax.jit(model).lower(X)
  text = lowered.as_text(debug_info=True)
  assert "jit(model)/my_sine/" in text
  hlo = lowered.compile().as_text()
  names = [l for l in hlo.splitlines() if 'op_name="jit(model)/my_sine/' in l]
  assert names, hlo
  grad_text = jax.jit(jax.grad(model)).lower(X).as_text(debug_info=True)
  assert "/my_sine_transpose/" in grad_text


def test_profile_times_each_kernel_of_a_jitted_model():
  jitted = jax.jit(model)
  np.testing.assert_allclose(jitted(X), WANT, rtol=1e-5)   # traced before
  with pl.profile() as prof:
    for _ in range(3):
      np.testing.assert_allclose(jitted(X), WANT, rtol=1e-5)
    g = jax.jit(jax.grad(model))(X)
  np.testing.assert_allclose(g, 2.0 * jnp.cos(X), rtol=1e-5)
  stats = prof.as_dict()
  assert stats["my_sine"]["calls"] == 3
  assert stats["my_sine_transpose"]["calls"] == 1
  assert stats["my_sine"]["total_s"] > 0
  lines = prof.summary().splitlines()
  assert lines[0].split() == ["kernel", "calls", "total", "ms", "mean", "ms"]
  assert any(l.split()[:2] == ["my_sine", "3"] for l in lines)
  # Outside the block the model runs as before and nothing is recorded.
  assert not profiling.enabled()
  jitted(X)
  assert prof.as_dict()["my_sine"]["calls"] == 3


def test_trace_file_names_the_kernel(tmp_path):
  jitted = jax.jit(model)
  with pl.profile(str(tmp_path), create_perfetto_trace=True) as prof:
    jitted(X).block_until_ready()
  assert "trace: " + str(tmp_path) in prof.summary()
  files = glob.glob(os.path.join(tmp_path, "**", "perfetto_trace.json.gz"),
                    recursive=True)
  assert files
  data = json.load(gzip.open(files[0]))
  events = data["traceEvents"] if isinstance(data, dict) else data
  spans = [e for e in events if e.get("name") == "my_sine (dsl kernel)"]
  assert spans and all(e.get("dur", 0) > 0 for e in spans)


def test_host_backends_are_timed_through_call_host():
  def fake_kernel(x):
    return [np.asarray(x) * 2]

  @jax.jit
  def f(x):
    outs, failed = host_failures.call_host(
        fake_kernel, [jax.ShapeDtypeStruct(x.shape, x.dtype)], x,
        kernel="host_kernel")
    return outs[0], failed
  with pl.profile() as prof:
    out, failed = f(jnp.ones(8))
  np.testing.assert_array_equal(out, 2 * np.ones(8))
  assert int(failed) == 0
  assert prof.as_dict()["host_kernel"]["calls"] == 1


def test_empty_profile_says_where_to_look():
  with pl.profile() as prof:
    pass
  assert "jax.profiler trace" in prof.summary()


def _make_doubler():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0
  return kernel


def _make_negater():
  def kernel(x_ref, o_ref):
    o_ref[...] = -x_ref[...]
  return kernel


def test_kernels_that_share_a_name_are_told_apart():
  out = jax.ShapeDtypeStruct((1024,), jnp.float32)
  double = pl.pallas_call(_make_doubler(), out, backend="interpret")
  negate = pl.pallas_call(_make_negater(), out, backend="interpret")
  with pl.profile() as prof:
    jax.jit(lambda x: double(x) + negate(negate(x)))(X).block_until_ready()
  stats = prof.as_dict()
  assert len(stats) == 2, stats
  by_line = {k.split(":")[-1].rstrip(")"): v["calls"] for k, v in
             stats.items()}
  assert all(k.startswith("kernel (") for k in stats), stats
  assert by_line[str(_make_doubler.__code__.co_firstlineno + 1)] == 1
  assert by_line[str(_make_negater.__code__.co_firstlineno + 1)] == 2
