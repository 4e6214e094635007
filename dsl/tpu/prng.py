"""The TPU's stateful random numbers: `prng_seed`, `prng_random_bits` and the
`stateful_*` samplers.

`prng_seed` and `prng_random_bits` are primitives with an effect (the
core's random state), as on the TPU: the kernel jaxpr holds no state, and
each backend gives them their meaning (rules keyed by primitive):

- "mosaic": `tpu.prng_set_seed_32` and `tpu.prng_random_bits`, the TPU's
  hardware generator (lowering_mosaic/tpu/rules/prng.py);
- "mosaic_interpret": those two ops run by our interpreter, each device
  keeping a key and a draw counter
  (lowering_mosaic/verification/interpreter/prng_ops.py);
- "interpret": the state lives in an SMEM scratch that the backend puts
  around the kernel body before discharging it (dsl/tpu/prng_state.py).

Both host backends draw with the same counter-based generator
(`dsl.tpu.prng_state`: threefry-2x32 keyed by a hash of the seeds), so they
give the same bits, and other bits than a TPU. Like the TPU's, the state is
only defined after `prng_seed` in the same grid step. Triton has no such
generator (nor has Pallas's Triton backend): it rejects these primitives.

The samplers turn 32-bit words into numbers the way `jax.random` does
(uniform: 23 random mantissa bits under the exponent of 1.0, minus 1,
scaled; normal: `sqrt(2) * erf_inv` of a uniform in (-1, 1); bernoulli:
a uniform below `p`), so a kernel draws what a user of `jax.random`
expects, from the kernel's state instead of a key.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from dsl.core.jax_internals import core, effects
from jax.extend.core import Primitive

from dsl.core.errors import KernelError, KernelTypeError, user_frame
from dsl.core.primitives import allowed_everywhere
from dsl.core.tracing import in_kernel_body


@allowed_everywhere
class PrngEffect(effects.Effect):
  """Reads and advances the core's random state."""

  def __str__(self):
    return "Prng"


prng_effect = PrngEffect()

prng_seed_p = Primitive("prng_seed")
prng_seed_p.multiple_results = True


@prng_seed_p.def_effectful_abstract_eval
def _prng_seed_abstract_eval(*seeds):
  return [], {prng_effect}


prng_random_bits_p = Primitive("prng_random_bits")


@prng_random_bits_p.def_effectful_abstract_eval
def _prng_random_bits_abstract_eval(*, shape, dtype):
  return core.ShapedArray(shape, dtype), {prng_effect}


def _outside_kernel(name: str):
  if not in_kernel_body():
    raise KernelError(None, f"{name}: prng_seed and the random draws can "
                      "only be called inside a kernel body", user_frame())


def _seed_value(seed, k: int):
  aval = core.typeof(seed)
  dtype = getattr(aval, "dtype", None)
  if getattr(aval, "shape", None) != () or not (
      jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_):
    raise KernelTypeError(
        None, f"prng_seed: seed {k} must be an integer scalar, got "
        f"{aval.str_short() if hasattr(aval, 'str_short') else aval}",
        user_frame())
  if dtype in (jnp.int32, jnp.uint32):
    return seed
  return lax.convert_element_type(seed, jnp.int32)


def prng_seed(*seeds) -> None:
  """Seeds the core's random state; several seeds are mixed."""
  _outside_kernel("prng_seed")
  if not seeds:
    raise KernelTypeError(None, "prng_seed needs at least one seed",
                          user_frame())
  prng_seed_p.bind(*(_seed_value(s, k) for k, s in enumerate(seeds)))


def _draw(shape, dtype=jnp.int32):
  try:
    shape = tuple(int(d) for d in shape)
  except TypeError:
    raise KernelTypeError(None, f"the shape of a random draw must be a tuple "
                          f"of static ints, got {shape!r}", user_frame()
                          ) from None
  return prng_random_bits_p.bind(shape=shape, dtype=jnp.dtype(dtype))


def prng_random_bits(shape):
  """int32 random bits of `shape` from the core's random state."""
  _outside_kernel("prng_random_bits")
  return _draw(shape)


# ------------------------------------------------------------ samplers
# 32-bit words as jax.random turns them into numbers; the state gives words
# of 32 bits only, so (as on Pallas's TPU backend) only 32-bit dtypes.

def _float32_only(name: str, dtype):
  dtype = jax.dtypes.canonicalize_dtype(jnp.float32 if dtype is None
                                        else dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise KernelTypeError(None, f"{name}: dtype must be a float dtype, got "
                          f"{dtype}", user_frame())
  if jnp.finfo(dtype).bits != 32:
    raise KernelTypeError(
        None, f"{name}: the random state gives 32-bit words, so dtype must "
        f"be float32, got {dtype}; draw float32 and cast", user_frame())
  return dtype


def stateful_bits(shape=(), dtype=None):
  """`jax.random.bits` without the key: uint32 words from the state."""
  _outside_kernel("stateful_bits")
  dtype = jnp.dtype(jnp.uint32 if dtype is None else dtype)
  if dtype != jnp.uint32:
    raise KernelTypeError(None, "stateful_bits: the random state gives "
                          f"32-bit words, so dtype must be uint32, got "
                          f"{dtype}", user_frame())
  return _draw(shape, jnp.uint32)


def _uniform(shape, dtype, minval, maxval):
  """Uniform in [minval, maxval): 23 random mantissa bits of a float in
  [1, 2), minus 1, scaled (jax.random.uniform's conversion)."""
  shape = tuple(shape)
  minval = lax.broadcast_to_rank(lax.convert_element_type(minval, dtype),
                                 len(shape))
  maxval = lax.broadcast_to_rank(lax.convert_element_type(maxval, dtype),
                                 len(shape))
  nmant = jnp.finfo(dtype).nmant
  bits = _draw(shape, jnp.uint32)
  mantissa = lax.shift_right_logical(bits, jnp.array(32 - nmant, jnp.uint32))
  one_bits = np.array(1.0, dtype).view(np.uint32)
  in_1_2 = lax.bitcast_convert_type(
      lax.bitwise_or(mantissa, jnp.asarray(one_bits, jnp.uint32)), dtype)
  floats = in_1_2 - jnp.array(1.0, dtype)
  return lax.max(minval, lax.reshape(floats * (maxval - minval) + minval,
                                     shape))


def stateful_uniform(shape=(), dtype=None, minval=0.0, maxval=1.0):
  """`jax.random.uniform` without the key: floats in [minval, maxval)."""
  _outside_kernel("stateful_uniform")
  return _uniform(shape, _float32_only("stateful_uniform", dtype), minval,
                  maxval)


def stateful_normal(shape=(), dtype=None):
  """`jax.random.normal` without the key: standard normal floats."""
  _outside_kernel("stateful_normal")
  dtype = _float32_only("stateful_normal", dtype)
  lo = np.nextafter(np.array(-1.0, dtype), np.array(0.0, dtype), dtype=dtype)
  u = _uniform(shape, dtype, lo, np.array(1.0, dtype))
  return lax.mul(np.array(np.sqrt(2), dtype), lax.erf_inv(u))


def stateful_bernoulli(p=0.5, shape=None, mode="low"):
  """`jax.random.bernoulli` without the key: True with probability `p`."""
  _outside_kernel("stateful_bernoulli")
  if mode not in ("low", "high"):
    raise KernelTypeError(None, f"stateful_bernoulli: mode must be 'low' or "
                          f"'high', got {mode!r}", user_frame())
  dtype = lax.dtype(p)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise KernelTypeError(None, "stateful_bernoulli: the probability p must "
                          f"have a float dtype, got {dtype}", user_frame())
  dtype = _float32_only("stateful_bernoulli", dtype)
  p = lax.convert_element_type(p, dtype)
  shape = np.shape(p) if shape is None else tuple(shape)
  if mode == "low":
    return _uniform(shape, dtype, 0.0, 1.0) < p
  u1, u2 = _uniform((2, *shape), dtype, 0.0, 1.0)
  u2 = u2 * 2.0 ** -jnp.finfo(dtype).nmant   # resolution of one uniform
  return u2 < p - u1
