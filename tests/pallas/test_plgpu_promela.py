"""The mbarrier protocol of explicit plgpu kernels, exported to Promela and
checked by SPIN (lowering_mosaic/gpu/plgpu_skeleton.py, plgpu_model.py):
kernels that are right verify clean; seeded bugs (a missing barrier_wait,
a wrong arrival count) come back with the warpgroup, the barrier and the
line."""
from __future__ import annotations

import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
import lowering_mosaic.verify
from benchmarks.pallas_library.cases_mgpu import simulated_gpu
from benchmarks.pallas_library.swap import swapped
from dsl import mosaic_gpu as plgpu
from dsl.core.errors import KernelDeadlockError
from dsl.core.inspection import traced_kernels
from lowering_mosaic.gpu import plgpu_model
from lowering_mosaic.gpu.plgpu_skeleton import skeleton
from lowering_mosaic.verification import promela
from tests.pallas import plgpu_rings

SPIN_OK, SPIN_WHY = promela.spin_available()
needs_spin = pytest.mark.skipif(not SPIN_OK, reason=SPIN_WHY)

HERE = os.path.basename(plgpu_rings.__file__)
STEPS, SLOTS, BLOCK = 4, 2, (64, 128)


def ring_kernel(**bugs):
  """The shared ring kernel at STEPS, SLOTS, BLOCK, with `bugs` seeded
  (plgpu_rings.producer_consumer)."""
  return plgpu_rings.producer_consumer(pl, plgpu, STEPS, SLOTS, BLOCK,
                                       **bugs)


X = jax.ShapeDtypeStruct((STEPS * BLOCK[0], BLOCK[1]), jnp.float32)


def _source_line(text: str) -> str:
  with open(plgpu_rings.__file__) as fh:
    for n, line in enumerate(fh, start=1):
      if text in line:
        return f"{HERE}:{n}"
  raise AssertionError(text)


def _spec(f, *args):
  ((spec, _),) = traced_kernels(f, *args)
  return spec


# ----------------------------------------------------------- the skeleton

def test_skeleton_follows_the_ring():
  sk = skeleton(_spec(ring_kernel(), X))
  consumer, producer = ([(e.kind, e.what) for e in p] for p in sk.programs)
  loads = [w for k, w in producer if k == "load"]
  assert loads == [f"starts a TMA copy x_ref[{64 * i}:{64 * i + 64}] -> "
                   f"ring[{i % 2}], arriving on loaded[{i % 2}]"
                   for i in range(STEPS)]
  assert [w for k, w in producer if k == "wait"] == [
      "waits on consumed[0]", "waits on consumed[1]"]
  assert [w for k, w in consumer if k in ("wait", "read", "arrive")][:3] == [
      "waits on loaded[0]", "reads ring[0]", "arrives on consumed[0]"]
  assert consumer[-1] == ("retire", "waits for its SMEM -> GMEM copies of "
                          "out")
  assert sorted(sk.loops.values()) == [[STEPS], [STEPS]]


# ------------------------------------------------------------- SPIN runs

@needs_spin
def test_ring_kernel_verifies_clean():
  rep = lowering_mosaic.verify(ring_kernel(), X)
  assert rep.kind == "ok", str(rep)
  assert rep.states > 10


@needs_spin
def test_missing_barrier_wait_is_a_race():
  rep = lowering_mosaic.verify(ring_kernel(wait_loaded=False), X)
  assert rep.kind == "race", str(rep)
  read = _source_line("out[...] = ring[slot] * 2 + 1")
  assert "warpgroup wg=0 reads ring[" in rep.message
  assert rep.error_line.endswith(read)
  assert rep.trail[-1].process == "warpgroup wg=0"
  assert rep.trail[-1].line.endswith(read)
  copies = [s for s in rep.trail if s.process == "warpgroup wg=1"]
  assert copies and "arriving on loaded[0]" in copies[0].what


@needs_spin
def test_wrong_arrival_count_deadlocks():
  f = ring_kernel(loaded_arrivals=2)
  rep = lowering_mosaic.verify(f, X)
  assert rep.kind == "deadlock", str(rep)
  wait = _source_line("plgpu.barrier_wait(loaded.at[slot])")
  (blocked,) = [b for b in rep.blocked if b.process == "warpgroup wg=0"]
  assert blocked.what == "blocked: waits on loaded[0]"
  assert blocked.line.endswith(wait)
  assert "warpgroup wg=0 waits on loaded[0]" in rep.message
  # The interpret backend runs into the same deadlock.
  x = jnp.ones(X.shape, X.dtype)
  with pytest.raises(KernelDeadlockError, match="loaded|waits"):
    with pl.default_backend("interpret"):
      f(x)


def test_ring_kernel_computes_on_the_interpret_backend():
  x = jnp.arange(np.prod(X.shape), dtype=X.dtype).reshape(X.shape)
  with pl.default_backend("interpret"):
    got = ring_kernel()(x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(x * 2 + 1))


@needs_spin
def test_dumped_model_verifies_on_its_own(tmp_path):
  jax.config.update("jax_pallas_dump_promela_to", str(tmp_path))
  try:
    rep = lowering_mosaic.verify(ring_kernel(wait_loaded=False), X)
  finally:
    jax.config.update("jax_pallas_dump_promela_to", "")
  (path,) = glob.glob(str(tmp_path / "body-*.pml"))
  again = lowering_mosaic.verify.verify_promela(path)
  assert again.kind == rep.kind == "race"
  assert again.message == rep.message
  text = lowering_mosaic.verify.models(ring_kernel(), X)[0]
  assert plgpu_model.is_plgpu_model(text) and "proctype wg1()" in text


def test_mosaic_gpu_lowering_dumps_the_model(tmp_path):
  jax.config.update("jax_pallas_dump_promela_to", str(tmp_path))
  try:
    with pl.default_backend("mosaic_gpu"):
      jax.jit(ring_kernel()).trace(X).lower(lowering_platforms=("cuda",))
  finally:
    jax.config.update("jax_pallas_dump_promela_to", "")
  (path,) = glob.glob(str(tmp_path / "body-*.pml"))
  with open(path) as fh:
    assert plgpu_model.MARK in fh.read()


# ------------------------------------------------ Pallas's Hopper matmul

def _hopper_matmul_spec():
  m = swapped("gpu.hopper_matmul_mgpu")
  a = jax.ShapeDtypeStruct((128, 256), jnp.float16)
  b = jax.ShapeDtypeStruct((256, 128), jnp.float16)
  config = m.TuningConfig(tile_m=64, tile_n=64, tile_k=64,
                          max_concurrent_steps=2)
  with simulated_gpu(m):
    return _spec(lambda a, b: m.matmul(a, b, None, config), a, b)


@needs_spin
def test_hopper_matmul_verifies_clean_and_a_seeded_bug_is_caught():
  sk = skeleton(_hopper_matmul_spec())
  assert len(sk.programs) == 3                    # 2 compute wgs, 1 memory
  loads = [e for e in sk.programs[2] if e.kind == "load"]
  assert len(loads) == 2 * 4                      # 2 inputs x 4 k steps
  rep = plgpu_model.verify(sk)
  assert rep.kind == "ok", str(rep)
  # A compute warpgroup that no longer waits for its first input's copies.
  first_wait = next(e for e in sk.programs[0] if e.kind == "wait")
  barrier = sk.barrier_name(first_wait.barrier).split("[")[0]
  if sk.barrier_name(first_wait.barrier).count("[") > 1:
    barrier = sk.barrier_name(first_wait.barrier).rsplit("[", 1)[0]
  bad = plgpu_model.verify(plgpu_model.without(sk, 0, "wait", barrier))
  assert bad.kind == "race", str(bad)
  assert bad.message.startswith(f"kernel {rep.kernel}: race: warpgroup wg=0 "
                                "issues a WGMMA")
  assert "hopper_matmul_mgpu.py:" in bad.error_line


# ------------------------------------- attention_mgpu's backward kernels

def _attention_backward_specs():
  """{name: KernelSpec} of the kernels of `jax.grad` of Pallas's
  attention_mgpu (block 64, depth 2): its forward, `kernel_dq` and
  `kernel_dkv`."""
  m = swapped("gpu.attention_mgpu")
  q = jax.ShapeDtypeStruct((1, 256, 1, 64), jnp.float16)
  config = m.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2,
                          causal=False, block_q_dq=64, block_kv_dq=64,
                          block_q_dkv=64, block_kv_dkv=64)
  loss = lambda q, k, v: m.attention(q, k, v, config).astype(
      jnp.float32).sum()
  with simulated_gpu(m):
    return {spec.name: spec for spec, _ in traced_kernels(
        jax.grad(loss, argnums=(0, 1, 2)), q, q, q)}


@needs_spin
def test_attention_backward_verifies_clean_and_an_early_refill_is_caught():
  specs = _attention_backward_specs()
  assert sorted(specs) == ["entry", "kernel_dkv", "kernel_dq"]
  for name, inputs in (("kernel_dq", 2), ("kernel_dkv", 4)):
    sk = skeleton(specs[name])
    memory = len(sk.programs) - 1
    rep = plgpu_model.verify(sk)
    assert rep.kind == "ok", str(rep)
    # The memory warpgroup waits for each input's own consumed barrier
    # right before that input's copy (manual_consumed_barriers).
    kinds = [e.kind for e in sk.programs[memory]
             if e.kind in ("wait", "load")]
    assert kinds[2 * inputs:4 * inputs] == ["wait", "load"] * inputs
    # Without the wait for the first input's release, its slot is refilled
    # before the compute warpgroup released it.
    first_wait = next(e for e in sk.programs[memory] if e.kind == "wait")
    barrier = sk.barrier_name(first_wait.barrier).rsplit("[", 1)[0]
    bad = plgpu_model.verify(plgpu_model.without(sk, memory, "wait",
                                                 barrier))
    assert bad.kind == "race", str(bad)
    assert bad.message.startswith(f"kernel {name}: race: warpgroup "
                                  f"wg={memory} starts a TMA copy")
