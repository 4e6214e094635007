"""Model checking of Mosaic kernels with SPIN.

    import lowering_mosaic.verify
    report = lowering_mosaic.verify(f, *args, num_devices=4)
    report.kind     # "ok" | "race" | "deadlock" | "semaphore" | "bound" | "error"
    print(report)   # the counterexample, in the kernel's source lines

`f(*args)` is traced (args may be arrays or `jax.ShapeDtypeStruct`s), every
`pallas_call` in it is lowered to its Mosaic module, the module becomes a
Promela model (lowering_mosaic/verification/promela/) and SPIN searches all of its
interleavings. A `plgpu.kernel` is checked on the mbarrier protocol its
warpgroups write instead (lowering_mosaic/gpu/plgpu_model.py). Command line:

    python -m lowering_mosaic.verify kernel.pml
    python -m lowering_mosaic.verify my.module:function f32[8,128] ...
    python -m lowering_mosaic.verify kernels.collectives:all_gather \
        f32[32,128] --axis x=4     # per device, in shard_map over x

See docs/verification.md.
"""
from __future__ import annotations

import argparse
import functools
import inspect
import os
import re
import sys
import types
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from dsl.core.inspection import traced_kernels
from dsl.tools.targets import load_function
from lowering_mosaic.gpu import plgpu_model
from lowering_mosaic.tpu.mlir_modules import module_of
from lowering_mosaic.verification.promela import Options, to_promela
from lowering_mosaic.verification.promela.dump import (kernel_name_of,
                                                      maybe_dump_text)
from lowering_mosaic.verification.promela.spin_report import Report, Reports
from lowering_mosaic.verification.promela.spin import (SpinNotFoundError,
                                                       require_spin, run_spin)

__all__ = ["verify", "verify_module", "verify_promela", "models", "main",
           "SpinNotFoundError"]


def _options(queue, check_entry, max_parallel, max_cells) -> Options:
  return Options(queue=int(queue), check_entry=bool(check_entry),
                 max_parallel=int(max_parallel), max_cells=int(max_cells))


def verify_module(module, *, num_devices: Optional[int] = None,
                  max_depth: int = 200_000, timeout_s: float = 60.0,
                  memory_mb: int = 512, queue: int = 4,
                  check_entry: bool = True, max_parallel: int = 4,
                  max_cells: int = 16, keep_dir: Optional[str] = None
                  ) -> Report:
  """Verifies one Mosaic module (an `ir.Module` from `lowering_mosaic`).
  The model checked is written to `jax_pallas_dump_promela_to` when set."""
  require_spin()
  opts = _options(queue, check_entry, max_parallel, max_cells)
  text = to_promela(module, num_devices, opts)
  maybe_dump_text(text, kernel_name_of(module))
  return verify_promela(text, max_depth=max_depth, timeout_s=timeout_s,
                        memory_mb=memory_mb, keep_dir=keep_dir)


def verify_promela(model: str, *, max_depth: int = 200_000,
                   timeout_s: float = 60.0, memory_mb: int = 512,
                   keep_dir: Optional[str] = None) -> Report:
  """Verifies a Promela model: its text, or the path of a `.pml` file (one
  written by `jax_pallas_dump_promela_to` translates back to kernel lines)."""
  text = model
  path = None
  if "\n" not in model and os.path.exists(model):
    path = model
    with open(model) as fh:
      text = fh.read()
  name = "model"
  if path:
    name = re.sub(r"[^A-Za-z0-9_.-]", "_",
                  os.path.splitext(os.path.basename(path))[0]) or "model"
  if plgpu_model.is_plgpu_model(text):
    return plgpu_model.verify_model(text, max_depth=max_depth,
                                    timeout_s=timeout_s, memory_mb=memory_mb,
                                    keep_dir=keep_dir, name=name)
  workdir = None
  if keep_dir:
    os.makedirs(keep_dir, exist_ok=True)
    workdir = keep_dir
  return run_spin(text, max_depth=max_depth, timeout_s=timeout_s,
                  memory_mb=memory_mb, workdir=workdir, name=name)


def verify(f, *args, num_devices: Optional[int] = None,
           max_depth: int = 200_000, timeout_s: float = 60.0,
           memory_mb: int = 512, queue: int = 4, check_entry: bool = True,
           max_parallel: int = 4, max_cells: int = 16,
           keep_dir: Optional[str] = None, **kwargs):
  """Checks every `pallas_call` in `f(*args)` for races and deadlocks on
  all interleavings of its devices, grid points and DMA engines.

  num_devices: devices running the kernel (default: the shard_map mesh the
    kernel is called in, else 1).
  max_depth: SPIN's search depth limit (steps along one interleaving).
  timeout_s: wall-clock limit of each search; memory_mb: its memory limit.
  queue: DMA queue slots per device (a start blocks while they are full).
  check_entry: a remote DMA or signal reaching a device before it entered
    the kernel counts as a race (real TPUs need a barrier handshake).
  max_parallel: parallel grid points per device modelled as processes of
    their own; beyond this they run in order.
  keep_dir: keep the model, pan.c and the trail there.

  Returns a `Report` (one kernel) or a `Reports` list (several); `.kind` is
  ok / race / deadlock / semaphore / bound / error. Raises
  `SpinNotFoundError` (saying `apt-get install spin`) without SPIN.
  """
  require_spin()
  kernels = list(traced_kernels(f, *args, **kwargs))
  if not kernels:
    raise ValueError("verify: the function calls no pallas_call")
  search = dict(max_depth=max_depth, timeout_s=timeout_s, memory_mb=memory_mb)
  reports = []
  for k, (spec, mesh_axes) in enumerate(kernels):
    sub = os.path.join(keep_dir, f"kernel{k}") if keep_dir and len(
        kernels) > 1 else keep_dir
    if plgpu_model.is_plgpu_kernel(spec):
      reports.append(plgpu_model.verify_kernel(spec, keep_dir=sub, **search))
      continue
    reports.append(verify_module(
        module_of(spec, mesh_axes), num_devices=num_devices, queue=queue,
        check_entry=check_entry, max_parallel=max_parallel,
        max_cells=max_cells, keep_dir=sub, **search))
  return reports[0] if len(reports) == 1 else Reports(reports)


def models(f, *args, num_devices: Optional[int] = None,
           options: Optional[Options] = None, **kwargs) -> list[str]:
  """The Promela model of every pallas_call in `f(*args)`: a
  `plgpu.kernel`'s mbarrier protocol (lowering_mosaic/gpu/plgpu_model.py),
  any other kernel's Mosaic module."""
  return [plgpu_model.kernel_model(spec)
          if plgpu_model.is_plgpu_kernel(spec) else
          to_promela(module_of(spec, mesh_axes), num_devices, options)
          for spec, mesh_axes in traced_kernels(f, *args, **kwargs)]


# ------------------------------------------------------------ CLI

_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16",
           "i32": "int32", "i16": "int16", "i8": "int8", "u8": "uint8",
           "u32": "uint32", "bool": "bool", "f64": "float64",
           "i64": "int64"}


def parse_shape(text: str):
  """'f32[8,128]', 'float32[8, 128]' or '8x128xf32' -> ShapeDtypeStruct."""
  t = text.strip()
  m = re.fullmatch(r"([A-Za-z0-9_]+)\[([\d,\s]*)\]", t)
  if m:
    dt, dims = m.group(1), m.group(2)
    shape = tuple(int(d) for d in dims.replace(" ", "").split(",") if d)
  else:
    parts = t.split("x")
    if len(parts) < 2 or not all(p.isdigit() for p in parts[:-1]):
      raise ValueError(f"cannot read the shape {text!r}; write e.g. "
                       "f32[8,128] or 8x128xf32")
    dt, shape = parts[-1], tuple(int(p) for p in parts[:-1])
  return jax.ShapeDtypeStruct(shape, jnp.dtype(_DTYPES.get(dt, dt)))


def _needs_axis_name(fn) -> bool:
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False
  p = params.get("axis_name")
  return p is not None and p.default is p.empty


def parse_axis(text: str) -> tuple[str, int]:
  """'x=4' -> ('x', 4): a mesh axis name and its size."""
  name, _, size = text.partition("=")
  if not name.isidentifier() or not size.isdigit() or int(size) < 1:
    raise ValueError(f"cannot read the mesh axis {text!r}; write NAME=SIZE, "
                     "e.g. x=4")
  return name, int(size)


def in_shard_map(fn, axis: str, size: int):
  """`fn` run per device inside `shard_map` over a 1-D mesh axis `axis` of
  `size` devices, given `axis_name=axis` when it takes one. Its arguments
  are split along dim 0; `.global_args` turns per-device shapes into them."""
  if len(jax.devices()) < size:
    raise ValueError(f"the mesh axis {axis}={size} needs {size} devices, "
                     f"there are {len(jax.devices())}; use --host-devices")
  mesh = Mesh(np.array(jax.devices()[:size]), (axis,))
  body = functools.partial(fn, axis_name=axis) if _needs_axis_name(fn) else fn

  def per_device(*shards):
    return jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis),
                         check_vma=False)(*shards)

  def global_args(args):
    return [jax.ShapeDtypeStruct((a.shape[0] * size, *a.shape[1:]), a.dtype)
            for a in args]
  per_device.global_args = global_args
  return per_device


def _target(fn, axis_text: Optional[str], num_devices: Optional[int], args):
  """The function to verify and its arguments: `fn` itself, or `fn` inside
  `shard_map` when --axis is given or `fn` needs an `axis_name`."""
  if axis_text is None and not _needs_axis_name(fn):
    return fn, args
  if axis_text is None:
    axis_text = f"x={num_devices or 2}"
    print(f"note: {getattr(fn, '__name__', 'the function')} takes axis_name: "
          f"running it in shard_map over the mesh axis {axis_text} (choose "
          "with --axis NAME=SIZE); the shapes are per device", file=sys.stderr)
  axis, size = parse_axis(axis_text)
  wrapped = in_shard_map(fn, axis, size)
  return wrapped, wrapped.global_args(args)


def _host_devices(n: int):
  flag = "--xla_force_host_platform_device_count"
  flags = os.environ.get("XLA_FLAGS", "")
  if flag not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {flag}={n}".strip()


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
      prog="python -m lowering_mosaic.verify",
      description="Check a Mosaic kernel (or a Promela model of one) for "
      "races, deadlocks and unbalanced semaphores with SPIN.",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="examples:\n"
      "  python -m lowering_mosaic.verify mypkg.kernels:f f32[8,128]\n"
      "  python -m lowering_mosaic.verify path/to/file.py:f f32[8,128]\n"
      "  # a collective kernel that takes axis_name, on 4 devices:\n"
      "  python -m lowering_mosaic.verify kernels.collectives:all_gather "
      "f32[32,128] --axis x=4\n"
      "  python -m lowering_mosaic.verify kernel.pml\n"
      "exit status: 0 ok, 1 a race, deadlock, semaphore or other error in "
      "the kernel, 2 the search hit a bound (or bad arguments), 3 SPIN is "
      "not installed (Debian/Ubuntu: apt-get install spin)")
  ap.add_argument("target", help="a .pml file, or module:function (also "
                  "path/to/file.py:function) calling pallas_call")
  ap.add_argument("shapes", nargs="*", help="argument shapes for "
                  "module:function, e.g. f32[8,128] or 8x128xf32")
  ap.add_argument("--num-devices", type=int, default=None,
                  help="devices running the kernel (default: the mesh axis "
                  "of --axis, else 1)")
  ap.add_argument("--axis", metavar="NAME=SIZE", default=None,
                  help="run module:function per device inside shard_map over "
                  "a mesh axis NAME of SIZE devices, passing axis_name=NAME "
                  "when it takes one; SHAPES are then per device. A function "
                  "that needs axis_name gets --axis x=2 by default")
  ap.add_argument("--max-depth", type=int, default=200_000)
  ap.add_argument("--timeout", type=float, default=60.0, help="seconds")
  ap.add_argument("--memory-mb", type=int, default=512)
  ap.add_argument("--queue", type=int, default=4,
                  help="DMA queue slots per device")
  ap.add_argument("--no-entry-check", action="store_true",
                  help="allow remote writes before the peer entered")
  ap.add_argument("--host-devices", type=int, default=8,
                  help="CPU devices for shard_map meshes (default 8)")
  ap.add_argument("--keep", metavar="DIR", default=None,
                  help="keep the model, pan.c and trail in DIR")
  ap.add_argument("--emit", action="store_true",
                  help="print the Promela model instead of verifying it")
  a = ap.parse_args(argv)
  try:
    if a.target.endswith(".pml") and ":" not in a.target:
      if a.emit:
        print(open(a.target).read())
        return 0
      rep = verify_promela(a.target, max_depth=a.max_depth,
                           timeout_s=a.timeout, memory_mb=a.memory_mb,
                           keep_dir=a.keep)
    else:
      _host_devices(a.host_devices)
      fn = load_function(a.target)
      args = [parse_shape(s) for s in a.shapes]
      fn, args = _target(fn, a.axis, a.num_devices, args)
      if a.emit:
        for text in models(fn, *args, num_devices=a.num_devices,
                           options=_options(a.queue, not a.no_entry_check,
                                            4, 16)):
          print(text)
        return 0
      rep = verify(fn, *args, num_devices=a.num_devices,
                   max_depth=a.max_depth, timeout_s=a.timeout,
                   memory_mb=a.memory_mb, queue=a.queue,
                   check_entry=not a.no_entry_check, keep_dir=a.keep)
  except SpinNotFoundError as e:
    print(f"error: {e}", file=sys.stderr)
    return 3
  print(rep)
  kind = rep.kind
  return 0 if kind == "ok" else (2 if kind == "bound" else 1)


class _CallableModule(types.ModuleType):
  """`lowering_mosaic.verify` is this module; calling it calls `verify`."""

  def __call__(self, *args, **kwargs):
    return verify(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
  sys.exit(main())
