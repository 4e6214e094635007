"""dsl.core.inspection: the kernels a function makes (inside control flow and
shard_map too), and each as a backend's lowering receives it; the tools
that show generated code (`to_source`, `to_modules`, `to_gpu_modules`)
show what the lowering builds."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import dsl as pl
from dsl.core.inspection import (as_lowered, kernel_specs,
                                 traced_kernel_calls, traced_kernels)
from dsl.core.normalize import needs_normalizing


def _kernel(x_ref, o_ref):
  x = x_ref[...]
  which = jnp.clip((x * 3).astype(jnp.int32), 0, 2)
  o_ref[...] = jnp.tanh(x) + lax.select_n(which, x, x * x, jnp.cos(x))


def _call(x, name="k", backend=None):
  return pl.pallas_call(
      _kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), name=name,
      backend=backend, grid=(x.shape[0] // 8,),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)))(x)


def test_kernels_are_found_in_branches_loops_and_shard_map():
  mesh = Mesh(np.array(jax.devices()[:2]), ("d",))

  def f(x, p):
    a = lax.cond(p, lambda v: _call(v, "in_cond"), lambda v: v, x)
    b = lax.fori_loop(0, 2, lambda i, v: _call(v, "in_loop"), x)
    c = jax.shard_map(functools.partial(_call, name="in_shard_map"),
                      mesh=mesh, in_specs=P("d"), out_specs=P("d"))(x)
    return a + b + c

  x = jnp.ones((16, 128), jnp.float32)
  found = traced_kernels(f, x, True)
  assert [(s.name, axes) for s, axes in found] == [
      ("in_cond", ()), ("in_loop", ()), ("in_shard_map", (("d", 2),))]
  jaxpr = jax.make_jaxpr(f)(x, True).jaxpr
  assert [s for s, _ in kernel_specs(jaxpr)] == [s for s, _ in found]


def test_kernel_calls_say_which_read_the_functions_inputs():
  """A kernel reads an input when its operand is the input or a view of it
  (reshape, transpose, slice, cast), also through jit and cond; not when
  the operand is computed from it or another kernel's output."""
  def f(x, y, p):          # x: (128, 16)
    a = _call(x.T.reshape(16, 128), "view")
    b = _call(a, "of_a_kernel")
    c = _call(x.T * 2, "computed")
    d = jax.jit(lambda v: _call(v, "in_jit"))(y[:16].astype(jnp.float32))
    e = lax.cond(p, lambda v: _call(v, "in_cond"), lambda v: v, b)
    g = lax.cond(p, lambda v: _call(v, "in_cond"), lambda v: v, x.T)
    return a + b + c + d + e + g

  x = jnp.ones((16, 128), jnp.float32)
  y = jnp.ones((32, 128), jnp.bfloat16)
  calls = traced_kernel_calls(f, x.T, y, True)
  assert [(c.spec.name, c.reads_inputs) for c in calls] == [
      ("view", (0,)), ("of_a_kernel", ()), ("computed", ()),
      ("in_jit", (0,)), ("in_cond", ()), ("in_cond", (0,))]
  assert [c.spec for c in calls] == [
      s for s, _ in traced_kernels(f, x.T, y, True)]


@pytest.mark.parametrize("backend", ["triton", "mosaic", "mosaic_gpu"])
def test_as_lowered_normalizes_derived_kernels(backend):
  x = jnp.full((8, 128), 0.5, jnp.float32)
  jvp = lambda a, t: jax.jvp(_call, (a,), (t,))
  (spec, axes), = traced_kernels(jvp, x, x)
  assert needs_normalizing(spec.jaxpr.jaxpr)    # jit, select_n of 3 cases
  lowered = as_lowered(spec, backend, axes)
  assert not needs_normalizing(lowered.jaxpr.jaxpr)
  assert as_lowered(spec, "interpret", axes) is spec


def test_to_source_shows_the_kernel_the_triton_lowering_builds():
  import lowering_triton
  from lowering_triton.kernel import generate
  x = jnp.full((8, 128), 0.5, jnp.float32)
  jvp = lambda a, t: jax.jvp(functools.partial(
      _call, backend="triton_interpret"), (a,), (t,))
  (spec, axes), = traced_kernels(jvp, x, x)
  want = generate(as_lowered(spec, "triton", axes)).source
  assert lowering_triton.to_source(jvp, x, x) == [want]
  got = jvp(x, x)
  ref = jax.jvp(lambda a: jnp.tanh(a) + lax.select_n(
      jnp.clip((a * 3).astype(jnp.int32), 0, 2), a, a * a, jnp.cos(a)),
      (x,), (x,))
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
