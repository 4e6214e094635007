"""`python -m benchmarks --kernel module:function`: a user's own kernel in the
benchmark table, beside XLA (its reference) and Pallas."""
import csv
import io
import json

import pytest

# The CLI runner and the per-test autotune cache (an autouse fixture).
from tests.pallas.cli_testing import private_autotune_cache  # noqa: F401
from tests.pallas.cli_testing import run_cli

FAST = ["--repeats", "1"]
SCALE = "tests.pallas.bench_user_kernel:scale"


def test_pl_kernel_beside_xla_and_pallas(capsys, tmp_path):
  j, c, p = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "r.png"
  rc, out, err = run_cli(
      capsys, "--kernel", SCALE, "--inputs", "f32[256,128]", "--reference",
      "tests.pallas.bench_user_kernel:scale_ref", "--config", "block=32",
      "--json", str(j), "--csv", str(c), "--plot", str(p),
      "--progress", "always", *FAST)
  assert rc == 0, out + err
  row, = [l for l in out.splitlines() if l.startswith(SCALE)]
  assert "256x128" in row and "block=32" in row and row.rstrip().endswith("ok")
  assert "5/5 100%" in err       # the progress bar ran to the end
  r, = json.loads(j.read_text())["rows"]
  assert (r["kernel"], r["source"], r["dtype"]) == (SCALE, "user", "float32")
  assert r["config"] == {"block": 32} and r["check"] == "ok"
  assert r["dsl"]["median_s"] > 0 and r["peers"]["xla"]["ratio"] > 0
  assert r["peers"]["pallas"]["mode"] == "interpret"
  assert r["peers"]["pallas"]["median_s"] > 0
  assert r["throughput_unit"] == "B/s"
  assert r["throughput"] == pytest.approx(
      2 * 256 * 128 * 4 / r["dsl"]["median_s"])
  rec, = csv.DictReader(io.StringIO(c.read_text()))
  assert rec["kernel"] == SCALE and float(rec["xla_ratio"]) > 0
  assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dsl_kernel_from_a_file_without_reference(capsys, tmp_path):
  j = tmp_path / "r.json"
  target = "tests/pallas/bench_user_kernel.py:add"
  rc, out, err = run_cli(capsys, "--kernel", target, "--inputs",
                         "bf16[512], bf16[512]", "--backends", "interpret",
                         "--json", str(j), "--progress", "never", *FAST)
  assert rc == 0, out + err
  r, = json.loads(j.read_text())["rows"]
  assert (r["kernel"], r["size"], r["dtype"]) == (target, "512", "bfloat16")
  assert r["dsl"]["median_s"] > 0 and r["check"] == "n/a"
  assert r["peers"]["xla"]["note"] == "n/a: no --reference"
  assert r["peers"]["pallas"]["note"] == "n/a: no 'pl' parameter"


@pytest.mark.parametrize("argv, message", [
    (["--kernel", SCALE], "--kernel needs --inputs"),
    (["--inputs", "f32[8]"], "--inputs needs --kernel"),
    (["--kernel", SCALE, "--inputs", "f32(8)"], "malformed --inputs"),
    (["--kernel", SCALE, "--inputs", "q7[8]"], "unknown dtype 'q7'"),
    (["--kernel", "no_such_module_xyz:f", "--inputs", "f32[8]"],
     "cannot import no_such_module_xyz"),
    (["--kernel", "tests.pallas.bench_user_kernel:nope", "--inputs",
      "f32[8]"], "has no 'nope'"),
    (["--kernel", SCALE, "--inputs", "f32[64,8]", "--config", "blok=8"],
     "blok are not keyword parameters"),
    (["--kernel", SCALE, "--inputs", "f32[8]", "--sizes", "8"],
     "--sizes does not apply to --kernel"),
    (["--kernel", SCALE, "--inputs", "f32[8]", "--dtype", "bfloat16"],
     "--dtype does not apply to --kernel"),
    (["--kernel", SCALE, "--inputs", "f32[8], f32[8]"],
     "--inputs gives 2 arrays but --kernel " + SCALE + " takes 1 positional "
     "argument (x)"),
    (["--kernel", "tests/pallas/bench_user_kernel.py:add", "--inputs",
      "f32[8]"], "--inputs gives 1 array but --kernel"),
])
def test_bad_user_kernel_arguments(capsys, argv, message):
  rc, out, err = run_cli(capsys, *argv)
  assert rc == 2
  assert err.startswith("dsl-bench: error:") and message in err
  assert len(err.strip().splitlines()) == 1
