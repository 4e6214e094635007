"""Shipped GPU defaults (dsl.tools.gpu_defaults): the lookup over fabricated
tables, the shipped tables themselves, and kernels/ reading them (configs
and the backend choice) where a GPU is present or named."""
from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import pytest

import kernels
from benchmarks.suite import SUITE
from dsl.tools import gpu_defaults
from lowering_triton.aot import kernel_specs
from lowering_triton.kernel import generate
from tests.pallas.testing import CPU_BACKENDS

H200 = gpu_defaults.Device("NVIDIA H200", "9.0")
H100 = gpu_defaults.Device("NVIDIA H100 80GB HBM3", "9.0")


def _entry(config, source="test"):
  return {"config": config, "source": source}


CONFIGS = {
    "format": 1,
    "devices": {"NVIDIA H200": {
        "matmul/triton/4096x4096x4096:bfloat16": _entry({"bm": 128}, "exact"),
        "matmul/triton/*x4096x*:bfloat16": _entry({"bm": 96}, "two dims"),
        "matmul/triton/*:bfloat16": _entry({"bm": 64}, "bf16"),
    }},
    "families": {"hopper": {
        "matmul/triton/4096x4096x4096:bfloat16": _entry({"bm": 1}, "family"),
        "matmul/triton/*:*": _entry({"bm": 32}, "any"),
        "matmul/mosaic_gpu/*": _entry({"bm": 16}, "mosaic"),
    }},
}
BACKENDS = {
    "format": 1,
    "devices": {"NVIDIA H200": {"kernels.matmul": {"backend": "mosaic_gpu",
                                                   "source": "measured"}}},
    "families": {"hopper": {"*": {"backend": "triton", "source": "family"}}},
}


@pytest.fixture
def tables(tmp_path, monkeypatch):
  """Fabricated tables in place of the shipped ones."""
  configs, backends = tmp_path / "configs.json", tmp_path / "backends.json"
  configs.write_text(json.dumps(CONFIGS))
  backends.write_text(json.dumps(BACKENDS))
  monkeypatch.setattr(gpu_defaults, "CONFIGS_PATH", str(configs))
  monkeypatch.setattr(gpu_defaults, "BACKENDS_PATH", str(backends))
  monkeypatch.delenv(gpu_defaults.ENV_SWITCH, raising=False)
  return configs, backends


def _bm(dims, dtype="bfloat16", backend="triton", device=H200):
  hit = gpu_defaults.lookup("matmul", dims, dtype, backend, device=device)
  return hit and (hit.config["bm"], hit.where)


def test_device_entries_first_then_the_most_specific_pattern(tables):
  assert _bm((4096, 4096, 4096)) == (128, "NVIDIA H200")
  assert _bm((1024, 4096, 512)) == (96, "NVIDIA H200")
  assert _bm((1024, 1024, 1024)) == (64, "NVIDIA H200")
  # the device has no float32 entry: its family's
  assert _bm((1024, 1024, 1024), "float32") == (32, "hopper family")
  assert _bm((8, 8, 8), backend="mosaic_gpu") == (16, "hopper family")


def test_family_from_compute_capability_or_name(tables):
  assert _bm((4096,) * 3, device=H100) == (1, "hopper family")
  assert _bm((4096,) * 3, device=gpu_defaults.Device("NVIDIA GH200 480GB")) \
      == (1, "hopper family")
  assert gpu_defaults.family(gpu_defaults.Device("NVIDIA A10G")) == "ampere"
  assert gpu_defaults.family(gpu_defaults.Device("x", "8.6")) == "ampere"
  # the compute capability decides over the name
  assert gpu_defaults.family(gpu_defaults.Device("NVIDIA H100", "10.0")) \
      is None
  assert _bm((4096,) * 3, device=gpu_defaults.Device("NVIDIA B200", "10.0")) \
      is None


def test_no_gpu_cpu_backends_and_the_switch_give_none(tables, monkeypatch):
  assert jax.default_backend() == "cpu"
  assert gpu_defaults.current_device() is None
  assert gpu_defaults.lookup("matmul", (4096,) * 3, "bfloat16",
                             "triton") is None
  assert gpu_defaults.backend_for("kernels.matmul") is None
  for backend in CPU_BACKENDS:
    assert _bm((4096,) * 3, backend=backend) is None
  monkeypatch.setenv(gpu_defaults.ENV_SWITCH, "0")
  assert _bm((4096,) * 3) is None
  assert gpu_defaults.backend_for("kernels.matmul", device=H200).backend \
      == "triton"


def test_for_device_names_the_gpu_on_a_machine_without_one(tables):
  with gpu_defaults.for_device("NVIDIA H200", "9.0"):
    hit = gpu_defaults.lookup("matmul", (4096,) * 3, jnp.bfloat16, "triton")
  assert (hit.config, hit.source, hit.key) == (
      {"bm": 128}, "exact", "matmul/triton/4096x4096x4096:bfloat16")
  assert gpu_defaults.current_device() is None


def test_backend_choice_per_kernel_and_device(tables):
  choose = lambda k, d: gpu_defaults.backend_for(k, device=d)
  assert choose("kernels.matmul", H200).backend == "mosaic_gpu"
  assert choose("kernels.softmax", H200).backend == "triton"
  assert choose("kernels.softmax", H200).where == "hopper family"
  assert choose("kernels.matmul", H100).backend == "triton"
  other = choose("kernels.matmul", gpu_defaults.Device("NVIDIA B200", "10.0"))
  assert (other.backend, other.where) == ("triton", "-")


def test_a_rewritten_table_is_read_again(tables):
  configs, _ = tables
  assert _bm((4096,) * 3) == (128, "NVIDIA H200")
  data = json.loads(configs.read_text())
  data["devices"]["NVIDIA H200"]["matmul/triton/4096x4096x4096:bfloat16"][
      "config"]["bm"] = 256
  gpu_defaults.write(str(configs), data)
  assert _bm((4096,) * 3) == (256, "NVIDIA H200")
  assert gpu_defaults.load(str(configs.parent / "missing.json"))[
      "devices"] == {}


def test_pattern_matching():
  m = gpu_defaults.match
  assert m("4096x4096:float32", "4096x4096:float32") == 3
  assert m("*x4096:float32", "1024x4096:float32") == 2
  assert m("*x4096", "1024x4096:float32") == 1
  assert m("*:float32", "1x2x3:float32") == 1
  assert m("*", "1x2x3:float32") == 0
  assert m("*x4096:float32", "1024x4096:bfloat16") is None
  assert m("*x*", "1x2x3:float32") is None


# ------------------------------------------------------------ shipped tables

def _shipped(path):
  with open(path) as f:
    return json.load(f)


def _entries(table):
  for tier in ("devices", "families"):
    for where, entries in table[tier].items():
      for key, entry in entries.items():
        yield where, key, entry


def test_shipped_configs_are_valid_and_say_where_they_came_from():
  table = _shipped(gpu_defaults.CONFIGS_PATH)
  assert set(table["families"]) <= set(gpu_defaults.FAMILIES)
  suite = {b.name: b for b in SUITE}
  names = {f"kernels.{k}" for k in kernels.KERNELS}
  seen = 0
  for where, key, entry in _entries(table):
    kernel, backend, size = key.split("/")
    assert backend in gpu_defaults.GPU_BACKENDS, key
    assert entry["source"].strip(), key
    assert gpu_defaults.match(size, "1x1:float32") is not None or \
        ":" in size, key
    if kernel in suite:      # a config the benchmark accepts unchanged
      dims = [4096 if d == "*" else int(d) for d in size.split(":")[0]
              .split("x")] if size.split(":")[0] != "*" else None
      if dims is not None:
        dims = suite[kernel].normalize(tuple(dims))
        assert suite[kernel].fix_config(dims, entry["config"]) == \
            entry["config"], key
    else:
      assert kernel.split(".")[0] + "." + kernel.split(".")[1] in names, key
    seen += 1
  assert seen >= 10


def test_shipped_backend_choices_are_gpu_backends_with_sources():
  table = _shipped(gpu_defaults.BACKENDS_PATH)
  names = {f"kernels.{k}" for k in kernels.KERNELS} | {"*"}
  for where, kernel, entry in _entries(table):
    assert kernel in names, kernel
    assert entry["backend"] in gpu_defaults.GPU_BACKENDS
    assert entry["source"].strip()
  # nothing measured Mosaic GPU faster yet: the seeded choice is Triton
  assert {e["backend"] for _, _, e in _entries(table)} == {"triton"}


def test_shipped_tables_give_hopper_gpus_measured_matmul_tiles():
  """The quick suite's f32 matmul no longer runs the small 64x64x32 tile
  on Hopper devices; bf16 takes the measured winners."""
  def cfg(dims, dtype, device):
    return gpu_defaults.lookup("matmul", dims, dtype, "triton",
                               device=device).config
  old_default = {"variant": "loop_k", "bm": 64, "bn": 64, "bk": 32,
                 "num_warps": 4, "num_stages": 3}
  assert cfg((4096,) * 3, "float32", H200) != old_default
  assert "autotune" in gpu_defaults.lookup(
      "matmul", (4096,) * 3, "float32", "triton", device=H200).source
  assert cfg((4096,) * 3, "bfloat16", H200) == {
      "variant": "loop_k", "bm": 128, "bn": 128, "bk": 64, "num_warps": 4,
      "num_stages": 3}
  assert cfg((4096,) * 3, "bfloat16", H100)["bn"] == 256
  unknown = gpu_defaults.Device("NVIDIA B200", "10.0")
  assert gpu_defaults.lookup("matmul", (4096,) * 3, "float32", "triton",
                             device=unknown) is None


# ------------------------------------------------------------ kernels/

def _spec(f, *args, name):
  (spec,) = [s for s in kernel_specs(f, *args) if s.name == name]
  return spec


def _launch(spec):
  p = spec.compiler_params
  return p and (p.num_warps, p.num_stages)


KERNEL_TABLE = {
    "format": 1,
    "devices": {"NVIDIA H200": {
        "kernels.softmax/triton/64x256:float32": _entry(
            {"block_rows": 4, "num_warps": 2, "num_stages": 1}),
        "kernels.layer_norm/triton/*x256:*": _entry(
            {"block_rows": 2, "num_warps": 8}),
        "kernels.matmul/triton/*:float32": _entry(
            {"block_sizes": [32, 16, 64], "num_warps": 8, "num_stages": 2}),
        "kernels.flash_attention/triton/*x*x*x64:*": _entry(
            {"block_q": 32, "block_k": 16, "num_warps": 2, "num_stages": 2}),
        "kernels.flash_attention.dq/triton/*x*x*x64:*": _entry(
            {"block_q": 16, "block_k": 64, "num_warps": 8, "num_stages": 4}),
    }},
    "families": {},
}


@pytest.fixture
def kernel_table(tmp_path, monkeypatch):
  path = tmp_path / "configs.json"
  path.write_text(json.dumps(KERNEL_TABLE))
  monkeypatch.setattr(gpu_defaults, "CONFIGS_PATH", str(path))
  monkeypatch.delenv(gpu_defaults.ENV_SWITCH, raising=False)
  jax.clear_caches()    # JAX caches the traces of custom_vjp kernels
  yield
  jax.clear_caches()


def _fresh(f, *args, name):
  """A spec traced afresh (outside any earlier trace's cache)."""
  jax.clear_caches()
  return _spec(f, *args, name=name)


def test_row_kernels_take_blocks_and_warps_from_the_table(kernel_table):
  x = jnp.ones((64, 256), jnp.float32)
  w = jnp.ones((256,), jnp.float32)
  soft = lambda x: kernels.softmax(x, backend="triton")
  norm = lambda x: kernels.layer_norm(x, w, w, backend="triton")
  interp = lambda x: kernels.softmax(x, backend="triton_interpret")
  before = _fresh(soft, x, name="softmax_fused")
  cpu_before = _fresh(interp, x, name="softmax_fused")
  with gpu_defaults.for_device("NVIDIA H200", "9.0"):
    spec = _fresh(soft, x, name="softmax_fused")
    ln = _fresh(norm, x, name="layer_norm_fwd")
    mine = _fresh(lambda x: kernels.softmax(x, backend="triton",
                                            block_rows=16), x,
                  name="softmax_fused")
    cpu = _fresh(interp, x, name="softmax_fused")
  assert spec.grid_mapping.in_mappings[0].block_shape[0] == 4
  assert _launch(spec) == (2, 1)
  assert ln.grid_mapping.in_mappings[0].block_shape[0] == 2
  assert _launch(ln) == (8, None)
  # without a GPU: the code's choice (8 rows, 4 warps for 256 columns)
  assert before.grid_mapping.in_mappings[0].block_shape[0] == 8
  assert _launch(before) == (4, None)
  # the caller's blocks win, and CPU backends never read the table
  assert mine.grid_mapping.in_mappings[0].block_shape[0] == 16
  assert _launch(mine) == (4, None)
  assert cpu.grid_mapping.in_mappings[0].block_shape == \
      cpu_before.grid_mapping.in_mappings[0].block_shape
  assert _launch(cpu) == _launch(cpu_before)


def test_matmul_takes_tiles_and_launch_from_the_table(kernel_table):
  x = jnp.ones((128, 256), jnp.float32)
  y = jnp.ones((256, 64), jnp.float32)
  f = lambda x, y: kernels.matmul(x, y, backend="triton")
  with gpu_defaults.for_device("NVIDIA H200", "9.0"):
    spec = _fresh(f, x, y, name="matmul")
  assert spec.grid_mapping.in_mappings[0].block_shape == (32, 64)
  assert spec.grid_mapping.in_mappings[1].block_shape == (64, 16)
  assert _launch(spec) == (8, 2)
  default = _fresh(f, x, y, name="matmul")
  assert default.grid_mapping.in_mappings[0].block_shape == (64, 32)
  assert default.compiler_params is None


def test_flash_attention_forward_and_backward_entries(kernel_table):
  q = jnp.ones((1, 128, 2, 64), jnp.float32)
  loss = jax.grad(lambda q, k, v: jnp.sum(kernels.flash_attention(
      q, k, v, backend="triton")), (0, 1, 2))
  with gpu_defaults.for_device("NVIDIA H200", "9.0"):
    specs = {s.name: s for s in kernel_specs(loss, q, q, q)}
  fwd, dq, dkdv = (specs[f"flash_attention_{n}"]
                   for n in ("fwd", "bwd_dq", "bwd_dkdv"))
  assert fwd.grid_mapping.in_mappings[0].block_shape[1] == 32
  # Triton walks the 128 keys in a loop of 16-key windows
  assert re.search(r"for \w+ in tl\.range\(0, 8\):", generate(fwd).source)
  assert _launch(fwd) == (2, 2)
  assert _launch(dq) == (8, 4)
  assert dq.grid_mapping.in_mappings[0].block_shape[1] == 16
  # no dK/dV entry: the code's small-head-dim config
  assert _launch(dkdv) == (4, 3)


def test_kernels_run_on_the_shipped_backend_choice(tables, monkeypatch):
  x = jnp.ones((2, 8, 16), jnp.float32)
  y = jnp.ones((16, 8), jnp.float32)
  mm = lambda x, y: kernels.matmul(x, y)
  soft = lambda x: kernels.softmax(x)
  # on a CPU: the CPU's backend (traced, each platform's version names its
  # backend; called on arrays, None as before: pallas_call picks it)
  assert _fresh(mm, x, y, name="matmul").backend == "interpret"
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with gpu_defaults.for_device("NVIDIA H200", "9.0"):
    assert _fresh(mm, x, y, name="matmul").backend == "mosaic_gpu"
    assert _fresh(soft, x, name="softmax_fused").backend == "triton"
    assert _fresh(lambda x, y: kernels.matmul(x, y, backend="triton"), x, y,
                  name="matmul").backend == "triton"
    jax.config.update("jax_pallas_use_mosaic_gpu", True)
    try:
      assert _fresh(soft, x, name="softmax_fused").backend == "mosaic_gpu"
    finally:
      jax.config.update("jax_pallas_use_mosaic_gpu", False)
  jax.clear_caches()


# ------------------------------------------------------------ compiled

HOPPER_SHARED = 227 * 1024     # the most shared memory one H100/H200 CTA gets


def _concrete(size: str) -> tuple[int, ...] | None:
  """A size to compile a pattern at: '*' dims become 4096 (or the row count
  16384), a bare '*' none."""
  dims = size.split(":")[0]
  if dims == "*":
    return None
  parts = dims.split("x")
  return tuple(16384 if d == "*" and i == 0 and len(parts) == 2 else
               4096 if d == "*" else int(d) for i, d in enumerate(parts))


def test_shipped_hopper_triton_configs_compile_for_sm_90_within_shared_memory():
  """Every shipped Triton config of a benchmark kernel for a Hopper device
  compiles for sm_90 and fits one CTA's shared memory (a config that does
  not fit would fail on the GPU only)."""
  from benchmarks import peers
  from lowering_triton.aot import compile_aot
  table = _shipped(gpu_defaults.CONFIGS_PATH)
  tiers = [table["families"]["hopper"]] + list(table["devices"].values())
  suite = {b.name: b for b in SUITE}
  compiled = 0
  for entries in tiers:
    for key, entry in entries.items():
      kernel, backend, size = key.split("/")
      if kernel not in suite or backend != "triton":
        continue
      dtype = size.split(":")[1]
      bench = suite[kernel]
      dims = _concrete(size) or bench.normalize((4096,))
      config = bench.fix_config(dims, entry["config"], dtype)
      fn = peers.dsl_fn(bench, "triton", dims, dtype, config)
      args = [jax.ShapeDtypeStruct(a.shape, a.dtype)
              for a in jax.eval_shape(lambda: bench.inputs(dims, dtype))]
      (k,) = compile_aot(fn, *args, target="sm_90")
      assert k.shared <= HOPPER_SHARED, (key, k.shared)
      assert (k.num_warps, k.num_stages) == (
          config["num_warps"], config["num_stages"]), key
      compiled += 1
  assert compiled >= 8


@pytest.mark.parametrize("d,dtype,want", [
    (64, "bfloat16", {"fwd": (128, 64, 4, 3), "dkdv": (64, 64, 4, 3),
                      "dq": (64, 64, 4, 3)}),
    (128, "bfloat16", {"fwd": (128, 128, 8, 2), "dkdv": (32, 128, 8, 3),
                       "dq": (128, 32, 8, 3)}),
    (128, "float32", {"fwd": (128, 64, 8, 2), "dkdv": (32, 128, 8, 3),
                      "dq": (128, 32, 8, 3)}),
])
def test_shipped_hopper_attention_configs(d, dtype, want):
  """Hopper GPUs get a shipped config for each flash attention kernel at
  head_dim 64 and 128 (bf16; f32 forward at 128), measured or marked as an
  unmeasured heuristic; causal attention takes the same entries."""
  names = {"fwd": "kernels.flash_attention",
           "dkdv": "kernels.flash_attention.dkdv",
           "dq": "kernels.flash_attention.dq"}
  for kernel, (bq, bk, warps, stages) in want.items():
    hit = gpu_defaults.lookup(names[kernel], (4, 2048, 16, d), dtype,
                              "triton", device=H200)
    assert hit is not None and hit.where == "hopper family", (kernel, d)
    assert hit.config == {"block_q": bq, "block_k": bk, "num_warps": warps,
                          "num_stages": stages}, (kernel, d, dtype)
    assert hit.source.startswith(("NVIDIA", "unmeasured heuristic")), (
        kernel, hit.source)
