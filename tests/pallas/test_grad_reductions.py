"""Reverse mode of kernels that accumulate along a sequential grid dim
(dsl/transforms/reduction_transpose.py): a matmul's backward pass is two matmul
kernels with reductions of their own, not a per-point transpose whose
cotangents are summed outside the kernel."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl.transforms import reduction_transpose, simplify
from lowering_triton import aot
from tests.pallas.testing import CPU_BACKENDS, matmul_call

mm = importlib.import_module("kernels.matmul")


def _spec(f, *args):
  jaxpr = jax.make_jaxpr(f)(*args)
  return next(e for e in jaxpr.eqns
              if e.primitive.name == "pallas_call").params["spec"]


def _kernels(f, *args):
  """Names of the pallas_calls `f` makes."""
  jaxpr = jax.make_jaxpr(f)(*args)
  return [e.params["spec"].name for e in jaxpr.eqns
          if e.primitive.name == "pallas_call"]


def _data(*shapes, seed=0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]


def _decaying(x):
  """acc = acc / 2 + x block: the state is scaled, not only added to."""
  def kernel(x_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] = acc_ref[...] * 0.5 + x_ref[...]

    @pl.when(pl.program_id(1) == pl.num_programs(1) - 1)
    def _():
      o_ref[...] = acc_ref[...]
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((8, 128), x.dtype), grid=(1, 4),
      in_specs=[pl.BlockSpec((8, 128), lambda i, k: (i, k))],
      out_specs=pl.BlockSpec((8, 128), lambda i, k: (i, 0)),
      scratch_shapes=[pl.tpu.VMEM((8, 128), jnp.float32)],
      backend="interpret")(x)


def test_matmul_with_scratch_accumulator_is_a_reduction():
  x, y, b = _data((64, 64), (64, 64), (64,))
  red = reduction_transpose.find(_spec(lambda x, y: mm.matmul_2d(
      x, y, backend="interpret", blocks=(32, 32, 16)), x, y))
  assert red is not None and red.dim == 2
  # The output is overwritten by the epilogue; the scratch carries `c`,
  # which is the output's cotangent as it is.
  assert red.carried == (False, True) and red.identity == (None, 0)
  assert red.direct == ()
  assert red.const_dims == ((1,), (0,))
  with_bias = reduction_transpose.find(_spec(lambda x, y, b: mm.matmul_2d(
      x, y, b, backend="interpret", blocks=(32, 32, 16)), x, y, b))
  assert with_bias.direct == (2,)      # the bias: read by the epilogue only


def test_output_accumulator_is_a_reduction():
  x, y = _data((16, 256), (256, 256))
  red = reduction_transpose.find(_spec(
      matmul_call(pl, None, 16, 256, 256, (8, 128, 128),
                  backend="interpret"), x, y))
  assert red is not None and red.carried == (True,)
  assert red.identity == (0,)


def test_scaled_state_is_not_a_reduction_and_still_differentiates():
  (x,) = _data((8, 512))
  assert reduction_transpose.find(_spec(_decaying, x)) is None

  def want(x):
    acc = jnp.zeros((8, 128))
    for k in range(4):
      acc = acc * 0.5 + x[:, 128 * k:128 * (k + 1)]
    return acc
  (ct,) = _data((8, 128), seed=1)
  got = jax.vjp(_decaying, x)[1](ct)[0]
  np.testing.assert_allclose(got, jax.vjp(want, x)[1](ct)[0], rtol=1e-5,
                             atol=1e-5)


_SHAPES = {"interpret": [(64, 64, 64, (32, 32, 16)),
                         (40, 72, 48, (16, 16, 32))],
           "triton_interpret": [(64, 48, 32, (32, 16, 16))],
           "mosaic_interpret": [(16, 256, 384, (8, 128, 128)),
                                (16, 256, 512, (8, 256, 128))]}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("bias,act", [(False, None), (True, None),
                                      (True, "relu"), (False, "gelu")])
def test_matmul_grads_match_the_reference(backend, bias, act):
  for m, k, n, blocks in _SHAPES[backend]:
    x, y, b, ct = _data((m, k), (k, n), (n,), (m, n))
    b = b if bias else None
    argnums = (0, 1, 2) if bias else (0, 1)

    def loss(x, y, b):
      return jnp.sum(mm.matmul_2d(x, y, b, activation=act, backend=backend,
                                  blocks=blocks) * ct)
    got = jax.grad(loss, argnums)(x, y, b)
    want = jax.grad(lambda x, y, b: jnp.sum(
        mm.reference(x, y, bias=b, activation=act) * ct), argnums)(x, y, b)
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-3)
    names = _kernels(jax.grad(loss, argnums), x, y, b)
    if act is not None and k % blocks[2]:
      continue       # a partial K block: the per-point derivation
    # A recording pass only for a nonlinear epilogue, which also has its
    # own kernel, as the bias has.
    assert names == (["matmul"] + ["matmul_record"] * (act is not None)
                     + ["matmul_finalize"] * (bias or act is not None)
                     + ["matmul_transpose"] * 2), names


def test_accumulating_kernels_keep_outer_dims_parallel():
  x, y, ct = _data((64, 64), (64, 64), (64, 64))
  jaxpr = jax.make_jaxpr(jax.grad(lambda x, y: jnp.sum(mm.matmul_2d(
      x, y, backend="interpret", blocks=(32, 32, 16)) * ct), (0, 1)))(x, y)
  for e in jaxpr.eqns:
    spec = e.params.get("spec")
    if spec is not None and spec.name == "matmul_transpose":
      gm = spec.grid_mapping
      plan = gm.plan(spec.compiler_params, spec.jaxpr)
      assert plan.parallel == (0, 1) and plan.sequential == (2,)


def _transposed(f, *args):
  """{name: (grid, block shapes)} of the accumulating kernels of `f`'s
  gradient, in order."""
  jaxpr = jax.make_jaxpr(jax.grad(f, tuple(range(len(args)))))(*args)
  return [(e.params["spec"].grid_mapping.grid,
           [bm.block_shape for bm in e.params["spec"].grid_mapping.block_mappings])
          for e in jaxpr.eqns if e.primitive.name == "pallas_call"
          and e.params["spec"].name == "matmul_transpose"]


def test_accumulating_kernels_take_the_forward_tile_for_their_own_problem():
  """dx = c @ y.T and dy = x.T @ c in (bm, bn) blocks summed over bk-wide
  steps, as the forward's (bm, bn, bk) tile gives them, not in the blocks
  of x and y."""
  x, y, ct = _data((64, 128), (128, 64), (64, 64))
  got = _transposed(lambda x, y: jnp.sum(mm.matmul_2d(
      x, y, backend="interpret", blocks=(32, 32, 16)) * ct), x, y)
  # dx: operands y (K, N) and c (M, N), output (M, K); grid (M, K, N).
  # dy: operands x (M, K) and c (M, N), output (K, N); grid (K, N, M).
  assert got == [((2, 4, 4), [(32, 16), (32, 16), (32, 32)]),
                 ((4, 2, 4), [(16, 32), (16, 32), (32, 32)])], got


def test_accumulating_kernels_keep_the_forward_blocks_where_new_ones_would_not_fit():
  """No retiling where the new blocks would be less aligned than the
  forward's (a TPU's (8, 128) rule: dy's x block would be (128, 8))."""
  x, y, ct = _data((16, 256), (256, 512), (16, 512))
  got = _transposed(lambda x, y: jnp.sum(mm.matmul_2d(
      x, y, backend="interpret", blocks=(8, 256, 128)) * ct), x, y)
  # dx retiled: K whole (256 wide), N in 128-wide steps.
  assert got[0] == ((2, 1, 4), [(256, 128), (8, 128), (8, 256)]), got
  # dy as the forward's blocks: inputs x, y, then c; output y's blocks.
  assert got[1] == ((2, 2, 2), [(8, 128), (128, 256), (8, 256),
                                (128, 256)]), got


def _weighted_matmul(x, y, weight=lambda k: (k + 1).astype(jnp.float32)):
  """sum over K steps k of weight(k) * x_k @ y_k (by default (k + 1): each
  step reads its id)."""
  def kernel(x_ref, y_ref, o_ref):
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += jnp.dot(x_ref[...], y_ref[...]) * weight(k)
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((32, 64), jnp.float32), grid=(2, 2, 4),
      in_specs=[pl.BlockSpec((16, 16), lambda i, j, k: (i, k)),
                pl.BlockSpec((16, 32), lambda i, j, k: (k, j))],
      out_specs=pl.BlockSpec((16, 32), lambda i, j, k: (i, j)),
      backend="interpret", name="matmul")(x, y)


def test_a_step_that_reads_its_grid_ids_keeps_the_forward_blocks():
  x, y, ct = _data((32, 64), (64, 64), (32, 64))
  loss = lambda x, y: jnp.sum(_weighted_matmul(x, y) * ct)
  got = _transposed(loss, x, y)
  assert [blocks[-1] for _, blocks in got] == [(16, 16), (16, 32)], got

  def want(x, y):
    w = jnp.repeat(jnp.arange(1.0, 5.0), 16)
    return jnp.sum(((x * w) @ y) * ct)
  for g, w in zip(jax.grad(loss, (0, 1))(x, y),
                  jax.grad(want, (0, 1))(x, y)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-3)


def test_a_scaled_product_is_retiled():
  """`acc += (x @ y) * 0.5`: a scalar scales the step at any tile."""
  x, y, ct = _data((32, 64), (64, 64), (32, 64))
  f = lambda x, y: _weighted_matmul(x, y, weight=lambda k: 0.5)
  loss = lambda x, y: jnp.sum(f(x, y) * ct)
  got = _transposed(loss, x, y)
  # dx in (16, 32) blocks (the forward's out tile), dy in (16, 32) too.
  assert [blocks[-1] for _, blocks in got] == [(16, 32), (16, 32)], got
  for g, w in zip(jax.grad(loss, (0, 1))(x, y), jax.grad(
      lambda x, y: jnp.sum(0.5 * (x @ y) * ct), (0, 1))(x, y)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-3)


def test_a_transposed_product_is_the_product_of_swapped_operands():
  """`(c^T x)^T`, what JAX's transpose of a product gives for its rhs,
  is cleaned to `x^T c`: no transposition of the result in the kernel."""
  c, x = _data((32, 16), (32, 24))
  closed = jax.make_jaxpr(lambda c, x: jax.lax.dot_general(
      c, x, (((0,), (0,)), ((), ()))).T)(c, x)
  clean = simplify.simplify_closed(closed)
  assert [e.primitive.name for e in clean.jaxpr.eqns] == ["dot_general"]
  np.testing.assert_allclose(
      jax.core.eval_jaxpr(clean.jaxpr, clean.consts, c, x)[0], x.T @ c, rtol=1e-5, atol=1e-5)


def _hot_loops(side):
  _, fns, args = importlib.import_module("benchmarks.grad_vs_hand").gradients(
      "matmul", "triton", m=512, k=512, n=512)
  out = {}
  for kern in aot.compile_aot(fns[side], *args, target="sm_90"):
    st = kern.stats()
    out.setdefault(kern.name, []).append(
        (max(lp.mix.instructions for lp in st.hot_loops), st.registers,
         bool(st.spills)))
  return out


def test_derived_matmul_backward_on_sm90_stays_near_hand_written():
  """The derived dx and dy kernels against the hand-written backward's two
  matmuls: with tiles of their own (the forward's, the reduced and kept
  dims swapped: `dsl/transforms/retile.py`) their steps are the
  hand-written kernels' (64, 32) x (32, 64) dots, so no spills, and
  registers and hot loops within 1.25x."""
  hand, auto = _hot_loops("hand"), _hot_loops("auto")
  assert "matmul_record" not in auto and len(auto["matmul_transpose"]) == 2
  worst_hand = max(h for h, _, _ in hand["matmul"])
  regs_hand = max(r for _, r, _ in hand["matmul"])
  for instr, regs, spills in auto["matmul_transpose"]:
    assert not spills
    assert regs <= 1.25 * regs_hand, (regs, regs_hand)
    assert instr <= 1.25 * worst_hand, (instr, worst_hand)
