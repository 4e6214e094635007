"""What the runner needs to know about one benchmark kernel."""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.usage_errors import UsageError
from dsl.tools import gpu_defaults

Size = tuple[int, ...]
Config = dict[str, Any]

def random_inputs(shapes, dtype, seed: int = 0):
  """Deterministic normal inputs, one array per shape, on the default device."""
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return tuple(jax.random.normal(k, s, jnp.float32).astype(dtype)
               for k, s in zip(keys, shapes))


def pow2_at_most(n: int) -> int:
  return 1 << (max(1, n).bit_length() - 1)


class KernelBench:
  """One kernel, written once against a `pl` module (dsl or Pallas).

  `build(pl, size, dtype, config, **call_kw)` returns a function of the
  inputs that calls `pl.pallas_call(..., **call_kw)`; call_kw selects the
  backend (`backend=` for dsl, `interpret=True` for Pallas) and compiler
  parameters. `reference` is the plain-jnp version that XLA runs as a peer.
  """
  name: str = ""
  summary: str = ""
  dims_doc: str = ""          # e.g. "N" or "M[xKxN]"
  bound: str = "memory"        # "memory" (GB/s) or "compute" (FLOP/s)
  source: str = "suite"        # "suite" (benchmarks/suite) or "kernels"
  pallas_source: bool = True   # the same source runs under jax.experimental.pallas
  tunable: bool = True

  # --- sizes
  def normalize(self, dims: Size) -> Size:
    raise NotImplementedError

  def default_sizes(self, platform: str) -> list[Size]:
    raise NotImplementedError

  def quick_sizes(self, platform: str) -> list[Size]:
    return self.default_sizes(platform)[-1:]

  # --- data
  def inputs(self, size: Size, dtype) -> tuple:
    raise NotImplementedError

  def reference(self, *inputs):
    raise NotImplementedError

  # --- kernel
  def default_config(self, size: Size, backend: str, platform: str) -> Config:
    return {}

  def search_space(self, size: Size, backend: str, platform: str) -> list[Config]:
    return [self.default_config(size, backend, platform)]

  def shipped(self, size: Size, backend: str, dtype
              ) -> gpu_defaults.Default | None:
    """The shipped GPU default of this kernel at this size on this machine's
    GPU (dsl/tools/data/gpu_configs.json), or None."""
    return gpu_defaults.lookup(self.name, size, dtype, backend)

  def shown_config(self, size: Size, backend: str, dtype, config: Config
                   ) -> Config:
    """What the config column shows for a row that runs `config`."""
    return config

  def chosen_config(self, size: Size, backend: str, platform: str, dtype
                    ) -> tuple[Config, str]:
    """The config a row runs when the user gives none, and where it came
    from: the shipped GPU default for this device over the kernel's own
    default (`default_config`), else the latter alone."""
    config = self.default_config(size, backend, platform)
    hit = self.shipped(size, backend, dtype)
    if hit is None:
      return self.fix_config(size, config, dtype), "default"
    return (self.fix_config(size, {**config, **hit.config}, dtype),
            f"shipped: {hit.key} ({hit.where})")

  def fix_config(self, size: Size, config: Config, dtype=None) -> Config:
    """Clips a (cached or user) config to what this size allows."""
    return dict(config)

  def build(self, pl, size: Size, dtype, config: Config, **call_kw) -> Callable:
    raise NotImplementedError

  def grid_points(self, size: Size, config: Config) -> int:
    return 1

  # --- accounting
  def flops(self, size: Size) -> float:
    return 0.0

  def io_bytes(self, size: Size, dtype) -> float:
    return 0.0

  def tolerance(self, dtype) -> float:
    return 1e-4 if jnp.dtype(dtype).itemsize >= 4 else 5e-2

  def triton_peer(self, size: Size, dtype, config: Config):
    """A hand-written Triton kernel (GPU only) or None where none is written."""
    return None

  # --- availability (kernels/ adapters override)
  def unavailable(self) -> str | None:
    return None

  def check_dims(self, dims: Size, allowed: tuple[int, ...]) -> None:
    if len(dims) not in allowed:
      want = " or ".join(str(a) for a in allowed)
      raise UsageError(
          f"size {'x'.join(map(str, dims))} has {len(dims)} dim(s); kernel "
          f"'{self.name}' takes {want} ({self.dims_doc})")


def unique_configs(configs: list[Config]) -> list[Config]:
  seen, out = set(), []
  for c in configs:
    key = tuple(sorted((k, str(v)) for k, v in c.items()))
    if key not in seen:
      seen.add(key)
      out.append(c)
  return out


def max_rel_err(got, want) -> float:
  got = np.asarray(jnp.asarray(got, jnp.float32))
  want = np.asarray(jnp.asarray(want, jnp.float32))
  if got.shape != want.shape:
    return math.inf
  scale = max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
  return float(np.max(np.abs(got - want))) / scale if got.size else 0.0
