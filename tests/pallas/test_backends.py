"""The backend registry: one record per backend, one function that resolves
`backend=`, `interpret=`, `jax_pallas_use_mosaic_gpu` and the platform."""
import ast
import contextlib
import dataclasses
import glob
import importlib
import os

import jax
import jax.numpy as jnp
import pytest

import dsl as pl
from dsl.core import backends, config
from tests.pallas.testing import CPU_BACKENDS

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


@contextlib.contextmanager
def _mosaic_gpu_flag():
  old = config.use_mosaic_gpu()
  jax.config.update("jax_pallas_use_mosaic_gpu", True)
  try:
    yield
  finally:
    jax.config.update("jax_pallas_use_mosaic_gpu", old)


def test_requested_backend_from_backend_and_interpret():
  assert backends.requested(None) is None
  assert backends.requested(None, interpret=True) == "interpret"
  assert backends.requested("mosaic_interpret", interpret=True) == \
      "mosaic_interpret"
  assert backends.requested(None, interpret="triton_interpret") == \
      "triton_interpret"
  assert backends.requested("triton", interpret=False) == "triton"


def test_resolve_by_platform_and_flag():
  assert [backends.resolve(None, platform=p) for p in
          ("cpu", "gpu", "cuda", "rocm", "tpu")] == [
              "interpret", "triton", "triton", "triton", "mosaic"]
  assert backends.resolve("mosaic_interpret", platform="cuda") == \
      "mosaic_interpret"
  assert backends.resolve(None, interpret=True, platform="tpu") == \
      "interpret"
  with _mosaic_gpu_flag():
    assert backends.resolve(None, platform="cuda") == "mosaic_gpu"
    assert backends.resolve(None, platform="gpu") == "mosaic_gpu"
    assert backends.resolve(None, platform="rocm") == "triton"
    assert backends.resolve(None, platform="cpu") == "interpret"


def test_records_describe_every_built_in_backend():
  assert set(pl.BACKENDS) <= set(backends.REGISTRY)
  host = [b for b in pl.BACKENDS if backends.REGISTRY[b].on_host]
  assert tuple(host) == CPU_BACKENDS == ("interpret", "triton_interpret",
                                         "mosaic_interpret")
  for name in pl.BACKENDS:
    rec = backends.REGISTRY[name]
    assert rec.name == name and rec.platforms
    assert rec.on_host == (set(rec.platforms) == {"cpu", "cuda", "rocm",
                                                  "tpu"})
  triton = backends.REGISTRY["triton"].compiler_params_class()
  assert triton is pl.triton.CompilerParams
  assert backends.REGISTRY["mosaic"].compiler_params_class() is \
      pl.tpu.CompilerParams
  assert backends.REGISTRY["interpret"].compiler_params_class() is None


@pytest.mark.parametrize("name", ["triton", "triton_interpret", "mosaic",
                                  "mosaic_interpret", "mosaic_gpu"])
def test_each_package_registers_its_lowering_and_rule_table(name):
  rule = backends.lowering_rule(name, "<test>", None)
  assert callable(rule) and backends.REGISTRY[name].lowering is rule
  table = backends.rule_table(name)
  assert table is not None and len(table.names()) > 50


def test_default_backend_chooses_for_kernels_that_name_none():
  with pl.default_backend("mosaic_interpret"):
    assert backends.resolve(None, platform="tpu") == "mosaic_interpret"
    assert backends.resolve(None, platform="cpu") == "mosaic_interpret"
    assert backends.resolve("triton_interpret") == "triton_interpret"
    assert backends.resolve(None, interpret=True) == "interpret"
    with pl.default_backend(None):
      assert backends.resolve(None, platform="cpu") == "interpret"
  assert backends.resolve(None, platform="cpu") == "interpret"
  with pytest.raises(pl.BackendError, match="unknown backend 'nope'"):
    pl.default_backend("nope")


def test_default_backend_is_part_of_the_jit_cache_key():
  seen = []

  def kernel(x_ref, o_ref):
    seen.append(backends.traced_backend().name)
    o_ref[...] = x_ref[...] * 2
  x = jnp.ones((8, 128))
  f = jax.jit(pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                             name="k_default_backend"))
  assert float(f(x)[0, 0]) == 2.0
  with pl.default_backend("mosaic_interpret"):
    assert float(f(x)[0, 0]) == 2.0       # traced again, for this backend
  assert float(f(x)[0, 0]) == 2.0
  assert seen == ["interpret", "mosaic_interpret"]


def test_unknown_backend_names_the_kernel():
  with pytest.raises(pl.BackendError, match="kernel 'k'.*unknown backend "
                     "'nope'"):
    backends.record("nope", "k", "here.py:1")


def test_kernel_knows_the_backend_it_is_traced_for():
  seen = []

  def kernel(x_ref, o_ref):
    seen.append(backends.traced_backend().name)
    o_ref[...] = x_ref[...]
  x = jnp.ones((8, 128))
  for backend in (None, "mosaic_interpret", "triton_interpret"):
    jax.make_jaxpr(pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape,
                                                               x.dtype),
                                  backend=backend, name=f"k{backend}"))(x)
  assert seen == ["interpret", "mosaic_interpret", "triton_interpret"]


def test_mosaic_gpu_imports_without_the_tpu_lowering_or_verification():
  import subprocess
  import sys
  code = ("import sys, lowering_mosaic.gpu; print(sorted(m for m in "
          "sys.modules if m.startswith('lowering_')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=True, cwd=_ROOT).stdout
  loaded = eval(out)   # noqa: S307 - our own printout of a list of str
  assert "lowering_mosaic.gpu.launch" in loaded
  assert not [m for m in loaded if m.startswith(
      ("lowering_mosaic.tpu", "lowering_mosaic.verification",
       "lowering_triton"))], loaded


def test_lowering_mosaic_names_load_from_their_sub_packages():
  import lowering_mosaic
  from lowering_mosaic.tpu import mlir_modules
  from lowering_mosaic.verification import interpreter, promela
  assert lowering_mosaic.to_mlir is mlir_modules.to_mlir
  assert lowering_mosaic.interpreter is interpreter
  assert lowering_mosaic.promela is promela
  assert lowering_mosaic.interpreter_options is interpreter.interpreter_options
  with pytest.raises(AttributeError):
    lowering_mosaic.no_such_name   # noqa: B018


# ------------------------------------------------------ the kernel library

def _named_backends(node) -> list[str]:
  """Backend names among the string constants of a comparison operand."""
  items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) \
      else [node]
  return [i.value for i in items if isinstance(i, ast.Constant)
          and i.value in backends.REGISTRY]


def test_kernel_library_compares_no_backend_names():
  """kernels/ asks the registry's record what a backend builds and where it
  runs (kernels.blocking), never tests a backend's name."""
  found = []
  for path in sorted(glob.glob(os.path.join(_ROOT, "kernels", "*.py"))):
    with open(path) as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, ast.Compare):
        code = (isinstance(node.left, ast.Call) and
                getattr(node.left.func, "id", "") == "_code")
        names = [n for o in [node.left, *node.comparators]
                 for n in _named_backends(o)]
        if names and not code:         # `_code(b) == "triton"`: a code word
          found.append((os.path.basename(path), node.lineno, names))
      elif (isinstance(node, ast.Call) and
            getattr(node.func, "attr", "") == "startswith"):
        found.append((os.path.basename(path), node.lineno, "startswith"))
  assert not found, found


@pytest.mark.parametrize("like", ["triton_interpret", "interpret"])
def test_kernel_blocks_follow_the_record_not_the_name(like, monkeypatch):
  """A backend registered under a new name with the record of `like` gets
  the blocks `like` gets."""
  twin = dataclasses.replace(backends.REGISTRY[like], name=f"{like}_twin")
  monkeypatch.setitem(backends.REGISTRY, twin.name, twin)
  mm = importlib.import_module("kernels.matmul")
  fa = importlib.import_module("kernels.flash_attention")
  for m, n, k in [(64, 96, 200), (1000, 1000, 1000)]:
    for dtype in (jnp.float32, jnp.bfloat16):
      assert (mm.block_sizes(m, n, k, twin.name, dtype)
              == mm.block_sizes(m, n, k, like, dtype))
  for kernel in ("fwd", "dkdv", "dq"):
    assert (fa.attention_blocks(512, 1024, 64, twin.name, kernel=kernel)
            == fa.attention_blocks(512, 1024, 64, like, kernel=kernel))
