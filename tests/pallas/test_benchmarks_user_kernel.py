"""`python -m benchmarks --kernel module:function`: a user's own kernel in the
benchmark table, beside XLA (its reference) and Pallas."""
import csv
import io
import json

import numpy as np
import pytest

from benchmarks.suite.user import UserKernel, parse_input_specs

# The CLI runner and the per-test autotune cache (an autouse fixture).
from tests.pallas.cli_testing import private_autotune_cache  # noqa: F401
from tests.pallas.cli_testing import run_cli

FAST = ["--repeats", "1"]
SCALE = "tests.pallas.bench_user_kernel:scale"
LOOKUP = "tests.pallas.bench_user_kernel:lookup"


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
    (["--kernel", LOOKUP, "--inputs", "f32[8], u8[8]:0..1000"],
     "0..1000 does not fit uint8"),
    (["--kernel", LOOKUP, "--inputs", "f32[8], i32[8]:9..3"],
     "the range 9..3 is empty"),
    (["--kernel", LOOKUP, "--inputs", "f32[8], i32[8]:labels"],
     "unknown --inputs modifier 'labels'"),
])
def test_bad_user_kernel_arguments(capsys, argv, message):
  rc, out, err = run_cli(capsys, *argv)
  assert rc == 2
  assert err.startswith("dsl-bench: error:") and message in err
  assert len(err.strip().splitlines()) == 1


def test_integer_inputs_take_ranges_and_sorted_offsets():
  specs, fills = zip(*parse_input_specs(
      "f32[1000], i32[4096]:0..1000, i32[65]:0..4096:sorted, "
      "i32[9]:sorted, f32[64]:-1..1, i32[8]"))
  bench = UserKernel("f", lambda *xs: xs, specs, fills=fills)
  table, labels, offsets, counts, uniform, zeros = [
      np.asarray(x) for x in bench.inputs(None, None)]
  assert labels.dtype == np.int32 and labels.shape == (4096,)
  assert labels.min() >= 0 and labels.max() < 1000
  assert len(np.unique(labels)) > 500          # spread over the range
  assert (np.diff(offsets) >= 0).all() and 0 <= offsets[0]
  assert offsets[-1] < 4096
  assert (np.diff(counts) >= 0).all() and counts.max() <= 9
  assert -1 <= uniform.min() and uniform.max() < 1
  assert table.dtype == np.float32 and (zeros == 0).all()


def test_a_kernel_on_integer_labels_beside_its_reference(capsys, tmp_path):
  j = tmp_path / "r.json"
  rc, out, err = run_cli(
      capsys, "--kernel", LOOKUP, "--inputs", "f32[1000], i32[4096]:0..1000",
      "--reference", "tests.pallas.bench_user_kernel:lookup_ref",
      "--backends", "interpret", "--json", str(j), "--progress", "never",
      *FAST)
  assert rc == 0, out + err
  r, = json.loads(j.read_text())["rows"]
  assert r["check"] == "ok" and r["dsl"]["median_s"] > 0
