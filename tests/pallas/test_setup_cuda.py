"""A GPU user's set-up: scripts/cuda_extra.py picks JAX's CUDA plugin from
`nvidia-smi` (fabricated outputs here), and scripts/setup.sh installs it on
a machine with a driver and does nothing new on one without."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import stat
import subprocess
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
_spec = importlib.util.spec_from_file_location(
    "cuda_extra", os.path.join(ROOT, "scripts", "cuda_extra.py"))
cuda_extra = importlib.util.module_from_spec(_spec)
sys.modules["cuda_extra"] = cuda_extra     # dataclasses look their module up
_spec.loader.exec_module(cuda_extra)


def smi(cuda: str) -> str:
  return f"""Thu Nov 27 10:00:00 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 575.57.08              Driver Version: 575.57.08      CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
|   0  NVIDIA H200                    On  |   00000000:19:00.0 Off |                    0 |
+-----------------------------------------------------------------------------------------+
"""


@pytest.mark.parametrize("returncode, output, extra, says", [
    (None, "", None, "no nvidia-smi"),
    (9, "NVIDIA-SMI has failed because it couldn't communicate with the "
        "NVIDIA driver.", None, "couldn't communicate"),
    (0, "No devices were found", None, "no CUDA version"),
    (0, smi("11.8"), None, "upgrade the driver"),
    (0, smi("12.2"), "cuda12", "CUDA 12.2"),
    (0, smi("12.9"), "cuda12", "CUDA 12.9"),
    (0, smi("13.0"), "cuda13", "CUDA 13.0"),
    (0, smi("14.1"), "cuda13", "CUDA 14.1"),   # newer drivers run older CUDA
])
def test_decision_from_nvidia_smi(returncode, output, extra, says):
  d = cuda_extra.decide(returncode, output)
  assert d.extra == extra
  assert says in d.reason


def test_requirement_pins_the_installed_jax(monkeypatch):
  assert cuda_extra.requirement("cuda12") == f"jax[cuda12]=={jax.__version__}"
  assert cuda_extra.requirement("cuda13") == f"jax[cuda13]=={jax.__version__}"


def test_without_jax_the_requirement_pins_constraints_txt(monkeypatch):
  def missing(name):
    raise importlib.metadata.PackageNotFoundError(name)
  monkeypatch.setattr(importlib.metadata, "version", missing)
  with open(os.path.join(ROOT, "constraints.txt")) as f:
    pinned = next(l.split("==")[1].strip() for l in f
                  if l.startswith("jax=="))
  assert cuda_extra.requirement("cuda12") == f"jax[cuda12]=={pinned}"


def test_main_prints_the_requirement_only_when_missing(monkeypatch, capsys):
  monkeypatch.setattr(cuda_extra, "run_nvidia_smi", lambda: (0, smi("13.0")))
  monkeypatch.setattr(cuda_extra, "plugin_installed", lambda extra: False)
  assert cuda_extra.main(["--missing"]) == 0
  out, err = capsys.readouterr()
  assert out == f"jax[cuda13]=={jax.__version__}\n" and "CUDA 13.0" in err
  monkeypatch.setattr(cuda_extra, "plugin_installed", lambda extra: True)
  assert cuda_extra.main(["--missing"]) == 0
  assert capsys.readouterr().out == ""
  monkeypatch.setattr(cuda_extra, "run_nvidia_smi", lambda: (None, ""))
  assert cuda_extra.main([]) == 0
  assert capsys.readouterr().out == ""


def test_verify_warns_when_jax_does_not_see_the_gpu(monkeypatch, capsys):
  monkeypatch.setattr(cuda_extra, "run_nvidia_smi", lambda: (0, smi("12.4")))
  assert cuda_extra.main(["--verify"]) == 1     # this machine: JAX on CPU
  err = capsys.readouterr().err
  assert "an NVIDIA GPU is present" in err and f"jax[cuda12]=={jax.__version__}" in err
  monkeypatch.setattr(cuda_extra, "run_nvidia_smi", lambda: (None, ""))
  assert cuda_extra.main(["--verify"]) == 0


def _fake_machine(tmp_path, cuda: str | None):
  """A copy of the set-up scripts, a .venv whose pip only records its
  arguments, and a PATH with `spin` and, when `cuda`, `nvidia-smi`."""
  (tmp_path / "scripts").mkdir()
  for name in ("setup.sh", "cuda_extra.py", "toolchain.py"):
    shutil.copy(os.path.join(ROOT, "scripts", name), tmp_path / "scripts")
  shutil.copy(os.path.join(ROOT, "constraints.txt"), tmp_path)
  bin_, venv = tmp_path / "bin", tmp_path / ".venv" / "bin"
  bin_.mkdir()
  venv.mkdir(parents=True)
  log = tmp_path / "pip.log"

  def script(path, text):
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
  script(venv / "python", f'exec "{sys.executable}" "$@"\n')
  script(venv / "pip", f'echo "$@" >> "{log}"\n')
  script(bin_ / "spin", "exit 0\n")
  if cuda:
    script(bin_ / "nvidia-smi", f"cat <<'EOF'\n{smi(cuda)}EOF\n")
  env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}")
  r = subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")],
                     cwd=tmp_path, env=env, capture_output=True, text=True,
                     timeout=300)
  return r, (log.read_text() if log.exists() else "")


def test_setup_installs_the_plugin_on_a_gpu_machine(tmp_path):
  r, pip = _fake_machine(tmp_path, "12.4")
  assert r.returncode == 0, r.stderr
  want = f"jax[cuda12]=={jax.__version__}"
  assert f"install --quiet -c constraints.txt {want}" in pip
  assert f"set-up: installing {want}" in r.stderr
  # pip was a stub, so JAX still runs on the CPU: said loudly
  assert "warning: an NVIDIA GPU is present" in r.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None,
                    reason="this machine has an NVIDIA driver")
def test_setup_on_a_cpu_machine_installs_no_plugin(tmp_path):
  r, pip = _fake_machine(tmp_path, None)
  assert r.returncode == 0, r.stderr
  assert "cuda" not in pip and "set-up:" not in r.stderr
