"""The TPU's random generator in the Mosaic interpreter.

Each simulated device has its own random state, as each TPU core has, kept
across grid steps: a key and a draw counter (`Device.prng`).
`tpu.prng_set_seed_32` makes the key from its seeds and `tpu.prng_random_bits`
draws a vector of words and advances the counter, with the host backends'
generator (dsl/tpu/prng_state.py), so a kernel draws here the bits the
interpret backend draws. A draw before any seed is an error: a TPU's state
is undefined until the kernel seeds it.
"""
from __future__ import annotations

import math

import numpy as np

from dsl.tpu.prng_state import draw_words, seed_key
from lowering_mosaic.verification.interpreter.program import _fail, stateful
from lowering_mosaic.verification.interpreter.value_ops import (result_dtype,
                                                                result_shape)


@stateful("tpu.prng_set_seed_32")
def _seed(op, c):
  def fn(frame, *seeds):
    k0, k1 = seed_key(np, [np.asarray(s).astype(np.uint32) for s in seeds])
    frame.world.devices[frame.device].prng = [k0, k1, np.uint32(0)]
  return fn, list(op.operands), False


@stateful("tpu.prng_random_bits")
def _random_bits(op, c):
  shape, dtype = result_shape(op), result_dtype(op)
  n = math.prod(shape)

  def fn(frame):
    state = frame.world.devices[frame.device].prng
    if state is None:
      _fail(frame, "random bits drawn before prng_seed (a TPU's random "
            "state is undefined until the kernel seeds it)")
    k0, k1, counter = state
    words = draw_words(np, k0, k1, counter, n)
    state[2] = np.uint32((int(counter) + 1) % (1 << 32))
    return words.view(dtype).reshape(shape)
  return fn, [], False
