"""The jax_pallas_* options, registered with JAX's config where JAX lacks them.

Each is set like any JAX option: an environment variable
(`JAX_PALLAS_ENABLE_RUNTIME_ASSERT=1`), `jax.config.update(name, value)`, or an
absl flag after `jax.config.parse_flags_with_absl()`.
"""
from __future__ import annotations

import itertools
import sys

from dsl.core.jax_internals import config as jax_config


def _existing(name):
  return jax_config.config._value_holders.get(name)


def bool_option(name: str, default: bool, help: str):
  """The boolean JAX option `name` (defined here the first time; a JAX
  version that defines it already keeps its own)."""
  holder = _existing(name)
  if holder is not None or name in jax_config.config.values:
    return holder
  return jax_config.bool_state(name, default, help, include_in_jit_key=True,
                               include_in_trace_context=True)


def _string(name: str, default: str, help: str):
  holder = _existing(name)
  if holder is not None or name in jax_config.config.values:
    return holder
  return jax_config.string_state(name, default, help)


def _optional_string(name: str, help: str):
  """A string option that is None by default and part of jit's cache key
  (a jitted function traced under another value is traced again)."""
  holder = _existing(name)
  if holder is not None or name in jax_config.config.values:
    return holder
  return jax_config.string_or_object_state(
      name, None, help, include_in_jit_key=True,
      include_in_trace_context=True, validator=_optional_string_value)


def _optional_string_value(value) -> None:
  if value is not None and not isinstance(value, str):
    raise ValueError(f"expected a string or None, got {value!r}")


enable_runtime_assert_option = bool_option(
    "jax_pallas_enable_runtime_assert", False,
    "If set, enables runtime assertions in the kernel via checkify.check. "
    "Otherwise, runtime asserts are ignored unless functionalized using "
    "checkify.checkify.")
dump_promela_to_option = _string(
    "jax_pallas_dump_promela_to", "",
    "If set, dumps a Promela model of each Mosaic-lowered kernel to this "
    "directory.")
use_mosaic_gpu_option = bool_option(
    "jax_pallas_use_mosaic_gpu", False,
    "If True, lower Pallas kernels to the experimental Mosaic GPU dialect, "
    "instead of Triton IR.")
triton_tensor_descriptors_option = bool_option(
    "jax_pallas_triton_tensor_descriptors", True,
    "If True, the Triton backend loads whole, aligned tiles inside loops "
    "through tensor descriptors (TMA copies on sm_90 and newer).")
dump_triton_to_option = _string(
    "jax_pallas_dump_triton_to", "",
    "If set, writes each generated Triton kernel's source to this directory.")
default_backend_option = _optional_string(
    "jax_pallas_default_backend",
    "If set, the backend kernels run on when they name none (backend=None, "
    "interpret=False); else the default of the platform.")
dump_mlir_to_option = _string(
    "jax_pallas_dump_mlir_to", "",
    "If set, writes each kernel's Mosaic MLIR module (TPU or GPU) to this "
    "directory.")
# JAX defines jax_pallas_verbose_errors itself; it is read, not redefined.
verbose_errors_option = bool_option(
    "jax_pallas_verbose_errors", True,
    "If True, print verbose error messages for kernels.")
# So do these two (registered here only for a JAX that lacks them).
enable_debug_checks_option = bool_option(
    "jax_pallas_enable_debug_checks", False,
    "If set, ``pl.debug_check`` calls are checked at runtime. Otherwise, "
    "they are a noop.")
poison_buffers_option = bool_option(
    "jax_pallas_poison_buffers", False,
    "If set, scratch buffers and run_scoped allocations start as poison "
    "(NaN for floats) instead of zeros.")


# Which InterpreterOptions the mosaic_interpret backend uses (an id set by
# `lowering_mosaic.interpreter_options`). Defined when dsl is imported, not
# when the interpreter first runs: a state defined later would change JAX's
# trace context, so a function jitted before would be traced again.
mosaic_interpret_options_id = jax_config.int_state(
    "jax_mosaic_interpret_options", 0,
    "Internal: which lowering_mosaic.InterpreterOptions the mosaic_interpret "
    "backend uses (set with lowering_mosaic.interpreter_options).",
    include_in_jit_key=True, include_in_trace_context=True
) if _existing("jax_mosaic_interpret_options") is None else _existing(
    "jax_mosaic_interpret_options")


def _late_absl_flags(names) -> None:
  """Makes the order of `import dsl` and JAX's absl set-up not matter.

  `jax.config.config_with_absl()` (and `parse_flags_with_absl()`) register
  absl flags for the options defined so far; options that `import dsl`
  defines afterwards get their flags here, and when the command line was
  already parsed, their `--jax_pallas_...` arguments are read now."""
  cfg = jax_config.config
  if not getattr(cfg, "use_absl", False):
    return            # absl comes later and will see our options
  # absl is optional for JAX (and for us): imported only when JAX uses it.
  from absl import flags
  define = {bool: flags.DEFINE_bool, str: flags.DEFINE_string}
  for name in names:
    if name not in flags.FLAGS and name in cfg.meta:
      flag_type, args, kwargs = cfg.meta[name]
      define[flag_type](name, cfg._value_holders[name].value, *args, **kwargs)
  if getattr(jax_config, "already_configured_with_absl", False):
    argv = itertools.takewhile(lambda a: a != "--", sys.argv)
    flags.FLAGS(["", *(a for a in argv if a.startswith("--jax_pallas_")
                       or a.startswith("--nojax_pallas_"))], known_only=True)
    for name in names:
      if name in flags.FLAGS and flags.FLAGS[name].present:
        cfg._value_holders[name]._set(flags.FLAGS[name].value)


_late_absl_flags([n for n in jax_config.config._value_holders
                  if n.startswith("jax_pallas_")])


def read_option(name):
  """The current value of the JAX option `name`."""
  return jax_config.config._value_holders[name].value


def enable_runtime_assert() -> bool:
  return bool(read_option("jax_pallas_enable_runtime_assert"))


def enable_debug_checks() -> bool:
  """JAX's jax_pallas_enable_debug_checks: `pl.debug_check` is checked."""
  return bool(read_option("jax_pallas_enable_debug_checks"))


def poison_buffers() -> bool:
  """JAX's jax_pallas_poison_buffers: scratch and run_scoped buffers start as
  poison (dsl/core/poison.py) instead of zeros."""
  return bool(read_option("jax_pallas_poison_buffers"))


def use_mosaic_gpu() -> bool:
  return bool(read_option("jax_pallas_use_mosaic_gpu"))


def verbose_errors() -> bool:
  return bool(read_option("jax_pallas_verbose_errors"))


def dump_promela_to() -> str:
  return read_option("jax_pallas_dump_promela_to") or ""


def triton_tensor_descriptors() -> bool:
  return bool(read_option("jax_pallas_triton_tensor_descriptors"))


def dump_triton_to() -> str:
  return read_option("jax_pallas_dump_triton_to") or ""


def default_backend() -> str | None:
  """JAX option jax_pallas_default_backend: the backend of kernels that
  name none (None: the platform's)."""
  return read_option("jax_pallas_default_backend") or None


def dump_mlir_to() -> str:
  return read_option("jax_pallas_dump_mlir_to") or ""
