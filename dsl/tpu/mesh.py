"""Meshes of TensorCores for `pl.kernel(body, out_type, mesh=...)`.

A `TensorCoreMesh` of N cores runs the kernel body once per core. dsl runs it
as a `pallas_call` over a `parallel` grid of N whose one axis carries the
mesh's axis name (dsl.core.named_axes), so `lax.axis_index(axis_name)` is the
core's index and `lax.axis_size(axis_name)` the number of cores; every input
and output is a whole-array ref in `ANY` memory, as in Pallas. On the host
backends the cores run one after another; on a TPU the Mosaic compiler
spreads a `parallel` grid dim over the chip's cores.
"""
from __future__ import annotations

import collections
import dataclasses
import enum

import jax
from jax import lax

from dsl.core.errors import KernelError, user_frame
from dsl.core.primitives import when


class CoreType(enum.Enum):
  """The kind of core a mesh is made of. dsl runs TensorCore meshes only."""
  TC = "tc"
  SC_SCALAR_SUBCORE = "sc_scalar_subcore"
  SC_VECTOR_SUBCORE = "sc_vector_subcore"

  def __str__(self) -> str:
    return self.value


def _default_num_cores() -> int:
  """The cores of the default device: a TPU's own count, 1 elsewhere."""
  return int(getattr(jax.devices()[0], "num_cores", 1) or 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorCoreMesh:
  """A mesh of `num_cores` TensorCores along one axis named `axis_name`."""
  axis_name: str
  num_cores: int = dataclasses.field(default_factory=_default_num_cores)

  def __post_init__(self):
    if not isinstance(self.axis_name, str):
      raise TypeError(f"TensorCoreMesh axis_name must be a str, got "
                      f"{self.axis_name!r}")
    if (isinstance(self.num_cores, bool) or not isinstance(self.num_cores, int)
        or self.num_cores < 1):
      raise ValueError(f"TensorCoreMesh num_cores must be a positive int, "
                       f"got {self.num_cores!r}")

  @property
  def core_type(self) -> CoreType:
    return CoreType.TC

  @property
  def shape(self):
    return collections.OrderedDict({self.axis_name: self.num_cores})

  @property
  def grid(self) -> tuple[tuple[str, int], ...]:
    """The named grid the mesh runs as."""
    return ((self.axis_name, self.num_cores),)

  @property
  def dimension_semantics(self) -> tuple[str, ...]:
    return ("parallel",)


def create_tensorcore_mesh(axis_name: str, devices=None,
                           num_cores: int | None = None) -> TensorCoreMesh:
  """A `TensorCoreMesh` over the cores of `devices[0]`, or of `num_cores`
  cores (default: the default device's; 1 on a CPU)."""
  if devices is not None and num_cores is not None:
    raise ValueError("cannot specify both devices and num_cores")
  if num_cores is None:
    num_cores = (int(getattr(devices[0], "num_cores", 1) or 1)
                 if devices is not None else _default_num_cores())
  return TensorCoreMesh(axis_name=axis_name, num_cores=num_cores)


def run_on_first_core(core_axis_name: str):
  """Decorator: runs `f()` on core 0 of `core_axis_name` only."""
  num_cores = lax.axis_size(core_axis_name)

  def wrapped(f):
    if num_cores == 1:
      return f()
    return when(lax.axis_index(core_axis_name) == 0)(f)
  return wrapped


def core_barrier(sem, *, core_axis_name: str) -> None:
  """Waits until every core of `core_axis_name` reaches this point. A mesh
  of one core has nothing to wait for. Cores of a larger mesh run as the
  steps of a grid, one after another on the host backends, so a core that
  waits for a later one never returns: that is an error at trace time."""
  del sem
  num_cores = lax.axis_size(core_axis_name)
  if num_cores > 1:
    raise KernelError(
        None, f"core_barrier over {num_cores} cores of {core_axis_name!r}: "
        "dsl runs the cores of a mesh as the steps of a parallel grid, which "
        "cannot wait for each other; split the work so that each core "
        "writes its own part of the outputs, or use a mesh of one core",
        user_frame())


def check_mesh(kernel: str, mesh, where: str) -> TensorCoreMesh:
  """`mesh` if dsl runs kernels over it; else a KernelError naming it."""
  if isinstance(mesh, TensorCoreMesh):
    return mesh
  kind = type(mesh).__name__
  hint = ("a GPU mesh (threads and warpgroups of Mosaic GPU) has no "
          "counterpart here: write the kernel with pl.pallas_call over a "
          "grid" if "gpu" in type(mesh).__module__.lower() or hasattr(
              mesh, "num_threads") else
          "make one with dsl.tpu.create_tensorcore_mesh(axis_name)")
  raise KernelError(kernel, f"pl.kernel(mesh=...) takes a "
                    f"dsl.tpu.TensorCoreMesh, got {kind}; {hint}", where,
                    operand="mesh")
