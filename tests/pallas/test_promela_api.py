"""lowering_mosaic.verify: the API, its limits, the dump option and the CLI."""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import dsl as pl
from dsl import tpu as pltpu
import lowering_mosaic
import lowering_mosaic.verify as verify
from lowering_mosaic.verification import promela
from lowering_mosaic.tpu.mlir_modules import to_modules
from lowering_mosaic.verification.promela import spin as spin_mod
from benchmarks import promela_corpus as corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
SPIN_OK, SPIN_WHY = promela.spin_available()
needs_spin = pytest.mark.skipif(not SPIN_OK, reason=SPIN_WHY)


# Module-level functions for the CLI's module:function form.
def cli_copy(x):
  return corpus.copy_through_vmem()[0](x)


def cli_read_early(x):
  return corpus.copy_through_vmem("read_early")[0](x)


def cli_all_gather(x):
  return corpus.ring_all_gather(n=2)[0](x)


@pytest.fixture
def promela_dir(tmp_path):
  d = tmp_path / "models" / "nested"
  jax.config.update("jax_pallas_dump_promela_to", str(d))
  try:
    yield d
  finally:
    jax.config.update("jax_pallas_dump_promela_to", "")


# ------------------------------------------------------------ verify()

def test_verify_is_callable_as_the_module():
  assert callable(lowering_mosaic.verify)
  assert lowering_mosaic.verify.verify is verify.verify


@needs_spin
def test_report_fields_for_a_correct_kernel():
  f, args = corpus.copy_through_vmem()
  rep = verify(f, *args)
  assert rep.kind == "ok" and rep.ok and bool(rep)
  assert rep.kernel == "_copy_kernel"
  assert rep.states > 0 and rep.transitions >= rep.states and rep.depth > 0
  assert 0 < rep.search_s <= rep.time_s
  assert rep.num_devices == 1
  assert "ok" in str(rep) and "states" in rep.summary()


@needs_spin
def test_race_report_names_the_kernel_lines():
  f, args = corpus.copy_through_vmem("read_early")
  rep = verify(f, *args)
  src = inspect.getsource(corpus._copy_kernel).splitlines()
  first = corpus._copy_kernel.__code__.co_firstlineno
  read_line = first + next(k for k, l in enumerate(src) if "BUG: reads" in l)
  start_line = first + next(k for k, l in enumerate(src) if "copy.start()" in l)
  assert rep.kind == "race"
  assert rep.error_line.endswith(f"/promela_corpus.py:{read_line}")
  assert f"/promela_corpus.py:{start_line}" in rep.message
  lines = [s.line for s in rep.trail]
  assert lines[0].endswith(f":{start_line}") and lines[-1].endswith(
      f":{read_line}")
  assert not rep.blocked


@needs_spin
@pytest.mark.parametrize("variant,kind", [("read_early", "race"),
                                          ("wrong_sem", "deadlock")])
def test_reports_use_the_kernels_parameter_names(variant, kind):
  # _copy_kernel(x_hbm, o_ref, buf, sem): operands are named as the kernel
  # names them, not after the specs they come from.
  f, args = corpus.copy_through_vmem(variant)
  rep = verify(f, *args)
  text = str(rep)
  assert rep.kind == kind
  assert "DMA x_hbm -> buf, signals sem[0]" in text, text
  assert "scratch_shapes" not in text and "in_specs" not in text, text
  if kind == "race":
    assert "device 0's buf (vmem[8, 128])" in rep.message, rep.message
  else:
    assert "waits for DMA x_hbm -> buf on sem[1]" in rep.message, rep.message


@needs_spin
def test_num_devices_defaults_to_the_mesh_and_can_be_given():
  f, args = corpus.ring_all_gather(n=2)
  assert verify(f, *args).num_devices == 2
  # A module lowered for a 2-device mesh, modelled on 3 devices: its ring
  # arithmetic is mod 2, so device 2 acts as a second device 0.
  rep = verify(f, *args, num_devices=3)
  assert rep.num_devices == 3 and rep.kind == "semaphore", rep


@needs_spin
def test_entry_check_can_be_turned_off():
  f, args = corpus.ring_all_gather("no_handshake", n=2)
  assert verify(f, *args).kind == "race"
  assert verify(f, *args, check_entry=False).kind == "ok"


@needs_spin
def test_depth_bound():
  f, args = corpus.ring_all_gather(n=3)
  rep = verify(f, *args, max_depth=20)
  assert rep.kind == "bound", rep
  assert "depth limit" in rep.message and "max_depth=20" in rep.message
  assert rep.states > 0


@needs_spin
def test_time_bound():
  f, args = corpus.ring_all_gather(n=4)
  rep = verify(f, *args, timeout_s=0.05)
  assert rep.kind == "bound", rep
  assert "time limit" in rep.message
  assert rep.states > 0 and rep.depth > 0


@needs_spin
def test_several_kernels_give_several_reports():
  f1, args = corpus.copy_through_vmem()
  f2, _ = corpus.copy_through_vmem("read_early")
  reps = verify(lambda x: f2(f1(x)), *args)
  assert [r.kind for r in reps] == ["ok", "race"]
  assert reps.kind == "race" and not reps.ok


@needs_spin
def test_queue_size_is_a_model_parameter(tmp_path):
  f, args = corpus.double_buffered()
  rep = verify(f, *args, queue=1, keep_dir=str(tmp_path))
  assert rep.kind == "ok"
  text = (tmp_path / "model.pml").read_text()
  assert "#define Q 1" in text
  assert rep.model_path == str(tmp_path / "model.pml")


def test_verify_without_spin_says_how_to_install_it(monkeypatch):
  monkeypatch.setattr(spin_mod, "find_spin", lambda: None)
  f, args = corpus.copy_through_vmem()
  with pytest.raises(promela.SpinNotFoundError, match="apt-get install spin"):
    verify(f, *args)
  ok, why = spin_mod.spin_available()
  assert not ok and "apt-get install spin" in why


# ------------------------------------------------------------ the dump option

def test_maybe_dump_writes_the_model(promela_dir):
  f, args = corpus.copy_through_vmem()
  (module,) = to_modules(f, *args)
  path = promela.maybe_dump(module, "my kernel")
  assert path and os.path.dirname(path) == str(promela_dir)
  assert re.fullmatch(r"my_kernel-[0-9a-f]{8}\.pml", os.path.basename(path))
  text = open(path).read()
  assert "proctype kernel" in text and "@@stmt" in text
  # the same module gives the same file name
  assert promela.maybe_dump(module, "my kernel") == path


def test_maybe_dump_is_off_by_default():
  f, args = corpus.copy_through_vmem()
  (module,) = to_modules(f, *args)
  assert promela.maybe_dump(module, "k") is None


def test_maybe_dump_takes_the_mesh_size(promela_dir):
  f, args = corpus.ring_all_gather(n=3)
  (module,) = to_modules(f, *args)
  text = open(promela.maybe_dump(module, "ag")).read()
  assert "#define NDEV 3" in text
  text = open(promela.maybe_dump(module, "ag", num_devices=2)).read()
  assert "#define NDEV 2" in text


@pytest.mark.parametrize("backend", ["mosaic_interpret", "mosaic"])
def test_lowering_through_the_mosaic_path_dumps(promela_dir, backend):
  from lowering_mosaic.tpu import launch as mosaic_backend
  if "maybe_dump" not in inspect.getsource(mosaic_backend):
    pytest.skip("the Mosaic backends do not call "
                "lowering_mosaic.verification.promela.maybe_dump yet")

  def kernel(x_hbm, o_ref, buf, sem):
    c = pltpu.make_async_copy(x_hbm, buf, sem)
    c.start()
    c.wait()
    o_ref[...] = buf[...]

  def f(x):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((8, 128), lambda: (0, 0)),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32),
                        pltpu.SemaphoreType.DMA], backend=backend)(x)

  x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
  platforms = ("tpu",) if backend == "mosaic" else ("cpu",)
  jax.jit(f).trace(x).lower(lowering_platforms=platforms)
  files = sorted(os.listdir(promela_dir))
  assert len(files) == 1 and re.fullmatch(r"kernel-[0-9a-f]{8}\.pml",
                                          files[0]), files


@needs_spin
def test_a_dumped_model_verifies_on_its_own(promela_dir):
  f, args = corpus.copy_through_vmem("read_early")
  (module,) = to_modules(f, *args)
  path = promela.maybe_dump(module, "early")
  rep = verify.verify_promela(path)
  assert rep.kind == "race"
  assert rep.error_line and "/promela_corpus.py:" in rep.error_line
  assert rep.kernel == "_copy_kernel"


@needs_spin
def test_verify_writes_the_model_it_checks_to_the_dump_directory(promela_dir):
  f, args = corpus.copy_through_vmem("read_early")
  rep = verify(f, *args, queue=2)
  (path,) = list(promela_dir.glob("*.pml"))
  assert path.name.startswith("_copy_kernel-")
  # the model verify checked (its options included), which verifies alone
  assert "DMA queue: 2 slots per device" in path.read_text()
  again = verify.verify_promela(str(path))
  assert again.kind == rep.kind == "race"


# ------------------------------------------------------------ the CLI

def _cli(*argv, timeout=300):
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return subprocess.run([sys.executable, "-m", "lowering_mosaic.verify",
                         *argv], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout)


@needs_spin
def test_cli_on_a_pml_file(promela_dir):
  f, args = corpus.copy_through_vmem("wrong_sem")
  (module,) = to_modules(f, *args)
  path = promela.maybe_dump(module, "wrong")
  r = _cli(path)
  assert r.returncode == 1, r.stdout + r.stderr
  assert "deadlock" in r.stdout and "/promela_corpus.py:" in r.stdout


@needs_spin
@pytest.mark.parametrize("fn,shape,code,kind", [
    ("cli_copy", "f32[8,128]", 0, "ok"),
    ("cli_read_early", "8x128xf32", 1, "race"),
    ("cli_all_gather", "f32[16,128]", 0, "ok"),
])
def test_cli_on_a_function(capsys, fn, shape, code, kind):
  assert verify.main([f"tests.pallas.test_promela_api:{fn}", shape]) == code
  out = capsys.readouterr().out
  assert f": {kind} (" in out
  if kind == "race":
    assert "/promela_corpus.py:" in out and "trail:" in out


@needs_spin
def test_cli_runs_a_kernel_that_takes_an_axis_name(capsys):
  # kernels.collectives.all_gather(x, *, axis_name): the CLI runs it per
  # device inside shard_map; SHAPES are per device.
  assert verify.main(["kernels.collectives:all_gather", "f32[32,128]"]) == 0
  captured = capsys.readouterr()
  assert captured.out.startswith("all_gather: ok ("), captured.out
  assert "--axis NAME=SIZE" in captured.err and "x=2" in captured.err
  assert verify.main(["kernels.collectives:all_gather", "f32[32,128]",
                      "--axis", "ring=4", "--timeout", "120"]) == 0
  out = capsys.readouterr()
  assert out.out.startswith("all_gather: ok (") and not out.err, out


def test_cli_help_shows_how_to_pass_an_axis(capsys):
  with pytest.raises(SystemExit):
    verify.main(["--help"])
  out = capsys.readouterr().out
  assert "--axis NAME=SIZE" in out
  assert ("python -m lowering_mosaic.verify kernels.collectives:all_gather "
          "f32[32,128] --axis x=4") in out
  with pytest.raises(ValueError, match="write NAME=SIZE"):
    verify.parse_axis("4")
  # every exit status, SPIN missing included
  assert "0 ok, 1 a race" in out and "2 the search hit a bound" in out
  assert "3 SPIN is not installed" in out


def test_cli_exits_with_3_without_spin(capsys, monkeypatch):
  from lowering_mosaic.verification.promela import spin
  monkeypatch.setattr(spin, "find_spin", lambda: None)
  code = verify.main(["tests.pallas.test_promela_api:cli_all_gather",
                      "f32[16,128]"])
  err = capsys.readouterr().err
  assert code == 3 and "spin" in err.lower(), err


@needs_spin
def test_cli_bound_exit_code(capsys):
  assert verify.main(["tests.pallas.test_promela_api:cli_all_gather",
                      "f32[16,128]", "--max-depth", "10"]) == 2
  assert "bound" in capsys.readouterr().out


def test_cli_emits_the_model(capsys):
  assert verify.main(["tests.pallas.test_promela_api:cli_copy", "f32[8,128]",
                      "--emit", "--queue", "2"]) == 0
  out = capsys.readouterr().out
  assert "proctype kernel" in out and "#define Q 2" in out


def test_cli_without_spin(monkeypatch, capsys):
  monkeypatch.setattr(spin_mod, "find_spin", lambda: None)
  assert verify.main(["tests.pallas.test_promela_api:cli_copy",
                      "f32[8,128]"]) == 3
  assert "apt-get install spin" in capsys.readouterr().err


def test_shape_parsing():
  s = verify.parse_shape("bf16[4, 8]")
  assert s.shape == (4, 8) and s.dtype == jnp.bfloat16
  assert verify.parse_shape("2x3xi32").shape == (2, 3)
  with pytest.raises(ValueError, match="f32"):
    verify.parse_shape("nonsense")
