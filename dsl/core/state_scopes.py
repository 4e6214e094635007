"""Refs with a scope other than the grid point's: `run_state` (refs that live
for one function call and start from given values) and `get_global` (a ref
that lives for the whole kernel launch, shared by every grid point).

`run_state(f)(init)` is built on `run_scoped`: each leaf of `init` becomes a
scoped ref that starts with the leaf's value, `f` runs on the refs, and
their final values come back in `init`'s structure. A leaf may also be a
scratch type that carries its initial value (`plgpu.ACC.init(x)`: an
accumulator starting at `x`), which gives the ref its type.

`get_global(what)` is a primitive: each call site is one ref of type `what`
(e.g. `plgpu.SemaphoreType.REGULAR`) that every program of the launch sees.
The interpret backend runs it in the `plgpu.kernel` interpreter
(dsl/interpret/warpgroups.py), where a launch is one run of the kernel.
"""
from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
from jax import tree_util
from jax.extend.core import Primitive

from dsl.core.errors import KernelTypeError, user_frame
from dsl.core.jax_internals import core, state_types
from dsl.core.primitives import run_scoped


def _is_typed_init(x) -> bool:
  """A scratch type with an initial value (`plgpu.ACC.init(x)`)."""
  return hasattr(x, "ref_aval") and hasattr(x, "value")


def run_state(f: Callable[[Any], None]) -> Callable[[Any], Any]:
  """`run_state(f)(init)`: runs `f` on refs holding `init`'s leaves and
  returns the values the refs hold when `f` returns, shaped like `init`."""

  def wrapped(init):
    leaves, tree = tree_util.tree_flatten(init, is_leaf=_is_typed_init)
    types, values = [], []
    for i, leaf in enumerate(leaves):
      if _is_typed_init(leaf):
        types.append(leaf.ref_aval())
        values.append(leaf.value)
      elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        types.append(state_types.AbstractRef(
            core.ShapedArray(tuple(leaf.shape), jnp.dtype(leaf.dtype))))
        values.append(leaf)
      else:
        raise KernelTypeError(
            None, f"run_state: leaf {i} of the initial values must be an "
            f"array or an initialized scratch type such as "
            f"plgpu.ACC.init(x), got {type(leaf).__name__}", user_frame())

    def body(*refs):
      for ref, value in zip(refs, values):
        ref[...] = jnp.asarray(value, ref.dtype)
      f(tree_util.tree_unflatten(tree, list(refs)))
      return [ref[...] for ref in refs]

    return tree_util.tree_unflatten(tree, run_scoped(body, *types))
  return wrapped


get_global_p = Primitive("get_global")
# It makes a ref (as `jax.new_ref` does): effects on it are not effects on
# the kernel's inputs.
get_global_p.ref_primitive = True
get_global_p.ref_allocating = True


@get_global_p.def_abstract_eval
def _get_global_abstract_eval(*, what):
  return what


def get_global(what) -> Any:
  """A ref of type `what` (a scratch type such as
  `plgpu.SemaphoreType.REGULAR`) that lives for the whole launch: every
  program of the kernel sees the same one; each call site is its own."""
  if not hasattr(what, "get_ref_aval"):
    raise KernelTypeError(None, f"get_global takes a scratch type such as "
                          f"plgpu.SemaphoreType.REGULAR, got {what!r}",
                          user_frame())
  return get_global_p.bind(what=what.get_ref_aval())
