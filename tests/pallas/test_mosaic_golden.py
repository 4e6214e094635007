"""Golden tests: our "mosaic" backend against JAX's own Pallas TPU lowering.

Every kernel of mosaic_corpus.py is lowered for a TPU (on the CPU) by
`jax.experimental.pallas` and by `dsl`; the Mosaic modules in the two
`tpu_custom_call`s are decoded, canonicalized and compared op for op (see
mosaic_golden.py for what is normalized), and so are the calls' configs and
attributes; our locations are checked on their own (mosaic_locations.py).
"""
import inspect
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu

import dsl
from dsl.core import backends
from dsl import tpu as dtpu
from dsl.core.poison import poison_value
import kernels
from tests.pallas import mosaic_golden as golden
from tests.pallas import mosaic_locations, pallas_internals, testing
from tests.pallas.mosaic_corpus import CASES

# Where the corpus's kernels and index maps come from besides the case's own
# file: the kernel library and the shared blocked matmul.
LIBRARY_SOURCES = frozenset(
    [str(p) for p in pathlib.Path(kernels.__file__).parent.glob("*.py")]
    + [inspect.getsourcefile(testing)])


def sources(name) -> set:
  """The files whose lines a case's locations may name."""
  return {inspect.getsourcefile(CASES[name])} | LIBRARY_SOURCES


def lower_both(name):
  build = CASES[name]
  f, args = build(jpl, jpltpu)
  theirs = golden.lower_tpu(f, *args)
  f, args = build(dsl, dtpu)
  ours = golden.lower_tpu(f, *args)
  return ours, theirs


# The differences docs/mosaic.md lists as harmless ("Fidelity to Pallas"):
# case -> the operations only our module may have (and, as a tuple with a
# second set, those only Pallas's may have). The test checks that the
# modules differ in only those operations, and that they do differ, so an
# entry goes when the difference is fixed.
DOCUMENTED = {
    # float -> integer casts are defined for NaN and out-of-range values
    "float_to_int_cast": {"arith.cmpf", "arith.andi", "arith.select",
                          "arith.constant"},
    "logic_clamp_and_select": {"arith.cmpf", "arith.andi", "arith.select",
                               "arith.constant"},
    # a dynamic roll shift is taken mod the axis length
    "dynamic_ref_slices": {"arith.remsi", "arith.addi", "arith.constant"},
    # float `!=` (jnp.isnan's x != x) is `cmpf une`, true for NaN as in
    # numpy; Pallas emits `cmpf one`, false for NaN
    "nan_test_and_rounding": set(),
    # integer division and remainder are defined for 0 and INT_MIN / -1
    "integer_division_and_select": {"arith.cmpi", "arith.ori", "arith.select",
                                    "arith.subi", "arith.constant"},
    # argmax returns the first NaN's index: max, compare, iota, min
    # instead of tpu.reduce_index
    "argmax_and_compare": ({"vector.multi_reduction", "vector.shape_cast",
                            "vector.broadcast", "arith.cmpf", "arith.ori",
                            "tpu.iota", "arith.select", "arith.constant"},
                           {"tpu.reduce_index"}),
}

# Kernels that run inside shard_map (tests/pallas/test_mosaic_multidevice.py
# runs such kernels).
SHARD_MAPPED = {"remote_ring_copy", "remote_wait_send_recv",
                "barrier_and_remote_signal", "barrier_in_control_flow",
                "barrier_with_tag",
                "logical_device_id",
                "accumulating_remote_copy"}

# Kernels Pallas's TPU lowering rejects (docs/mosaic.md): case -> (its
# exception, what it says, what our module shows instead).
# - An Element dim beside a blocked one: Pallas requires all or none; ours
#   makes every index of the window an element offset (the blocked dim's
#   index times its block size), a window a TPU reads as Pallas's.
REJECTED_BY_PALLAS = {
    "element_mixed_with_blocked": (
        NotImplementedError, "All block dimensions must be Elements",
        "window_kind = #tpu.element_window<[0, 0], [0, 0]>"),
}


# Kernels both lowerings reject: case -> (Pallas's exception, what it says,
# what ours says); ours is always a BackendError (a NotImplementedError).
# - An accumulating DMA (`start(add=True)`, `sync_copy(add=True)`, local or
#   remote): the TensorCore's `tpu.enqueue_dma` only copies.
# - `pl.Buffered` with more than two buffers: Pallas raises its own
#   `LoweringException`, a bare Exception subclass outside its public API,
#   which no dsl error can be; and with `use_lookahead=True`.
def _lowering_exception():
  return pallas_internals.LoweringException


_ACCUMULATING = (NotImplementedError, "DMA with add=True is not supported",
                 "accumulating DMA")
REJECTED_BY_BOTH = {
    "accumulating_dma": _ACCUMULATING,
    "accumulating_sync_copy": _ACCUMULATING,
    "accumulating_remote_copy": _ACCUMULATING,
    "buffered_three": (_lowering_exception(), "Only single \\(1\\) and "
                       "double \\(2\\) buffering are supported. Got 3",
                       "supports 1 or 2 buffers, got Buffered\\(3\\)"),
    "buffered_lookahead": (NotImplementedError, "Lookahead is not supported",
                           "use_lookahead=True\\) is not supported"),
}


@pytest.mark.parametrize(
    "name", sorted(set(CASES) - set(REJECTED_BY_PALLAS) - set(REJECTED_BY_BOTH)))
def test_matches_pallas(name):
  ours, theirs = lower_both(name)
  assert theirs, "Pallas emitted no tpu_custom_call"
  problems = golden.compare(ours, theirs, sources(name))
  if name not in DOCUMENTED:
    assert not problems, "\n".join(problems)
    return
  assert problems, f"{name} matches Pallas now: remove it from DOCUMENTED"
  allowed = DOCUMENTED[name]
  ours_only, pallas_only = allowed if isinstance(allowed, tuple) else (
      allowed, set())
  for a, b in zip(ours, theirs):
    assert a.config == b.config and a.attrs == b.attrs
    assert not mosaic_locations.check_frames(a.located, sources(name))
    extra, missing = golden.op_difference(a.module, b.module)
    detail = "\n" + golden.diff(a.module, b.module)
    assert set(missing) <= pallas_only, f"ops only Pallas has: {missing}" + detail
    assert set(extra) <= ours_only, f"ops only we have: {extra}" + detail


@pytest.mark.parametrize("name", sorted(REJECTED_BY_PALLAS))
def test_rejected_by_pallas_but_lowered_by_us(name):
  exc, says, ours_shows = REJECTED_BY_PALLAS[name]
  f, args = CASES[name](jpl, jpltpu)
  with pytest.raises(exc, match=says):
    golden.lower_tpu(f, *args)
  f, args = CASES[name](dsl, dtpu)
  (call, *_) = golden.lower_tpu(f, *args)
  assert ours_shows in call.module


@pytest.mark.parametrize("name", sorted(REJECTED_BY_BOTH))
def test_rejected_by_pallas_and_by_us(name):
  pallas_raises, pallas_says, we_say = REJECTED_BY_BOTH[name]
  f, args = CASES[name](jpl, jpltpu)
  with pytest.raises(pallas_raises, match=pallas_says):
    golden.lower_tpu(f, *args)
  f, args = CASES[name](dsl, dtpu)
  with pytest.raises(NotImplementedError, match=we_say) as e:
    golden.lower_tpu(f, *args)
  assert isinstance(e.value, dsl.BackendError)


def test_mixed_element_window_takes_element_offsets():
  f, args = CASES["element_mixed_with_blocked"](dsl, dtpu)
  (call,) = golden.lower_tpu(f, *args)
  # transform_0 returns (i * 8, j * 128): element offsets in both dims
  transform = call.module.split("func.func @transform_0")[1].split(
      "func.func")[0]
  assert "arith.muli %arg1, %K" in transform and "arith.constant 128" in (
      transform)


# The corpus kernels that run here under both host backends (kernels/ and
# shard_map ones have their own tests): the module, run by the Mosaic
# interpreter, computes what the plain interpreter computes.
RUNNABLE = sorted(n for n in CASES
                  if not n.startswith("lib_") and n not in SHARD_MAPPED
                  and n not in REJECTED_BY_BOTH)


def _random_like(args, seed=0):
  rng = np.random.default_rng(seed)
  return tuple(
      jnp.asarray(rng.standard_normal(a.shape), a.dtype)
      if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args)


@pytest.mark.parametrize("name", RUNNABLE)
def test_mosaic_interpreter_runs_the_corpus(name, monkeypatch):
  results = {}
  for backend in ("interpret", "mosaic_interpret"):
    monkeypatch.setitem(backends.DEFAULT_FOR_PLATFORM, "cpu", backend)
    f, args = CASES[name](dsl, dtpu)
    results[backend] = jax.jit(f)(*_random_like(args))
  for a, b in zip(jax.tree.leaves(results["interpret"]),
                  jax.tree.leaves(results["mosaic_interpret"])):
    a, b = np.asarray(a), np.asarray(b)
    # Output memory no step writes is uninitialized on a TPU: poison on
    # mosaic_interpret, zeros on interpret (a few corpus kernels write part
    # of their output).
    unwritten = (b == poison_value(b.dtype)) | (np.isnan(b) if np.issubdtype(
        b.dtype, np.floating) else False)
    unwritten &= (a == 0)
    np.testing.assert_allclose(np.where(unwritten, 0, a).astype(np.float32),
                               np.where(unwritten, 0, b).astype(np.float32),
                               rtol=2e-2, atol=2e-2)


def test_float_not_equal_is_unordered_unlike_pallas():
  ours, theirs = lower_both("nan_test_and_rounding")
  assert "arith.cmpf une, %0, %0" in ours[0].module
  assert "arith.cmpf one, %0, %0" in theirs[0].module


def _tagged_pair(pl, pltpu, tags, collective_id=None):
  """Two barrier kernels in one computation, with the given tags."""
  from jax import lax
  from jax.sharding import PartitionSpec as P
  from tests.pallas.mosaic_corpus_dma import N_DEV, _mesh

  def call(tag_list):
    def kernel(x_ref, o_ref):
      me = lax.axis_index("x")
      for tag in tag_list:
        barrier = pltpu.get_barrier_semaphore(tag=tag)
        pl.semaphore_signal(barrier, 1, device_id=(lax.rem(me + 1, N_DEV),),
                            device_id_type=pl.DeviceIdType.MESH)
        pl.semaphore_wait(barrier, 1)
      o_ref[...] = x_ref[...]
    params = pltpu.CompilerParams(collective_id=collective_id)
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32),
                          compiler_params=params)

  def f(x):
    for tag_list in tags:
      x = jax.shard_map(call(tag_list), mesh=_mesh(), in_specs=P("x"),
                        out_specs=P("x"), check_vma=False)(x)
    return x
  return f, jnp.ones((N_DEV * 8, 128), jnp.float32)


def test_barrier_tags_name_collectives_as_in_pallas():
  # one id per distinct tag, in order: ("a",) -> 0, ("b",) -> 1
  ids = {}
  for pl, pltpu in ((jpl, jpltpu), (dsl, dtpu)):
    f, x = _tagged_pair(pl, pltpu, [["a"], ["b"], ["a"]])
    ids[pl] = [c.config["custom_call_config"]["collective_id"]
               for c in golden.lower_tpu(f, x)]
  assert ids[dsl] == ids[jpl] == [0, 1, 0]


def test_barrier_tag_and_collective_id_conflict_as_in_pallas():
  for pl, pltpu in ((jpl, jpltpu), (dsl, dtpu)):
    f, x = _tagged_pair(pl, pltpu, [["a"]], collective_id=3)
    with pytest.raises(ValueError, match="Conflicting collective_id"):
      golden.lower_tpu(f, x)


def test_two_barrier_tags_in_one_kernel_are_rejected_as_in_pallas():
  for pl, pltpu in ((jpl, jpltpu), (dsl, dtpu)):
    f, x = _tagged_pair(pl, pltpu, [["a", "b"]])
    with pytest.raises(ValueError, match="tags"):
      golden.lower_tpu(f, x)


def _threefry_reference(key, hi, lo):
  from jax.extend.random import threefry2x32_p
  o1, o2 = threefry2x32_p.bind(key[0, 0], key[0, 1], hi, lo)
  return o1 ^ o2, o1


# Kernels whose rules lower through Pallas's operations (tile, ref reshape,
# threefry2x32): mosaic_interpret computes what jax.numpy computes.
JNP_REFERENCES = {
    "tile_repeats": lambda x: jnp.tile(x, (2, 3)),
    "reshaped_ref_window": lambda x, i: (x[i[0]].reshape(32, 128)[1::2],
                                         x.reshape(64, 128)),
    "threefry_hash": _threefry_reference,
}


@pytest.mark.parametrize("name", sorted(JNP_REFERENCES))
def test_mosaic_interpret_matches_jnp(name, monkeypatch):
  monkeypatch.setitem(backends.DEFAULT_FOR_PLATFORM, "cpu", "mosaic_interpret")
  f, args = CASES[name](dsl, dtpu)
  args = _random_like(args, seed=1)
  got, want = jax.jit(f)(*args), JNP_REFERENCES[name](*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
