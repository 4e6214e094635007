"""Accumulators in registers on backend "mosaic_gpu" (lowering_mosaic/gpu/
accumulators.py): refs that keep their value across the sequential steps
(a matmul's output block, attention's running statistics and output) are
carried by the loop over steps (`scf.for` iter_args) instead of being read
from and written to shared memory at every step, and `acc + dot(a, b)`
becomes one wgmma accumulating into `acc`; a `pl.when` that initializes
them on the first step becomes the loop's initial values. Checked on the modules the
lowering builds, and numerically: the rewritten body, run on the CPU step
by step with its carry as the emitted loop runs it, gives what the
kernel's jnp reference, Pallas's interpreter and our interpret backend
give."""
import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dsl.core.jax_internals import core, state_discharge, state_types
from jax.experimental import pallas as jpl
from jax.experimental.pallas import tpu as jpltpu

import dsl as pl
from dsl import tpu as pltpu
from dsl.core.index_maps import evaluate_index_map
from dsl.core.normalize import normalize
from lowering_mosaic.gpu import accumulators as A
from lowering_mosaic.gpu.plan import make_gpu_plan
from dsl.core.inspection import kernel_specs
from benchmarks.mosaic_gpu_kernels import (_flash_kernel, _matmul_kernel,
                                          _ref_attention, flash_attention,
                                          matmul)
from tests.pallas import mosaic_twins
from tests.pallas.mosaic_gpu_testing import (
    BF, count_op, gpu_module, mlir_region, normal_arrays, warpgroup_roles)

# The sample kernels run by Pallas (jax.experimental.pallas), the peer.
TWIN = mosaic_twins.twin("benchmarks.mosaic_gpu_kernels")


def _spec_and_plan(f, *args):
  (spec, _), = kernel_specs(jax.make_jaxpr(f)(*args).jaxpr)
  spec = normalize(spec, values_in_memory=True)
  return spec, make_gpu_plan(spec)


def _loop(region: str) -> str:
  """The loop over sequential steps in a warpgroup's region."""
  return mlir_region(region, region.index("scf.for"))


# ------------------------------------------------------------ the CPU run

def initial_carry(body, rank):
  """The carried values before the first step, as the emitter makes them:
  the hoisted initialization's (initial_values.py), zeros for the rest."""
  carry = [np.zeros(body.jaxpr.jaxpr.invars[rank + p].aval.shape,
                    body.jaxpr.jaxpr.invars[rank + p].aval.dtype)
           for p in body.carried]
  if body.initial is not None:
    values = core.eval_jaxpr(body.initial.jaxpr, body.initial.consts)
    for k, v in zip(body.initialized, values):
      carry[k] = np.asarray(v)
  return carry


def steps_on_cpu(spec, plan, *arrays):
  """What the emitted loop computes, on the CPU: at each point of the
  parallel grid dims, `plan.body` at every sequential step, the carried
  values threaded from step to step (from `initial_carry`), the other refs' blocks
  as arrays (inputs sliced by their index maps); output blocks stored
  where the lowering stores them: the moving ones after every step, the
  others after the loop (a carried one: its final carried value)."""
  gm = spec.grid_mapping
  grid = tuple(int(g) for g in gm.grid)
  body = plan.body
  pure = state_discharge.discharge_state(body.jaxpr, should_discharge=True)
  rank = len(grid)
  n_in = gm.num_inputs
  outs = [np.zeros(b.mapping.array_aval.shape, b.mapping.array_aval.dtype)
          for b in plan.blocks[n_in:]]
  idx = [evaluate_index_map(b.mapping, grid) for b in plan.blocks]

  def window(k, ids):
    b = plan.blocks[k]
    start = idx[k][tuple(ids)] * np.asarray(b.mapping.block_sizes)
    return tuple(slice(s, s + n) for s, n in zip(start,
                                                 b.mapping.block_sizes))

  seq_sizes = [grid[d] for d in plan.sequential]
  for par in np.ndindex(*[grid[d] for d in plan.parallel]):
    refs = [None] * len(plan.blocks) + [np.zeros(s, d)
                                         for s, d in plan.scratch]
    for k, b in enumerate(plan.blocks[n_in:], n_in):
      refs[k] = np.zeros(b.kernel_shape, b.dtype)
    carry = initial_carry(body, rank)
    ids = [0] * rank
    for d, v in zip(plan.parallel, par):
      ids[d] = v
    for seq in np.ndindex(*seq_sizes):
      for d, v in zip(plan.sequential, seq):
        ids[d] = v
      for k, b in enumerate(plan.blocks[:n_in]):
        refs[k] = arrays[k][window(k, ids)].reshape(b.kernel_shape)
      args = list(refs)
      for p, v in zip(body.carried, carry):
        args[p] = v
      res = core.eval_jaxpr(pure.jaxpr, pure.consts,
                            *[np.int32(i) for i in ids], *args)
      carry = list(res[:len(body.carried)])
      ref_vals = iter(res[len(body.carried):])
      for i, a in enumerate(args):
        if i not in body.carried:
          refs[i] = np.asarray(next(ref_vals))
      for k, b in enumerate(plan.blocks[n_in:], n_in):
        if b.moves:
          outs[k - n_in][window(k, ids)] = refs[k].reshape(
              b.mapping.block_sizes)
    for k, b in enumerate(plan.blocks[n_in:], n_in):
      if not b.moves:
        value = (carry[body.carried.index(k)] if k in body.carried
                 else refs[k])
        outs[k - n_in][window(k, ids)] = np.asarray(value).reshape(
            b.mapping.block_sizes)
  return outs


# ------------------------------------------------------------ matmul

def _pallas_matmul(x, y, bm, bn, bk):
  m, k = x.shape
  n = y.shape[1]
  return jpl.pallas_call(
      TWIN._matmul_kernel, jax.ShapeDtypeStruct((m, n), jnp.float32),
      grid=(m // bm, n // bn, k // bk),
      in_specs=[jpl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                jpl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
      out_specs=jpl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
      interpret=True)(x, y)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape,blocks", [
    ((256, 128, 256), (128, 128, 64)),
    ((128, 256, 128), (64, 128, 32)),
])
def test_carried_matmul_body_computes_the_product(shape, blocks, dtype):
  m, k, n = shape
  x, y = normal_arrays(0, (m, k), (k, n), dtype=dtype)
  f = functools.partial(matmul, bm=blocks[0], bn=blocks[1], bk=blocks[2])
  spec, plan = _spec_and_plan(f, x, y)
  assert plan.carried == (2,)            # the output block
  (got,) = steps_on_cpu(spec, plan, x, y)
  want = jnp.dot(x, y, preferred_element_type=jnp.float32)
  np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(got, _pallas_matmul(x, y, *blocks),
                             rtol=1e-2, atol=1e-2)
  ours = pl.pallas_call(
      _matmul_kernel, jax.ShapeDtypeStruct((m, n), jnp.float32),
      grid=(m // blocks[0], n // blocks[1], k // blocks[2]),
      in_specs=[pl.BlockSpec(blocks[::2], lambda i, j, kk: (i, kk)),
                pl.BlockSpec(blocks[2:0:-1], lambda i, j, kk: (kk, j))],
      out_specs=pl.BlockSpec(blocks[:2], lambda i, j, kk: (i, j)),
      backend="interpret")(x, y)
  np.testing.assert_allclose(got, ours, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("params", [{}, dict(warp_specialize=False),
                                    dict(pipeline_depth=1, num_consumers=1)])
def test_matmul_loop_carries_the_accumulator(params):
  """The consumer's loop carries the f32 output tile; the wgmma
  accumulates into it; nothing of it goes through shared memory inside
  the loop; it is stored once, after the loop, then copied out."""
  m = gpu_module(functools.partial(matmul, **params), BF(512, 256),
                 BF(256, 256))
  text = m.dialect_text
  region = (warpgroup_roles(text)[0] if m.plan.schedule.warp_specialized
            else text)
  loop = _loop(region)
  header = loop.splitlines()[0]
  assert re.search(r"iter_args\(%\w+ = %\w+\) -> \(vector<128x128xf32>\)",
                   header), header
  assert count_op(loop, "mosaic_gpu.vector_store") == 0
  assert "-> vector<128x128xf32>\n" not in "".join(
      l + "\n" for l in loop.splitlines() if "vector_load" in l)
  acc = re.search(r"mosaic_gpu.wgmma accumulator\((%\w+) :", loop).group(1)
  # The accumulator is the carried value itself: the kernel's k == 0
  # zeroing is the loop's initial value, no switch at every step.
  assert re.search(r"iter_args\(" + re.escape(acc) + " = ", header), acc
  assert "scf.index_switch" not in loop.split("mosaic_gpu.wgmma")[0]
  yielded = re.findall(r"scf.yield (%[\w#]+) : vector<128x128xf32>\n",
                       loop)[-1]
  assert re.search(re.escape(yielded) + r" = mosaic_gpu.wgmma", loop)
  after = region[region.index(loop) + len(loop):]
  assert after.index("mosaic_gpu.vector_store") < after.index(
      "mosaic_gpu.async_store")


# ------------------------------------------------------------ attention

def _flash_inputs(seed, sq=256, sk=256, d=128):
  return normal_arrays(seed, (sq, d), (sk, d), (sk, d))


def test_flash_attention_carries_its_statistics_and_output():
  q, k, v = _flash_inputs(1, 512, 1024)
  m = gpu_module(flash_attention, q, k, v)
  plan = m.plan
  # m, l and acc scratch are carried; none has a shared-memory buffer.
  assert plan.carried == (4, 5, 6)
  assert plan.smem_scratch() == []
  consumer, _ = warpgroup_roles(m.dialect_text)
  loop = _loop(consumer)
  assert re.search(r"-> \(vector<64xf32>, vector<64xf32>, "
                   r"vector<64x128xf32>\)", loop.splitlines()[0])
  # The only store in the loop is the output block's, at the last step.
  assert count_op(loop, "mosaic_gpu.vector_store") == 1
  loads = [l for l in loop.splitlines() if "vector_load" in l]
  assert loads and all("xf32" not in l for l in loads)
  # p @ v accumulates into the rescaled accumulator, fenced (registers
  # the multiply wrote): an optimization barrier, then `wgmma.fence`.
  accs = re.findall(r"mosaic_gpu.wgmma accumulator\((%\w+) :", loop)
  assert len(accs) == 2
  fenced = re.search(re.escape(accs[1])
                     + r' = "mosaic_gpu.optimization_barrier"\((%\w+)\)', loop)
  assert fenced, accs[1]
  assert re.search(re.escape(fenced.group(1)) + r" = arith.mulf", loop)
  assert "wgmma.fence" in loop[fenced.end():loop.index(
      f"accumulator({accs[1]}")]


def _flash_call(api, vmem, kernel, q, k, v, **kw):
  """The sample flash kernel through `api` (dsl or Pallas). A new function
  each call: Pallas reuses a kernel's trace across grids of the same block
  shapes (its `num_programs` then is the first grid's)."""
  spec = lambda f: api.BlockSpec((64, 128), f)
  return api.pallas_call(
      lambda *refs: kernel(*refs), jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(q.shape[0] // 64, k.shape[0] // 64),
      in_specs=[spec(lambda i, j: (i, 0)), spec(lambda i, j: (j, 0)),
                spec(lambda i, j: (j, 0))],
      out_specs=spec(lambda i, j: (i, 0)),
      scratch_shapes=[vmem((64,), jnp.float32), vmem((64,), jnp.float32),
                      vmem((64, 128), jnp.float32)], **kw)(q, k, v)


@pytest.mark.parametrize("sq,sk", [(256, 256), (128, 512)])
def test_carried_flash_body_computes_attention(sq, sk):
  q, k, v = _flash_inputs(2, sq, sk)
  spec, plan = _spec_and_plan(flash_attention, q, k, v)
  assert plan.carried == (4, 5, 6)
  (got,) = steps_on_cpu(spec, plan, q, k, v)
  got = np.asarray(got, np.float32)
  want = _ref_attention(q, k, v, 0.125)
  np.testing.assert_allclose(got, np.asarray(want, np.float32), atol=3e-2)
  pallas = _flash_call(jpl, jpltpu.VMEM, TWIN._flash_kernel, q, k, v,
                       interpret=True)
  np.testing.assert_allclose(got, np.asarray(pallas, np.float32), atol=2e-2)
  ours = _flash_call(pl, pltpu.VMEM, _flash_kernel, q, k, v,
                     backend="interpret")
  np.testing.assert_allclose(got, np.asarray(ours, np.float32), atol=2e-2)


# ------------------------------------------------------------ what stays

def _acc_call(kernel, steps=4, scratch=(), out_block=(64, 128)):
  def f(x, y):
    return pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((64, 128), jnp.float32),
        grid=(steps,),
        in_specs=[pl.BlockSpec((64, 64), lambda s: (0, s)),
                  pl.BlockSpec((64, 128), lambda s: (s, 0))],
        out_specs=pl.BlockSpec(out_block, lambda s: (0, 0)),
        scratch_shapes=list(scratch), backend="mosaic_gpu")(x, y)
  return f, BF(64, 64 * steps), BF(64 * steps, 128)


def _mm(x_ref, y_ref):
  return jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)


def _windowed(x_ref, y_ref, o_ref):
  @pl.when(pl.program_id(0) == 0)
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)
  o_ref[:, :64] += x_ref[...].astype(jnp.float32)
  o_ref[:, 64:] += x_ref[...].astype(jnp.float32) * 2.0


def _in_a_loop(x_ref, y_ref, o_ref, acc_ref):
  @pl.when(pl.program_id(0) == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  def add(i, c):
    acc_ref[...] += x_ref[...].astype(jnp.float32)
    return c
  jax.lax.fori_loop(0, 2, add, 0)
  o_ref[:, :64] = acc_ref[...]
  o_ref[:, 64:] = acc_ref[...]


def _write_only(x_ref, y_ref, o_ref):
  o_ref[...] = _mm(x_ref, y_ref)       # the last step's product stays


@pytest.mark.parametrize("kernel,scratch,carried", [
    (_windowed, (), ()),                 # windows of the ref: shared memory
    (_in_a_loop, (pltpu.VMEM((64, 64), jnp.float32),), ()),   # a loop's ref
    (_write_only, (), ()),               # never read: stored in place
])
def test_refs_not_read_whole_stay_in_shared_memory(kernel, scratch, carried):
  f, x, y = _acc_call(kernel, scratch=scratch)
  spec, plan = _spec_and_plan(f, x, y)
  assert plan.carried == carried
  assert isinstance(plan.body.jaxpr.jaxpr.invars[-1].aval,
                    state_types.AbstractRef)
  gpu_module(f, x, y)                     # and the kernel still builds


def test_one_step_kernels_carry_nothing():
  f, x, y = _acc_call(lambda x_ref, y_ref, o_ref: o_ref.__setitem__(
      ..., o_ref[...] * 0.0 + _mm(x_ref, y_ref)), steps=1)
  assert _spec_and_plan(f, x, y)[1].carried == ()


def _prims(jaxpr):
  return [e.primitive for e in jaxpr.eqns]


def test_a_dot_never_moves_past_a_write():
  """x + dot(a, b) fuses unless a write sits between the dot and the add
  (the wgmma reads its operands from shared memory when it runs)."""
  def fused(x_ref, y_ref, o_ref):
    p = _mm(x_ref, y_ref)
    o_ref[...] = o_ref[...] + p

  def kept(x_ref, y_ref, o_ref):
    p = _mm(x_ref, y_ref)
    x_ref[...] = jnp.zeros_like(x_ref)  # overwrites the dot's operand
    o_ref[...] = o_ref[...] + p

  for kernel, want in ((fused, True), (kept, False)):
    f, x, y = _acc_call(kernel, steps=1)
    spec, plan = _spec_and_plan(f, x, y)
    prims = _prims(plan.body.jaxpr.jaxpr)
    assert (A.dot_accumulate_p in prims) == want
    assert (jax.lax.dot_general_p in prims) != want


@pytest.mark.parametrize("causal", [False, True])
def test_library_attention_kernels_carry_their_accumulators(causal):
  """The library's flash attention forward and backward kernels on
  mosaic_gpu carry their scratch accumulators (m, l, acc; dK, dV; dQ)."""
  fa = importlib.import_module("kernels.flash_attention")
  q = BF(1, 256, 2, 128)
  specs = [s for s, _ in kernel_specs(jax.make_jaxpr(jax.grad(
      lambda q, k, v: jnp.sum(fa.flash_attention(
          q, k, v, causal=causal, backend="mosaic_gpu").astype(
              jnp.float32)), (0, 1, 2)))(q, q, q).jaxpr)]
  carried = {}
  for spec in specs:
    plan = make_gpu_plan(normalize(spec, values_in_memory=True))
    carried[spec.name] = plan.carried
    n = len(plan.prefetch) + len(plan.blocks)
    # every scratch accumulator is carried: none in shared memory
    assert plan.smem_scratch() == [], spec.name
    assert all(p >= n for p in plan.carried), spec.name
  assert len(carried["flash_attention_fwd"]) == 3
  assert len(carried["flash_attention_bwd_dkdv"]) == 2
  assert len(carried["flash_attention_bwd_dq"]) == 1


# ------------------------------------------------------------ initial values
# (initial_values.py) A `pl.when` that initializes the carried refs on the
# first sequential step, and only then, leaves the loop and becomes its
# initial carry; anything else stays in the body. The accumulators only
# WGMMAs write in the loop are fenced once, before it; other WGMMA
# accumulators where they are used (PTX's `wgmma.fence`).

M, K, N = 256, 256, 128
BM, BK, BN = 128, 64, 128
SPLIT = 2            # "two_dims": K's steps as SPLIT x (K // BK // SPLIT)


# name -> (grid rank, when(api) -> the predicate, init(row block, o_ref)
#          -> the value it writes, whether it is hoisted)
CASES = {
    "zeros_first": (3, lambda api: api.program_id(2) == 0,
                    lambda row, o: jnp.zeros_like(o), True),
    "ones_first": (3, lambda api: api.program_id(2) == 0,
                   lambda row, o: jnp.ones_like(o), True),
    "both_dims_first": (4, lambda api: (api.program_id(2) == 0)
                        & (api.program_id(3) == 0),
                        lambda row, o: jnp.full_like(o, 2.0), True),
    # Not the first step only: each stays in the loop.
    "second_step": (3, lambda api: api.program_id(2) == 1,
                    lambda row, o: jnp.zeros_like(o), False),
    "inner_dim_only": (4, lambda api: api.program_id(3) == 0,
                       lambda row, o: jnp.zeros_like(o), False),
    "parallel_dim": (3, lambda api: api.program_id(0) == 0,
                     lambda row, o: jnp.ones_like(o), False),
    # A value of the grid point (not constants alone): stays.
    "by_row_block": (3, lambda api: api.program_id(2) == 0,
                     lambda row, o: jnp.full_like(o, row), False),
}


def _call(api, name, x, y, **kw):
  rank, when, init, _ = CASES[name]
  nk = K // BK

  def kernel(x_ref, y_ref, o_ref):
    row = api.program_id(0).astype(jnp.float32)   # the row block

    @api.when(when(api))
    def _():
      o_ref[...] = init(row, o_ref)
    o_ref[...] += jnp.dot(x_ref[...], y_ref[...],
                          preferred_element_type=jnp.float32)

  if rank == 3:
    grid = (M // BM, N // BN, nk)
    kk = lambda k: k
    specs = [pl.BlockSpec((BM, BK), lambda i, j, k: (i, k)),
             pl.BlockSpec((BK, BN), lambda i, j, k: (k, j)),
             pl.BlockSpec((BM, BN), lambda i, j, k: (i, j))]
  else:
    grid = (M // BM, N // BN, SPLIT, nk // SPLIT)
    kk = lambda a, b: a * (nk // SPLIT) + b
    specs = [pl.BlockSpec((BM, BK), lambda i, j, a, b: (i, kk(a, b))),
             pl.BlockSpec((BK, BN), lambda i, j, a, b: (kk(a, b), j)),
             pl.BlockSpec((BM, BN), lambda i, j, a, b: (i, j))]
  if api is jpl:
    specs = [jpl.BlockSpec(s.block_shape, s.index_map) for s in specs]
  return api.pallas_call(
      kernel, jax.ShapeDtypeStruct((M, N), jnp.float32), grid=grid,
      in_specs=specs[:2], out_specs=specs[2], **kw)(x, y)


def _ours(name):
  return lambda x, y: _call(pl, name, x, y, backend="mosaic_gpu")


@pytest.mark.parametrize("name", list(CASES))
def test_only_a_first_step_initialization_is_hoisted(name):
  x, y = normal_arrays(3, (M, K), (K, N))
  _, plan = _spec_and_plan(_ours(name), x, y)
  assert plan.carried == (2,)
  hoisted = CASES[name][3]
  assert plan.body.initialized == ((0,) if hoisted else ())
  conds = [e for e in plan.body.jaxpr.jaxpr.eqns
           if e.primitive.name == "cond"]
  # The initialization is the body's only `cond`: gone once hoisted.
  assert len(conds) == (0 if hoisted else 1)
  # Only WGMMAs write the accumulator in the loop once its initialization
  # has left it.
  assert plan.body.tensor_core == ((0,) if hoisted else ())
  (got,) = steps_on_cpu(*_spec_and_plan(_ours(name), x, y), x, y)
  np.testing.assert_allclose(got, _reference(name, x, y), rtol=1e-2,
                             atol=1e-2)
  if name in DEFINED_IN_PALLAS:
    want = _call(jpl, name, x, y, interpret=True)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)


# The kernels that write the output before reading it (Pallas's
# interpreter fills what the others read first with NaNs; the lowering
# starts the carried values at zero).
DEFINED_IN_PALLAS = ("zeros_first", "ones_first", "both_dims_first",
                     "by_row_block")


def _reference(name, x, y):
  """What each kernel computes, in jax.numpy (unwritten outputs read as
  zeros)."""
  nk = K // BK
  dot = lambda k0, k1: jnp.dot(x[:, k0 * BK:k1 * BK], y[k0 * BK:k1 * BK],
                               preferred_element_type=jnp.float32)
  full = dot(0, nk)
  rows = (jnp.arange(M) // BM)[:, None]
  return {
      "zeros_first": full,
      "ones_first": 1.0 + full,
      "both_dims_first": 2.0 + full,
      "second_step": dot(1, nk),
      "inner_dim_only": dot(nk - nk // SPLIT, nk),
      "parallel_dim": jnp.where(rows == 0, 1.0 + dot(nk - 1, nk), full),
      "by_row_block": rows.astype(jnp.float32) + full,
  }[name]


def _fences(text: str) -> int:
  return text.count("wgmma.fence")


@pytest.mark.parametrize("name", ["zeros_first", "second_step"])
def test_wgmma_accumulators_are_fenced_before_other_code_wrote_them(name):
  """A hoisted accumulator is fenced once, before the loop, and not in
  it; one the loop's branch chooses is fenced at every step, before its
  WGMMA."""
  x, y = normal_arrays(4, (M, K), (K, N))
  m = gpu_module(_ours(name), x, y)
  consumer, _ = warpgroup_roles(m.dialect_text)
  loop = _loop(consumer)
  before = consumer[:consumer.index(loop)]
  wgmma = loop.index("mosaic_gpu.wgmma")
  if CASES[name][3]:
    assert (_fences(before), _fences(loop)) == (1, 0)
    assert before.rindex("wgmma.fence") > before.rindex(
        '"mosaic_gpu.optimization_barrier"')
  else:
    assert (_fences(before), _fences(loop[:wgmma])) == (0, 1)
