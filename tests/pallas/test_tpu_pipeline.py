"""`tpu.emit_pipeline` in the Pallas pattern: an outer `pallas_call` with
operands in HBM (`pl.ANY`) and an inner pipeline that streams their blocks
through VMEM, on every host backend, against jnp and Pallas's interpret mode;
and lowered for a TPU (the module verifies)."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dsl.core.jax_internals import DMA_WAIT_NAMES_COPY, tpu_info
from jax.experimental import pallas as jpl

import dsl
from dsl import tpu as dtpu
from lowering_mosaic import interpreter_options
from lowering_mosaic.verification import promela
from lowering_mosaic.verify import verify
from tests.pallas import mosaic_golden as golden
from tests.pallas.testing import CPU_BACKENDS, assert_close
from tests.pallas.tpu_pipeline_kernels import (ELEMENTWISE, MATMULS, TPU,
                                               any_call, elementwise,
                                               elementwise_case, inputs,
                                               matmul, matmul_case)

BACKENDS = CPU_BACKENDS
f32 = jnp.float32
# sums over k = 256 in another order than jnp.dot's
MATMUL_TOL = {f32: 1e-4}


@pytest.mark.parametrize("case", sorted(MATMULS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_matmul_with_accumulator(backend, case):
  x, y, blocks, want = matmul_case(case)
  got = matmul(dsl, x, y, backend=backend, **blocks)
  assert_close(got, want, x.dtype, MATMUL_TOL)


@pytest.mark.parametrize("case", sorted(ELEMENTWISE))
@pytest.mark.parametrize("backend", BACKENDS)
def test_elementwise(backend, case):
  x, y, blocks, want = elementwise_case(case)
  got = elementwise(dsl, x, y, backend=backend, **blocks)
  assert got.dtype == x.dtype
  assert_close(got, want, x.dtype)


@pytest.fixture
def pallas_tpu_interpret(monkeypatch):
  """Pallas's emit_pipeline asks for the TPU's generation: name one for the
  CPU device, so that its TPU interpret mode runs here."""
  monkeypatch.setitem(tpu_info.registry, "cpu", lambda: (
      tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1)))


@pytest.mark.parametrize("kind,case", [("matmul", "f32_2x2x2"),
                                       ("matmul", "bf16_2x3x1"),
                                       ("elementwise", "f32_3x2"),
                                       ("elementwise", "bf16_1x4")])
def test_like_pallas_interpret(kind, case, pallas_tpu_interpret):
  fn, make = ((matmul, matmul_case) if kind == "matmul"
              else (elementwise, elementwise_case))
  x, y, blocks, want = make(case)
  theirs = fn(jpl, x, y, **blocks)
  assert_close(theirs, want, x.dtype, MATMUL_TOL)
  ours = fn(dsl, x, y, backend="mosaic_interpret", **blocks)
  assert_close(ours, theirs, x.dtype, MATMUL_TOL)


@pytest.mark.parametrize("backend", ["interpret", "mosaic_interpret"])
def test_single_buffered(backend):
  x, y, blocks, want = matmul_case("f32_2x2x2")
  assert_close(matmul(dsl, x, y, backend=backend, no_pipelining=True,
                      **blocks), want, tol=MATMUL_TOL)


def test_correct_in_any_dma_order():
  x, y, blocks, want = matmul_case("f32_2x2x2")
  for seed in range(3):
    for p in (0.05, 0.9):
      with interpreter_options(seed=seed, dma_completion_prob=p):
        got = matmul(dsl, x, y, backend="mosaic_interpret", **blocks)
      assert_close(got, want, tol=MATMUL_TOL)


def _revisited(pl, x, backend=None):
  """The output block of row i is written at its first step only and kept
  over the next two: its buffer must stay the same while it is visited."""
  def inner(x_ref, o_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      o_ref[...] = x_ref[...] + 1

  def kernel(x_hbm, o_hbm):
    TPU[pl].emit_pipeline(
        inner, grid=(x_hbm.shape[0] // 8, 3),
        in_specs=[pl.BlockSpec((8, 128), lambda i, l: (i, l))],
        out_specs=[pl.BlockSpec((8, 128), lambda i, l: (i, 0))])(x_hbm, o_hbm)
  out = jax.ShapeDtypeStruct((x.shape[0], 128), x.dtype)
  return any_call(pl, kernel, out, 1, backend)(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_revisited_output_keeps_its_buffer(backend):
  x, = inputs([(24, 384)], f32)
  assert_close(_revisited(dsl, x, backend), x[:, :128] + 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_squeezed_dims_and_scratch(backend):
  """A squeezed leading block dim, and the pipeline's `scratches` passed to
  the body after the blocks (a running sum over the pipeline's steps)."""
  def inner(x_ref, o_ref, acc_ref):
    @dsl.when(dsl.program_id(0) == 0)
    def _():
      acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)
    acc_ref[...] += x_ref[...]
    o_ref[...] = acc_ref[...] * dsl.num_programs(0)

  def kernel(x_hbm, o_hbm, acc):
    dtpu.emit_pipeline(
        inner, grid=(4,),
        in_specs=[dsl.BlockSpec((None, 8, 128), lambda i: (i, 0, 0))],
        out_specs=[dsl.BlockSpec((None, 8, 128), lambda i: (3 - i, 0, 0))],
    )(x_hbm, o_hbm, scratches=[acc])

  x, = inputs([(4, 8, 128)], f32)
  got = any_call(dsl, kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), 1,
              backend, [dtpu.VMEM((8, 128), f32)])(x)
  assert_close(got, (jnp.cumsum(x, axis=0) * 4)[::-1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_operands_in_vmem_are_views(backend):
  """Blocked (VMEM) operands of the outer kernel reach the body as windows
  of themselves, next to an HBM operand streamed through VMEM."""
  def inner(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] - y_ref[...]

  def kernel(x_vmem, y_hbm, o_vmem):
    spec = dsl.BlockSpec((8, 128), lambda i: (i, 0))
    dtpu.emit_pipeline(inner, grid=(2,), in_specs=[spec, spec],
                       out_specs=spec)(x_vmem, y_hbm, o_vmem)

  x, y = inputs([(16, 128), (16, 128)], f32)
  whole = dsl.BlockSpec((16, 128), lambda: (0, 0))
  got = dsl.pallas_call(
      kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
      in_specs=[whole, dsl.BlockSpec(memory_space=dsl.ANY)],
      out_specs=whole, backend=backend)(x, y)
  assert_close(got, x - y)


def _ops(module: str) -> list[str]:
  return golden._OP.findall(module)


@pytest.mark.parametrize("kind", ["matmul", "elementwise"])
def test_lowers_for_tpu(kind):
  """The module verifies (`golden.decode` checks), copies every block with
  DMAs into VMEM and never loads from HBM."""
  if kind == "matmul":
    x, y, blocks, _ = matmul_case("f32_2x2x2")
    f = functools.partial(matmul, dsl, backend="mosaic", **blocks)
  else:
    x, y, blocks, _ = elementwise_case("bf16_1x4")
    f = functools.partial(elementwise, dsl, backend="mosaic", **blocks)
  call, = golden.lower_tpu(f, x, y)
  ops = _ops(call.module)
  # the prologue's fetches, and in the loop: per input a prefetch and a
  # wait, per output a write-back and two waits
  assert ops.count("tpu.enqueue_dma") == 2 + 2 + 1
  wait = "tpu.wait_dma" if DMA_WAIT_NAMES_COPY else "tpu.wait_dma2"
  assert ops.count(wait) == 2 + 2
  assert ops.count("tpu.sem_alloc") == 3 and ops.count("scf.for") == 1
  loads = re.findall(r"vector\.load %(\w+)", call.module)
  assert loads and all(name.startswith("alloca") for name in loads)


def test_triton_addresses_hbm_directly():
  """On Triton the operands stay views: no DMA in the kernel's jaxpr."""
  x, y, blocks, _ = elementwise_case("f32_3x2")
  jaxpr = str(jax.make_jaxpr(functools.partial(
      elementwise, dsl, backend="triton_interpret", **blocks))(x, y))
  assert "dma_start" not in jaxpr
  jaxpr = str(jax.make_jaxpr(functools.partial(
      elementwise, dsl, backend="mosaic_interpret", **blocks))(x, y))
  assert "dma_start" in jaxpr


@pytest.mark.skipif(not promela.spin_available()[0],
                    reason=str(promela.spin_available()[1]))
@pytest.mark.parametrize("kind", ["matmul", "single_buffered", "elementwise",
                                  "revisited"])
def test_spin_finds_no_race_or_deadlock(kind):
  """SPIN explores every order of the DMAs of the TPU module: the schedule
  waits for each block before the body reads it and for each write-back
  before its buffer is written again."""
  if kind in ("matmul", "single_buffered"):
    x, y, blocks, _ = matmul_case("f32_2x2x2")
    args = (x, y)
    f = functools.partial(matmul, dsl, backend="mosaic",
                          no_pipelining=kind == "single_buffered", **blocks)
  elif kind == "elementwise":
    x, y, blocks, _ = elementwise_case("f32_3x2")
    args = (x, y)
    f = functools.partial(elementwise, dsl, backend="mosaic", **blocks)
  else:
    args = tuple(inputs([(24, 384)], f32))
    f = functools.partial(_revisited, dsl, backend="mosaic")
  report = verify(f, *args)
  assert report.kind == "ok", str(report)


def _add_bias(pl, x, b, backend=None):
  """x + b: the bias block's index never changes, so it is fetched once."""
  def inner(x_ref, b_ref, o_ref):
    o_ref[...] = x_ref[...] + b_ref[...]

  def kernel(x_hbm, b_hbm, o_hbm):
    spec = pl.BlockSpec((8, 128), lambda i, j: (i, j))
    TPU[pl].emit_pipeline(
        inner, grid=(x_hbm.shape[0] // 8, 1),
        in_specs=[spec, pl.BlockSpec((8, 128), lambda i, j: (0, 0))],
        out_specs=spec)(x_hbm, b_hbm, o_hbm)
  return any_call(pl, kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), 2,
               backend)(x, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unchanging_block_is_fetched_once(backend):
  x, b = inputs([(32, 128), (8, 128)], f32)
  assert_close(_add_bias(dsl, x, b, backend), x + jnp.tile(b, (4, 1)))
  if backend == "mosaic_interpret":
    call, = golden.lower_tpu(functools.partial(_add_bias, dsl,
                                               backend="mosaic"), x, b)
    # the two fetches before the loop, x's prefetch, the write-back: no
    # DMA of the bias inside the loop
    assert _ops(call.module).count("tpu.enqueue_dma") == 4


def _traced_grid(x, n, backend):
  """A pipeline whose grid size is read from scalar prefetch."""
  def inner(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  def kernel(n_ref, x_hbm, o_hbm):
    spec = dsl.BlockSpec((8, 128), lambda i: (i, 0))
    dtpu.emit_pipeline(inner, grid=(n_ref[0],), in_specs=[spec],
                       out_specs=spec)(x_hbm, o_hbm)
  any_spec = dsl.BlockSpec(memory_space=dsl.ANY)
  return dsl.pallas_call(
      kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid_spec=dtpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, in_specs=[any_spec], out_specs=any_spec),
      backend=backend)(jnp.array([n], jnp.int32), x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_traced_grid_size(backend):
  x, = inputs([(32, 128)], f32)
  assert_close(_traced_grid(x, 3, backend)[:24], x[:24] * 2)
  jax.block_until_ready(_traced_grid(x, 0, backend))   # no DMA left behind


def test_views_differentiate_on_triton():
  """Where blocks are views (Triton), the kernel differentiates as any
  kernel on refs."""
  x, y = inputs([(24, 256), (24, 256)], f32)
  loss = lambda x, y: jnp.sum(elementwise(
      dsl, x, y, bm=8, bn=128, backend="triton_interpret") ** 2)
  gx, gy = jax.grad(loss, argnums=(0, 1))(x, y)
  assert_close(gx, 4 * (2 * x + y))
  assert_close(gy, 2 * (2 * x + y))


@pytest.mark.parametrize("backend", ["interpret", "mosaic_interpret"])
def test_uninitialized_accumulator_reads_poison(backend):
  """An output block is not copied in (as on a TPU): a body that forgets to
  initialize its accumulator reads poison with jax_pallas_poison_buffers."""
  from dsl.core.jax_internals import config as jax_config

  def inner(x_ref, o_ref):
    o_ref[...] += x_ref[...]        # no init at the first step

  def kernel(x_hbm, o_hbm):
    dtpu.emit_pipeline(
        inner, grid=(2,),
        in_specs=[dsl.BlockSpec((8, 128), lambda l: (0, l))],
        out_specs=[dsl.BlockSpec((8, 128), lambda l: (0, 0))])(x_hbm, o_hbm)

  x, = inputs([(8, 256)], f32)
  with jax_config.jax_pallas_poison_buffers(True):
    got = any_call(dsl, kernel, jax.ShapeDtypeStruct((8, 128), f32), 1,
                backend)(x)
  assert np.isnan(np.asarray(got)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_body_prologue_runs_before_each_body(backend):
  def kernel(x_hbm, o_hbm, s_ref):
    def prologue():      # in the pipeline's grid: program_id is its step
      s_ref[...] = jnp.full(s_ref.shape, dsl.program_id(0), jnp.float32)

    def inner(x_ref, o_ref, s):
      o_ref[...] = x_ref[...] + s[...]

    spec = dsl.BlockSpec((8, 128), lambda i: (i, 0))
    dtpu.emit_pipeline(inner, grid=(3,), in_specs=[spec], out_specs=spec)(
        x_hbm, o_hbm, scratches=[s_ref], body_prologue=prologue)

  x, = inputs([(24, 128)], f32)
  got = any_call(dsl, kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), 1,
              backend, [dtpu.VMEM((8, 128), f32)])(x)
  assert_close(got, x + jnp.repeat(jnp.arange(3.), 8)[:, None])
