"""Helpers shared by the tests in tests/pallas: the backends a test runs on,
input arrays, one `assert_close` with per-dtype tolerances, running a kernel
on a backend, and recording the kernels a backend lowered."""
import contextlib
import inspect
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from jax.experimental import pallas as jpl
from jax.test_util import check_grads

import dsl as pl
from dsl.core import backends
from dsl.core.jax_internals import core, mlir

# ------------------------------------------------------------------ backends

# The built-in backends that run on a CPU (the registry's host backends);
# every feature test runs on each.
CPU_BACKENDS = tuple(b for b in backends.BACKENDS
                     if backends.REGISTRY[b].on_host)
# The CPU backends besides the default "interpret".
OTHER_CPU_BACKENDS = tuple(b for b in CPU_BACKENDS if b != "interpret")

# The Triton backend that `call` uses; the GPU tests switch it to "triton".
TRITON_BACKEND = ["triton_interpret"]
# The GPU architectures the Triton tests compile for ahead of time, as
# parameters: Hopper in the default suite, Ampere too with `-m slow`.
TRITON_ARCHS = ("sm_90", pytest.param("sm_80", marks=pytest.mark.slow))


def hypothesis_settings(max_examples, derandomize=True):
  """Hypothesis settings for kernel tests: no deadline (every new shape
  compiles a new program), reproducible examples unless told otherwise."""
  return settings(max_examples=max_examples, deadline=None,
                  derandomize=derandomize,
                  suppress_health_check=[HealthCheck.too_slow,
                                         HealthCheck.data_too_large])


# The kernel library's tests (test_kernels_*.py): dtypes and example budgets
# (every new shape compiles a new XLA program; a gradient check compiles a
# forward and a backward one).
kernel_dtypes = st.sampled_from((jnp.float32, jnp.bfloat16))
KERNEL_SETTINGS = hypothesis_settings(10)
KERNEL_GRAD_SETTINGS = hypothesis_settings(5)


# ------------------------------------------------------------------ inputs

def rng(seed) -> np.random.Generator:
  return np.random.default_rng(abs(hash(seed)) % (1 << 32))


def array(seed, shape, dtype, lo=-50, hi=50, scale=1.0, shift=0.0):
  """Random input from numpy (no per-shape XLA compile, unlike jax.random):
  integers in [lo, hi), booleans, or normal floats * scale + shift."""
  r = rng(seed)
  if dtype == jnp.bool_:
    return jnp.asarray(r.integers(0, 2, shape).astype(bool))
  if jnp.issubdtype(dtype, jnp.integer):
    return jnp.asarray(r.integers(lo, hi, shape)).astype(dtype)
  x = r.standard_normal(shape, np.float32) * scale + shift
  return jnp.asarray(x).astype(dtype)


# ------------------------------------------------------------------ comparing

# Tolerance by dtype of the computation; every other dtype uses DEFAULT_TOL.
TOLERANCES = {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 2e-3}
DEFAULT_TOL = 1e-5


def tolerance(dtype, overrides=None) -> float:
  """The tolerance for `dtype`: `overrides` ({dtype: tol}) first, then the
  TOLERANCES table, then DEFAULT_TOL."""
  dtype = jnp.dtype(dtype)
  for table in (overrides or {}, TOLERANCES):
    for k, t in table.items():
      if jnp.dtype(k) == dtype:
        return t
  return DEFAULT_TOL


def assert_close(got, want, dtype=jnp.float32, tol=None):
  """`got` equals `want` (of the same shape) within t, with t the
  tolerance of `dtype` (the dtype the kernel computes in), or `tol`: a
  number, or {dtype: tolerance} overriding the table for some dtypes.

  Every element is within t * (1 + |want|) (numpy's allclose with
  rtol = atol = t: NaN and inf where `want` has them) and within
  t * max(1, max |want|), the max over the finite elements."""
  t = tol if isinstance(tol, (int, float)) else tolerance(dtype, tol)
  got = np.asarray(jnp.asarray(got, jnp.float32))
  want = np.asarray(jnp.asarray(want, jnp.float32))
  assert got.shape == want.shape, (got.shape, want.shape)
  np.testing.assert_allclose(got, want, rtol=t, atol=t)
  finite = np.isfinite(want)
  if finite.any():
    scale = max(1.0, float(np.max(np.abs(want[finite]))))
    err = float(np.max(np.abs(got[finite] - want[finite])))
    assert err <= t * scale, f"max error {err} > {t} * {scale}"


def assert_tree_close(got, want, dtype=jnp.float32, tol=None):
  got_l, want_l = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got_l) == len(want_l)
  for g, w in zip(got_l, want_l):
    assert_close(g, w, dtype, tol)


# ------------------------------------------------------------------ running

def call(kernel, out_shape, *args, backend=None, **kw):
  """pallas_call on `backend` (default: the current Triton backend), under
  jit."""
  backend = backend or TRITON_BACKEND[0]
  return jax.jit(lambda *a: pl.pallas_call(kernel, out_shape, backend=backend,
                                           **kw)(*a))(*args)


# ------------------------------------------------------- comparing backends

# The name `run_on` and `run_backends` give Pallas's interpret mode
# (jax.experimental.pallas), the peer every CPU backend is compared with.
PALLAS = "pallas"

# A primitive no lowering has a rule for, defined for the tests of that error
# (so that filling a real gap never breaks them): XLA runs it as the identity.
no_rule_p = core.Primitive("no_rule_for_tests")
no_rule_p.def_impl(lambda x: x)
no_rule_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(no_rule_p, mlir.lower_fun(lambda x: x,
                                                 multiple_results=False))


def no_rule(x):
  """`x`, through a primitive no kernel backend lowers (`no_rule_p`)."""
  return no_rule_p.bind(x)


def run_on(backend, kernel, out_shape, *args, specs=None, **kw):
  """The kernel's results on `backend` (a dsl backend, or PALLAS), under
  jit. `specs(module)` builds the BlockSpec arguments from `dsl` or
  `jax.experimental.pallas`; `kw` goes to both pallas_calls."""
  api = jpl if backend == PALLAS else pl
  extra = specs(api) if specs is not None else {}
  if backend == PALLAS:
    call = jpl.pallas_call(kernel, out_shape, interpret=True, **extra, **kw)
  else:
    call = pl.pallas_call(kernel, out_shape, backend=backend, **extra, **kw)
  return jax.jit(call)(*args)


def run_backends(backends, kernel, out_shape, *args, pallas=True, specs=None,
                 **kw) -> dict:
  """{backend: results} on each of `backends` and, if `pallas`, on PALLAS."""
  names = tuple(backends) + ((PALLAS,) if pallas else ())
  return {b: run_on(b, kernel, out_shape, *args, specs=specs, **kw)
          for b in names}


def assert_same(got, want, err_msg="", signed_zeros=False):
  """Bit-for-bit the same values: NaN where NaN (bfloat16 compared as
  float32, where numpy sees its NaNs) and, with `signed_zeros`, the same
  sign of zero."""
  got, want = np.asarray(got), np.asarray(want)
  if want.dtype == jnp.bfloat16 or got.dtype == jnp.bfloat16:
    got, want = got.astype(np.float32), want.astype(np.float32)
  np.testing.assert_array_equal(got, want, err_msg=err_msg)
  if signed_zeros and np.issubdtype(want.dtype, np.floating):
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want),
                                  err_msg=f"{err_msg} (sign of zero)")


def assert_all_equal(results, want, signed_zeros=False):
  """Every backend's results in `results` (run_backends) equal `want`."""
  for backend, got in results.items():
    got_l, want_l = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_l) == len(want_l), f"backend {backend}"
    for g, w in zip(got_l, want_l):
      assert_same(g, w, f"backend {backend}", signed_zeros)


# ------------------------------------------------------------ gradients

# check_grads's tolerances for finite differences in float32.
GRAD_TOL = dict(atol=2e-2, rtol=2e-2)


def uniform_arrays(*shapes, lo=-1.0, hi=1.0, seed=0):
  """float32 arrays of `shapes`, uniform in [lo, hi)."""
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.uniform(lo, hi, s), jnp.float32) for s in shapes]


def _leaves(x):
  return jax.tree_util.tree_leaves(x)


def check_values_and_grads(f, want, args, tol=1e-4):
  """Values, finite-difference grads, and jvp/vjp against the reference."""
  f = jax.jit(f)      # one compile per transformation, not per primitive
  for got, ref in zip(_leaves(f(*args)), _leaves(want(*args))):
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
  check_grads(f, args, order=1, modes=("fwd", "rev"), **GRAD_TOL)
  tangents = uniform_arrays(*[a.shape for a in args], seed=1)
  _, t_got = jax.jvp(f, args, tuple(tangents))
  _, t_want = jax.jvp(want, args, tuple(tangents))
  for got, ref in zip(_leaves(t_got), _leaves(t_want)):
    np.testing.assert_allclose(got, ref, rtol=10 * tol, atol=10 * tol)
  out, pull = jax.vjp(f, *args)
  _, pull_want = jax.vjp(want, *args)
  ct = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(out),
      uniform_arrays(*[o.shape for o in _leaves(out)], seed=2))
  for got, ref in zip(pull(ct), pull_want(ct)):
    np.testing.assert_allclose(got, ref, rtol=10 * tol, atol=10 * tol)


def jitted(fn, **kw):
  """`fn` with keyword arguments bound, under jit (one compile, not one per
  eager op)."""
  return jax.jit(lambda *a: fn(*a, **kw))


def vjp_with(fn, args, cotangent):
  """The cotangents of `fn`'s differentiable args for output cotangent."""
  _, pullback = jax.vjp(fn, *args)
  return pullback(cotangent)


def automatic_vjp_or_xfail(fn, args, cotangent):
  """jax.vjp through a raw pallas_call (dsl's automatic reverse mode)."""
  try:
    return jax.jit(lambda *a: vjp_with(fn, a, cotangent))(*args)
  except NotImplementedError as e:
    pytest.xfail(f"automatic vjp not landed: {e}")


def run_or_skip(fn, *args):
  """Runs `fn` on a backend that may not support the kernel yet."""
  try:
    return jax.block_until_ready(fn(*args))
  except (pl.BackendError, NotImplementedError, ImportError) as e:
    pytest.skip(f"backend cannot run this kernel: {str(e).splitlines()[0]}")
  except pl.KernelError as e:
    pytest.skip(f"backend rejects this kernel: {str(e).splitlines()[0]}")


# ------------------------------------------------------------------ recording

@contextlib.contextmanager
def default_backend(name="triton_interpret", platform="cpu", run_on=None):
  """Makes `name` the backend of every pallas_call with backend=None on
  `platform`, and records the kernels lowered for it (those that name it
  too). With `run_on`, those kernels run on backend `run_on` instead: this
  collects the kernels a slow backend gets without running them there."""
  lowered = []
  old_default = backends.DEFAULT_FOR_PLATFORM[platform]
  rule = backends.lowering_rule(name, "<test>", None)
  run = backends.lowering_rule(run_on or name, "<test>", None)

  def counting(ctx, *args, spec):
    lowered.append(spec)
    return run(ctx, *args, spec=spec)

  backends.DEFAULT_FOR_PLATFORM[platform] = name
  backends.register_backend(name, counting)
  jax.clear_caches()
  try:
    yield lowered
  finally:
    backends.DEFAULT_FOR_PLATFORM[platform] = old_default
    backends.register_backend(name, rule)
    jax.clear_caches()


# ------------------------------------------------------------------ test cases

def parametrize_cases(fn):
  """The keyword arguments of every pytest.mark.parametrize case of `fn`."""
  axes = []
  for mark in getattr(fn, "pytestmark", []):
    if mark.name != "parametrize":
      continue
    names = [n.strip() for n in mark.args[0].split(",")]
    values = [v if len(names) > 1 else (v,) for v in mark.args[1]]
    axes.append([dict(zip(names, v)) for v in values])
  for combo in itertools.product(*axes):
    kw = {}
    for part in combo:
      kw.update(part)
    yield kw


def case_id(name, kw) -> str:
  if not kw:
    return name
  return name + "[" + "-".join(getattr(v, "__name__", str(v))
                               for v in kw.values()) + "]"


def test_cases(module, skip=(), backend=None, slow_after_first=False,
               every: int = 1):
  """(name, kwargs) pytest params for the test functions of `module`; with
  `backend`, only the cases run on `backend`, once per other argument; with
  `slow_after_first`, each function's cases after its first are marked
  slow (the default suite takes one of each), and with `every` = n the
  default suite takes that first case of every n-th function only (the
  rest run under -m slow)."""
  functions = [(name, fn) for name, fn in
               inspect.getmembers(module, inspect.isfunction)
               if name.startswith("test_") and name not in skip
               and getattr(fn, "__test__", True) is not False
               and "capfd" not in inspect.signature(fn).parameters]
  for k, (name, fn) in enumerate(functions):
    first = k % every == 0
    for kw in parametrize_cases(fn):
      if backend is not None:
        if kw.pop("backend", backend) != backend:
          continue
      marks = (pytest.mark.slow,) if slow_after_first and not first else ()
      first = False
      yield pytest.param(name, kw, id=case_id(name, kw), marks=marks)


test_cases.__test__ = False   # a helper, not a test


# ------------------------------------------------------------------ matmul

def matmul_kernel_for(pl, scratch: bool = False):
  """x @ y over an (i, j, k) grid, written against a `pl` module (dsl or
  jax.experimental.pallas): accumulated over k in the output block, or with
  `scratch` in a VMEM scratch stored to the output at the last k."""
  if not scratch:
    def matmul_kernel(x_ref, y_ref, o_ref):
      @pl.when(pl.program_id(2) == 0)
      def _():
        o_ref[...] = jnp.zeros_like(o_ref)
      o_ref[...] += jnp.dot(x_ref[...], y_ref[...],
                            preferred_element_type=jnp.float32)
    return matmul_kernel

  def matmul_kernel(x_ref, y_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)
    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...],
                            preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
      o_ref[...] = acc_ref[...].astype(o_ref.dtype)
  return matmul_kernel


def matmul_call(pl, pltpu, m, k, n, blocks, *, scratch=False,
                dtype=jnp.float32, **kw):
  """`pallas_call` of `matmul_kernel_for` for (m, k) @ (k, n) in blocks
  (bm, bk, bn); `kw` goes to pallas_call (backend, compiler_params, ...)."""
  bm, bk, bn = blocks
  return pl.pallas_call(
      matmul_kernel_for(pl, scratch), jax.ShapeDtypeStruct((m, n), dtype),
      grid=(m // bm, n // bn, k // bk),
      in_specs=[pl.BlockSpec((bm, bk), lambda i, j, l: (i, l)),
                pl.BlockSpec((bk, bn), lambda i, j, l: (l, j))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j, l: (i, j)),
      scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)] if scratch else [],
      **kw)


def line_of(path: str, marker: str) -> int:
  """The line of file `path` that holds `marker` (a comment the test puts
  on the line whose number an error must name)."""
  with open(path) as f:
    for i, line in enumerate(f, 1):
      if marker in line and "line_of" not in line:
        return i
  raise AssertionError(marker)
