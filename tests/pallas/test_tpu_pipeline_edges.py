"""`tpu.emit_pipeline` over operands in HBM that its blocks do not tile
(grid = cdiv): the last block along such a dim is a partial edge block, whose
DMAs copy only the in-bounds part. On every host backend against jnp, lowered
for a TPU (the module verifies), and checked by SPIN."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import dsl
from dsl import tpu as dtpu
from lowering_mosaic import interpreter_options
from lowering_mosaic.verification import promela
from lowering_mosaic.verify import verify
from tests.pallas import mosaic_golden as golden
from tests.pallas import tpu_pipeline_kernels as shared
from tests.pallas.tpu_pipeline_kernels import inputs
from tests.pallas.testing import CPU_BACKENDS, assert_close, matmul_kernel_for

BACKENDS = CPU_BACKENDS
f32, bf16 = jnp.float32, jnp.bfloat16
MATMUL_TOL = {f32: 1e-4}
ANY = dsl.BlockSpec(memory_space=dsl.ANY)


def _cdiv(a, b):
  return -(-a // b)


def _call(kernel, out_shape, n_in, backend, scratch_shapes=()):
  return dsl.pallas_call(kernel, out_shape, in_specs=[ANY] * n_in,
                         out_specs=ANY, scratch_shapes=scratch_shapes,
                         backend=backend)


def matmul(x, y, *, bm, bk, bn, backend, **pipeline_kw):
  """x @ y with an accumulator block; the K edge is masked in the body (the
  part of an edge block past the array is unspecified)."""
  k = x.shape[1]

  def inner(x_ref, y_ref, o_ref):
    l = dsl.program_id(2)

    @dsl.when(l == 0)
    def _():
      o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
    a, b = x_ref[...], y_ref[...]
    if k % bk:
      col = l * bk + lax.broadcasted_iota(jnp.int32, a.shape, 1)
      row = l * bk + lax.broadcasted_iota(jnp.int32, b.shape, 0)
      a = jnp.where(col < k, a, jnp.zeros_like(a))
      b = jnp.where(row < k, b, jnp.zeros_like(b))
    o_ref[...] += jnp.dot(a, b, preferred_element_type=f32)

  def kernel(x_hbm, y_hbm, o_hbm):
    m, n = x_hbm.shape[0], y_hbm.shape[1]
    dtpu.emit_pipeline(
        inner, grid=(_cdiv(m, bm), _cdiv(n, bn), _cdiv(k, bk)),
        in_specs=[dsl.BlockSpec((bm, bk), lambda i, j, l: (i, l)),
                  dsl.BlockSpec((bk, bn), lambda i, j, l: (l, j))],
        out_specs=dsl.BlockSpec((bm, bn), lambda i, j, l: (i, j)),
        **pipeline_kw)(x_hbm, y_hbm, o_hbm)

  out = jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), f32)
  return _call(kernel, out, 2, backend)(x, y)


def elementwise(x, y, *, bm, bn, backend):
  """2 x + y, the blocks visited in reverse column order (the edge column
  first)."""
  def inner(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] * 2 + y_ref[...]

  def kernel(x_hbm, y_hbm, o_hbm):
    m, n = x_hbm.shape
    nj = _cdiv(n, bn)
    spec = dsl.BlockSpec((bm, bn), lambda i, j: (i, nj - 1 - j))
    dtpu.emit_pipeline(inner, grid=(_cdiv(m, bm), nj), in_specs=[spec, spec],
                       out_specs=[spec])(x_hbm, y_hbm, o_hbm)

  return _call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), 2,
               backend)(x, y)


MATMULS = {   # name -> (m, k, n), (bm, bk, bn), dtype
    "f32_edges_everywhere": ((200, 300, 136), (128, 128, 128), f32),
    "bf16_edges_everywhere": ((40, 200, 300), (16, 128, 128), bf16),
    "f32_k_edge_only": ((16, 200, 128), (8, 128, 128), f32),
    "f32_smaller_than_block": ((5, 100, 60), (8, 128, 128), f32),
}
ELEMENTWISE = {   # name -> shape, block, dtype
    "f32_200x300": ((200, 300), (128, 128), f32),
    "bf16_40x300": ((40, 300), (16, 128), bf16),
    "f32_rows_only": ((20, 256), (8, 128), f32),
}


_matmul_case = functools.partial(shared.matmul_case, table=MATMULS)
_elementwise_case = functools.partial(shared.elementwise_case,
                                      table=ELEMENTWISE)


@pytest.mark.parametrize("backend,case", [
    (b, c) for b in BACKENDS for c in sorted(MATMULS)
    # Triton's views of a block larger than its array are refused
    if not (b == "triton_interpret" and c == "f32_smaller_than_block")])
def test_matmul_with_accumulator(backend, case):
  x, y, blocks, want = _matmul_case(case)
  got = matmul(x, y, backend=backend, **blocks)
  assert_close(got, want, x.dtype, MATMUL_TOL)


@pytest.mark.parametrize("case", sorted(ELEMENTWISE))
@pytest.mark.parametrize("backend", BACKENDS)
def test_elementwise(backend, case):
  x, y, blocks, want = _elementwise_case(case)
  got = elementwise(x, y, backend=backend, **blocks)
  assert got.dtype == x.dtype
  assert_close(got, want, x.dtype)


@pytest.mark.parametrize("backend", ["interpret", "mosaic_interpret"])
def test_single_buffered(backend):
  x, y, blocks, want = _matmul_case("f32_edges_everywhere")
  got = matmul(x, y, backend=backend, no_pipelining=True, **blocks)
  assert_close(got, want, tol=MATMUL_TOL)


def test_correct_in_any_dma_order():
  x, y, blocks, want = _matmul_case("f32_edges_everywhere")
  for seed in range(2):
    for p in (0.05, 0.9):
      with interpreter_options(seed=seed, dma_completion_prob=p):
        got = matmul(x, y, backend="mosaic_interpret", **blocks)
      assert_close(got, want, tol=MATMUL_TOL)


@pytest.mark.parametrize("backend", ["interpret", "mosaic_interpret"])
def test_past_the_array_reads_poison(backend):
  """The slot's part past the array holds poison on the host backends (it
  is unspecified on a TPU), so an unmasked reduction over it shows."""
  def inner(x_ref, o_ref):
    o_ref[...] = x_ref[...]      # the whole slot, padding included

  def kernel(x_hbm, o_hbm):
    dtpu.emit_pipeline(
        inner, grid=(3,),
        in_specs=[dsl.BlockSpec((8, 128), lambda i: (i, 0))],
        out_specs=[dsl.BlockSpec((None, 8, 128), lambda i: (i, 0, 0))],
    )(x_hbm, o_hbm)

  x, = inputs([(20, 128)], f32)
  got = np.asarray(_call(kernel, jax.ShapeDtypeStruct((3, 8, 128), f32), 1,
                         backend)(x)).reshape(24, 128)
  np.testing.assert_array_equal(got[:20], np.asarray(x))
  assert np.isnan(got[20:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_squeezed_and_element_dims_with_edges(backend):
  """A squeezed leading dim and an `Element` dim stay as they are; the two
  minor dims have edges."""
  def inner(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1

  def kernel(x_hbm, o_hbm):
    _, _, m, n = x_hbm.shape
    spec = dsl.BlockSpec((None, dsl.Element(2), 8, 128),
                         lambda b, e, i, j: (b, 2 * e, i, j))
    dtpu.emit_pipeline(inner, grid=(2, 2, _cdiv(m, 8), _cdiv(n, 128)),
                       in_specs=[spec], out_specs=[spec])(x_hbm, o_hbm)

  x, = inputs([(2, 4, 20, 200)], f32)
  got = _call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), 1, backend)(x)
  assert_close(got, x + 1)


def _negate_1d(x, backend):
  def inner(x_ref, o_ref):
    o_ref[...] = -x_ref[...]

  def kernel(x_hbm, o_hbm):
    spec = dsl.BlockSpec((256,), lambda i: (i,))
    dtpu.emit_pipeline(inner, grid=(_cdiv(x_hbm.shape[0], 256),),
                       in_specs=[spec], out_specs=[spec])(x_hbm, o_hbm)

  return _call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), 1,
               backend)(x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_dim_int32(backend):
  x = jnp.arange(300, dtype=jnp.int32) * 7 - 1000
  np.testing.assert_array_equal(np.asarray(_negate_1d(x, backend)),
                                np.asarray(-x))


def test_one_dim_lowers_for_tpu():
  """The lane edge of 44 elements is copied as one 128-element tile."""
  x = jnp.arange(300, dtype=jnp.float32)
  call, = golden.lower_tpu(functools.partial(_negate_1d, backend="mosaic"),
                           x)
  assert _dma_windows(call.module) == {(256,), (128,)}


def _pallas(kind, x, y, bm, bn, bk=None):
  """The same pipeline in Pallas, on its TPU interpreter."""
  from jax.experimental import pallas as jpl
  from jax.experimental.pallas import tpu as jpltpu

  def twice_plus(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] * 2 + y_ref[...]
  inner = twice_plus if kind == "elementwise" else matmul_kernel_for(jpl)

  def kernel(x_hbm, y_hbm, o_hbm):
    (m, k), n = x_hbm.shape, y_hbm.shape[1]
    if kind == "elementwise":
      spec = jpl.BlockSpec((bm, bn), lambda i, j: (i, j))
      specs, grid = ([spec, spec], spec), (_cdiv(m, bm), _cdiv(k, bn))
    else:
      specs = ([jpl.BlockSpec((bm, bk), lambda i, j, l: (i, l)),
                jpl.BlockSpec((bk, bn), lambda i, j, l: (l, j))],
               jpl.BlockSpec((bm, bn), lambda i, j, l: (i, j)))
      grid = (_cdiv(m, bm), _cdiv(n, bn), _cdiv(k, bk))
    jpltpu.emit_pipeline(inner, grid=grid, in_specs=specs[0],
                         out_specs=specs[1])(x_hbm, y_hbm, o_hbm)

  any_spec = jpl.BlockSpec(memory_space=jpl.ANY)
  dtype = x.dtype if kind == "elementwise" else f32
  return jpl.pallas_call(
      kernel, jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), dtype),
      in_specs=[any_spec] * 2, out_specs=any_spec,
      interpret=jpltpu.InterpretParams(detect_races=True))(x, y)


@pytest.mark.parametrize("kind", ["elementwise", "matmul"])
def test_like_pallas_interpret(kind, monkeypatch):
  """Row edges (whose in-bounds part is whole tiles: Pallas's interpreter
  refuses the tile-rounded DMA of a lane edge past the array)."""
  from dsl.core.jax_internals import tpu_info
  monkeypatch.setitem(tpu_info.registry, "cpu", lambda: (
      tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1)))
  if kind == "elementwise":
    x, y = inputs([(200, 256), (200, 256)], f32)
    ours = elementwise(x, y, bm=128, bn=128, backend="mosaic_interpret")
    theirs = _pallas(kind, x, y, bm=128, bn=128)
  else:
    x, y = inputs([(200, 256), (256, 128)], f32)
    ours = matmul(x, y, bm=128, bk=128, bn=128, backend="mosaic_interpret")
    theirs = _pallas(kind, x, y, bm=128, bn=128, bk=128)
  assert_close(ours, theirs, f32, MATMUL_TOL)


def _ops(module: str) -> list[str]:
  return golden._OP.findall(module)


def _dma_windows(module: str) -> set[tuple[int, ...]]:
  """The shapes of the windows the module's DMAs copy."""
  found = re.findall(r"tpu\.enqueue_dma source\(%\w+ : memref<([\dx]+)x[a-z]",
                     module)
  return {tuple(int(n) for n in f.split("x")) for f in found}


@pytest.mark.parametrize("shape,windows", [
    ((200, 300), {(128, 128), (72, 128)}),
    ((201, 300), {(128, 128), (80, 128)}),
])
def test_lowers_for_tpu(shape, windows):
  """The module verifies (`golden.decode` checks); an edge block's DMAs
  copy its in-bounds part rounded up to whole (8, 128) tiles, as a TPU's
  DMAs need (an array in HBM is stored padded to tiles), and no poison is
  written."""
  x, y = inputs([shape, shape], f32)
  call, = golden.lower_tpu(functools.partial(
      elementwise, bm=128, bn=128, backend="mosaic"), x, y)
  assert _dma_windows(call.module) == windows
  assert _ops(call.module).count("scf.for") == 1
  assert "0x7FC00000" not in call.module


def test_matmul_lowers_for_tpu():
  x, y, blocks, _ = _matmul_case("bf16_edges_everywhere")
  call, = golden.lower_tpu(functools.partial(
      matmul, backend="mosaic", **blocks), x, y)
  assert _ops(call.module).count("tpu.enqueue_dma") > 5


@pytest.mark.skipif(not promela.spin_available()[0],
                    reason=str(promela.spin_available()[1]))
@pytest.mark.parametrize("kind", ["matmul", "elementwise"])
def test_spin_finds_no_race_or_deadlock(kind):
  """SPIN explores every order of the DMAs of the TPU module, whose edge
  blocks are started and waited for in branches."""
  if kind == "matmul":
    x, y = inputs([(12, 200), (200, 136)], f32)
    f = functools.partial(matmul, bm=8, bk=128, bn=128, backend="mosaic")
  else:
    x, y = inputs([(20, 300), (20, 300)], f32)
    f = functools.partial(elementwise, bm=8, bn=128, backend="mosaic")
  report = verify(f, x, y)
  assert report.kind == "ok", str(report)
