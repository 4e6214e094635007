"""The benchmark CLI's GPU rows without a GPU: the configs and backends they
take from the shipped defaults, what the config column and the notes say,
and the autotune budget (the GPU check's tuning phase)."""
from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from benchmarks import autotune, cli, platform_info, report
from benchmarks.runner import Cell, Row
from benchmarks.suite import Add, by_name
from dsl.tools import gpu_defaults

H200 = ("NVIDIA H200", "9.0")


@pytest.fixture
def gpu(monkeypatch, tmp_path):
  """A machine that says it has an H200, with the shipped configs and a
  fabricated backend table (kernels.matmul on mosaic_gpu)."""
  monkeypatch.setattr(platform_info, "platform", lambda: "gpu")
  monkeypatch.setenv("DSL_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
  monkeypatch.delenv(gpu_defaults.ENV_SWITCH, raising=False)
  backends = tmp_path / "backends.json"
  backends.write_text(json.dumps({"format": 1, "families": {}, "devices": {
      H200[0]: {"kernels.matmul": {"backend": "mosaic_gpu", "source": "t"}}}}))
  monkeypatch.setattr(gpu_defaults, "BACKENDS_PATH", str(backends))
  with gpu_defaults.for_device(*H200):
    yield


def _cases(*argv):
  args = cli.build_parser().parse_args(list(argv))
  args.argv = list(argv)
  cli.check_args(args)
  kernels, _ = cli.select_kernels(args)
  backends = cli.select_backends(args, args.quick) if args.backends else [
      "triton"]
  return args, {(c.bench.name, c.size, c.backend): c
                for c in cli.build_cases(args, kernels, backends, args.quick)}


def test_quick_suite_gpu_rows_take_the_shipped_configs(gpu):
  args, cases = _cases("--quick")
  mm = cases[("matmul", (4096,) * 3, "triton")]
  want = gpu_defaults.lookup("matmul", (4096,) * 3, jnp.float32, "triton")
  assert mm.config == want.config
  assert mm.config != {"variant": "loop_k", "bm": 64, "bn": 64, "bk": 32,
                       "num_warps": 4, "num_stages": 3}
  assert mm.config_source == f"shipped: {want.key} (hopper family)"
  soft = cases[("softmax", (16384, 4096), "triton")]
  assert soft.config_source.startswith("shipped: softmax/triton/*x4096")
  # a size without an entry keeps the kernel's own default
  assert cases[("softmax", (4096, 1024), "triton")].config_source == "default"


def test_kernels_rows_run_the_kernels_own_backend_and_show_its_config(gpu):
  with pytest.raises(Exception, match="num_warps do not apply"):
    _cases("--kernels", "kernels.matmul", "--sizes", "64",
           "--config", "num_warps=8")
  _, cases = _cases("--kernels", "kernels.matmul", "--sizes", "256")
  # kernels.matmul picks mosaic_gpu on this device (the fabricated table)
  (mm,) = cases.values()
  assert mm.backend == "mosaic_gpu"
  args, cases = _cases("--kernels", "kernels.flash_attention",
                       "--sizes", "4x2048x16x128", "--dtype", "bfloat16")
  (fa,) = [c for k, c in cases.items() if k[0] == "kernels.flash_attention"]
  assert fa.backend == "triton"
  assert fa.config == {}          # nothing passed: the kernel chooses ...
  assert fa.shown == {"block_q": 128, "block_k": 128, "num_warps": 8,
                      "num_stages": 2}     # ... and the column says what
  assert fa.config_source.startswith(
      "shipped: kernels.flash_attention/triton/*x*x*x128:bfloat16")
  row = Row(fa, "bfloat16", Cell(note="n/a"), {})
  _, body, _ = report.table_rows([row])
  assert body[0][3] == "block_q=128 block_k=128 w=8 s=2"
  notes = cli.shipped_notes(args, [row, Row(mm, "bfloat16", Cell(note="-"),
                                            {})])
  assert any("kernels.flash_attention 4x2048x16x128 triton: block_q=128"
             in n for n in notes)
  assert any("kernels.matmul" in n and "backend mosaic_gpu" in n
             for n in notes)


def test_explicit_backends_and_cpu_rows_are_unchanged(gpu, monkeypatch):
  _, cases = _cases("--kernels", "kernels.matmul", "--sizes", "256",
                    "--backends", "interpret")
  (c,) = cases.values()
  assert (c.backend, c.config, c.config_source) == (
      "interpret", {}, "default (the kernel's own)")
  monkeypatch.setattr(platform_info, "platform", lambda: "cpu")
  _, cases = _cases("--kernels", "matmul", "--sizes", "1024",
                    "--backends", "interpret")
  (c,) = cases.values()
  assert c.config == {"variant": "grid_k", "bm": 128, "bn": 128, "bk": 128}
  assert c.config_source == "default"


def test_tune_budget_times_the_current_config_first_then_stops():
  bench = Add()
  best, best_t, results = autotune.search(
      bench, (4096,), jnp.float32, "interpret", "cpu", repeats=1,
      first={"block": 512}, budget_s=1e-9)
  assert [c for c, _ in results] == [{"block": 512}]
  assert best == {"block": 512} and best_t == results[0][1] > 0
  planned = autotune.candidates(bench, (4096,), jnp.float32, "interpret",
                                "cpu", {"block": 512})
  assert planned[0] == {"block": 512}
  assert len(planned) == len(bench.search_space((4096,), "interpret",
                                                "cpu")) + 1


def test_a_budgeted_search_shuffles_all_but_the_current_config():
  bench = by_name()["matmul"]
  args = ((4096,) * 3, jnp.float32, "triton", "gpu")
  first = {"variant": "loop_k", "bm": 32, "bn": 128, "bk": 32,
           "num_warps": 4, "num_stages": 4}
  plain = autotune.candidates(bench, *args, first)
  day1 = autotune.candidates(bench, *args, first, shuffle=1)
  day2 = autotune.candidates(bench, *args, first, shuffle=2)
  assert plain[0] == day1[0] == day2[0] == first
  key = lambda cs: sorted(json.dumps(c, sort_keys=True) for c in cs)
  assert key(plain) == key(day1) == key(day2)
  assert day1[1:4] != day2[1:4] and day1 == autotune.candidates(
      bench, *args, first, shuffle=1)


def test_tune_budget_needs_autotune():
  with pytest.raises(Exception, match="--tune-budget needs --autotune"):
    _cases("--tune-budget", "5")


def test_matmul_triton_search_space_holds_the_measured_winners():
  space = by_name()["matmul"].search_space((4096,) * 3, "triton", "gpu")
  tiles = {(c["bm"], c["bn"], c["bk"], c["num_warps"], c["num_stages"])
           for c in space}
  assert {(128, 256, 64, 8, 3), (128, 128, 64, 4, 3),
          (32, 128, 32, 4, 4)} <= tiles
  assert len(space) <= 48
