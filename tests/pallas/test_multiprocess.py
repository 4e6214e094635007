"""Kernels in a job of two processes (`jax.distributed` on the CPU, gloo
collectives), the way a model outgrows one machine: on every CPU backend a
kernel partitioned under a sharded `jax.jit` across the processes, its
gradient, and a ring of the two devices inside `shard_map`; and
`dsl.autotune` decides once, in process 0, so that both processes compile
the same program although their cache files name different winners.

The two processes (tests/pallas/multiprocess_worker.py) start once for the
module and report what they computed; each test checks one part of it.
"""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
BACKENDS = ("interpret", "triton_interpret", "mosaic_interpret")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_job(tmp, backends) -> list[dict]:
  """Starts the two processes on `backends`; their reports, by rank."""
  port = str(_free_port())
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)          # one CPU device per process
  env["PYTHONPATH"] = ROOT
  procs = [subprocess.Popen(
      [sys.executable, "-m", "tests.pallas.multiprocess_worker", str(rank),
       port, str(tmp / f"r{rank}.json"), str(tmp / f"cache{rank}.json"),
       ",".join(backends)],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True) for rank in (0, 1)]
  logs = []
  for p in procs:
    try:
      out, _ = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail("the two processes did not finish in 240 s")
    logs.append(out)
  for rank, (p, log) in enumerate(zip(procs, logs)):
    assert p.returncode == 0, f"process {rank} failed:\n{log[-4000:]}"
  return [json.loads((tmp / f"r{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
  """The default suite runs the job once, on the default backend; the
  `slow` test below runs it on every CPU backend."""
  return run_job(tmp_path_factory.mktemp("job"), ["interpret"])


def _rows(rank):
  return np.arange(16 * 128, dtype=np.float32).reshape(16, 128) + 1000 * rank


def test_one_job_of_two_processes(job):
  for rank, r in enumerate(job):
    assert (r["rank"], r["processes"], r["devices"]) == (rank, 2, 2)


def check_partitioned(job, backend):
  for rank, r in enumerate(job):
    got = r["backends"][backend]
    x = _rows(rank)
    np.testing.assert_array_equal(got["out"], 3 * x)
    assert got["out_sharding"] == "P('x', None)"


def check_grad(job, backend):
  for rank, r in enumerate(job):
    x = _rows(rank)     # d/dx sum((2x + x)^2) = 18 x
    np.testing.assert_allclose(r["backends"][backend]["grad"], 18 * x,
                               rtol=1e-6)


def check_ring(job, backend):
  for rank, r in enumerate(job):
    ring = r["backends"][backend]["ring"]
    if backend == "triton_interpret":   # the neighbour's shard, plus one
      assert ring == [2.0 - rank + 1.0] * 8
    else:                               # the all_gather of both shards
      assert ring == [1.0] * 8 + [2.0] * 8


def test_autotune_decides_once_for_the_job(job):
  first, second = (r["autotune"] for r in job)
  # process 0 read its cache (block 512); process 1's says 1024 but it
  # takes process 0's choice, and both compile the same program
  assert first["config"] == second["config"] == {"block": 512}
  assert (first["source"], second["source"]) == ("cached", "shared")
  assert first["program"] == second["program"]


def test_a_kernel_failure_raises_in_every_process(job):
  first, second = (r["failure"] for r in job)
  # the check fails on process 1's shard: it raises the KernelCheckError,
  # and process 0 raises too, naming the process that failed
  assert second.startswith("KernelCheckError: kernel 'positive': x must not "
                           "be negative"), second
  assert "kernel '<a kernel of process 1>'" in first, first


def test_partitioned_kernel_grad_and_ring_across_processes(job):
  check_partitioned(job, "interpret")
  check_grad(job, "interpret")
  check_ring(job, "interpret")


@pytest.mark.slow
def test_every_cpu_backend_across_processes(tmp_path):
  job = run_job(tmp_path, list(BACKENDS))
  for backend in BACKENDS:
    check_partitioned(job, backend)
    check_grad(job, backend)
    check_ring(job, backend)
