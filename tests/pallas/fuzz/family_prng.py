"""The `prng` family: dropout seeded from scalar prefetch, under `jax.grad`.

Each grid point seeds the core's random state with `prng_seed(seed_ref[0])`
(now and then mixed with its program id), draws a keep mask with
`stateful_bernoulli(q, block)`, and writes `where(keep, x / q, 0)` and the
mask itself. The case runs the kernel forward and `jax.grad` of
`sum(kernel(x) * g)` through it (the backward pass runs the kernel's
forward again, which must draw the same mask).

Random bits are the backend's: no reference can know them. What the
reference holds instead is the structure a correct dropout gives, against
the kernel's own forward mask `keep`:

- the output is `x / q` where `keep`, 0 elsewhere;
- the gradient is `g / q` where `keep`, 0 elsewhere (for q = 1/2: 2 * g);
- the mask is 0s and 1s and keeps between 0.4 q and 0.8 of the elements
  (q is 1/4 or 1/2 and every block has at least 1024 elements, so a fair
  draw never leaves that range).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tests.pallas.fuzz.common import Draw
from tests.pallas.fuzz.family_accumulate import _tags
from tests.pallas.fuzz.spec import Case, Dim, Operand, make_inputs


def generate(d: Draw, seed: int, index: int, tpu: bool) -> Case:
  grid = (d.int(1, 3),)
  rows, cols = 8 * d.pick([1, 2]), 128 * d.pick([1, 2])
  dims = (Dim("blocked", rows, "axis", 0), Dim("blocked", cols, "const", 0))
  shape = (grid[0] * rows, cols)
  x = Operand(shape, "float32", dims)
  g = Operand(shape, "float32", dims)     # the cotangent, an input too
  y = Operand(shape, "float32", dims)
  keep = Operand(shape, "int32", dims)
  q = d.pick([0.5, 0.5, 0.25])
  mix_pid = d.chance(0.5)
  body = dict(q=q, mix_pid=mix_pid, tol=(1e-6, 0.0, 1e-6))
  tags = {"prng", "prng_grad", f"prng_keep:{q}",
          "prng_seed_pid" if mix_pid else "prng_seed_prefetch"}
  prefetch = (d.int(0, 1 << 20),)
  # the kernel writes y and keep; the gradient is compared as a third
  body["n_kernel_out"] = 2
  return Case(seed, index, "prng", grid, (x, g), (y, keep, y),
              tuple(body.items()), prefetch, None, (),
              frozenset(_tags(tags, (x, g), (y, keep), grid, True)))


def body(case: Case, ctx) -> None:
  """The forward kernel (the cotangent input is not read)."""
  p = case.param
  seeds = (ctx.prefetched(0),) + ((ctx.pid(0),) if p("mix_pid") else ())
  keep = ctx.bernoulli(seeds, p("q"), case.inputs[0].kshape)
  x = ctx.load(0)
  ctx.store(0, ctx.xp.where(keep, x * (1 / p("q")), 0.0))
  ctx.store(1, keep.astype(np.int32))


def run(case: Case, build) -> list[np.ndarray]:
  """[y, keep, dL/dx] on one backend: `build(case)` gives (f, args) of the
  forward kernel; the gradient is that of sum(y * g) through it."""
  f, args = build(case)
  pf, x, g = args
  y, keep = f(pf, x, g)
  grad = jax.grad(lambda x: jnp.sum(f(pf, x, g)[0] * g))(x)
  return [np.asarray(y), np.asarray(keep), np.asarray(grad)]


def derive(case: Case, got) -> list[np.ndarray]:
  """The outputs a correct dropout gives for the kernel's own forward mask
  (`got[1]`); a mask too lopsided to be a fair draw is answered with -1s,
  which no kernel output matches."""
  x, g = make_inputs(case)
  keep = np.asarray(got[1])
  q = case.param("q")
  frac = float(np.mean(keep == 1))
  fair = np.isin(keep, (0, 1)).all() and 0.4 * q < frac < 0.8
  want_keep = keep if fair else np.full(keep.shape, -1, np.int32)
  on = keep == 1
  return [np.where(on, x * np.float32(1 / q), np.float32(0)),
          want_keep, np.where(on, g * np.float32(1 / q), np.float32(0))]
