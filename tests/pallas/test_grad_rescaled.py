"""Reverse mode of rescaled reductions (dsl/transforms/rescaled_reduction.py):
a kernel that keeps a running max and rescales its sums when it grows (an
online softmax) differentiates through a finalize kernel and one
accumulating kernel per input group, with the final max and sums recorded
by the forward kernel, not through a per-point transpose of every step."""
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as ppl
from jax.experimental.pallas import tpu as ppltpu
from jax.test_util import check_grads

import dsl as pl
from dsl.core.inspection import traced_kernel_calls
from dsl.transforms import rescaled_reduction, transposed_tiles
from tests.pallas.testing import CPU_BACKENDS

fa = importlib.import_module("kernels.flash_attention")


def online_softmax_call(pl, pltpu, rows, cols, blocks, *, extra=0.0,
                        rescale_sum=True, **kw):
  """`pallas_call` of a row-wise online softmax over column blocks: per
  row, `sum_j softmax(x)_j * y_j` and the log-sum-exp of `x`. `extra`
  added to the running sum at every step, or the sum not rescaled when
  the max grows (`rescale_sum=False`), make it no sum at the final max."""
  br, bc = blocks

  def kernel(x_ref, y_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
      m_sc[...] = jnp.full_like(m_sc, -1e30)
      l_sc[...] = jnp.zeros_like(l_sc)
      acc_sc[...] = jnp.zeros_like(acc_sc)
    x = x_ref[...]
    m = m_sc[...]
    m_new = jnp.maximum(m, jnp.max(x, axis=1))
    p = jnp.exp(x - m_new[:, None])
    alpha = jnp.exp(m - m_new)
    l = l_sc[...] * alpha if rescale_sum else l_sc[...]
    l_sc[...] = l + jnp.sum(p, axis=1) + extra
    acc_sc[...] = acc_sc[...] * alpha + jnp.sum(p * y_ref[...], axis=1)
    m_sc[...] = m_new

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
      o_ref[...] = (acc_sc[...] / l_sc[...])[:, None]
      lse_ref[...] = (m_sc[...] + jnp.log(l_sc[...]))[:, None]

  # (rows, 1) columns: a TPU block of rows is a multiple of 8 sublanes.
  row = jax.ShapeDtypeStruct((rows, 1), jnp.float32)
  return pl.pallas_call(
      kernel, (row, row), grid=(rows // br, cols // bc),
      in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j))] * 2,
      out_specs=(pl.BlockSpec((br, 1), lambda i, j: (i, 0)),) * 2,
      scratch_shapes=[pltpu.VMEM((br,), jnp.float32)] * 3, **kw)


def _online_reference(x, y):
  p = jax.nn.softmax(x, axis=1)
  return (jnp.sum(p * y, axis=1, keepdims=True),
          jax.nn.logsumexp(x, axis=1, keepdims=True))


def _data(*shapes, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


def _spec(f, *args):
  return next(iter(traced_kernel_calls(f, *args))).spec


def _kernel_names(f, *args):
  return [c.spec.name for c in traced_kernel_calls(f, *args)]


_ROWS, _COLS, _BLOCKS = 16, 512, (8, 128)


def _online(backend, **kw):
  return online_softmax_call(pl, pl.tpu, _ROWS, _COLS, _BLOCKS,
                             backend=backend, **kw)


def test_online_softmax_is_a_rescaled_reduction():
  x, y = _data((_ROWS, _COLS), (_ROWS, _COLS))
  resc = rescaled_reduction.find(_spec(_online("interpret"), x, y))
  assert resc is not None and resc.dim == 1
  # States: the outputs (o, lse), then scratch (m, l, acc).
  assert resc.max_state == 2 and resc.rescaled == (3, 4)
  # x and y move along both dims (no sum over a grid dim: each point
  # writes its own block), the recorded max stays put along the columns.
  assert resc.reduction.const_dims == ((), (), (1,))


def test_online_softmax_backward_is_finalize_and_accumulating_kernels():
  x, y, ct = _data((_ROWS, _COLS), (_ROWS, _COLS), (_ROWS, 1))
  f = _online("interpret")
  names = _kernel_names(jax.grad(lambda x, y: jnp.sum(f(x, y)[0] * ct),
                                 (0, 1)), x, y)
  # The forward kernel (recording its final max and sums), the finalize
  # kernel, and one accumulating kernel for x and y (same blocks): no
  # recording replay, no per-point transposition.
  assert names == ["kernel", "kernel_finalize", "kernel_at_max_transpose"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_online_softmax_grads_match_the_reference(backend):
  x, y, ct_o, ct_l = _data((_ROWS, _COLS), (_ROWS, _COLS), (_ROWS, 1),
                           (_ROWS, 1), seed=1)
  x = x * 3.0       # rows whose max moves from block to block
  f = _online(backend)
  pallas = online_softmax_call(ppl, ppltpu, _ROWS, _COLS, _BLOCKS,
                               interpret=True)
  for got, want, ref in zip(f(x, y), pallas(x, y), _online_reference(x, y)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)

  def loss(g):
    return lambda x, y: sum(jnp.sum(o * c) for o, c in zip(g(x, y),
                                                           (ct_o, ct_l)))
  got = jax.grad(loss(f), (0, 1))(x, y)
  want = jax.grad(loss(_online_reference), (0, 1))(x, y)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_online_softmax_passes_check_grads():
  x, y = _data((_ROWS, _COLS), (_ROWS, _COLS), seed=2)
  check_grads(_online("interpret"), (x, y), order=1, modes=("rev",),
              atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kw", [dict(extra=1.0), dict(rescale_sum=False)],
                         ids=["sum_plus_one", "sum_not_rescaled"])
def test_a_sum_that_does_not_scale_with_the_max_keeps_the_per_point_path(kw):
  """`l = l * alpha + sum(p) + 1` (the 1 is not rescaled) or `l = l +
  sum(p)` (l not rescaled where the max grows): the final sum is no plain
  sum at the final max; the derivation refuses the kernel and the
  per-point transposition still differentiates it."""
  x, y = _data((_ROWS, _COLS), (_ROWS, _COLS), seed=3)
  f = _online("interpret", **kw)
  assert rescaled_reduction.find(_spec(f, x, y)) is None
  names = _kernel_names(jax.grad(lambda x, y: jnp.sum(f(x, y)[0]), (0, 1)),
                        x, y)
  assert any(n.endswith("_record") for n in names)
  check_grads(f, (x, y), order=1, modes=("rev",), atol=2e-2, rtol=2e-2)


# ------------------------------------------------------- flash attention

def _attention(backend, causal, block):
  def f(q, k, v):
    return fa.forward(q, k, v, causal=causal, sm_scale=1 / math.sqrt(
        q.shape[-1]), backend=backend, block_q=block, block_k=block,
                      loops=False)[0]
  return f


def _attention_grads(f, q, k, v, ct):
  return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * ct),
                  (0, 1, 2))(q, k, v)


_slow = pytest.mark.slow
_ATTENTION = [
    # backend, (batch, seq, heads, kv heads, head dim), block, dtype
    ("interpret", (2, 64, 2, 2, 32), 16, jnp.float32),
    pytest.param("interpret", (1, 96, 3, 3, 16), 32, jnp.float32,
                 marks=_slow),
    pytest.param("interpret", (1, 64, 2, 2, 32), 16, jnp.bfloat16,
                 marks=_slow),
    ("triton_interpret", (1, 64, 2, 2, 32), 16, jnp.float32),
    pytest.param("mosaic_interpret", (1, 384, 1, 1, 128), 128, jnp.float32,
                 marks=_slow),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal",
                                                       "noncausal"])
@pytest.mark.parametrize("backend,shape,block,dtype", _ATTENTION)
def test_flash_attention_grads_take_the_rescaled_path(backend, shape, block,
                                                       dtype, causal):
  b, s, h, hkv, d = shape
  q, ct = _data((b, s, h, d), (b, s, h, d), dtype=dtype)
  k, v = _data((b, s, hkv, d), (b, s, hkv, d), seed=1, dtype=dtype)
  f = _attention(backend, causal, block)
  names = _kernel_names(lambda *a: _attention_grads(f, *a, ct), q, k, v)
  assert [n for n in names if n.endswith(("_finalize", "_at_max_transpose",
                                          "_record"))] == [
      "flash_attention_fwd_finalize", "flash_attention_fwd_at_max_transpose",
      "flash_attention_fwd_at_max_transpose"]
  ref = _reference(causal)
  got = _attention_grads(f, q, k, v, ct)
  want = _attention_grads(ref, q, k, v, ct)
  tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
  for a, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(a, np.float32),
                               np.asarray(w, np.float32), rtol=tol, atol=tol)


def _reference(causal):
  return lambda q, k, v: fa.reference(q, k, v, causal=causal)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1)])
def test_grouped_kv_heads_are_summed_in_the_dkdv_accumulator(heads, kv_heads):
  """A kv block serves several query heads: the dk/dv kernel walks the
  heads of a group and their q blocks along one dim (`grouped_grid`), as
  the hand-written kernel does, on a grid of kv heads (one kv head: the
  whole heads dim folded)."""
  q, ct = _data((1, 64, heads, 32), (1, 64, heads, 32))
  k, v = _data((1, 64, kv_heads, 32), (1, 64, kv_heads, 32), seed=1)
  f = _attention("interpret", True, 16)
  calls = traced_kernel_calls(lambda *a: _attention_grads(f, *a, ct), q, k, v)
  grids = {c.spec.name: c.spec.grid_mapping.grid for c in calls}
  assert "flash_attention_fwd_record" not in grids
  transposed = [c.spec for c in calls
                if c.spec.name == "flash_attention_fwd_at_max_transpose"]
  # dq: (batch, kv heads, group * q blocks, kv blocks); dk/dv: (batch, kv
  # heads, kv blocks, group * q blocks), its last dim its reduction, the
  # kv blocks parallel.
  g = heads // kv_heads
  dkdv = transposed[-1]
  assert dkdv.grid_mapping.grid == (1, kv_heads, 4, g * 4)
  seq = dkdv.grid_mapping.plan(dkdv.compiler_params, dkdv.jaxpr).sequential
  assert 2 not in seq and 3 in seq
  for a, w in zip(_attention_grads(f, q, k, v, ct),
                  _attention_grads(_reference(True), q, k, v, ct)):
    np.testing.assert_allclose(a, w, rtol=2e-5, atol=2e-5)


def test_linearize_applies_the_linear_kernel_that_takes_the_records():
  """`jax.linearize` runs the linear kernel forward: it takes the records
  as inputs it does not read, and gives the tangents `jax.jvp` gives."""
  x, y, tx, ty = _data(*[(_ROWS, _COLS)] * 4, seed=4)
  f = _online("interpret")
  out, f_jvp = jax.linearize(f, x, y)
  want_out, want_t = jax.jvp(f, (x, y), (tx, ty))
  for a, b in zip(out, want_out):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  for a, b in zip(f_jvp(tx, ty), want_t):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# ------------------------------------------------- tiles made transposed

def _tile_dots(a, b, c, row):
  """`p = exp(a b^T - row)`; `p^T c` (p's leading dim contracted) and
  `(c^T p)^T` (c's leading dim, the result transposed back)."""
  p = jnp.exp(jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())))
              - row[:, None])
  lead = jax.lax.dot_general(p, c, (((0,), (0,)), ((), ())))
  back = jax.lax.dot_general(c, p, (((0,), (0,)), ((), ()))).T
  return lead, back


def test_dots_contracting_a_tiles_leading_dim_take_it_computed_transposed():
  """`transposed_tiles`: the tile is computed from `b a^T` and the row
  broadcast along the other dim, so no dot contracts a leading dim and
  nothing is transposed; the values stay."""
  a, b, c = _data((16, 8), (32, 8), (16, 4), seed=5)
  (row,) = _data((16,), seed=6)
  closed = jax.make_jaxpr(_tile_dots)(a, b, c, row)
  new = transposed_tiles.transposed(closed)
  prims = [e.primitive.name for e in new.jaxpr.eqns]
  assert "transpose" not in prims
  for e in new.jaxpr.eqns:
    if e.primitive.name == "dot_general":
      (lc, _), _ = e.params["dimension_numbers"]
      assert tuple(lc) == (1,)
  got = jax.core.eval_jaxpr(new.jaxpr, new.consts, a, b, c, row)
  want = _tile_dots(a, b, c, row)
  for x, y in zip(got, want):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_a_leading_contraction_of_an_input_is_left_as_it_is():
  """A matmul's `dy = x^T c`: `x` is read, not computed from a dot, so
  making it transposed would move it in memory; the dot stays."""
  x, c = _data((16, 8), (16, 4), seed=7)
  closed = jax.make_jaxpr(lambda x, c: jax.lax.dot_general(
      x, c, (((0,), (0,)), ((), ()))))(x, c)
  assert transposed_tiles.transposed(closed) is closed
