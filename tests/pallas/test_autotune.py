"""`dsl.autotune`: search, the on-disk cache across calls and processes, the
switch, jit, launch parameters and errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl.tools import autotune_cache, autotuning

CONFIGS = [{"block": 128}, {"block": 256}, {"block": 512}]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))


def make_add(name="test_autotune.add", configs=CONFIGS, **kw):
  @pl.autotune(configs=configs, key=["x"], name=name, repeats=1, **kw)
  def add(x, y, *, block=1024, backend=None):
    spec = pl.BlockSpec((block,), lambda i: (i,))

    def add_kernel(x_ref, y_ref, o_ref):
      o_ref[...] = x_ref[...] + y_ref[...]
    return pl.pallas_call(
        add_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(x.shape[0], block),), in_specs=[spec, spec],
        out_specs=spec, backend=backend)(x, y)
  return add


@pytest.fixture
def cache(tmp_path, monkeypatch):
  path = tmp_path / "autotune.json"
  monkeypatch.setenv(autotune_cache.ENV_VAR, str(path))
  monkeypatch.delenv(autotuning.ENV_SWITCH, raising=False)
  return path


def _inputs(n=1024):
  x = jnp.arange(n, dtype=jnp.float32)
  return x, jnp.full((n,), 0.5, jnp.float32)


def _entries(path):
  data = json.loads(path.read_text())
  (dev,) = data["devices"].values()
  return dev


def test_miss_then_hit_in_one_process(cache):
  x, y = _inputs()
  add = make_add()
  np.testing.assert_allclose(add(x, y), x + y)
  first = add.choose(x, y)
  assert first.source == "searched"
  assert len(first.results) == len(CONFIGS)
  assert first.config in CONFIGS
  (key, entry), = _entries(cache).items()
  assert key == "test_autotune.add/interpret/x=f32[1024]"
  assert entry["config"] == first.config and entry["candidates"] == 3
  # The same kernel, decorated again (a new process would do this), reads
  # the winner from disk without timing anything.
  again = make_add()
  assert again.choose(x, y).source == "cached"
  assert again.choose(x, y).config == first.config
  np.testing.assert_allclose(again(x, y), x + y)
  # Another size is another key: searched again.
  x2, y2 = _inputs(2048)
  assert again.choose(x2, y2).source == "searched"
  assert len(_entries(cache)) == 2


def test_cached_config_outside_the_configs_is_searched_again(cache):
  x, y = _inputs()
  autotune_cache.store("test_autotune.add", "x=f32[1024]", "interpret",
                       {"block": 64}, median_s=1.0, candidates=1)
  assert make_add().choose(x, y).source == "searched"


SCRIPT = """
import jax.numpy as jnp
import dsl as pl
import jax

@pl.autotune(configs=[{"block": 128}, {"block": 256}], key=["x"],
             name="test_autotune.subprocess_add", repeats=1)
def add(x, y, *, block=1024):
  spec = pl.BlockSpec((block,), lambda i: (i,))
  def add_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]
  return pl.pallas_call(add_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(pl.cdiv(x.shape[0], block),),
                        in_specs=[spec, spec], out_specs=spec)(x, y)

x = jnp.ones(512)
assert float(add(x, x).sum()) == 1024.0
print("SOURCE", add.choose(x, x).source, add.choose(x, x).config["block"])
"""


def test_hit_across_processes(tmp_path):
  script = tmp_path / "user_kernel.py"
  script.write_text(textwrap.dedent(SCRIPT))
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             **{autotune_cache.ENV_VAR: str(tmp_path / "cache.json")})
  env.pop(autotuning.ENV_SWITCH, None)

  def run():
    out = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    line, = [l for l in out.stdout.splitlines() if l.startswith("SOURCE")]
    return line.split()[1:]
  first = run()
  assert first[0] == "searched"
  second = run()
  assert second == ["cached", first[1]]


def test_switched_off_uses_the_first_config_and_writes_nothing(cache,
                                                               monkeypatch):
  monkeypatch.setenv(autotuning.ENV_SWITCH, "0")
  x, y = _inputs()
  add = make_add()
  choice = add.choose(x, y)
  assert (choice.source, choice.config) == ("default", CONFIGS[0])
  np.testing.assert_allclose(add(x, y), x + y)
  assert not cache.exists()
  # A cached winner is still used.
  autotune_cache.store("test_autotune.add", "x=f32[1024]", "interpret",
                       CONFIGS[2], median_s=1.0, candidates=3)
  choice = add.choose(x, y)
  assert (choice.source, choice.config) == ("cached", CONFIGS[2])


def test_under_jit_searches_at_trace_time_and_traces_only_the_winner(cache):
  x, y = _inputs()
  add = make_add()

  def model(x, y):
    return jnp.sum(add(x, y) * 2.0)
  jaxpr = jax.make_jaxpr(model)(x, y)
  calls = [e for e in jaxpr.jaxpr.eqns if e.primitive is pl.pallas_call_p]
  assert len(calls) == 1
  choice = add.choose(x, y)
  assert choice.source == "searched"
  block = calls[0].params["spec"].grid_mapping.block_mappings[0].block_shape
  assert tuple(block) == (choice.config["block"],)
  np.testing.assert_allclose(jax.jit(model)(x, y), 2 * float(jnp.sum(x + y)))
  assert len(_entries(cache)) == 1


def test_summary_line_when_verbose(cache, capsys):
  x, y = _inputs()
  add = make_add()
  with _verbose():
    add(x, y)
    add(x, y)
  lines = [l for l in capsys.readouterr().err.splitlines()
           if l.startswith("dsl.autotune:")]
  assert len(lines) == 1
  assert "test_autotune.add [x=f32[1024]] on interpret" in lines[0]
  assert "best of 3 config(s)" in lines[0] and str(cache) in lines[0]


def _verbose():
  import contextlib

  @contextlib.contextmanager
  def ctx():
    old = jax.config.read("jax_pallas_verbose_errors")
    jax.config.update("jax_pallas_verbose_errors", True)
    try:
      yield
    finally:
      jax.config.update("jax_pallas_verbose_errors", old)
  return ctx()


def test_launch_keywords_become_triton_compiler_params(cache, monkeypatch):
  monkeypatch.setenv(autotuning.ENV_SWITCH, "0")
  add = make_add(configs=[{"block": 256, "num_warps": 2, "num_stages": 3}])
  x, y = _inputs()
  jaxpr = jax.make_jaxpr(lambda x, y: add(x, y, backend="triton"))(x, y)
  spec = jaxpr.jaxpr.eqns[0].params["spec"]
  assert (spec.compiler_params.num_warps, spec.compiler_params.num_stages) \
      == (2, 3)
  jaxpr = jax.make_jaxpr(lambda x, y: add(x, y, backend="interpret"))(x, y)
  assert jaxpr.jaxpr.eqns[0].params["spec"].compiler_params is None


def test_launch_keywords_reach_the_automatic_backend_on_a_gpu(cache,
                                                             monkeypatch):
  """backend=None on a GPU runs Triton, so the tuned num_warps/num_stages
  must reach it (they were dropped: "gpu" is JAX's platform name, not a key
  of the platform -> backend table)."""
  monkeypatch.setenv(autotuning.ENV_SWITCH, "0")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  add = make_add(configs=[{"block": 256, "num_warps": 2, "num_stages": 3}])
  x, y = _inputs()
  spec = jax.make_jaxpr(add)(x, y).jaxpr.eqns[0].params["spec"]
  assert spec.backend is None
  assert (spec.compiler_params.num_warps, spec.compiler_params.num_stages) \
      == (2, 3)
  # With jax_pallas_use_mosaic_gpu the automatic backend is mosaic_gpu,
  # which takes no Triton launch parameters.
  with _mosaic_gpu_flag():
    spec = jax.make_jaxpr(add)(x, y).jaxpr.eqns[0].params["spec"]
  assert spec.compiler_params is None


def test_platform_default_backend_by_platform(monkeypatch):
  from dsl.core import backends
  assert [backends.platform_default(p) for p in
          ("cpu", "gpu", "cuda", "rocm", "tpu")] == [
              "interpret", "triton", "triton", "triton", "mosaic"]
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert backends.platform_default() == "triton"
  assert not backends.runs_on_host(None)
  with _mosaic_gpu_flag():
    assert backends.platform_default() == "mosaic_gpu"
    assert backends.platform_default("cpu") == "interpret"


def _mosaic_gpu_flag():
  import contextlib

  @contextlib.contextmanager
  def ctx():
    old = jax.config.jax_pallas_use_mosaic_gpu
    jax.config.update("jax_pallas_use_mosaic_gpu", True)
    try:
      yield
    finally:
      jax.config.update("jax_pallas_use_mosaic_gpu", old)
  return ctx()


def test_wrong_config_keyword_is_a_clear_error():
  with pytest.raises(TypeError) as e:
    make_add(configs=[{"block": 128}, {"blok": 256}])
  msg = str(e.value)
  assert "configs[1]" in msg and "'blok'" in msg
  assert "its keywords: x, y, block, backend" in msg
  assert "test_autotune.py" in msg


def test_wrong_key_and_tuned_argument_are_errors(cache):
  with pytest.raises(TypeError, match="key 'z' is not a parameter"):
    pl.autotune(CONFIGS, key=["z"])(lambda x, *, block: x)
  with pytest.raises(TypeError, match="non-empty list of configs"):
    pl.autotune([])(lambda x, *, block: x)
  x, y = _inputs()
  with pytest.raises(TypeError, match="block are chosen by autotuning"):
    make_add()(x, y, block=128)


def test_no_config_runs(cache):
  def broken(x, *, block):
    raise ValueError(f"block {block} does not fit")
  tuned = pl.autotune([{"block": 1}, {"block": 2}], name="broken")(broken)
  with pytest.raises(TypeError, match="no config ran .*block 1 does not fit"):
    tuned(jnp.ones(4))


MODULE = """
import jax
import jax.numpy as jnp
import dsl as pl

@pl.autotune(configs=[{"block": 128}, {"block": 256}], key=["x"])
def add(x, y, *, block=128):
  spec = pl.BlockSpec((block,), lambda i: (i,))
  return pl.pallas_call(lambda x_ref, y_ref, o_ref: o_ref.__setitem__(
      ..., x_ref[...] + y_ref[...]), jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(x.shape[0] // block,), in_specs=[spec, spec],
      out_specs=spec)(x, y)

if __name__ == "__main__":
  x = jnp.ones(512)
  print("SOURCE", add.name, add.choose(x, x).source)
"""


def test_a_script_and_the_same_module_imported_share_cache_entries(tmp_path):
  pkg = tmp_path / "mypkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "tuned.py").write_text(textwrap.dedent(MODULE))
  env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}",
             JAX_PLATFORMS="cpu",
             **{autotune_cache.ENV_VAR: str(tmp_path / "cache.json")})
  env.pop(autotuning.ENV_SWITCH, None)

  def run(*argv):
    out = subprocess.run([sys.executable, *argv], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    line, = [l for l in out.stdout.splitlines() if l.startswith("SOURCE")]
    return line.split()[1:]
  # run as a script (module __main__), then imported by another script
  assert run(str(pkg / "tuned.py")) == ["mypkg.tuned.add", "searched"]
  (tmp_path / "user.py").write_text(
      "import jax.numpy as jnp\nfrom mypkg import tuned\nx = jnp.ones(512)\n"
      "print('SOURCE', tuned.add.name, tuned.add.choose(x, x).source)\n")
  assert run(str(tmp_path / "user.py")) == ["mypkg.tuned.add", "cached"]
  assert run("-m", "mypkg.tuned") == ["mypkg.tuned.add", "cached"]
