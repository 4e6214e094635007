"""The jax_pallas_* options: set three ways, and what verbose errors change."""
import contextlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import dsl as pl
from dsl.core import config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OPTIONS = {
    "jax_pallas_enable_runtime_assert": ("1", "true", True),
    "jax_pallas_enable_debug_checks": ("1", "true", True),
    "jax_pallas_poison_buffers": ("1", "true", True),
    "jax_pallas_use_mosaic_gpu": ("1", "true", True),
    "jax_pallas_verbose_errors": ("1", "true", True),
    "jax_pallas_dump_promela_to": ("/tmp/pml", "/tmp/pml", "/tmp/pml"),
    "jax_pallas_dump_triton_to": ("/tmp/tt", "/tmp/tt", "/tmp/tt"),
    "jax_pallas_dump_mlir_to": ("/tmp/mlir", "/tmp/mlir", "/tmp/mlir"),
}

# Every option read in one process (one process per way of setting them).
PRINT = ("import jax, dsl; from dsl import config; "
         "{parse}print(repr({{n: config.read_option(n) for n in {names!r}}}))")
NAMES = sorted(OPTIONS)
EXPECTED = repr({n: OPTIONS[n][2] for n in NAMES})


def _run(code, env=None, argv=()):
  full_env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
  out = subprocess.run([sys.executable, "-c", code, *argv], env=full_env,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  return out.stdout.strip().splitlines()[-1]


def test_every_option_from_environment_variables():
  env = {n.upper(): OPTIONS[n][0] for n in NAMES}
  assert _run(PRINT.format(parse="", names=NAMES), env=env) == EXPECTED


def test_every_option_from_absl_flags():
  argv = tuple(f"--{n}={OPTIONS[n][1]}" for n in NAMES)
  got = _run(PRINT.format(parse="jax.config.parse_flags_with_absl(); ",
                          names=NAMES), argv=argv)
  assert got == EXPECTED


def test_options_unset_read_their_defaults():
  env = {k: v for k, v in os.environ.items()
         if k.lower() not in OPTIONS}
  got = subprocess.run(
      [sys.executable, "-c", PRINT.format(parse="", names=NAMES)],
      env=dict(env, PYTHONPATH=ROOT), capture_output=True, text=True,
      timeout=120).stdout.strip().splitlines()[-1]
  assert got != EXPECTED


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_option_from_config_update(name):
  _, _, expected = OPTIONS[name]
  old = config.read_option(name)
  try:
    jax.config.update(name, expected)
    assert config.read_option(name) == expected
  finally:
    jax.config.update(name, old)


def test_defaults():
  assert config.enable_runtime_assert() is False
  assert config.use_mosaic_gpu() is False
  assert config.dump_promela_to() == ""
  assert config.enable_debug_checks() is False
  assert config.poison_buffers() is False


@contextlib.contextmanager
def _verbose(value):
  old = config.verbose_errors()
  jax.config.update("jax_pallas_verbose_errors", value)
  try:
    yield
  finally:
    jax.config.update("jax_pallas_verbose_errors", old)


def _bad_call():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...][:2]
  return pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32))(
      jnp.ones(8))


def test_verbose_errors_show_marked_source():
  with _verbose(True):
    with pytest.raises(pl.KernelError) as info:
      _bad_call()
  msg = str(info.value)
  assert "\n  at " in msg and __file__ in msg
  assert "> " in msg and "o_ref[...] = x_ref[...][:2]" in msg


def test_terse_errors_are_one_line():
  with _verbose(False):
    with pytest.raises(pl.KernelError) as info:
      _bad_call()
  msg = str(info.value)
  assert "\n" not in msg and f"(at {__file__}:" in msg


def test_verbose_lowering_error_marks_failing_equation():
  from dsl.core.errors import BackendError, eqn_error
  def kernel(x_ref, o_ref):
    y = jnp.cumsum(x_ref[...])
    o_ref[...] = y
  jaxpr = jax.make_jaxpr(
      lambda x: pl.pallas_call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32))(x)
  )(jnp.ones(8)).eqns[0].params["spec"].jaxpr
  outer = next(e for e in jaxpr.jaxpr.eqns if "jaxpr" in e.params)
  eqn = next(e for e in outer.params["jaxpr"].jaxpr.eqns
             if e.primitive.name == "cumsum")
  with _verbose(True):
    err = eqn_error(BackendError, "kernel", eqn, "cumsum is not supported",
                    jaxpr)
  msg = str(err)
  marked = [l for l in msg.splitlines() if l.startswith(">>>")]
  assert len(marked) == 1 and "jit" in marked[0]  # the call holding it
  assert "cumsum" in msg
  assert f"{__file__}:{kernel.__code__.co_firstlineno + 1}" in msg
  with _verbose(False):
    err = eqn_error(BackendError, "kernel", eqn, "cumsum is not supported",
                    jaxpr)
  assert "\n" not in str(err)


def _copy_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...] + 1.0


def test_use_mosaic_gpu_is_honoured_on_gpu_lowering():
  """With the option on, CUDA lowering goes through Mosaic GPU (its custom
  call, not Triton's); backend='triton' still picks Triton."""
  f = lambda x: pl.pallas_call(_copy_kernel,
                               jax.ShapeDtypeStruct((64, 128), jnp.float32))(x)
  x = jnp.ones((64, 128), jnp.float32)
  with pl.config.use_mosaic_gpu_option(True):
    text = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu_v2" in text and "triton_kernel_call" not in text


def test_absl_flags_parsed_before_import_dsl():
  # parse_flags_with_absl() may run before `import dsl` registers its
  # options: their --jax_pallas_* arguments are still read.
  names = sorted(OPTIONS)
  code = ("import jax; jax.config.parse_flags_with_absl(); import dsl; "
          "from dsl import config; "
          f"print(repr([config.read_option(n) for n in {names!r}]))")
  argv = [f"--{n}={OPTIONS[n][1]}" for n in names]
  assert _run(code, argv=argv) == repr([OPTIONS[n][2] for n in names])


def test_config_with_absl_before_import_dsl():
  # jax.config.config_with_absl() then absl's own parsing (as app.run does),
  # with dsl imported in between.
  code = ("import sys, jax; jax.config.config_with_absl(); import dsl; "
          "from absl import flags; flags.FLAGS(sys.argv); "
          "jax.config.complete_absl_config(flags); from dsl import config; "
          "print(repr(config.read_option('jax_pallas_enable_runtime_assert')))")
  assert _run(code, argv=["--jax_pallas_enable_runtime_assert=true"]) == "True"
