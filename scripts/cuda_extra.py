"""Which CUDA plugin of JAX this machine needs, from the NVIDIA driver.

`scripts/setup.sh` runs it on machines with `nvidia-smi`:

    python scripts/cuda_extra.py --missing   # prints "jax[cuda12]==0.12.0.1"
                                             # when that plugin is not yet
                                             # installed; nothing otherwise
    python scripts/cuda_extra.py --verify    # after installing: does JAX
                                             # see the GPU? (exit 1 if not)

The choice follows the CUDA version the driver supports (the "CUDA Version"
in `nvidia-smi`'s header): 13.x and newer take the pinned jax's `cuda13`
extra, 12.x its `cuda12` extra; an older driver, a failing `nvidia-smi` or
none at all take nothing (JAX runs on the CPU), said on stderr. Only the
standard library is used, and jax only by `--verify`.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys

# The oldest and newest CUDA majors the pinned jax has plugins for.
EXTRAS = {12: "cuda12", 13: "cuda13"}
# constraints.txt: the jax the set-up installs, when jax is not installed yet.
CONSTRAINTS = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "constraints.txt")
_VERSION = re.compile(r"CUDA Version\s*:\s*(\d+)\.(\d+)")


@dataclasses.dataclass(frozen=True)
class Decision:
  extra: str | None        # "cuda12", "cuda13" or None (CPU only)
  reason: str


def decide(returncode: int | None, output: str) -> Decision:
  """The plugin for a machine whose `nvidia-smi` exited with `returncode`
  (None: not installed) printing `output`."""
  if returncode is None:
    return Decision(None, "no nvidia-smi: no NVIDIA driver, JAX runs on the "
                    "CPU")
  first = next((l.strip() for l in output.splitlines() if l.strip()), "")
  if returncode != 0:
    return Decision(None, f"nvidia-smi failed (exit {returncode}: {first}): "
                    "no usable NVIDIA driver, JAX runs on the CPU")
  m = _VERSION.search(output)
  if m is None:
    return Decision(None, "nvidia-smi names no CUDA version: JAX runs on the "
                    "CPU")
  major, minor = int(m.group(1)), int(m.group(2))
  if major < min(EXTRAS):
    return Decision(None, f"the NVIDIA driver supports CUDA {major}.{minor}; "
                    f"jax {jax_version()} needs CUDA {min(EXTRAS)} or newer: "
                    "upgrade the driver to use the GPU (JAX runs on the CPU)")
  extra = EXTRAS[min(major, max(EXTRAS))]
  return Decision(extra, f"the NVIDIA driver supports CUDA {major}.{minor}: "
                  f"JAX's {extra} plugin")


def jax_version() -> str:
  try:
    return importlib.metadata.version("jax")
  except importlib.metadata.PackageNotFoundError:
    return pinned_jax()


def pinned_jax(path: str = CONSTRAINTS) -> str:
  with open(path) as f:
    for line in f:
      m = re.match(r"\s*jax\s*==\s*(\S+)", line)
      if m:
        return m.group(1)
  raise SystemExit(f"{path} pins no jax")


def requirement(extra: str) -> str:
  """The pip requirement of a plugin for the installed (pinned) jax."""
  return f"jax[{extra}]=={jax_version()}"


def plugin_installed(extra: str) -> bool:
  return importlib.util.find_spec(f"jax_{extra}_plugin") is not None


def run_nvidia_smi(timeout: float = 60.0) -> tuple[int | None, str]:
  try:
    r = subprocess.run(["nvidia-smi"], capture_output=True, text=True,
                       timeout=timeout)
  except FileNotFoundError:
    return None, ""
  except (OSError, subprocess.TimeoutExpired) as e:
    return 1, f"{type(e).__name__}: {e}"
  return r.returncode, r.stdout + r.stderr


def verify(decision: Decision) -> tuple[bool, str]:
  """Whether JAX now runs on the GPU the driver reported."""
  import jax  # noqa: PLC0415 - only --verify needs jax (set-up runs first)
  platform = jax.default_backend()
  if platform == "gpu":
    return True, f"JAX runs on {jax.devices()[0].device_kind}"
  return False, (
      f"warning: an NVIDIA GPU is present ({decision.reason}) but JAX runs "
      f"on the {platform}: `make run` would benchmark the CPU. Check "
      f"`.venv/bin/pip install '{requirement(decision.extra)}'` and "
      "`nvidia-smi`.")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--missing", action="store_true", help="print the "
                 "requirement only when its plugin is not installed")
  p.add_argument("--verify", action="store_true", help="check that JAX "
                 "runs on the GPU (exit 1 if a GPU is present and it does "
                 "not)")
  args = p.parse_args(argv)
  decision = decide(*run_nvidia_smi())
  if args.verify:
    if decision.extra is None:
      return 0
    ok, message = verify(decision)
    print(f"set-up: {message}", file=sys.stderr)
    return 0 if ok else 1
  print(f"set-up: {decision.reason}", file=sys.stderr)
  if decision.extra and not (args.missing and plugin_installed(
      decision.extra)):
    print(requirement(decision.extra))
  return 0


if __name__ == "__main__":
  sys.exit(main())
