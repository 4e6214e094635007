"""The GPU check (benchmarks.gpu_check) without a GPU: its time plan, the
arguments, the message on a machine without a GPU, the record built from
the phases' outputs, the comparison with the last record, the refresh of
the shipped tables, and a whole run with fabricated phases. Every record
and output here is fabricated, in a temporary folder."""
from __future__ import annotations

import json
import os
import sys

import jax
import pytest

from benchmarks.gpu_check import cli, phases, record, refresh, summary
from dsl.tools import gpu_defaults

H200 = "NVIDIA H200"


# ------------------------------------------------------------ plan, args

def test_the_plan_fits_in_eight_minutes():
  assert phases.total_budget() <= phases.LIMIT_S == 480
  assert all(p.budget_s > 0 for p in phases.PHASES)
  assert phases.NAMES == ("tests", "triton", "attention", "mosaic", "quick",
                        "tune")
  assert [p.name for p in phases.select(["tune", "tests"])] == ["tests", "tune"]
  assert [p.name for p in phases.select(skip=["tests"])] == list(phases.NAMES[1:])
  with pytest.raises(phases.PlanError, match="unknown phase 'x'"):
    phases.select(["x"])
  tests = phases.select(["tests"])[0]
  assert tests.command("/o")[:4] == [sys.executable, "-m", "pytest", "-m"]
  assert tests.environment("/o")["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
  tune = phases.select(["tune"])[0]
  assert tune.environment("/o")["DSL_AUTOTUNE_CACHE"] == "/o/autotune.json"
  assert "--tune-budget" in tune.command("/o")


def test_plan_and_usage_need_no_gpu(capsys):
  assert cli.main(["--plan", "--out", "/tmp/x"]) == 0
  out = capsys.readouterr().out
  assert "tests" in out and "$ python -m pytest -m gpu" in out
  assert f"{phases.total_budget()}s" in out
  assert cli.main(["--only", "nope"]) == 2
  assert "unknown phase 'nope'" in capsys.readouterr().err
  assert cli.main(["--no-such-flag"]) == 2


def test_without_a_gpu_it_says_so_and_exits_2(capsys, tmp_path):
  assert jax.default_backend() == "cpu"
  assert cli.main(["--results", str(tmp_path)]) == 2
  err = capsys.readouterr().err
  assert "no GPU: JAX runs on the cpu" in err and "scripts/setup.sh" in err
  assert os.listdir(tmp_path) == []


# ------------------------------------------------------------ records

TRITON_OUT = [
    {"bench": "matmul bf16 4096^3", "impl": "jnp.dot (cuBLAS)", "config": "",
     "ms": 0.20, "value": 687.0, "unit": "TFLOP/s", "err": 0.9},
    {"bench": "matmul bf16 4096^3", "impl": "ours",
     "config": "b128x128x64 w4 s3",
     "ms": 0.25, "value": 550.0, "unit": "TFLOP/s", "err": 0.9,
     "kernel": "matmul", "size": "4096x4096x4096", "dtype": "bfloat16",
     "cfg": {"variant": "loop_k", "bm": 128, "bn": 128, "bk": 64,
             "num_warps": 4, "num_stages": 3}},
    {"bench": "matmul bf16 4096^3", "impl": "ours",
     "config": "b128x256x64 w8 s3",
     "ms": 0.21, "value": 650.0, "unit": "TFLOP/s", "err": 0.9,
     "kernel": "matmul", "size": "4096x4096x4096", "dtype": "bfloat16",
     "cfg": {"variant": "loop_k", "bm": 128, "bn": 256, "bk": 64,
             "num_warps": 8, "num_stages": 3}},
    {"bench": "matmul bf16 4096^3", "impl": "pallas",
     "config": "b128x256x64 w8 s3",
     "ms": float("nan"), "value": float("nan"), "unit": "TFLOP/s",
     "err": float("nan"), "note": "RuntimeError: boom"},
]
ATTENTION_OUT = {
    "copy_GBps": 4200.0,
    "attention": [{"kernel": "flash_attention", "mode": "fwd", "seq": 2048,
                   "ours_ms": 0.4, "error": None, "pallas_ms": 0.5,
                   "pallas_note": None, "cudnn_ms": None,
                   "cudnn_note": "n/a: RuntimeError: no cudnn",
                   "mosaic_gpu_ours_ms": 0.6, "mosaic_gpu_error": None}],
    "rowwise": [{"kernel": "softmax", "shape": [8192, 8192], "ms": 0.1,
                 "GB/s": 2600.0, "error": None}],
}


def _cli_row(kernel, size, backend, dsl_s, xla_s, *, check="ok", dtype=
             "float32", config=None, tuning=None):
  row = {"kernel": kernel, "size": size, "dtype": dtype, "backend": backend,
         "config": config or {}, "shown_config": config or {},
         "config_source": "default", "check": check,
         "dsl": {"median_s": dsl_s, "note": None},
         "peers": {"xla": {"median_s": xla_s, "note": None},
                   "pallas": {"median_s": None, "note": "n/a: x"}},
         "throughput": 1.0, "throughput_unit": "B/s"}
  if tuning:
    row["autotune"] = tuning
  return row


def test_rows_from_each_phase_output():
  rows = record.rows_of_triton(TRITON_OUT)
  assert rows[1]["id"] == "triton|matmul bf16 4096^3 b128x128x64 w4 s3|ours"
  assert rows[1]["time_s"] == pytest.approx(0.25e-3)
  assert rows[1]["config"]["bm"] == 128 and rows[1]["kernel"] == "matmul"
  assert rows[3]["ok"] is False and rows[3]["time_s"] is None
  assert rows[3]["note"] == "RuntimeError: boom"
  att = record.rows_of_attention(ATTENTION_OUT)
  by = {r["id"]: r for r in att}
  assert by["attention|copy 1 GiB|xla"]["value"] == 4200.0
  assert by["attention|flash_attention fwd seq=2048|ours"]["time_s"] == \
      pytest.approx(0.4e-3)
  assert not by["attention|flash_attention fwd seq=2048|cudnn"]["ok"]
  assert by["attention|flash_attention fwd seq=2048|ours mosaic_gpu"][
      "time_s"] == pytest.approx(0.6e-3)
  assert by["attention|softmax 8192x8192|ours"]["kernel"] == "kernels.softmax"
  cli_rows = record.rows_of_cli("quick", {"rows": [
      _cli_row("add", "4194304", "triton", 1e-4, 1e-4)]})
  assert [r["impl"] for r in cli_rows] == ["dsl", "xla", "pallas"]
  assert cli_rows[0]["id"] == "quick|add 4194304 float32 triton|dsl"
  assert cli_rows[2]["ok"] is False


def test_the_gpu_scripts_write_what_the_record_reads():
  """gpu_triton and gpu_attention on a CPU: our GPU kernels and the GPU
  peers fail (said in the rows), XLA's dot runs; the record reads both."""
  import dsl
  from benchmarks import gpu_attention, gpu_triton
  out = []
  gpu_triton.bench_matmul(128, {"ours": dsl}, out)
  rows = record.rows_of_triton(json.loads(json.dumps(out)))
  cublas, ours = rows[0], rows[1]
  assert cublas["ok"] and cublas["time_s"] > 0
  assert (ours["impl"], ours["kernel"], ours["size"], ours["ok"]) == (
      "ours", "matmul", "128x128x128", False)
  assert ours["config"]["variant"] == "loop_k" and "BackendError" in \
      ours["note"]
  att = gpu_attention.attention_rows([128], batch=1, heads=2, dim=64,
                                     backends=("triton", "mosaic_gpu"))
  rows = record.rows_of_attention(json.loads(json.dumps(
      {"copy_GBps": 1.0, "attention": att, "rowwise": []})))
  impls = {r["impl"] for r in rows if "seq=128" in r["id"]}
  assert impls == {"ours", "ours mosaic_gpu", "pallas", "cudnn"}
  assert all(not r["ok"] and r["note"] for r in rows if "seq=128" in r["id"])


def test_test_counts_from_junit(tmp_path):
  path = tmp_path / "t.xml"
  path.write_text(
      '<testsuites><testsuite name="pytest" tests="4" failures="1" '
      'errors="0" skipped="1"><testcase classname="tests.a" name="t1"/>'
      '<testcase classname="tests.a" name="t2"><failure message="x"/>'
      '</testcase><testcase classname="tests.b" name="t3"><skipped/>'
      '</testcase><testcase classname="tests.b" name="t4"/></testsuite>'
      '</testsuites>')
  t = record.tests_of_junit(str(path))
  assert (t["passed"], t["skipped"], t["failed"]) == (2, 1, ["tests.a::t2"])


def _record(date, kind=H200, rows=(), sha="abc"):
  return {"format": 1, "date": date, "device_kind": kind,
          "device": {"compute_capability": "9.0"}, "commit": {"sha": sha},
          "versions": {"jax": "0.11.2"}, "phases": {}, "rows": list(rows)}


def test_last_record_of_the_same_device_kind(tmp_path):
  for date, kind in (("2026-11-28T10:00:00", H200),
                     ("2026-11-29T10:00:00", "NVIDIA H100 80GB HBM3"),
                     ("2026-11-27T10:00:00", H200)):
    record.write(_record(date, kind), str(tmp_path))
  (tmp_path / "junk.json").write_text("{ not json")
  last = record.last_record(H200, str(tmp_path))
  assert last["date"] == "2026-11-28T10:00:00"
  assert record.last_record(H200, str(tmp_path), before=last["date"])[
      "date"] == "2026-11-27T10:00:00"
  assert record.last_record("NVIDIA A100", str(tmp_path)) is None
  assert sorted(os.listdir(tmp_path))[0] == "20261127-100000-nvidia-h200.json"


def _r(id_, time_s=None, value=None, ok=True, unit=""):
  return {"id": id_, "phase": id_.split("|")[0],
          "impl": id_.rsplit("|", 1)[1], "time_s": time_s,
          "value": value, "ok": ok, "unit": unit}


def test_rows_more_than_ten_percent_slower_are_flagged():
  before = _record("2026-11-27T10:00:00", rows=[
      _r("q|a|dsl", 1.0), _r("q|b|dsl", 1.0), _r("q|c|dsl", 1.0),
      _r("q|d|xla", value=100.0, unit="GB/s"), _r("q|e|dsl", 1.0)])
  now = _record("2026-11-28T10:00:00", rows=[
      _r("q|a|dsl", 1.25), _r("q|b|dsl", 1.05), _r("q|c|dsl", 9.0, ok=False),
      _r("q|d|xla", value=80.0, unit="GB/s"), _r("q|new|dsl", 5.0)])
  slower = record.compare(now, before)
  assert [(s["id"], round(s["slowdown"], 2)) for s in slower] == [
      ("q|a|dsl", 1.25), ("q|d|xla", 1.25)]
  assert record.compare(now, None) == []
  text = summary.render(now, before, slower, [], "rec.json", True)
  assert "1.25x  q|a|dsl  (1000 ms -> 1250 ms)" in text
  assert "1.25x  q|d|xla  (100 GB/s -> 80 GB/s)" in text


# ------------------------------------------------------------ refresh

@pytest.fixture
def tables(tmp_path, monkeypatch):
  configs, backends = tmp_path / "configs.json", tmp_path / "backends.json"
  gpu_defaults.write(str(configs), {"format": 1, "devices": {}, "families": {
      "hopper": {"matmul/triton/*:bfloat16": {
          "config": {"variant": "loop_k", "bm": 128, "bn": 128, "bk": 64,
                     "num_warps": 4, "num_stages": 3}, "source": "seed"}}}})
  gpu_defaults.write(str(backends), {"format": 1, "devices": {}, "families": {
      "hopper": {"*": {"backend": "triton", "source": "seed"}}}})
  monkeypatch.setattr(gpu_defaults, "CONFIGS_PATH", str(configs))
  monkeypatch.setattr(gpu_defaults, "BACKENDS_PATH", str(backends))
  monkeypatch.delenv(gpu_defaults.ENV_SWITCH, raising=False)
  return configs, backends


def _tuned(kernel, size, first, results, dtype="float32"):
  return record.rows_of_cli("tune", {"rows": [_cli_row(
      kernel, size, "triton", min(t for _, t in results if isinstance(
          t, float)), 1.0, dtype=dtype, config=first,
      tuning={"before": first, "candidates": len(results),
              "results": results})]})


def _mosaic(kernel, size, triton_s, mosaic_s, mosaic_ok=True):
  return record.rows_of_cli("mosaic", {"rows": [
      _cli_row(kernel, size, "triton", triton_s, 1.0, dtype="bfloat16"),
      _cli_row(kernel, size, "mosaic_gpu", mosaic_s, 1.0, dtype="bfloat16",
               check="ok" if mosaic_ok else "error")]})


def test_winners_refresh_the_configs_of_the_device(tables):
  configs, _ = tables
  rows = record.rows_of_triton(TRITON_OUT)
  rows += _tuned("add", "4194304", {"block": 1024},
                 [[{"block": 1024}, 1.0e-4], [{"block": 4096}, 0.8e-4],
                  [{"block": 256}, "RuntimeError: too big"]])
  rows += _tuned("softmax", "4096x1024", {"block_rows": 1},
                 [[{"block_rows": 1}, 1.0e-4], [{"block_rows": 2}, 0.99e-4]])
  rows += _tuned("kernels.softmax", "4096x1024", {},
                 [[{}, 1.0e-4], [{"block_rows": 8}, 1.1e-4]])
  rec = _record("2026-11-28T10:00:00", rows=rows, sha="0123456789abcdef")
  changes = refresh.refresh(rec)
  table = json.loads(configs.read_text())
  dev = table["devices"][H200]
  # gpu_triton: 128x256 beat the 128x128 in force (0.21 vs 0.25 ms)
  mm = dev["matmul/triton/4096x4096x4096:bfloat16"]
  assert mm["config"]["bn"] == 256
  assert mm["measured"]["median_s"] == pytest.approx(0.21e-3)
  assert "gpu_check (commit 0123456789)" in mm["source"]
  assert "the config in force took 0.25 ms" in mm["source"]
  # autotune: block 4096 beat the default by 20%
  assert dev["add/triton/4194304:float32"]["config"] == {"block": 4096}
  # within the margin (1%): no change; the kernel's own choice won: none
  assert "softmax/triton/4096x1024:float32" not in dev
  assert not any(k.startswith("kernels.softmax") for k in dev)
  assert len(changes) == 2 and table["families"]["hopper"]
  # a lookup now finds the device's winner
  hit = gpu_defaults.lookup("matmul", (4096,) * 3, "bfloat16", "triton",
                            device=gpu_defaults.Device(H200, "9.0"))
  assert hit.where == H200 and hit.config["bn"] == 256
  # refreshing again from the same record changes nothing
  assert [c for c in refresh.refresh(rec) if "matmul" in c] == []


def test_backend_choice_from_triton_and_mosaic_gpu_rows(tables):
  _, backends = tables
  rows = (_mosaic("kernels.matmul", "1024x1024x1024", 1e-4, 0.8e-4)
          + _mosaic("kernels.matmul", "4096x4096x4096", 1e-3, 0.9e-3)
          + _mosaic("kernels.softmax", "4096x1024", 1e-4, 0.5e-4)
          + _mosaic("kernels.softmax", "16384x4096", 1e-4, None, False)
          + _mosaic("kernels.rms_norm", "4096x1024", 1e-4, 0.99e-4))
  rec = _record("2026-11-28T10:00:00", rows=rows)
  w = refresh.backend_winners(rec)
  assert w["kernels.matmul"]["backend"] == "mosaic_gpu"
  assert w["kernels.matmul"]["ratio"] == pytest.approx((0.8 * 0.9) ** 0.5)
  assert w["kernels.softmax"]["backend"] == "triton"
  assert "did not run 1 of 2 sizes" in w["kernels.softmax"]["why"]
  assert w["kernels.rms_norm"]["backend"] == "triton"     # within the margin
  changes = refresh.refresh(rec)
  assert changes == [f"{H200}: kernels.matmul -> mosaic_gpu (mosaic_gpu / "
                     "triton time 0.85x (geometric mean over 2 sizes, bf16))"]
  choice = gpu_defaults.backend_for("kernels.matmul",
                                    device=gpu_defaults.Device(H200, "9.0"))
  assert (choice.backend, choice.where) == ("mosaic_gpu", H200)
  assert gpu_defaults.backend_for("kernels.softmax", device=gpu_defaults.Device(
      H200, "9.0")).backend == "triton"


# ------------------------------------------------------------ whole runs

def test_a_phase_is_stopped_at_its_budget(tmp_path):
  ok = phases.Phase("a", "t", 60, ("-c", "print('hi')"), None)
  slow = phases.Phase("b", "t", 1, ("-c", "import time; time.sleep(30)"), None)
  bad = phases.Phase("c", "t", 60, ("-c", "raise SystemExit(3)"), None)
  r = cli.run_phase(ok, str(tmp_path))
  assert (r["status"], r["returncode"], r["tail"]) == ("ok", 0, "hi\n")
  r = cli.run_phase(slow, str(tmp_path))
  assert r["status"] == "timeout" and r["wall_s"] < 20
  assert cli.run_phase(bad, str(tmp_path))["returncode"] == 3


def _writer(name, data):
  """A phase that writes `data` as its JSON output."""
  text = json.dumps(json.dumps(data))
  code = f"import sys; open(sys.argv[1], 'w').write({text})"
  return ("-c", code, "{out}/" + name)


def test_a_whole_check_with_fabricated_phases(tables, tmp_path, monkeypatch,
                                              capsys):
  configs, _ = tables
  results = tmp_path / "results"
  previous = _record("2026-01-02T10:00:00", rows=[
      {"id": "quick|add 4194304 float32 triton|dsl", "phase": "quick",
       "impl": "dsl",
       "time_s": 1.0e-4, "ok": True, "value": None, "unit": ""}])
  record.write(previous, str(results))
  quick = {"rows": [_cli_row("add", "4194304", "triton", 1.3e-4, 1.0e-4),
                    _cli_row("matmul", "4096x4096x4096", "triton", 1.05e-3,
                             1.0e-3)],
           "meta": {"peak": {"bytes_per_s": 4.2e12},
                    "peak_notes": ["%peak: 1 row(s) ran above the copy"]}}
  fake = (
      phases.Phase("triton", "t", 60, _writer("triton.json", TRITON_OUT),
                 "triton.json"),
      phases.Phase("quick", "t", 60, _writer("quick.json", quick), "quick.json"),
      phases.Phase("tune", "t", 1, ("-c", "import time; time.sleep(30)"),
                 "tune.json"),
  )
  monkeypatch.setattr(phases, "PHASES", fake)
  monkeypatch.setattr(phases, "NAMES", tuple(p.name for p in fake))
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(cli, "environment", lambda: {
      "device_kind": H200, "device": {"compute_capability": "9.0"},
      "versions": {"jax": "0.11.2", "triton": "3.6.0"},
      "commit": {"sha": "feedface00", "dirty": False}})
  rc = cli.main(["--results", str(results), "--out", str(tmp_path / "o")])
  out = capsys.readouterr().out
  assert rc == 1                      # the tune phase ran out of time
  (path,) = [p for p in os.listdir(results) if "20260102" not in p]
  rec = json.loads((results / path).read_text())
  assert rec["device_kind"] == H200 and rec["commit"]["sha"] == "feedface00"
  assert rec["phases"]["tune"]["status"] == "timeout"
  assert rec["phases"]["quick"]["rows"] == 6
  assert rec["phases"]["quick"]["peak"] == {"bytes_per_s": 4.2e12}
  assert "quick: %peak: 1 row(s) ran above the copy" in out
  assert any(r["id"] == "triton|matmul bf16 4096^3 b128x256x64 w8 s3|ours"
             for r in rec["rows"])
  assert "1.30x  quick|add 4194304 float32 triton|dsl" in out
  assert "1 of 2 met" in out and "missed: add 4194304 float32 triton 1.30x" \
      in out
  assert f"{H200}: matmul/triton/4096x4096x4096:bfloat16" in out
  assert rec["refreshed"] and json.loads(configs.read_text())["devices"][H200]
  assert out.rstrip().splitlines()[-1].startswith("phases took")
  # replaying the record compares it with the one before, changes nothing new
  rc = cli.main(["--replay", str(results / path), "--results", str(results),
                 "--no-update-defaults"])
  out = capsys.readouterr().out
  assert rc == 1 and "not refreshed" in out and "1.30x" in out
