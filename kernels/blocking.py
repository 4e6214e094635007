"""Block sizes per backend, shared by the kernels of this library.

Each backend wants different blocks:

- `interpret` (the CPU default) runs the parallel grid dims as one vectorized
  XLA computation and the sequential ones as a loop, so big blocks that divide
  the array exactly are best: few loop steps and no padding copies.
- `triton` / `triton_interpret` want power-of-two blocks sized for one GPU
  program (registers and shared memory).
- `mosaic` / `mosaic_interpret` want blocks whose last two dims are multiples
  of (8, 128) or the full array dims.
- `mosaic_gpu` wants tiles of 64-row multiples (the warpgroup's wgmma
  register layout, which row reductions use; TMA zero-fills rows past the
  array) that fit shared memory (227 KiB per CTA, with double buffering).
"""
from __future__ import annotations

import functools

import jax
from jax import tree_util

from dsl import triton as plt
from dsl.core import backends, config
from dsl.core.jax_internals import core
from dsl.tools import autotune_cache, gpu_defaults


def resolve_backend(backend: str | None) -> str:
  """The backend a `backend=None` kernel will run on, for choosing blocks."""
  return backends.resolve(backend)


def choose_backend(kernel: str, backend: str | None) -> str | None:
  """The backend `kernels.<kernel>` passes to its pallas_calls: `backend`
  when the caller gives one; on a GPU with None, the shipped choice for this
  kernel and device (`dsl/tools/data/gpu_backends.json`), or `mosaic_gpu` when
  `jax_pallas_use_mosaic_gpu` asks for it (`dsl.core.backends.resolve`); None
  elsewhere (pallas_call picks the platform's backend)."""
  if backend is not None or jax.default_backend() != "gpu":
    return backend
  if config.use_mosaic_gpu():
    return backends.resolve(None)
  choice = gpu_defaults.backend_for(f"kernels.{kernel}")
  return choice.backend if choice else None


def platform_backend(kernel: str, platform: str) -> str:
  """The backend `kernels.<kernel>` runs on when lowered for `platform` (a
  lowering platform: "cpu", "cuda", "rocm", "tpu") and its caller gives
  none: for this process's platform what `choose_backend` says, else (and
  for other platforms) the platform's default backend. Always a name: in
  an export for several platforms every version is lowered for each of
  them, so each names the backend its blocks are for."""
  if platform == backends.lowering_platform():
    chosen = choose_backend(kernel, None)
    if chosen is not None:
      return chosen
  return backends.platform_default(platform)


def _traced(leaves) -> bool:
  return any(isinstance(x, core.Tracer) for x in leaves)


def _is_operand(x) -> bool:
  return isinstance(x, (jax.Array, core.Tracer)) or hasattr(x, "__array__")


def per_platform(kernel: str):
  """Decorates `kernels.<kernel>`'s entry point `fn(*arrays, ...,
  backend=None, ...)` so that it picks its backend and blocks for the
  platform it is lowered for, not for the platform of this process.

  Traced (under `jax.jit`, `jax.export`, `grad`, ...) with `backend=None`,
  the call becomes `jax.lax.platform_dependent` over one version of the
  kernel per lowering platform (`platform_backend`), each with that
  backend's blocks: lowered for one platform, only its version is lowered
  (`.lower(lowering_platforms=("cuda",))` on a CPU host gets the GPU
  kernel); exported for several, the module carries each one. Called on
  concrete arrays, or with a backend, it runs as before."""

  def decorate(fn):
    @functools.wraps(fn)
    def wrapper(*args, backend=None, **kwargs):
      leaves, tree = tree_util.tree_flatten((args, kwargs))
      if backend is not None or not _traced(leaves):
        return fn(*args, backend=backend, **kwargs)
      operand = [_is_operand(x) for x in leaves]
      operands = [x for x, o in zip(leaves, operand) if o]

      def version(backend, *values):
        it = iter(values)
        full = [next(it) if o else x for x, o in zip(leaves, operand)]
        a, kw = tree_util.tree_unflatten(tree, full)
        return fn(*a, backend=backend, **kw)

      versions: dict[str, object] = {}
      branches = {}
      for platform in backends.DEFAULT_FOR_PLATFORM:
        chosen = platform_backend(kernel, platform)
        if chosen not in versions:
          versions[chosen] = functools.partial(version, chosen)
        branches[platform] = versions[chosen]
      return jax.lax.platform_dependent(*operands, **branches)
    return wrapper
  return decorate


def gpu_config(kernel: str, dims, dtype, backend: str, *given) -> dict:
  """The shipped default config of `kernels.<kernel>` (or one of its
  kernels, e.g. "flash_attention.dq") at this size on this GPU
  (`dsl/tools/data/gpu_configs.json`: block sizes, num_warps, num_stages), or {}
  where the kernel's own choice applies: a CPU backend, no GPU, no entry, or
  block sizes the caller gave (`given`, any not None)."""
  if any(g is not None for g in given):
    return {}
  hit = gpu_defaults.lookup(f"kernels.{kernel}", dims, dtype, backend)
  return dict(hit.config) if hit else {}


def _code(backend: str) -> str:
  """What `backend` builds, from its record in the registry."""
  return backends.record(backend).code


def runs_on_host(backend: str) -> bool:
  """A backend that runs kernels on the host (a CPU backend), from its
  record in the registry."""
  return backends.record(backend).on_host


def is_jax(backend: str) -> bool:
  """A backend that runs kernels as plain JAX ops (`interpret`)."""
  return _code(backend) == "jax"


def is_triton(backend: str) -> bool:
  return _code(backend) == "triton"


def is_mosaic(backend: str) -> bool:
  """A Mosaic backend, TPU or GPU."""
  return _code(backend) in ("mosaic", "mosaic_gpu")


def is_mosaic_gpu(backend: str) -> bool:
  return _code(backend) == "mosaic_gpu"


GPU_ROWS = 64                   # rows of a warpgroup's wgmma layout
GPU_ROW_BLOCK_BYTES = 96 * 1024  # one (rows, cols) block of a row kernel


def gpu_rows(n: int, target: int = GPU_ROWS) -> int:
  """Rows of a mosaic_gpu block: a multiple of 64, at most `target` (or
  64), at least 64 even past a shorter array (TMA zero-fills those rows)."""
  rows = max(GPU_ROWS, -(-n // GPU_ROWS) * GPU_ROWS)
  return max(GPU_ROWS, min(rows, target) // GPU_ROWS * GPU_ROWS)


def gpu_cols(n: int, itemsize: int, rows: int = GPU_ROWS) -> int:
  """Columns of a mosaic_gpu row-kernel block: the whole row when a block
  of `rows` such rows stays within GPU_ROW_BLOCK_BYTES and TMA can move it
  (at most 256 columns, or whole 128-byte swizzle spans), else the widest
  power of two that does."""
  span = 128 // itemsize
  if rows * n * itemsize <= GPU_ROW_BLOCK_BYTES and (n <= 256 or n % span == 0):
    return n
  return max(span, pow2_floor(GPU_ROW_BLOCK_BYTES // (rows * itemsize)))


def is_tpu(backend: str) -> bool:
  """The Mosaic TPU backends (not "mosaic_gpu"), whose blocks follow the
  TPU tiling rule."""
  return _code(backend) == "mosaic"


def pow2_floor(n: int) -> int:
  p = 1
  while p * 2 <= n:
    p *= 2
  return p


def divisor_block(n: int, target: int, multiple: int = 1) -> int:
  """A block for a dim of size `n`, at most `target`.

  The whole dim when it fits; else the largest divisor of `n` that is a
  multiple of `multiple` and at least target/4 (no partial block, so no
  padding); else `target` itself (the last block is partial and masked).
  """
  if n <= target:
    return n
  target = max(multiple, target - target % multiple)
  for b in range(target, max(multiple, target // 4) - 1, -multiple):
    if n % b == 0:
      return b
  return target


def block_for(n: int, backend: str, *, interpret: int, triton: int,
              mosaic: int, mosaic_multiple: int = 8) -> int:
  """The block for a dim of size `n` on `backend`, from per-backend targets."""
  if is_triton(backend):
    return min(pow2_floor(max(n, 1)), triton)
  if is_mosaic(backend):
    if n <= mosaic:
      return n
    return divisor_block(n, mosaic, mosaic_multiple)
  return divisor_block(n, interpret)


def tuned(kernel: str, dims, dtype, backend: str | None) -> dict:
  """The autotuning cache's winner for `kernels.<kernel>` at this size on this
  device and backend (`python -m benchmarks --autotune` fills it), or {}."""
  try:
    cfg = autotune_cache.lookup(f"kernels.{kernel}",
                                autotune_cache.size_key(dims, dtype),
                                backend=resolve_backend(backend))
  except Exception:  # noqa: BLE001 - a broken cache never breaks a kernel
    return {}
  return cfg or {}


def triton_params(backend: str, *, num_warps: int | None,
                  num_stages: int | None = None):
  """Launch parameters for Triton backends (None elsewhere, or when neither
  is given: the lowering's defaults)."""
  if not is_triton(backend) or (num_warps is None and num_stages is None):
    return None
  return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def row_warps(width: int) -> int:
  """Warps for one program per row of `width` elements (measured on an H100:
  16 warps reach the copy bandwidth for 8192-wide bf16 rows)."""
  if width >= 4096:
    return 16
  if width >= 1024:
    return 8
  return 4
