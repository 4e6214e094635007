"""The functions a row times: dsl on one backend, and its peers.

    dsl     the kernel through `dsl.pallas_call(..., backend=<row backend>)`
    xla     the kernel's plain-jnp reference, compiled by XLA (always)
    pallas  the same kernel source through `jax.experimental.pallas`:
            interpret mode for host backends, Triton on GPU (Mosaic GPU
            for the mosaic_gpu rows), Mosaic on TPU
    triton  a hand-written Triton kernel (GPU only, where one is natural)
"""
from __future__ import annotations

from benchmarks import platform_info

PEERS = ("xla", "pallas", "triton")
PEER_TITLES = {"xla": "XLA", "pallas": "Pallas", "triton": "Triton"}


class PeerUnavailable(Exception):
  """The peer cannot run here; str(e) is what its column shows."""


def _triton_params(module, config):
  if "num_warps" not in config and "num_stages" not in config:
    return None
  return module.CompilerParams(num_warps=config.get("num_warps"),
                               num_stages=config.get("num_stages"))


def dsl_fn(bench, backend, size, dtype, config):
  import dsl
  kw = {"backend": backend}
  if dsl.core.backends.REGISTRY[backend].code == "triton":
    params = _triton_params(dsl.triton, config)
    if params is not None:
      kw["compiler_params"] = params
  return bench.build(dsl, size, dtype, config, **kw)


def xla_fn(bench):
  if bench.reference is None:
    raise PeerUnavailable("n/a: no --reference")
  return bench.reference


def pallas_fn(bench, mode, size, dtype, config):
  if not bench.pallas_source:
    raise PeerUnavailable(getattr(bench, "pallas_note",
                                  "n/a: source imports dsl"))
  reason = platform_info.pallas_unavailable(mode)
  if reason:
    raise PeerUnavailable(reason)
  from jax.experimental import pallas as jpl
  kw = {}
  if mode == "interpret":
    kw["interpret"] = True
  elif mode == "triton":
    from jax.experimental.pallas import triton as jpl_triton
    params = _triton_params(jpl_triton, config)
    if params is not None:
      kw["compiler_params"] = params
  elif mode == "mosaic_gpu":
    # The type of compiler_params picks Pallas's Mosaic GPU lowering.
    from jax.experimental.pallas import mosaic_gpu as jpl_mgpu
    kw["compiler_params"] = jpl_mgpu.CompilerParams()
  return bench.build(jpl, size, dtype, config, **kw)


def triton_fn(bench, size, dtype, config):
  if not platform_info.has_gpu():
    raise PeerUnavailable("n/a: no GPU")
  from benchmarks import triton_peers
  try:
    fn = bench.triton_peer(size, dtype, config)
  except triton_peers.PeerUnavailable as e:
    raise PeerUnavailable(str(e))
  if fn is None:
    raise PeerUnavailable("n/a: none written")
  return fn
