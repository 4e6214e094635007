"""Pallas's collective plgpu ops (`all_gather_mgpu`, `reduce_scatter_mgpu`,
`collective_matmul_mgpu`) and the primitives they are made of, lowered by
backend "mosaic_gpu" for CUDA on a CPU inside `shard_map` over the 8 CPU
devices of the test run, and compared with the module Pallas's own Mosaic
GPU lowering builds from the same source (tests/pallas/plgpu_modules.py
catches both where they reach jaxlib's library).

The differences the comparisons allow are those docs/mosaic-gpu.md lists:
the mesh's block and warpgroup indices are read once, at the top of the
block; lowered vectors have no unit dims (a `(1, 16, 128)` tile is a
`(16, 128)` vector, in the same `WG_STRIDED` layout); scalar bookkeeping
the library's canonicalization folds.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import pallas as jpl
from jax.experimental.pallas import mosaic_gpu as jplgpu

import dsl as pl
from dsl import mosaic_gpu as plgpu
from dsl.core.errors import BackendError
from lowering_mosaic.gpu import to_gpu_modules
from benchmarks.pallas_library.cases_mgpu import simulated_gpu
from benchmarks.pallas_library.swap import original, swapped
from tests.pallas.plgpu_collective_kernels import (
    device_index, multicast_signal, multimem_load_max, multimem_load_reduce,
    multimem_store, multimem_store_scalar, remote_copy, signal_and_wait)
from tests.pallas.plgpu_modules import captured  # noqa: F401 -- a fixture
from tests.pallas.plgpu_modules import (canonical, key_ops, lower_op_both,
                                        only_in, schedule, unnamed)

F32 = jnp.float32


def on_mesh(fn, shape, dtype, out_spec=jax.P("x")):
  """`fn` per device of a mesh of the 8 CPU devices along "x", lowered
  for CUDA (dsl's kernels lower through custom partitioning under a
  sharded jit, which needs the devices)."""
  mesh = jax.make_mesh((8,), ("x",))
  x = jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(
      mesh, jax.P("x")))
  f = jax.shard_map(fn, mesh=mesh, in_specs=jax.P("x"), out_specs=out_spec,
                    check_vma=False)
  return jax.jit(f).trace(x).lower(lowering_platforms=("cuda",))


def _all_gather(m):
  with simulated_gpu(m):
    return on_mesh(lambda s: m.all_gather(s, axis_name="x", num_blocks=2),
                   (8 * 16, 128), F32, jax.P())


def _reduce_scatter(m):
  with simulated_gpu(m):
    return on_mesh(lambda s: m.reduce_scatter(
        s, axis_name="x", scatter_dimension=0, num_blocks=2),
                   (8 * 64, 128), F32)


def _collective_matmul(m):
  rhs = jnp.ones((128, 128), jnp.float16)
  config = m.hopper_matmul_mgpu.TuningConfig(tile_m=64, tile_n=64, tile_k=64,
                                             max_concurrent_steps=2)
  with simulated_gpu(m):
    return on_mesh(lambda s: m.all_gather_lhs_matmul(s, rhs, "x",
                                                     config=config),
                   (8 * 64, 128), jnp.float16, jax.P())


_OPS = {"gpu.all_gather_mgpu": _all_gather,
        "gpu.reduce_scatter_mgpu": _reduce_scatter,
        "gpu.collective_matmul_mgpu": _collective_matmul}


def custom_call(lowered) -> str:
  """The kernel's custom call in StableHLO, without its serialized module
  and hash (the modules are compared below)."""
  (line,) = [line for line in lowered.as_text().splitlines()
             if "custom_call @mosaic_gpu" in line]
  line = re.sub(r'(module|kernel_hash) = "(\\.|[^"\\])*"', r"\1", line)
  return re.sub(r"%\w+", "%v", line.strip())


@pytest.mark.parametrize("op", sorted(_OPS))
def test_collective_custom_call_is_pallas_custom_call(op):
  """The same call: the semaphores' buffer an operand (zeros) aliased to an
  extra output, symmetric-memory operands, XLA's collective metadata and
  the replica ids of the devices."""
  with pl.default_backend("mosaic_gpu"):
    ours = custom_call(_OPS[op](swapped(op)))
  assert ours == custom_call(_OPS[op](original(op)))
  assert "uses_xla_collective_metadata = true" in ours
  assert "output_operand_alias<output_tuple_indices = [" in ours


# What a collective does, as the lowered module spells it: the device id
# (read from the collective metadata), multicast stores and reducing loads,
# signals to peers (one `red.release` each, a multicast one too), the polls
# of a wait that keeps the count, TMA copies (to a peer's memory too) and
# block barriers.
_COLLECTIVE = ("mosaic_gpu.device_id_load", "multimem.st",
               "multimem.ld_reduce", "multimem.red.release",
               "red.release.sys.global.add.u32", "ld.relaxed.sys.global",
               "fence.acquire.sys", "cp.async.bulk.tensor", "bar.sync")


def collective_ops(text: str) -> dict[str, int]:
  return {k: text.count(k) for k in _COLLECTIVE}


def module_attributes(text: str) -> str:
  """The module's attributes: the library's flags of what it uses
  (collective metadata, multimem) and of its symmetric-memory operands."""
  head = next(line for line in canonical(text) if line.startswith("module"))
  return head.replace(', mosaic_gpu.dump_basename = "kernel"', "")


# The lines a `(1, 16, 128)` (all-gather) or `(1, 8, 128)` (reduce-scatter)
# tile makes: as dsl's `(16, 128)` vector (a subview dropping the unit dim,
# 2-D descriptors, a flat view of its elements) or as Pallas's 3-D one (3-D
# descriptors, a `(1, 2048)` view, and the index arithmetic of each
# element's address in the unit dim, which dsl's view has not).
def _is_tile_line(line: str, rows: int) -> bool:
  two_d = (f"{rows}x128xf32", "array<2 x i64>", f"<[{rows}, 128], 4>",
           f"{rows * 128}xf32")
  three_d = (f"1x{rows}x128xf32", "array<3 x i64>")
  index_math = ("arith.remui", "arith.divui", "arith.constant")
  return any(k in line for k in two_d + three_d + index_math)


@pytest.mark.parametrize("op,lower,rows", [
    ("gpu.all_gather_mgpu", _all_gather, 16),
    ("gpu.reduce_scatter_mgpu", _reduce_scatter, 8)])
def test_multimem_op_module_is_pallas_module(captured, op, lower, rows):
  ((ours, ours_low), (theirs, theirs_low)) = lower_op_both(lower, op,
                                                           captured)
  assert schedule(ours) == schedule(theirs)
  assert module_attributes(ours) == module_attributes(theirs)
  assert "mosaic_gpu.collective_metadata_used" in module_attributes(ours)
  assert collective_ops(ours) == collective_ops(theirs)
  assert collective_ops(ours_low) == collective_ops(theirs_low)
  assert collective_ops(ours_low)["multimem.red.release"] == 1
  assert collective_ops(ours_low)["ld.relaxed.sys.global"] == 1
  # Lowered: the same but for the tile's unit dim, which dsl's vectors
  # drop (its views need no per-element index arithmetic: fewer ops).
  extra_ours, extra_theirs = only_in(unnamed(ours_low), unnamed(theirs_low))
  assert extra_ours and extra_theirs
  assert all(_is_tile_line(line, rows) for line in extra_ours + extra_theirs)
  assert len(unnamed(ours_low)) < len(unnamed(theirs_low))


def test_collective_matmul_module_is_pallas_module(captured):
  ((ours, ours_low), (theirs, theirs_low)) = lower_op_both(
      _collective_matmul, "gpu.collective_matmul_mgpu", captured)
  # The Hopper matmul's schedule once per device step, with the sends of
  # the lhs to the next device (TMA stores to a peer's memory), a signal
  # of its semaphore (from pl.get_global) and a wait that keeps the count.
  assert schedule(ours) == schedule(theirs)
  assert key_ops(ours) == key_ops(theirs)
  assert key_ops(ours_low) == key_ops(theirs_low)
  assert collective_ops(ours) == collective_ops(theirs)
  assert collective_ops(ours_low) == collective_ops(theirs_low)
  assert ours.count("gmem_peer_id") == 0 and ours.count(
      "operandSegmentSizes = array<i32: 1, 1, 3, 0, 1>") == 2
  assert module_attributes(ours) == module_attributes(theirs)
  # Lowered: the same but for the warpgroup index, read once (4 warp
  # shuffles fewer), and where the block index is read (at the top).
  assert only_in(unnamed(ours_low), unnamed(theirs_low)) == (
      [], ["%v = nvvm.shfl.sync idx %v, %v, %v, %v : i32 -> i32"] * 4)


# ------------------------------------------------- the primitives alone

def lower_both_on_mesh(make, captured, dtype=F32):
  """[(dialect, lowered) of dsl's module, the same of Pallas's] of the
  kernel `make(pl, plgpu)` on each device."""
  modules = []
  for lib, extra in (((pl, plgpu), dict(backend="mosaic_gpu")),
                     ((jpl, jplgpu), {})):
    captured.clear()
    on_mesh(make(*lib, **extra), (8 * 128,), dtype)
    (module,) = captured
    modules.append(module)
  return modules


@pytest.mark.parametrize("make,expected,dtype", [
    (multimem_store, {"multimem.st": 1}, F32),
    (multimem_store_scalar, {"multimem.st": 1}, jnp.int32),
    (multimem_load_reduce, {"multimem.ld_reduce": 1}, F32),
    (multimem_load_max, {"multimem.ld_reduce": 1}, jnp.int32),
    (device_index, {"mosaic_gpu.device_id_load": 1}, F32),
    (signal_and_wait, {"red.release.sys.global.add.u32": 1,
                       "ld.relaxed.sys.global": 1}, F32),
    (multicast_signal, {"multimem.red.release": 1,
                        "ld.relaxed.sys.global": 1}, F32),
    (remote_copy, {"cp.async.bulk.tensor": 1}, F32)],
    ids=lambda x: x.__name__ if callable(x) and hasattr(x, "__code__")
    else "")
def test_collective_primitive_module_is_pallas_module(captured, make,
                                                      expected, dtype):
  (ours, ours_low), (theirs, theirs_low) = lower_both_on_mesh(make, captured,
                                                              dtype)
  ops = collective_ops(ours_low)
  assert {k: ops[k] for k in expected} == expected
  assert collective_ops(ours) == collective_ops(theirs)
  assert ops == collective_ops(theirs_low)
  assert module_attributes(ours) == module_attributes(theirs)
  assert unnamed(ours_low) == unnamed(theirs_low)


# ------------------------------------------------------------- refusals

def test_to_gpu_modules_builds_a_collective_on_the_shard_maps_mesh():
  """`to_gpu_modules` builds the module over the (abstract) device mesh of
  the shard_map around the kernel: no device is needed."""
  kernel = signal_and_wait(pl, plgpu, backend="mosaic_gpu")
  mesh = jax.make_mesh((8,), ("x",))
  f = jax.shard_map(kernel, mesh=mesh, in_specs=jax.P("x"),
                    out_specs=jax.P("x"), check_vma=False)
  x = jax.device_put(jnp.ones((8 * 128,), F32),
                     jax.sharding.NamedSharding(mesh, jax.P("x")))
  (module,) = to_gpu_modules(f, x)
  assert collective_ops(module.dialect_text)[
      "red.release.sys.global.add.u32"] == 1
  # One global semaphore: an aliased int32 operand, zeroed by the caller.
  assert module.plan.gmem_scratch == (jax.ShapeDtypeStruct((1,), jnp.int32),)


def test_collectives_outside_shard_map_are_refused_by_name():
  kernel = multimem_store(pl, plgpu, backend="mosaic_gpu")
  x = jnp.ones((128,), F32)
  with pytest.raises(BackendError, match=r"kernel 'body'.*plgpu\."
                     r"multimem_store needs the kernel to run inside "
                     r"jax\.shard_map"):
    jax.jit(kernel).trace(x).lower(lowering_platforms=("cuda",))


def test_device_index_in_a_pallas_call_is_refused_by_name():
  """The automatic schedule's kernels do not talk to other devices."""
  def k(x_ref, o_ref):
    o_ref[...] = x_ref[...] + lax.axis_index("x").astype(F32)
  f = pl.pallas_call(k, jax.ShapeDtypeStruct((64, 128), F32),
                     backend="mosaic_gpu")
  with pytest.raises(BackendError, match=r"kernel 'k': lax\.axis_index\('x'\) "
                     r"lowers in plgpu\.kernels only .*\(at \S+\.py:\d+\)"):
    on_mesh(f, (8 * 64, 128), F32)


def test_wait_that_keeps_the_count_is_refused_on_a_tpu():
  import dsl.tpu as pltpu

  def body(o_ref, sem):
    pl.semaphore_signal(sem)
    pl.semaphore_wait(sem, 1, decrement=False)
    o_ref[...] = jnp.zeros_like(o_ref)
  f = pl.pallas_call(body, jax.ShapeDtypeStruct((8, 128), F32),
                     scratch_shapes=[pltpu.SemaphoreType.REGULAR],
                     backend="mosaic")
  with pytest.raises(BackendError, match=r"semaphore_wait\(decrement=False\)"
                     r".*tpu\.sem_wait always decrements"):
    jax.jit(f).trace().lower(lowering_platforms=("tpu",))
