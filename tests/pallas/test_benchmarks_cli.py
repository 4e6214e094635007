"""The benchmark CLI (benchmarks/): listing, runs, reports, errors, autotune.

Tiny sizes and one repeat, so the whole file runs in seconds.
"""
import csv
import io
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from benchmarks import autotune, sizes
from benchmarks.usage_errors import UsageError
from benchmarks.progress import Progress
# The CLI runner and the per-test autotune cache (an autouse fixture).
from tests.pallas.cli_testing import private_autotune_cache  # noqa: F401
from tests.pallas.cli_testing import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
FAST = ["--repeats", "1", "--progress", "never"]



def test_list(capsys):
  rc, out, err = run_cli(capsys, "--list")
  assert rc == 0, err
  for name in ("add", "matmul", "softmax", "layer_norm", "interpret",
               "pallas interpret", "xla"):
    assert name in out
  # every known backend is listed, available or with its reason
  for b in ("triton", "triton_interpret", "mosaic", "mosaic_interpret"):
    assert f"\n  {b} " in out


def test_module_entry_point():
  r = subprocess.run([sys.executable, "-m", "benchmarks", "--list"], cwd=ROOT,
                     capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, DSL_BENCH_MALLOC="0"))
  assert r.returncode == 0, r.stderr
  assert "matmul" in r.stdout


def test_run_with_json_csv_plot(capsys, tmp_path):
  j, c, p = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "r.png"
  rc, out, err = run_cli(capsys, "--kernels", "add,matmul", "--sizes", "256",
                         "--json", str(j), "--csv", str(c), "--plot", str(p),
                         *FAST)
  assert rc == 0, out + err
  # the table: one row per kernel, peers side by side
  assert "vs XLA" in out and "vs Pallas" in out and "vs Triton" in out
  lines = [l for l in out.splitlines() if l.startswith(("add ", "matmul "))]
  assert len(lines) == 2
  data = json.loads(j.read_text())
  assert data["meta"]["device"]["platform"] == jax.default_backend()
  rows = {r["kernel"]: r for r in data["rows"]}
  assert set(rows) == {"add", "matmul"}
  for r in rows.values():
    assert r["dsl"]["median_s"] > 0
    assert r["check"] == "ok"
    assert r["peers"]["xla"]["median_s"] > 0
    assert r["peers"]["xla"]["ratio"] > 0
    # the same kernel source ran under jax.experimental.pallas
    assert r["peers"]["pallas"]["mode"] == "interpret"
    assert r["peers"]["pallas"]["median_s"] > 0
    assert r["dsl"]["memory"]["peak_over_io"] >= 1.0
    if jax.default_backend() == "cpu":
      assert r["peers"]["triton"]["note"] == "n/a: no GPU"
  assert rows["matmul"]["size"] == "256x256x256"
  assert rows["matmul"]["throughput_unit"] == "FLOP/s"
  recs = list(csv.DictReader(io.StringIO(c.read_text())))
  assert [r["kernel"] for r in recs] == ["add", "matmul"]
  assert float(recs[0]["median_s"]) > 0 and float(recs[0]["xla_ratio"]) > 0
  assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rowwise_kernels_match_reference(capsys, tmp_path):
  j = tmp_path / "r.json"
  rc, out, err = run_cli(capsys, "--kernels", "softmax,layer_norm", "--sizes",
                         "64x128", "--config", "block_rows=16", "--json",
                         str(j), *FAST)
  assert rc == 0, out + err
  rows = json.loads(j.read_text())["rows"]
  assert [r["check"] for r in rows] == ["ok", "ok"]
  assert all(r["config"] == {"block_rows": 16} for r in rows)


def test_interpret_goal_rows_and_skip_slow_peers(capsys, tmp_path):
  j = tmp_path / "r.json"
  rc, out, err = run_cli(capsys, "--kernels", "add", "--sizes", "4M",
                         "--skip-slow-peers", "--json", str(j), *FAST)
  assert rc == 0, out + err
  data = json.loads(j.read_text())
  row = data["rows"][0]
  assert row["config"] == {"block": 1024}
  assert row["peers"]["pallas"]["note"].startswith("skipped")
  assert "skipped" in out                      # shown, not dropped
  (goal,) = data["goals"]
  assert goal["kernel"] == "add" and goal["ratio_goal"] == 3.0
  assert goal["memory_ratio"] is not None
  assert "Interpret-speed goals" in out


def test_slow_peer_runs_once():
  from dsl.tools.timing import measure
  calls = []

  def slow(x):
    return jax.pure_callback(lambda v: (calls.append(1), v)[1],
                             jax.ShapeDtypeStruct(x.shape, x.dtype), x)
  # Pallas interpret: the first slow call is the measurement
  st = measure(slow, (jnp.ones(4),), repeats=5, slow_s=0.0, trust_first=True)
  assert len(st.samples) == 1 and len(calls) == 1
  # others: a second call confirms (a first call pays one-off costs)
  st = measure(slow, (jnp.ones(4),), repeats=5, slow_s=0.0)
  assert len(st.samples) == 1 and len(calls) == 3


@pytest.mark.parametrize("argv", [
    ["--kernels", "nope"],
    ["--kernels", "add", "--sizes", "4Q"],
    ["--kernels", "add", "--sizes", "64x64"],
    ["--kernels", "add", "--sizes", "0"],
    ["--kernels", "add", "--sizes", "1,,2"],
    ["--kernels", "add", "--backends", "no_such_backend"],
    ["--kernels", "add", "--config", "bm=64"],
    ["--repeats", "0"],
    ["--no-such-flag"],
    ["--kernels", "add", "--json", "/no/such/dir/out.json"],
    ["--suite", "pallas-ops", "--kernels", "tpu.nope"],
    ["--suite", "no-such-suite"],
])
def test_bad_arguments_exit_with_one_line(capsys, argv):
  rc, out, err = run_cli(capsys, *argv)
  assert rc == 2
  assert err.count("\n") == 1 and err.startswith("dsl-bench: error: "), err
  assert "Traceback" not in err and out == ""


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="has a GPU")
def test_unavailable_backend_is_an_error(capsys):
  rc, out, err = run_cli(capsys, "--kernels", "add", "--backends", "triton")
  assert rc == 2 and "needs a GPU" in err and err.count("\n") == 1


def test_sizes_parsing():
  assert sizes.parse_sizes("4M,1024x512, 2k") == [(1 << 22,), (1024, 512),
                                                  (2048,)]
  assert sizes.label((1 << 22,)) == "4M" and sizes.key((1 << 22,)) == "4194304"
  for bad in ("", "x", "1.5", "-3", "4MB"):
    with pytest.raises(UsageError):
      sizes.parse_sizes(bad)


def test_autotune_cache_round_trip(capsys, tmp_path):
  cache = tmp_path / "autotune.json"
  assert autotune.cache_path() == str(cache)
  key = autotune.size_key((4096,), jnp.float32)
  assert key == "4096:float32"
  assert autotune.lookup("add", key, backend="interpret") is None
  argv = ["--kernels", "add", "--sizes", "4096", "--autotune",
          "--tune-repeats", "1", *FAST]
  rc, out, err = run_cli(capsys, *argv)
  assert rc == 0, out + err
  assert "autotune: best of" in out
  cfg = autotune.lookup("add", key, backend="interpret")
  assert cfg is not None and cfg["block"] in (256, 1024, 4096)
  data = json.loads(cache.read_text())
  (dev,) = data["devices"]
  assert dev.startswith(autotune.device_key().split("|")[0])
  assert "jax=" in dev and "triton=" in dev
  # a second run reuses the winner instead of searching
  rc, out, err = run_cli(capsys, *argv)
  assert rc == 0 and "autotune: cached" in out
  assert f"block={cfg['block']}" in out


def test_autotune_store_lookup_and_bad_cache(tmp_path):
  path = str(tmp_path / "c.json")
  autotune.store("matmul", "64x64x64:float32", "triton", {"bm": 32},
                 median_s=1e-3, candidates=4, device_kind="NVIDIA H100",
                 path=path)
  assert autotune.lookup("matmul", "64x64x64:float32", backend="triton",
                         device_kind="NVIDIA H100", path=path) == {"bm": 32}
  # keyed by device kind (and versions): another device does not see it
  assert autotune.lookup("matmul", "64x64x64:float32", backend="triton",
                         device_kind="cpu", path=path) is None
  with open(path, "w") as f:
    f.write("{not json")
  assert autotune.lookup("matmul", "64x64x64:float32", backend="triton",
                         device_kind="NVIDIA H100", path=path) is None


def test_progress_bar_draws_on_stderr_like_streams():
  buf = io.StringIO()
  p = Progress(4, stream=buf, mode="always", refresh=60)
  p.status("add 4M interpret")
  p.advance(2)
  p.close()
  text = buf.getvalue()
  assert "2/4" in text and "50%" in text and "add 4M interpret" in text
  quiet = io.StringIO()
  p = Progress(4, stream=quiet, mode="auto")     # not a terminal: silent
  p.advance(4)
  p.close()
  assert quiet.getvalue() == ""


def test_kernels_library_is_picked_up_when_present(capsys, tmp_path):
  from benchmarks.suite import external_kernels
  ready = [k for k in external_kernels() if k.unavailable() is None
           and k.short == "softmax"]
  if not ready:
    pytest.skip("kernels.softmax is not available in this checkout")
  j = tmp_path / "r.json"
  rc, out, err = run_cli(capsys, "--kernels", "kernels.softmax", "--sizes",
                         "32x128", "--json", str(j), *FAST)
  assert rc == 0, out + err
  (row,) = json.loads(j.read_text())["rows"]
  assert row["check"] == "ok" and row["source"] == "kernels"
  assert row["peers"]["pallas"]["note"].startswith("n/a")


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")
def test_sharding_rows(capsys, tmp_path):
  """--sharding: the partitioned kernel, shard_map and the replicated run,
  each checked against the reference; no all-gather in the sharded one."""
  out = tmp_path / "sharding.json"
  code, text, _ = run_cli(capsys, "--sharding", "--kernels", "softmax",
                          "--sizes", "64x128", "--backends",
                          "interpret,mosaic_interpret", "--json", str(out),
                          *FAST)
  assert code == 0, text
  rows = json.loads(out.read_text())["sharding"]
  assert [r["backend"] for r in rows] == ["interpret", "mosaic_interpret"]
  for r in rows:
    assert r["sharded"]["all_gathers"] == 0
    assert all(r[n]["ok"] for n in ("sharded", "shard_map", "replicated"))
  assert "shard_map ms" in text


def test_pallas_ops_suite_times_dsl_beside_pallas(capsys, tmp_path):
  """--suite pallas-ops: an op of Pallas's kernel library on dsl's
  interpret beside Pallas's interpret mode, the outputs checked, the ratio
  in the table and the JSON record."""
  out = tmp_path / "pallas-ops.json"
  code, text, _ = run_cli(capsys, "--suite", "pallas-ops", "--kernels",
                          "gpu.softmax", "--json", str(out), *FAST)
  assert code == 0, text
  (row,) = json.loads(out.read_text())["rows"]
  assert row["op"] == "gpu.softmax" and row["check"] == "ok"
  assert row["ratio"] == pytest.approx(row["dsl_s"] / row["pallas_s"])
  assert "vs Pallas" in text and "gpu.softmax" in text


def test_grad_vs_hand_compares_gradients_and_prints_a_row(capsys):
  from benchmarks import grad_vs_hand
  assert grad_vs_hand.main(["--small", "--repeats", "1", "--kernels",
                            "softmax,layer_norm,matmul"]) == 0
  out = capsys.readouterr().out
  assert "softmax 16x128" in out and "layer_norm 16x128" in out
  assert "matmul 32x32x32" in out
  with pytest.raises(SystemExit):
    grad_vs_hand.main(["--kernels", "nope"])


def test_grad_vs_hand_aot_compiles_both_gradients_for_sm90(capsys):
  """--aot: the compile path of --backend triton, no GPU: every Triton
  kernel of both gradients, with its registers and shared memory."""
  from benchmarks import grad_vs_hand
  assert grad_vs_hand.main(["--small", "--aot", "sm_90", "--kernels",
                            "softmax"]) == 0
  lines = capsys.readouterr().out.splitlines()
  heads = [l for l in lines if "kernels compiled for sm_90" in l]
  assert [h.split(":")[0] for h in heads] == ["softmax 16x128 hand",
                                              "softmax 16x128 auto"]
  assert any("_transpose" in l and "regs" in l and "/SM" in l
             for l in lines)
  assert not any("SPILLS" in l for l in lines)
