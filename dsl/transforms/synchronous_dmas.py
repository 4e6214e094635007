"""A kernel's local DMAs made synchronous, for the recording kernel.

The recording kernel replays the forward pass and saves, at every grid
point, the scratch state the point finds on entry. A kernel that prefetches
the next point's data (a DMA started at one point and waited at the next)
has that DMA in flight at the next point's entry: reading its destination
then is a race on a TPU. The function each derived kernel differentiates
lets a DMA land when it starts (its discharged form), so the replay does
the same: each local `dma_start` is followed by its wait at once, and the
kernel's own local waits are dropped (the semaphore counts come out the
same). Remote DMAs, and the waits on them, are left as they are.
"""
from __future__ import annotations

from dsl.core.jax_internals import ClosedJaxpr
from dsl.core.normalize import rewrite_closed
from dsl.core.operand_layout import pack, unpack
from dsl.tpu.primitives import dma_start_p, dma_wait_p


def _start_and_wait(*flat, layout, **params):
  dma_start_p.bind(*flat, layout=layout, **params)
  a = unpack(flat, layout)
  if a["device_id"]:
    return []
  wait, wait_layout = pack(sem=a["dst_sem"], sem_t=a["dst_sem_t"],
                           src=a["src"], src_t=a["src_t"], dst=a["dst"],
                           dst_t=a["dst_t"], device_id=(), peer_sem=None,
                           peer_sem_t=())
  dma_wait_p.bind(*wait, layout=wait_layout, side="local",
                  device_id_type=params["device_id_type"],
                  device_id_axes=params["device_id_axes"],
                  mesh_axes=params["mesh_axes"])
  return []


def _wait(*flat, side, **params):
  if side != "local":
    dma_wait_p.bind(*flat, side=side, **params)
  return []


_RULES = {dma_start_p: _start_and_wait, dma_wait_p: _wait}


def synchronous_dmas(closed: ClosedJaxpr) -> ClosedJaxpr:
  """`closed` with its local DMAs synchronous (unchanged without DMAs)."""
  return rewrite_closed(closed, _RULES)
