"""JVP rules of the kernel primitives that move data between refs: DMAs,
semaphores and `run_scoped`.

`jvp.py` differentiates the kernel jaxpr with JAX's `jvp_jaxpr`, which puts
a tangent ref beside each float ref; these rules say what the primitives do
to those tangent refs:

- `dma_start` runs the primal DMA, then copies the tangent of the source
  window into the tangent of the destination window (adding it, for an
  accumulating DMA) with a DMA of its own on a scoped semaphore that it waits
  for at once. The user's semaphores count the primal DMA only, and the
  tangent copy goes through the DMA engine, so it also works where a ref in
  HBM cannot be loaded directly (Mosaic). A source without a tangent (an
  input that is not differentiated) writes zeros.
- DMA waits and the semaphore operations have no tangents.
- `run_scoped` allocates a tangent buffer beside each float allocation and
  runs the differentiated body.
"""
from __future__ import annotations

import jax.numpy as jnp
from dsl.core.jax_internals import (ad, close_jaxpr, core, source_info_util,
                                    state_types)

from dsl.core.dtypes import has_tangent
from dsl.core.errors import KernelError, source_info_frame
from dsl.core.memory import MemorySpace
from dsl.core.primitives import run_scoped, run_scoped_p
from dsl.core.semaphores import SemaphoreType
from dsl.core.operand_layout import unpack
from dsl.tpu.primitives import (dma_start_p, dma_wait_p, make_async_copy,
                                semaphore_read_p, semaphore_signal_p,
                                semaphore_wait_p, view_shape)


def _is_zero(t) -> bool:
  return type(t) is ad.Zero


def _view(ref, transforms):
  return state_types.TransformedRef(ref, transforms) if transforms else ref


def _copy_now(src, dst, add: bool):
  """A local DMA `src -> dst` on a scoped semaphore, waited for at once."""
  def body(sem):
    make_async_copy(src, dst, sem).start(add=add).wait()
  run_scoped(body, SemaphoreType.DMA(()))


def _write_zeros(dst, shape, dtype):
  """Zeros into the window `dst` (by DMA from a scoped VMEM buffer)."""
  def body(buf, sem):
    buf[...] = jnp.zeros(shape, dtype)
    make_async_copy(buf, dst, sem).start().wait()
  run_scoped(body, MemorySpace.VMEM(shape, dtype), SemaphoreType.DMA(()))


def _dma_start_jvp(primals, tangents, **params):
  dma_start_p.bind(*primals, **params)
  layout = params["layout"]
  p, t = unpack(primals, layout), unpack(tangents, layout)
  if _is_zero(t["dst"]):
    return [], []
  if p["device_id"]:
    raise KernelError(None, "jax.jvp / jax.grad of a remote DMA "
                      "(make_async_remote_copy) is not supported: give the "
                      "kernel a hand-written backward pass with "
                      "jax.custom_vjp", _line())
  dst = _view(t["dst"], p["dst_t"])
  if not _is_zero(t["src"]):
    _copy_now(_view(t["src"], p["src_t"]), dst, params["add"])
  elif not params["add"]:
    dtype = core.typeof(t["dst"]).dtype
    _write_zeros(dst, view_shape(t["dst"], p["dst_t"]), dtype)
  return [], []


def _line():
  return source_info_frame(source_info_util.current())


def _no_tangents(prim):
  def rule(primals, tangents, **params):
    out = prim.bind(*primals, **params)
    if prim.multiple_results:
      return out, [ad.Zero(core.typeof(o).to_tangent_aval()) for o in out]
    return out, ad.Zero(core.typeof(out).to_tangent_aval())
  ad.primitive_jvps[prim] = rule


def _tangent_ref_aval(aval):
  return state_types.AbstractRef(aval.inner_aval.to_tangent_aval(),
                                 memory_space=aval.memory_space)


def _run_scoped_jvp(primals, tangents, *, jaxpr, num_consts):
  scoped = [v.aval for v in jaxpr.invars[num_consts:]]
  const_nz = [not _is_zero(t) for t in tangents]
  scoped_nz = [has_tangent(a.inner_aval.dtype) for a in scoped]
  jj, out_nz = ad.jvp_jaxpr(close_jaxpr(jaxpr, ()),
                            const_nz + scoped_nz, instantiate=False)
  t_consts = [t for t in tangents if not _is_zero(t)]
  t_scoped = [_tangent_ref_aval(a) for a, nz in zip(scoped, scoped_nz) if nz]
  n_scoped = len(scoped)

  def body(*refs):
    bufs, t_bufs = refs[:n_scoped], refs[n_scoped:]
    return core.eval_jaxpr(jj.jaxpr, jj.consts, *primals, *bufs, *t_consts,
                           *t_bufs)

  outs = run_scoped(body, *scoped, *t_scoped)
  n_out = len(jaxpr.outvars)
  primal_out, t_iter = outs[:n_out], iter(outs[n_out:])
  t_out = [next(t_iter) if nz else ad.Zero(v.aval.to_tangent_aval())
           for v, nz in zip(jaxpr.outvars, out_nz)]
  return primal_out, t_out


ad.primitive_jvps[dma_start_p] = _dma_start_jvp
ad.primitive_jvps[run_scoped_p] = _run_scoped_jvp
for _p in (dma_wait_p, semaphore_signal_p, semaphore_wait_p,
           semaphore_read_p):
  _no_tangents(_p)
