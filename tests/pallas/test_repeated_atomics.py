"""Atomics through an array of indices that names an element several times
(a histogram) apply once per lane, one after another, on every backend that
has atomics (`interpret`; Triton, whose atomics take a block of pointers);
an array of indices also loads and stores through pointer blocks on Triton.
Checked against numpy's `ufunc.at` (and Pallas in interpret mode where it
does not drop repeats: gathers and scatters)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl

import dsl as pl
from dsl import triton as plt

BACKENDS = ("interpret", "triton_interpret")

# op -> numpy's accumulating ufunc
UFUNCS = {"add": np.add, "max": np.maximum, "min": np.minimum,
          "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}


def histogram(plt_module, op, bins, n, dtype):
  def kernel(idx_ref, v_ref, o_ref):
    o_ref[...] = jnp.full(o_ref.shape, 5, o_ref.dtype)
    getattr(plt_module, f"atomic_{op}")(o_ref, (idx_ref[...],), v_ref[...])
  return kernel, jax.ShapeDtypeStruct((bins,), dtype)


def _data(n, bins, dtype, seed=0):
  r = np.random.default_rng(seed)
  idx = r.integers(0, bins, n).astype(np.int32)
  idx[: n // 4] = 1                               # many repeats of one bin
  v = r.integers(1, 9, n).astype(dtype)
  return idx, v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", sorted(UFUNCS))
@pytest.mark.parametrize("n,bins", [(4, 4), (64, 8), (256, 16)])
def test_repeated_indices_accumulate_per_lane(backend, op, n, bins):
  idx, v = _data(n, bins, np.int32)
  kernel, out = histogram(plt, op, bins, n, jnp.int32)
  got = pl.pallas_call(kernel, out, backend=backend)(idx, v)
  want = np.full(bins, 5, np.int32)
  UFUNCS[op].at(want, idx, v)
  np.testing.assert_array_equal(got, want)


def test_the_histogram_of_the_issue():
  def kernel(idx_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)
    plt.atomic_add(o_ref, (idx_ref[...],), jnp.ones((4,), jnp.int32))
  idx = jnp.array([0, 0, 0, 1], jnp.int32)
  for b in BACKENDS:
    got = pl.pallas_call(kernel, jax.ShapeDtypeStruct((4,), jnp.int32),
                         backend=b)(idx)
    np.testing.assert_array_equal(got, [3, 1, 0, 0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_float_histogram_over_a_grid(backend):
  def kernel(idx_ref, v_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    plt.atomic_add(o_ref, (idx_ref[...],), v_ref[...])
  n, bins = 512, 8
  idx, v = _data(n, bins, np.float32, seed=3)
  f = pl.pallas_call(kernel, jax.ShapeDtypeStruct((bins,), jnp.float32),
                     grid=(n // 128,),
                     in_specs=[pl.BlockSpec((128,), lambda i: (i,))] * 2,
                     out_specs=pl.BlockSpec((bins,), lambda i: (0,)),
                     backend=backend)
  want = np.zeros(bins, np.float32)
  np.add.at(want, idx, v)
  # (Pallas's interpret mode keeps one update of each repeated element.)
  np.testing.assert_allclose(f(idx, v), want, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_old_values_serialize_the_lanes(backend):
  """The lanes of one element see each other's updates: a slot allocator."""
  def kernel(idx_ref, o_ref, slot_ref):
    o_ref[...] = jnp.zeros_like(o_ref)
    slot_ref[...] = plt.atomic_add(o_ref, (idx_ref[...],),
                                   jnp.ones((8,), jnp.int32))
  idx = jnp.array([2, 2, 0, 2, 0, 1, 2, 3], jnp.int32)
  counts, slots = pl.pallas_call(
      kernel, (jax.ShapeDtypeStruct((4,), jnp.int32),
               jax.ShapeDtypeStruct((8,), jnp.int32)), backend=backend)(idx)
  np.testing.assert_array_equal(counts, [2, 1, 4, 1])
  slots = np.asarray(slots)
  for b in range(4):   # each lane of a bin gets a distinct slot
    assert sorted(slots[idx == b]) == list(range(int((idx == b).sum())))


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_and_outside_lanes_do_nothing(backend):
  def kernel(idx_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)
    idx = idx_ref[...]
    plt.atomic_add(o_ref, (idx,), jnp.ones((8,), jnp.int32),
                   mask=jnp.arange(8) % 2 == 0)
  # Lanes 0, 2, 4, 6 add: index 9 is outside (dropped, as JAX drops a
  # scatter's), -1 counts from the end (index 3), as in JAX.
  idx = jnp.array([1, 1, 9, 1, -1, 1, 3, 3], jnp.int32)
  got = pl.pallas_call(kernel, jax.ShapeDtypeStruct((4,), jnp.int32),
                       backend=backend)(idx)
  np.testing.assert_array_equal(got, [0, 1, 0, 2])
  want = jnp.zeros(4, jnp.int32).at[idx[::2]].add(1)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_and_scatter_through_an_array_of_indices(backend):
  def kernel(idx_ref, x_ref, o_ref):
    o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[idx_ref[...]] = x_ref[idx_ref[...]] * 2
  idx = jnp.array([5, 0, 3, 7], jnp.int32)
  x = jnp.arange(8, dtype=jnp.float32)
  f = lambda pl_, **kw: pl_.pallas_call(
      kernel, jax.ShapeDtypeStruct((8,), jnp.float32), **kw)(idx, x)
  got = f(pl, backend=backend)
  want = np.zeros(8, np.float32)
  want[np.asarray(idx)] = np.asarray(x)[np.asarray(idx)] * 2
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got, f(jpl, interpret=True))


def test_histogram_compiles_to_atomics_on_a_block_of_pointers():
  from lowering_triton import aot
  kernel, out = histogram(plt, "add", 16, 256, jnp.float32)
  f = pl.pallas_call(kernel, out, backend="triton")
  (k,) = aot.compile_aot(f, jax.ShapeDtypeStruct((256,), jnp.int32),
                         jax.ShapeDtypeStruct((256,), jnp.float32))
  assert "atom.global" in k.ptx or "red.global" in k.ptx


def test_indices_outside_fail_the_same_check():
  jax.config.update("jax_pallas_enable_runtime_assert", True)
  try:
    kernel, out = histogram(plt, "add", 4, 8, jnp.int32)
    idx = jnp.array([0, 1, 2, 9, 3, 0, 1, 2], jnp.int32)
    msgs = {}
    for b in BACKENDS:
      with pytest.raises(pl.KernelCheckError) as e:
        pl.pallas_call(kernel, out, backend=b)(idx, jnp.ones(8, jnp.int32))
      msgs[b] = str(e.value)
    assert len(set(msgs.values())) == 1, msgs
    assert "atomic update of o_ref[indices 0 to 9]" in msgs["interpret"]
  finally:
    jax.config.update("jax_pallas_enable_runtime_assert", False)
