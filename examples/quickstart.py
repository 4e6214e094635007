"""A kernel inside a jitted model: the README's first example (the model,
its gradient and a vmap of the kernel), each checked against jnp."""
import jax
import jax.numpy as jnp

import dsl as pl


@pl.kernel(out_shape=lambda x, y: jax.ShapeDtypeStruct(x.shape, x.dtype),
           grid=lambda x, y: (pl.cdiv(x.shape[0], 1024),),
           in_specs=[pl.BlockSpec((1024,), lambda i: (i,))] * 2,
           out_specs=pl.BlockSpec((1024,), lambda i: (i,)))
def add(x_ref, y_ref, o_ref):
  o_ref[...] = x_ref[...] + y_ref[...]


@jax.jit
def model(x, y):
  return jnp.sum(add(x, y) ** 2)


if __name__ == "__main__":
  x = jnp.linspace(0.0, 1.0, 10_000)
  y = jnp.ones_like(x)
  got, want = model(x, y), jnp.sum((x + y) ** 2)
  print(f"kernel: {float(got):.4f}  jnp: {float(want):.4f}")
  assert jnp.allclose(got, want, rtol=1e-5)

  dx = jax.grad(model)(x, y)               # reverse mode through the kernel
  assert jnp.allclose(dx, 2 * (x + y), rtol=1e-5)
  print(f"grad: d/dx[0] = {float(dx[0]):.4f}  jnp: {float(2 * (x[0] + y[0])):.4f}")

  batched = jax.vmap(add)(jnp.stack([x, x]), jnp.stack([y, y]))
  assert batched.shape == (2, 10_000)
  assert jnp.allclose(batched, jnp.stack([x + y, x + y]))
  print(f"vmap: {batched.shape}, matches jnp")
