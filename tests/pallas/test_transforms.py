"""pallas_call under jvp, linearize, grad/vjp, vmap, checkify and shardings."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.test_util import check_grads

import dsl as pl
from dsl import tpu as pltpu
from tests.pallas.testing import assert_close, matmul_call


# ------------------------------------------------------------ test kernels

def sin_mul_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = jnp.sin(x_ref[...]) * y_ref[...]


def sin_mul(x, y):
  return pl.pallas_call(
      sin_mul_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
      in_specs=[pl.BlockSpec((x.shape[0] // 2,), lambda i: (i,))] * 2,
      out_specs=pl.BlockSpec((x.shape[0] // 2,), lambda i: (i,)))(x, y)


def matmul(x, y, b=8):
  return matmul_call(pl, pltpu, x.shape[0], x.shape[1], y.shape[1],
                     (b, b, b))(x, y)


def lse_kernel(x_ref, o_ref, m_ref):
  """Online log-sum-exp over column blocks: state in scratch and output."""
  k = pl.program_id(1)

  @pl.when(k == 0)
  def _():
    m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
    o_ref[...] = jnp.zeros_like(o_ref)
  m_new = jnp.maximum(m_ref[...], x_ref[...].max(axis=1))
  o_ref[...] = (o_ref[...] * jnp.exp(m_ref[...] - m_new)
                + jnp.exp(x_ref[...] - m_new[:, None]).sum(1))
  m_ref[...] = m_new

  @pl.when(k == pl.num_programs(1) - 1)
  def _():
    o_ref[...] = jnp.log(o_ref[...]) + m_ref[...]


def lse(x, b=8):
  return pl.pallas_call(
      lse_kernel, jax.ShapeDtypeStruct((x.shape[0],), jnp.float32),
      grid=(x.shape[0] // b, x.shape[1] // b),
      in_specs=[pl.BlockSpec((b, b), lambda i, k: (i, k))],
      out_specs=pl.BlockSpec((b,), lambda i, k: (i,)),
      scratch_shapes=[pltpu.VMEM((b,), jnp.float32)])(x)


def loop_kernel(x_ref, s_ref, o_ref, n_ref):
  """fori_loop, cond, a reduction, two outputs, an int input and output."""
  def body(i, acc):
    v = x_ref[i]
    return acc + jax.lax.cond(v > 0, lambda: v * v, lambda: jnp.tanh(v))
  total = jax.lax.fori_loop(0, x_ref.shape[0], body, jnp.float32(0))
  o_ref[...] = x_ref[...] * total + s_ref[...].astype(jnp.float32)
  n_ref[...] = s_ref[...] + 1


def loop_call(x, s):
  return pl.pallas_call(
      loop_kernel, (jax.ShapeDtypeStruct(x.shape, jnp.float32),
                    jax.ShapeDtypeStruct(s.shape, jnp.int32)))(x, s)


def loop_ref(x, s):
  total = jnp.sum(jnp.where(x > 0, x * x, jnp.tanh(x)))
  return x * total + s.astype(jnp.float32), s + 1


X = jax.random.normal(jax.random.key(0), (16,))
Y = jax.random.normal(jax.random.key(1), (16,))
A = jax.random.normal(jax.random.key(2), (16, 24))
B = jax.random.normal(jax.random.key(3), (24, 32))


# ------------------------------------------------------------ jvp

def test_jvp_is_one_kernel_and_correct():
  tx, ty = jnp.ones(16), jnp.arange(16.)
  p, t = jax.jvp(sin_mul, (X, Y), (tx, ty))
  pr, tr = jax.jvp(lambda x, y: jnp.sin(x) * y, (X, Y), (tx, ty))
  assert_close(p, pr)
  assert_close(t, tr)
  jaxpr = jax.make_jaxpr(lambda x, y: jax.jvp(sin_mul, (x, y), (x, y)))(X, Y)
  assert [e.primitive.name for e in jaxpr.eqns] == ["pallas_call"]
  inner = jaxpr.eqns[0].params["spec"]
  assert len(inner.grid_mapping.in_mappings) == 4  # x, y, tx, ty


def test_jvp_matmul_scratch_state_and_loops():
  ta, tb = jnp.ones_like(A), jnp.ones_like(B)
  _, t = jax.jvp(matmul, (A, B), (ta, tb))
  assert_close(t, ta @ B + A @ tb)
  tx = jax.random.normal(jax.random.key(9), (16, 24))
  _, t = jax.jvp(lse, (A,), (tx,))
  _, tr = jax.jvp(lambda a: jax.nn.logsumexp(a, axis=1), (A,), (tx,))
  assert_close(t, tr)


def test_jvp_int_inputs_get_float0_tangents():
  s = jnp.arange(16, dtype=jnp.int32)
  (o, n), (to, tn) = jax.jvp(loop_call, (X, s),
                             (jnp.ones(16), np.zeros(16, jax.dtypes.float0)))
  (ro, rn), (tro, _) = jax.jvp(loop_ref, (X, s),
                               (jnp.ones(16), np.zeros(16, jax.dtypes.float0)))
  assert_close(o, ro)
  assert_close(to, tro)
  assert tn.dtype == jax.dtypes.float0


def test_linearize():
  y, f_jvp = jax.linearize(sin_mul, X, Y)
  assert_close(y, jnp.sin(X) * Y)
  assert_close(f_jvp(jnp.ones(16), jnp.zeros(16)), jnp.cos(X) * Y)


# ------------------------------------------------------------ reverse mode

@pytest.mark.parametrize("fn,ref,args", [
    (sin_mul, lambda x, y: jnp.sin(x) * y, (X, Y)),
    (matmul, lambda a, b: a @ b, (A, B)),
    (lse, lambda a: jax.nn.logsumexp(a, axis=1), (A,)),
])
def test_grad_matches_reference(fn, ref, args):
  loss = lambda f: (lambda *a: jnp.sum(jnp.tanh(f(*a)) ** 2))
  argnums = tuple(range(len(args)))
  got = jax.grad(loss(fn), argnums)(*args)
  want = jax.grad(loss(ref), argnums)(*args)
  for g, w in zip(got, want):
    assert_close(g, w)


def test_grad_through_loops_cond_and_int_operands():
  s = jnp.arange(16, dtype=jnp.int32)
  f = lambda x: jnp.sum(loop_call(x, s)[0] ** 2)
  fr = lambda x: jnp.sum(loop_ref(x, s)[0] ** 2)
  assert_close(jax.grad(f)(X), jax.grad(fr)(X), tol=1e-3)


def test_vjp_and_value_and_grad():
  out, vjp = jax.vjp(matmul, A, B)
  ct = jax.random.normal(jax.random.key(5), out.shape)
  ga, gb = vjp(ct)
  assert_close(ga, ct @ B.T)
  assert_close(gb, A.T @ ct)
  v, g = jax.value_and_grad(lambda a: jnp.sum(lse(a)))(A)
  assert_close(v, jnp.sum(jax.nn.logsumexp(A, axis=1)))
  assert_close(g, jax.nn.softmax(A, axis=1))


def test_check_grads_fwd_rev():
  check_grads(sin_mul, (X, Y), order=1, modes=("fwd", "rev"), atol=1e-2,
              rtol=1e-2)
  check_grads(lse, (A,), order=1, modes=("fwd", "rev"), atol=1e-2, rtol=1e-2)
  check_grads(matmul, (A, B), order=1, modes=("fwd", "rev"), atol=1e-2,
              rtol=1e-2)


@pytest.mark.slow
def test_check_grads_fwd_rev_order_2():
  check_grads(sin_mul, (X, Y), order=2, modes=("fwd", "rev"), atol=1e-2,
              rtol=1e-2)
  check_grads(matmul, (A, B), order=2, modes=("fwd", "rev"), atol=1e-2,
              rtol=1e-2)


def test_hand_written_custom_vjp_agrees_with_automatic():
  def bwd_kernel(x_ref, y_ref, g_ref, gx_ref, gy_ref):
    gx_ref[...] = jnp.cos(x_ref[...]) * y_ref[...] * g_ref[...]
    gy_ref[...] = jnp.sin(x_ref[...]) * g_ref[...]

  @jax.custom_vjp
  def f(x, y):
    return sin_mul(x, y)

  def f_fwd(x, y):
    return sin_mul(x, y), (x, y)

  def f_bwd(res, g):
    x, y = res
    sds = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return tuple(pl.pallas_call(bwd_kernel, (sds, sds))(x, y, g))

  f.defvjp(f_fwd, f_bwd)
  loss = lambda fn: (lambda x, y: jnp.sum(fn(x, y) ** 3))
  hand = jax.grad(loss(f), (0, 1))(X, Y)
  auto = jax.grad(loss(sin_mul), (0, 1))(X, Y)
  for h, a in zip(hand, auto):
    assert_close(h, a)


def test_grad_with_aliased_input():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 3.0
  def f(x):
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((16,), jnp.float32),
                          grid=(1,), in_specs=[pl.BlockSpec((8,), lambda i: (0,))],
                          out_specs=pl.BlockSpec((8,), lambda i: (0,)),
                          input_output_aliases={0: 0})(x)
  assert_close(f(X), X.at[:8].multiply(3.0))
  g = jax.grad(lambda x: jnp.sum(f(x) * jnp.arange(16.)))(X)
  assert_close(g, jnp.arange(16.) * jnp.where(jnp.arange(16) < 8, 3.0, 1.0))


def test_grad_inside_jit():
  g = jax.jit(jax.grad(lambda a, b: jnp.sum(matmul(a, b) ** 2)))(A, B)
  assert_close(g, jax.grad(lambda a, b: jnp.sum((a @ b) ** 2))(A, B), tol=1e-3)


# ------------------------------------------------------------ vmap

@pytest.mark.parametrize("in_axes,out_axes", [
    ((0, 0), 0), ((1, None), 0), ((-1, 0), 1), ((None, 0), -1)])
def test_vmap_axes_match_python_loop(in_axes, out_axes):
  xs = jax.random.normal(jax.random.key(6), (3, 16))
  ys = jax.random.normal(jax.random.key(7), (3, 16))
  args = []
  for arr, ax in zip((xs, ys), in_axes):
    args.append(arr[0] if ax is None else jnp.moveaxis(arr, 0, ax))
  got = jax.vmap(sin_mul, in_axes=in_axes, out_axes=out_axes)(*args)
  want = jnp.stack([sin_mul(xs[b] if in_axes[0] is not None else xs[0],
                            ys[b] if in_axes[1] is not None else ys[0])
                    for b in range(3)], axis=0)
  assert_close(jnp.moveaxis(got, out_axes, 0), want)


def test_nested_vmap_with_program_id_and_scratch():
  def kernel(x_ref, o_ref, acc_ref):
    acc_ref[...] = x_ref[...] + pl.program_id(0) * 100 + pl.num_programs(0)
    o_ref[...] = acc_ref[...]
  def f(x):
    return pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
                          grid=(2,), in_specs=[pl.BlockSpec((4,), lambda i: (i,))],
                          out_specs=pl.BlockSpec((4,), lambda i: (i,)),
                          scratch_shapes=[pltpu.VMEM((4,), jnp.float32)])(x)
  xs = jax.random.normal(jax.random.key(8), (2, 3, 8))
  got = jax.vmap(jax.vmap(f))(xs)
  want = jnp.stack([jnp.stack([f(xs[a, b]) for b in range(3)]) for a in range(2)])
  assert_close(got, want)
  (call,) = [e for e in jax.make_jaxpr(jax.vmap(jax.vmap(f)))(xs).eqns
            if "spec" in e.params]
  assert call.params["spec"].grid_mapping.grid == (2, 3, 2)


def test_vmap_grid_spec_prefetch_and_aliases():
  def kernel(idx_ref, x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2 + idx_ref[0]
  def f(idx, x):
    return pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((4, 8), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(4,),
            in_specs=[pl.BlockSpec((1, 8), lambda i, idx: (idx[i], 0))],
            out_specs=pl.BlockSpec((1, 8), lambda i, idx: (i, 0))),
        input_output_aliases={1: 0})(idx, x)
  idx = jnp.array([[3, 2, 1, 0], [0, 0, 1, 1]], jnp.int32)
  xs = jax.random.normal(jax.random.key(9), (2, 4, 8))
  got = jax.vmap(f)(idx, xs)
  want = jnp.stack([f(idx[b], xs[b]) for b in range(2)])
  assert_close(got, want)
  got = jax.vmap(f, in_axes=(None, 0))(idx[0], xs)
  want = jnp.stack([f(idx[0], xs[b]) for b in range(2)])
  assert_close(got, want)


def test_grad_of_vmap_and_vmap_of_grad():
  xs = jax.random.normal(jax.random.key(10), (3, 16))
  g = jax.grad(lambda x: jnp.sum(jax.vmap(sin_mul, (0, None))(x, Y) ** 2))(xs)
  gr = jax.grad(lambda x: jnp.sum((jnp.sin(x) * Y) ** 2))(xs)
  assert_close(g, gr)
  g2 = jax.vmap(jax.grad(lambda x: jnp.sum(sin_mul(x, Y))))(xs)
  assert_close(g2, jnp.cos(xs) * Y)


# ------------------------------------------------------------ checks

def checked_kernel(x_ref, o_ref):
  pl.debug_check(jnp.all(x_ref[...] > 0), "x must be positive")
  checkify.check(jnp.all(x_ref[...] < 100), "x too big: {}", x_ref[0])
  o_ref[...] = jnp.sqrt(x_ref[...])


def checked(x):
  return pl.pallas_call(
      checked_kernel, jax.ShapeDtypeStruct((16,), jnp.float32), grid=(2,),
      in_specs=[pl.BlockSpec((8,), lambda i: (i,))],
      out_specs=pl.BlockSpec((8,), lambda i: (i,)))(x)


def test_checks_ignored_by_default():
  out = jax.jit(checked)(jnp.arange(16.) - 1)
  assert np.isnan(out[0])


def test_checkify_returns_error_as_value():
  err, _ = checkify.checkify(checked)(jnp.arange(16.) - 1)
  assert "x must be positive" in err.get()
  err, _ = jax.jit(checkify.checkify(checked))(jnp.arange(16.) + 200)
  assert "x too big: 200.0" in err.get()     # the first grid point's failure
  err, out = checkify.checkify(checked)(jnp.arange(16.) + 1)
  assert err.get() is None
  assert_close(out, jnp.sqrt(jnp.arange(16.) + 1))


def test_runtime_assert_flag_raises_with_message():
  with pl.config.enable_runtime_assert_option(True):
    with pytest.raises(Exception, match="x must be positive"):
      jax.block_until_ready(jax.jit(checked)(jnp.arange(16.) - 1))
    assert_close(jax.jit(checked)(jnp.arange(16.) + 1),
                 jnp.sqrt(jnp.arange(16.) + 1))


# ------------------------------------------------------------ several devices

def test_shard_map_and_sharded_jit_with_transforms():
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  devices = jax.devices()
  if len(devices) < 8:
    pytest.fail("tests/conftest.py should provide 8 host devices")
  mesh = Mesh(np.array(devices[:8]), ("d",))
  x = jax.random.normal(jax.random.key(11), (8 * 16,))
  y = jax.random.normal(jax.random.key(12), (8 * 16,))
  f = jax.shard_map(sin_mul, mesh=mesh, in_specs=(P("d"), P("d")),
                    out_specs=P("d"))
  assert_close(jax.jit(f)(x, y), jnp.sin(x) * y)
  g = jax.jit(jax.grad(lambda x, y: jnp.sum(f(x, y) ** 2)))(x, y)
  assert_close(g, 2 * jnp.sin(x) * y * jnp.cos(x) * y)
  _, t = jax.jvp(f, (x, y), (jnp.ones_like(x), jnp.zeros_like(y)))
  assert_close(t, jnp.cos(x) * y)
  xs = jnp.stack([x, y])
  assert_close(jax.vmap(f, (0, None))(xs, y), jnp.sin(xs) * y)
  sharding = NamedSharding(mesh, P("d"))
  xd, yd = jax.device_put(x, sharding), jax.device_put(y, sharding)
  out = jax.jit(lambda a, b: sin_mul(a.reshape(8, 16)[0], b.reshape(8, 16)[0]))(xd, yd)
  assert_close(out, jnp.sin(x[:16]) * y[:16])


@pytest.mark.parametrize("backend", ["interpret", "triton_interpret",
                                     "mosaic_interpret"])
def test_runtime_assert_on_every_cpu_backend(backend):
  def kernel(x_ref, o_ref):
    pl.debug_check(jnp.all(x_ref[...] > 0), "x must be positive")
    o_ref[...] = x_ref[...] * 2
  f = jax.jit(lambda x: pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32), backend=backend)(x))
  ones = jnp.ones((8, 128))
  assert_close(f(ones), 2 * ones)                       # off: ignored
  assert_close(f(-ones), -2 * ones)
  with pl.config.enable_runtime_assert_option(True):
    assert_close(f(ones), 2 * ones)
    with pytest.raises(Exception, match="x must be positive"):
      jax.block_until_ready(f(-ones))
