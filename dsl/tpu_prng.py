"""The TPU's stateful random numbers: `prng_seed`, `prng_random_bits` and the
`stateful_*` samplers.

The state is a threefry key in a 2-word SMEM scratch that the kernel body
runs inside (`tracing.trace_kernel` adds it, only for kernels that use these
functions): `prng_seed` writes the key made from the seeds, each draw splits
it, keeps one half and draws from the other — so draws inside a loop differ
per iteration. Like the TPU's, the state is only defined after `prng_seed`
in the same grid step (unseeded, it is unspecified). The bits are
threefry's, not the TPU hardware's: the same seed gives the same numbers on
every host backend, and other numbers than on a TPU.
"""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from dsl.errors import KernelError, user_frame

_STATE: contextvars.ContextVar = contextvars.ContextVar("dsl_prng_state",
                                                        default=None)


class NeedsPrngState(Exception):
  """Raised while tracing a kernel that draws random numbers without the
  state scratch; `trace_kernel` traces it again with the scratch."""


@contextlib.contextmanager
def prng_state(ref):
  token = _STATE.set(ref)
  try:
    yield
  finally:
    _STATE.reset(token)


def _state():
  ref = _STATE.get()
  if ref is None:
    if _STATE_WANTED.get():
      raise NeedsPrngState()
    raise KernelError(None, "prng_seed and the random draws can only be "
                      "called inside a kernel body", user_frame())
  return ref


# Set while a kernel body is traced: a draw then asks for the state.
_STATE_WANTED: contextvars.ContextVar = contextvars.ContextVar(
    "dsl_prng_wanted", default=False)


@contextlib.contextmanager
def in_kernel_body():
  token = _STATE_WANTED.set(True)
  try:
    yield
  finally:
    _STATE_WANTED.reset(token)


def state_shape():
  from dsl.memory import MemorySpace
  return MemorySpace.SMEM((2,), jnp.uint32)


def prng_seed(*seeds) -> None:
  """Seeds the kernel's random state; several seeds are mixed."""
  if not seeds:
    raise ValueError("prng_seed needs at least one seed")
  ref = _state()
  key = jax.random.PRNGKey(jnp.asarray(seeds[0]).astype(jnp.uint32))
  for s in seeds[1:]:
    key = jax.random.fold_in(key, jnp.asarray(s).astype(jnp.uint32))
  ref[...] = key


def _next_key():
  ref = _state()
  keep, draw = jax.random.split(ref[...])
  ref[...] = keep
  return draw


def prng_random_bits(shape):
  """int32 random bits of `shape` from the kernel's state."""
  bits = jax.random.bits(_next_key(), tuple(shape), jnp.uint32)
  return jax.lax.bitcast_convert_type(bits, jnp.int32)


def _stateful(sampler):
  def draw(*args, **kwargs):
    return sampler(_next_key(), *args, **kwargs)
  draw.__name__ = f"stateful_{sampler.__name__}"
  draw.__doc__ = (f"`jax.random.{sampler.__name__}` without the key: drawn "
                  "from the kernel's random state.")
  return draw


stateful_bits = _stateful(jax.random.bits)
stateful_uniform = _stateful(jax.random.uniform)
stateful_bernoulli = _stateful(jax.random.bernoulli)
stateful_normal = _stateful(jax.random.normal)
