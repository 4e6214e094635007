"""The host backends' random generator, and the interpret backend's random
state.

The generator is counter based: the state is a threefry-2x32 key and a draw
counter. `prng_seed(s0, s1, ...)` makes the key by hashing the seeds with
threefry (key_{k+1} = threefry(key_k, (s_k, k)), key_0 = (0, 0)) and sets the
counter to 0; a draw of n words encrypts the counter blocks (counter, j),
j < ceil(n / 2), under the key, takes the n first of the output words (first
words, then second words) and adds 1 to the counter. So the same seeds give
the same words, other seeds other words, and each draw new words. The
functions take numpy or jax.numpy uint32 arrays: the Mosaic interpreter runs
them on numpy values, the interpret backend traces them.

The interpret backend keeps the state (key, key, counter: uint32[3]) in an
SMEM scratch: `with_prng_state` re-traces a kernel jaxpr that uses the
random primitives inside a `run_scoped` of that scratch, each `prng_seed`
and `prng_random_bits` (in loops and branches too) becoming reads and
writes of it, before the kernel is discharged.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax
from dsl.core.jax_internals import (close_jaxpr, ClosedJaxpr, core,
                                    linear_util as lu, partial_eval as pe)

from dsl.core.errors import KernelError, source_info_frame
from dsl.core.jaxpr_walk import CALL_PRIMITIVES, call_body, retrace, sub_jaxprs
from dsl.tpu.prng import prng_random_bits_p, prng_seed_p
from dsl.core.memory import MemorySpace
from dsl.core.normalize import scan_layout
from dsl.core.primitives import run_scoped, run_scoped_p

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


def threefry2x32(k0, k1, x0, x1):
  """Threefry-2x32 with 20 rounds: the words (x0, x1) encrypted under the
  key (k0, k1); uint32 arrays (numpy or jax), broadcast together."""
  ks = (k0, k1, k0 ^ k1 ^ np.uint32(_PARITY))
  x0, x1 = x0 + ks[0], x1 + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = (x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r))
      x1 = x1 ^ x0
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
  return x0, x1


def seed_key(xp, seeds):
  """The key (k0, k1) made from the seeds (uint32 scalars or 1-element
  arrays)."""
  k0 = k1 = xp.zeros((1,), np.uint32)
  for k, s in enumerate(seeds):
    s = xp.reshape(xp.asarray(s).astype(np.uint32), (1,))
    k0, k1 = threefry2x32(k0, k1, s, xp.full((1,), k, np.uint32))
  return k0, k1


def draw_words(xp, k0, k1, counter, n: int):
  """n uint32 words of the draw number `counter` under the key."""
  m = (n + 1) // 2
  x1 = xp.arange(m, dtype=np.uint32)
  x0 = xp.zeros((m,), np.uint32) + counter
  o0, o1 = threefry2x32(k0, k1, x0, x1)
  return xp.concatenate([o0, o1])[:n]


# ------------------------------------------------------------ interpret

def _state_type():
  return MemorySpace.SMEM((3,), jnp.uint32)


def _seed(state, eqn, seeds):
  k0, k1 = seed_key(jnp, seeds)
  state[...] = jnp.concatenate([k0, k1, jnp.zeros((1,), jnp.uint32)])
  return []


def _random_bits(state, eqn, invals):
  shape, dtype = eqn.params["shape"], eqn.params["dtype"]
  st = state[...]
  n = int(np.prod(shape, dtype=np.int64))
  words = draw_words(jnp, st[0:1], st[1:2], st[2], n)
  state[2] = st[2] + np.uint32(1)
  return lax.bitcast_convert_type(words, dtype).reshape(shape)


def _cond(state, eqn, invals):
  index, *ops = invals
  branches = [functools.partial(_run_closed, b, state)
              for b in eqn.params["branches"]]
  return lax.switch(index, branches, *ops)


def _while(state, eqn, invals):
  p = eqn.params
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  cconsts, bconsts, init = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]
  return lax.while_loop(
      lambda c: _run_closed(p["cond_jaxpr"], state, *cconsts, *c)[0],
      lambda c: _run_closed(p["body_jaxpr"], state, *bconsts, *c),
      list(init))


def _scan(state, eqn, invals):
  p = eqn.params
  nc, ncarry, _, _ = scan_layout(p)
  consts, init, xs = (invals[:nc], invals[nc:nc + ncarry],
                      invals[nc + ncarry:])

  def step(carry, x):
    out = _run_closed(p["jaxpr"], state, *consts, *carry, *x)
    return out[:ncarry], out[ncarry:]
  carry, ys = lax.scan(step, list(init), list(xs), length=p["length"],
                       reverse=p["reverse"], unroll=p["unroll"])
  return [*carry, *ys]


def _run_scoped(state, eqn, invals):
  jaxpr, n = eqn.params["jaxpr"], eqn.params["num_consts"]
  avals = [v.aval for v in jaxpr.invars[n:]]
  return run_scoped(lambda *refs: _run(jaxpr, (), [*invals, *refs], state),
                    *avals)


def _call(state, eqn, invals):
  jaxpr, consts, args = call_body(eqn.params, invals)
  return _run(jaxpr, consts, args, state)


@functools.cache
def _rules():
  """primitive -> rule(state, eqn, invals), for the equations that seed,
  draw or hold jaxprs that do."""
  rules = {prng_seed_p: _seed, prng_random_bits_p: _random_bits,
           lax.cond_p: _cond, lax.while_p: _while, lax.scan_p: _scan,
           run_scoped_p: _run_scoped}
  rules.update({p: _call for p in CALL_PRIMITIVES})
  return rules


def _threaded(eqn):
  """The rule of an equation that uses the random state, else None."""
  if eqn.primitive not in (prng_seed_p, prng_random_bits_p) and not any(
      uses_prng(j) for j in sub_jaxprs(eqn.params)):
    return None
  rule = _rules().get(eqn.primitive)
  if rule is None:
    raise KernelError(
        None, f"random numbers inside '{eqn.primitive.name}' are not "
        "supported by the interpret backend",
        source_info_frame(eqn.source_info))
  return rule


@functools.lru_cache(maxsize=1024)
def uses_prng(jaxpr: core.Jaxpr) -> bool:
  """Whether `jaxpr` (or a jaxpr inside it) seeds or draws."""
  for eqn in jaxpr.eqns:
    if eqn.primitive in (prng_seed_p, prng_random_bits_p):
      return True
    if any(uses_prng(j) for j in sub_jaxprs(eqn.params)):
      return True
  return False


def _run_closed(closed, state, *args):
  return _run(closed.jaxpr, closed.consts, args, state)


def _run(jaxpr: core.Jaxpr, consts, args, state) -> list:
  """Evaluates `jaxpr` in the current trace with the random state `state`."""
  def eval_eqn(eqn, invals):
    rule = _threaded(eqn)
    if rule is not None:
      return rule(state, eqn, invals)
    params = eqn.primitive.get_bind_params(eqn.params)
    return eqn.primitive.bind(*invals, **params)
  return retrace(jaxpr, consts, args, eval_eqn)


def with_prng_state(closed: ClosedJaxpr) -> ClosedJaxpr:
  """`closed` with its random state in an SMEM scratch around its body
  (unchanged when it neither seeds nor draws)."""
  if not uses_prng(closed.jaxpr):
    return closed

  def body(*args):
    return run_scoped(lambda state: _run(closed.jaxpr, closed.consts, args,
                                         state), _state_type())

  avals = [v.aval for v in closed.jaxpr.invars]
  jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(
      lu.wrap_init(body, debug_info=closed.jaxpr.debug_info), avals)
  return close_jaxpr(jaxpr, consts)
