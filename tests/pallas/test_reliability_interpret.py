"""Cases where the host backends disagreed with each other or with Pallas:
blocks placed outside their array by static index maps, state carried
across grid steps in scratch, and masked accesses through a `pl.ds` that runs
past the array end. Each kernel is compared with a plain jax.numpy reference
and, where Pallas runs it, with jax.experimental.pallas in interpret mode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu

import dsl as pl
from dsl import tpu as pltpu
from dsl.core.errors import KernelError, kernel_error_of

HOST_BACKENDS = ("interpret", "triton_interpret", "mosaic_interpret")


# ------------------------------------------------- blocks outside the array

def copy_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...]


def _copy(backend, in_map, out_map=lambda i: (i, 0), grid=(4,),
          shape=(32, 128), block=(8, 128), in_block=None):
  return pl.pallas_call(
      copy_kernel, jax.ShapeDtypeStruct(shape, jnp.float32), grid=grid,
      in_specs=[pl.BlockSpec(in_block or block, in_map)],
      out_specs=pl.BlockSpec(block, out_map), backend=backend)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_element_offsets_as_block_indices_are_a_trace_time_error(backend):
  x = jnp.ones((32, 128), jnp.float32)
  call = _copy(backend, lambda i: (i * 8, 0))
  with pytest.raises(KernelError) as e:
    jax.jit(call).trace(x)
  msg = str(e.value)
  assert "in_specs[0]" in msg
  assert "grid point (1,)" in msg and "(8, 0)" in msg
  assert "index maps return block indices, not element offsets" in msg


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_negative_block_index_is_a_trace_time_error(backend):
  x = jnp.ones((32, 128), jnp.float32)
  call = _copy(backend, lambda i: (i, 0), out_map=lambda i: (i - 1, 0))
  with pytest.raises(KernelError, match=r"out_specs\[0\].*grid point \(0,\)"):
    call(x)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_partial_edge_blocks_stay_legal(backend):
  x = jnp.arange(20 * 128, dtype=jnp.float32).reshape(20, 128)
  call = _copy(backend, lambda i: (i, 0), grid=(3,), shape=(20, 128))
  np.testing.assert_array_equal(jax.jit(call)(x), x)


def test_element_dims_are_checked_against_array_and_padding():
  x = jnp.arange(32 * 128, dtype=jnp.float32).reshape(32, 128)
  ok = _copy("interpret", lambda i: (i * 8, 0),
             in_block=(pl.Element(8), 128))
  np.testing.assert_array_equal(jax.jit(ok)(x), x)
  bad = _copy("interpret", lambda i: (i * 8 + 8, 0),
              in_block=(pl.Element(8), 128))
  with pytest.raises(KernelError, match=r"grid point \(3,\).*element offset 32"):
    bad(x)


# ------------------------------------------- state carried across grid steps

# Kernels are built for a module (dsl or jax.experimental.pallas).

def running_sum_kernel(m):
  def kernel(x_ref, o_ref, acc_ref):
    @m.when(m.program_id(0) == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += x_ref[...]
    o_ref[...] = acc_ref[...]
  return kernel


def no_init_running_sum_kernel(m):
  # Reads the scratch before writing it at every step but the first.
  def kernel(x_ref, o_ref, acc_ref):
    first = m.program_id(0) == 0
    acc_ref[...] = jnp.where(first, 0., acc_ref[...]) + x_ref[...]
    o_ref[...] = acc_ref[...]
  return kernel


def scratch_written_first_kernel(m):
  def kernel(x_ref, o_ref, tmp_ref):
    tmp_ref[...] = x_ref[...] * 2.
    o_ref[...] = tmp_ref[...] + 1.
  return kernel


def _running_sum(module, kernel, semantics, **kw):
  tpu = pltpu if module is pl else jpltpu
  params = (tpu.CompilerParams(dimension_semantics=semantics)
            if semantics else None)
  spec = module.BlockSpec((8, 128), lambda i: (i, 0))
  return module.pallas_call(
      kernel(module), jax.ShapeDtypeStruct((32, 128), jnp.float32), grid=(4,),
      in_specs=[spec], out_specs=spec,
      scratch_shapes=[tpu.VMEM((8, 128), jnp.float32)],
      compiler_params=params, **kw)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("kernel,semantics", [
    (running_sum_kernel, ("arbitrary",)),
    (running_sum_kernel, None),
    (no_init_running_sum_kernel, None),
])
def test_scratch_carries_across_steps_whose_output_block_changes(
    backend, kernel, semantics):
  x = jax.random.normal(jax.random.key(0), (32, 128), jnp.float32)
  want = jnp.cumsum(x.reshape(4, 8, 128), axis=0).reshape(32, 128)
  got = jax.jit(_running_sum(pl, kernel, semantics, backend=backend))(x)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  oracle = jax.jit(_running_sum(jpl, kernel, semantics, interpret=True))(x)
  np.testing.assert_allclose(got, oracle, rtol=1e-6, atol=1e-6)


def test_scratch_written_first_at_each_step_keeps_the_grid_parallel():
  from dsl.core.grid_plan import make_plan
  from dsl.core.pallas_call import build_spec
  x = jnp.ones((32, 128), jnp.float32)
  call = _running_sum(pl, scratch_written_first_kernel, None,
                      backend="interpret")
  np.testing.assert_array_equal(jax.jit(call)(x), 3 * x)
  plans = {}
  for name, kernel in [("fresh", scratch_written_first_kernel),
                       ("carried", no_init_running_sum_kernel)]:
    spec, _ = build_spec(
        kernel(pl), (x,), jax.ShapeDtypeStruct((32, 128), jnp.float32),
        name=name, grid=(4,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)])
    plans[name] = make_plan(spec.grid_mapping, None, spec.jaxpr)
  assert plans["fresh"].parallel == (0,)
  assert plans["carried"].sequential == (0,)


# -------------------------------------- masked accesses past the array end

@pytest.mark.parametrize("backend", ("interpret", "triton_interpret"))
def test_masked_load_and_store_through_a_slice_past_the_end(backend):
  from dsl import triton as plt
  n, bs = 1000, 256

  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    offs = i * bs + jnp.arange(bs)
    x = plt.load(x_ref.at[pl.ds(i * bs, bs)], mask=offs < n, other=0.)
    plt.store(o_ref.at[pl.ds(i * bs, bs)], x * 2. + 1., mask=offs < n)

  x = jnp.arange(n, dtype=jnp.float32)
  call = pl.pallas_call(kernel, jax.ShapeDtypeStruct((n,), jnp.float32),
                        grid=(pl.cdiv(n, bs),), backend=backend)
  np.testing.assert_array_equal(jax.jit(call)(x), x * 2. + 1.)


def test_masked_atomic_add_through_a_slice_past_the_end():
  from dsl import triton as plt
  n, bs = 100, 64

  def kernel(x_ref, zeros_ref, o_ref):
    i = pl.program_id(0)
    offs = i * bs + jnp.arange(bs)
    x = plt.load(x_ref.at[pl.ds(i * bs, bs)], mask=offs < n, other=0.)
    plt.atomic_add(o_ref, pl.ds(i * bs, bs), x, mask=offs < n)

  # The output accumulates into the zeros it is aliased to (output memory
  # a kernel never writes is poison).
  x = jnp.arange(n, dtype=jnp.float32)
  call = pl.pallas_call(kernel, jax.ShapeDtypeStruct((n,), jnp.float32),
                        grid=(pl.cdiv(n, bs),), input_output_aliases={1: 0},
                        backend="interpret")
  np.testing.assert_array_equal(jax.jit(call)(x, jnp.zeros_like(x)), x)


def test_scratch_accumulator_over_a_reduction_axis_keeps_the_rows_parallel():
  from dsl.core.grid_plan import make_plan
  from dsl.core.pallas_call import build_spec

  def kernel(x_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += x_ref[...]
    o_ref[...] = acc_ref[...]

  x = jax.random.normal(jax.random.key(1), (16, 384), jnp.float32)
  kw = dict(grid=(2, 3), in_specs=[pl.BlockSpec((8, 128), lambda i, k: (i, k))],
            out_specs=pl.BlockSpec((8, 128), lambda i, k: (i, 0)),
            scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)])
  out = jax.ShapeDtypeStruct((16, 128), jnp.float32)
  spec, _ = build_spec(kernel, (x,), out, name="rows", **kw)
  plan = make_plan(spec.grid_mapping, None, spec.jaxpr)
  assert plan.parallel == (0,) and plan.sequential == (1,)
  got = jax.jit(pl.pallas_call(kernel, out, backend="interpret", **kw))(x)
  want = x.reshape(16, 3, 128).sum(axis=1)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------- zero-size operands

def _zero_size_kernel(x_ref, y_ref, o_ref, e_ref):
  o_ref[...] = y_ref[...] * 2 + jnp.sum(x_ref[...])
  e_ref[...] = x_ref[...] * 3


@pytest.mark.parametrize("backend", ["interpret", "triton_interpret"])
@pytest.mark.parametrize("shape", [(0,), (0, 16), (8, 0)])
def test_zero_size_operand_without_block_spec(backend, shape):
  """A zero-size operand with no BlockSpec (its block is the whole, empty
  array) runs; the planner divided by its block size before."""
  x = jnp.zeros(shape, jnp.float32)
  y = jnp.arange(128, dtype=jnp.float32).reshape(8, 16)
  f = pl.pallas_call(_zero_size_kernel,
                     (jax.ShapeDtypeStruct((8, 16), jnp.float32),
                      jax.ShapeDtypeStruct(shape, jnp.float32)),
                     backend=backend)
  for g in (f, jax.jit(f)):
    o, e = g(x, y)
    np.testing.assert_array_equal(o, y * 2)
    assert e.shape == shape


def test_zero_size_operand_on_mosaic_is_a_clear_error():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1    # zero-size-line
  with pytest.raises(KernelError) as e:
    pl.pallas_call(kernel, jax.ShapeDtypeStruct((0, 128), jnp.float32),
                   backend="mosaic_interpret")(jnp.zeros((0, 128)))
  msg = str(e.value)
  assert "kernel 'kernel'" in msg and "zero-size" in msg
  assert "test_reliability_interpret.py" in msg


# ------------------------------------------------- block indices from data

def _blocks_from_data(backend, idx, x, in_map=lambda i, idx: (idx[i], 0)):
  def kernel(idx_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((32, 128), jnp.float32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(4,),
          in_specs=[pl.BlockSpec((8, 128), in_map)],
          out_specs=pl.BlockSpec((8, 128),
                                 lambda i, idx: (3 - idx[i], 0))),   # the-map
      backend=backend)(idx, x)


def _map_line():
  lines = open(__file__).read().splitlines()
  n = next(k for k, t in enumerate(lines, 1) if "# the-map" in t
           and "_map_line" not in t)
  return f"{__file__}:{n}"


@pytest.mark.parametrize("jit", [False, True])
def test_block_indices_from_data_never_leave_the_buffer(jit):
  """Out-of-range block indices read from scalar prefetch: reads see
  poison and writes are dropped, as on mosaic_interpret (the interpret
  backend clamped them before: it read the wrong block and overwrote
  another one)."""
  x = jnp.arange(32 * 128, dtype=jnp.float32).reshape(32, 128)
  idx = jnp.array([0, 8, 2, -3], jnp.int32)
  f = lambda i, x: _blocks_from_data("interpret", i, x)
  got = np.asarray((jax.jit(f) if jit else f)(idx, x))
  np.testing.assert_array_equal(got[24:], x[:8] + 1)
  np.testing.assert_array_equal(got[8:16], x[16:24] + 1)
  # written by no step: the poison uninitialized output memory stands for,
  # on every host backend
  assert np.isnan(got[:8]).all() and np.isnan(got[16:24]).all()
  mosaic = np.asarray(_blocks_from_data("mosaic_interpret", idx, x))
  np.testing.assert_array_equal(mosaic, got)


@pytest.mark.parametrize("backend", ["interpret", "mosaic_interpret"])
@pytest.mark.parametrize("jit", [False, True])
def test_block_index_from_data_outside_the_array_is_a_runtime_error(backend,
                                                                     jit):
  x = jnp.ones((32, 128), jnp.float32)
  f = lambda i, x: _blocks_from_data(backend, i, x, lambda i, idx: (i, 0))
  g = jax.jit(f) if jit else f
  with pl.config.enable_runtime_assert_option(True):
    np.testing.assert_array_equal(g(jnp.array([0, 1, 2, 3], jnp.int32), x),
                                  x + 1)
    with pytest.raises(Exception) as e:
      jax.block_until_ready(g(jnp.array([0, 1, 2, 9], jnp.int32), x))
  err = kernel_error_of(e.value)
  assert isinstance(err, KernelError), e.value
  text = str(err).splitlines()[0]
  assert text.startswith("kernel 'kernel': out_specs[0]: block index (-6, 0) "
                         "at grid point (3,) is outside the array")
  assert "not element offsets" in text and _map_line() in text


def test_element_offsets_from_data_outside_the_array():
  """Element dims with offsets from data: the part of the window past the
  (padded) array reads poison and its writes are dropped."""
  def kernel(idx_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2
  x = jnp.arange(1, 17, dtype=jnp.float32)
  idx = jnp.array([0, 14, -2, 100], jnp.int32)
  out = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((4, 4), jnp.float32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(4,),
          in_specs=[pl.BlockSpec((pl.Element(4),), lambda i, idx: (idx[i],))],
          out_specs=pl.BlockSpec((None, 4), lambda i, idx: (i, 0))),
      backend="interpret")(idx, x)
  got = np.asarray(out)
  np.testing.assert_array_equal(got[0], [2, 4, 6, 8])
  np.testing.assert_array_equal(got[1, :2], [30, 32])
  assert np.isnan(got[1, 2:]).all() and np.isnan(got[3]).all()
  assert np.isnan(got[2, :2]).all()
  np.testing.assert_array_equal(got[2, 2:], [2, 4])


# ------------------------------------------------- DMA across grid steps

def _double_buffered(api, tpu, n, rows):
  """Step i waits for the copy of rows block i, which step i - 1 started
  (step 0 starts its own), and starts block i + 1 into the other slot."""
  def kernel(x_hbm, o_ref, buf, sem):
    i = api.program_id(0)

    def copy(block, slot):
      return tpu.make_async_copy(x_hbm.at[api.ds(block * rows, rows)],
                                 buf.at[slot], sem.at[slot])

    @api.when(i == 0)
    def _():
      copy(0, 0).start()

    @api.when(i + 1 < n)
    def _():
      copy(i + 1, (i + 1) % 2).start()

    copy(i, i % 2).wait()
    o_ref[...] = buf[i % 2] * 2.0 + i.astype(jnp.float32)

  return dict(
      grid=(n,), in_specs=[api.BlockSpec(memory_space=api.ANY)],
      out_specs=api.BlockSpec((rows, 128), lambda i: (i, 0)),
      scratch_shapes=[tpu.VMEM((2, rows, 128), jnp.float32),
                      tpu.SemaphoreType.DMA((2,))],
      compiler_params=tpu.CompilerParams(
          dimension_semantics=("arbitrary",))), kernel


@pytest.mark.parametrize("backend", ("interpret", "mosaic_interpret", "pallas"))
def test_dma_started_at_the_previous_step_lands_in_carried_scratch(backend):
  """Double buffering: the copy a step starts for the next step is waited
  for, and read from scratch, by that next step (it was lost on interpret:
  the scratch did not carry across steps)."""
  n, rows = 4, 8
  x = jnp.arange(n * rows * 128, dtype=jnp.float32).reshape(n * rows, 128)
  api, tpu = (jpl, jpltpu) if backend == "pallas" else (pl, pltpu)
  kw, kernel = _double_buffered(api, tpu, n, rows)
  out = jax.ShapeDtypeStruct(x.shape, x.dtype)
  if backend == "pallas":
    got = jpl.pallas_call(kernel, out, interpret=True, **kw)(x)
  else:
    got = pl.pallas_call(kernel, out, backend=backend, **kw)(x)
  step = jnp.repeat(jnp.arange(n, dtype=jnp.float32), rows)[:, None]
  np.testing.assert_array_equal(got, x * 2.0 + step)
