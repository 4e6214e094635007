"""The generated Triton source (readability, padding, dump flag), ahead-of-time
compilation, the GPU lowering (with a stand-in for jaxlib's GPU plugin),
debug printing and run-time asserts, and the errors for unsupported
constructs."""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import dsl as pl
import lowering_triton
from dsl import triton as plt
from dsl import tpu as pltpu
from tests.pallas import testing
from tests.pallas.testing import array, assert_close, call


def add_kernel(x_ref, y_ref, o_ref):
  o_ref[...] = x_ref[...] + y_ref[...]   # ADD-LINE


def _line_of(marker):
  with open(__file__) as f:
    for i, line in enumerate(f, 1):
      if marker in line and "_line_of" not in line:
        return i
  raise AssertionError(marker)


def blocked_add(x, y, block=128, **kw):
  return pl.pallas_call(
      add_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(pl.cdiv(x.shape[0], block),),
      in_specs=[pl.BlockSpec((block,), lambda i: (i,))] * 2,
      out_specs=pl.BlockSpec((block,), lambda i: (i,)), **kw)(x, y)


@pytest.fixture
def verbose_errors():
  from dsl.core import config
  old = config.verbose_errors()
  jax.config.update("jax_pallas_verbose_errors", True)
  yield
  jax.config.update("jax_pallas_verbose_errors", old)


# ------------------------------------------------------------------ source

def test_source_is_one_readable_triton_function():
  x = jnp.arange(1000.)
  (src,) = lowering_triton.to_source(blocked_add, x, x)
  assert "@triton.jit" in src and src.count("@triton.jit") == 1
  assert "def add_kernel(x_ptr, y_ptr, o_ptr):" in src
  assert "i = tl.program_id(0)" in src           # index map's argument name
  line = _line_of("# ADD-LINE")
  assert f"# test_triton_source.py:{line}: o_ref[...] = x_ref[...] + y_ref[...]" \
      in src
  assert "x_offs = x_start + tl.arange(0, 128)" in src
  assert "mask=x_offs < 1000" in src             # the partial edge block
  assert "GRID = (8, 1, 1)" in src and "def launch(x, y, o):" in src
  compile(src, "<generated>", "exec")            # valid Python


def test_source_comments_point_at_each_user_line():
  def kernel(x_ref, o_ref):
    a = x_ref[...] * 2.0        # LINE-A
    b = jnp.exp(a)              # LINE-B
    o_ref[...] = a + b          # LINE-C
  x = jnp.ones(16)
  (src,) = lowering_triton.to_source(
      lambda x: pl.pallas_call(kernel, jax.ShapeDtypeStruct((16,),
                                                            jnp.float32))(x), x)
  for tag in ("LINE-A", "LINE-B", "LINE-C"):
    assert f"test_triton_source.py:{_line_of('# ' + tag)}:" in src
  # The user's variable names name the values they produced.
  assert re.search(r"^\s+a = ", src, re.M) and re.search(r"^\s+b = tl.exp\(a\)",
                                                         src, re.M)


def test_non_power_of_two_blocks_are_padded_and_masked():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] - jnp.sum(x_ref[...], axis=1, keepdims=True)
  x = array(0, (30, 100), jnp.float32)
  f = lambda x: pl.pallas_call(
      kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(3,),
      in_specs=[pl.BlockSpec((10, 100), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((10, 100), lambda i: (i, 0)))(x)
  (src,) = lowering_triton.to_source(f, x)
  assert "10 padded to 16 lanes, 100 padded to 128 lanes" in src
  assert "tl.arange(0, 16)" in src and "tl.arange(0, 128)" in src
  assert "< 100" in src and "< 10" in src
  got = call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), x, grid=(3,),
             in_specs=[pl.BlockSpec((10, 100), lambda i: (i, 0))],
             out_specs=pl.BlockSpec((10, 100), lambda i: (i, 0)))
  assert_close(got, x - x.sum(1, keepdims=True), tol=1e-5)


def test_small_dot_is_padded_to_sixteen():
  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...])
  a, b = array(1, (8, 4), jnp.float32), array(2, (4, 8), jnp.float32)
  f = lambda a, b: pl.pallas_call(kernel, jax.ShapeDtypeStruct((8, 8),
                                                               jnp.float32))(a, b)
  (src,) = lowering_triton.to_source(f, a, b)
  assert "tl.dot needs M, N, K >= 16: padded K 4->16, M 8->16, N 8->16" in src
  for arch in ("sm_80", "sm_90"):
    (k,) = lowering_triton.compile_aot(f, a, b, target=arch)
    assert k.cubin


def test_sequential_grid_dims_become_loops():
  def kernel(x_ref, o_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      o_ref[...] = jnp.zeros_like(o_ref)
    o_ref[...] += x_ref[...]
  x = array(3, (32, 64), jnp.float32)
  f = lambda x: pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((32, 16), jnp.float32), grid=(2, 4),
      in_specs=[pl.BlockSpec((16, 16), lambda i, k: (i, k))],
      out_specs=pl.BlockSpec((16, 16), lambda i, k: (i, 0)))(x)
  (src,) = lowering_triton.to_source(f, x)
  assert "i = tl.program_id(0)" in src
  assert "for k in tl.range(0, 4):" in src
  assert "tl.debug_barrier()" in src


def _accumulate(x, kernel, out_block_rows=16):
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((32, 16), jnp.float32), grid=(2, 4),
      in_specs=[pl.BlockSpec((16, 16), lambda i, k: (i, k))],
      out_specs=pl.BlockSpec((out_block_rows, 16), lambda i, k: (i, 0)),
      scratch_shapes=[pltpu.VMEM((16, 16), jnp.float32)],
      backend="triton_interpret")(x)


def _loop_parts(src):
  """The source before, inside and after the `for k` loop."""
  head, rest = src.split("for k in tl.range(0, 4):", 1)
  lines = rest.split("\n")
  body = [l for l in lines[1:] if l.startswith(" " * 8)]
  after = [l for l in lines[1:] if not l.startswith(" " * 8)]
  return head, "\n".join(body), "\n".join(after)


def test_first_and_last_step_blocks_are_peeled_out_of_the_loop():
  def kernel(x_ref, o_ref, acc_ref):
    k = pl.program_id(1)

    @pl.when(k == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)   # PEEL-INIT
    acc_ref[...] += x_ref[...] * 2.0

    @pl.when(k == pl.num_programs(1) - 1)
    def _():
      o_ref[...] = acc_ref[...] + 1.0          # PEEL-LAST
  x = array(3, (32, 64), jnp.float32)
  f = lambda x: _accumulate(x, kernel)
  (src,) = lowering_triton.to_source(f, x)
  head, body, after = _loop_parts(src)
  assert "PEEL-INIT" in head and "first step (k = 0)" in head
  assert "PEEL-LAST" in after and "last step (k = 3)" in after
  assert "if " not in body and "tl.store" not in body
  want = (x.reshape(32, 4, 16).sum(1) * 2.0) + 1.0
  assert_close(jax.jit(f)(x), want)


def test_a_step_made_only_of_first_and_last_blocks_peels_both():
  def kernel(x_ref, o_ref, acc_ref):
    k = pl.program_id(1)

    @pl.when(k == 0)
    def _():
      o_ref[...] = x_ref[...]

    @pl.when(k == 3)
    def _():
      o_ref[...] += x_ref[...]    # the last step's x block
  x = array(6, (32, 64), jnp.float32)
  f = lambda x: _accumulate(x, kernel)
  (src,) = lowering_triton.to_source(f, x)
  head, body, after = _loop_parts(src)
  assert "first step (k = 0)" in head and "last step (k = 3)" in after
  assert "tl.load" not in body and "tl.store" not in body
  assert_close(jax.jit(f)(x), x[:, :16] + x[:, 48:])


def _scaled_accumulate(kernel, x, s):
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((32, 16), jnp.float32), grid=(2, 4),
      in_specs=[pl.BlockSpec((16,), lambda i, k: (0,)),
                pl.BlockSpec((16, 16), lambda i, k: (i, k))],
      out_specs=pl.BlockSpec((16, 16), lambda i, k: (i, 0)),
      scratch_shapes=[pltpu.VMEM((16, 16), jnp.float32)],
      backend="triton_interpret")(s, x)


@pytest.mark.parametrize("generate_raw", [False, True])
def test_reads_of_other_refs_and_calls_do_not_keep_the_first_step_in_the_loop(
    generate_raw):
  """A step that reads a ref the first-step block does not write (decode
  attention's sequence length) and computes with jnp functions (calls, in
  the kernel jaxpr as traced) before the block still peels it; the code is
  the same whether or not the spec was normalized first."""
  def kernel(s_ref, x_ref, o_ref, acc_ref):
    k = pl.program_id(1)
    scale = s_ref[...]                     # a read before the block
    half = jnp.remainder(k + 4, 4) // 2    # jnp calls before the block

    @pl.when(k == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)   # PEEL-INIT
    acc_ref[...] += x_ref[...] * scale[None, :] + half.astype(jnp.float32)

    @pl.when(k == 3)
    def _():
      o_ref[...] = acc_ref[...]
  x = array(3, (32, 64), jnp.float32)
  s = array(4, (16,), jnp.float32)
  f = lambda x, s: _scaled_accumulate(kernel, x, s)
  if generate_raw:
    (spec,) = [e.params["spec"] for e in jax.make_jaxpr(f)(x, s).eqns
               if "spec" in e.params]
    src = lowering_triton.generate(spec).source
  else:
    (src,) = lowering_triton.to_source(f, x, s)
  head, body, after = _loop_parts(src)
  assert "PEEL-INIT" in head and "first step (k = 0)" in head
  assert "if " not in body
  want = (x.reshape(32, 4, 16) * s).sum(1) + 2.0
  assert_close(jax.jit(f)(x, s), want)


def test_blocks_stay_in_the_loop_when_moving_them_would_reorder_effects():
  def kernel(x_ref, o_ref, acc_ref):
    k = pl.program_id(1)
    # a read before the first-step block writes (its value unused at k = 0)
    before = jnp.where(k == 0, 0.0, acc_ref[...])

    @pl.when(k == 0)
    def _():
      acc_ref[...] = jnp.ones_like(acc_ref)
    step = x_ref[...] + before
    acc_ref[...] += step

    @pl.when(k == 3)
    def _():
      o_ref[...] = acc_ref[...] + step    # uses a value of the last step
  x = array(4, (32, 64), jnp.float32)
  f = lambda x: _accumulate(x, kernel)
  (src,) = lowering_triton.to_source(f, x)
  head, body, after = _loop_parts(src)
  assert "first step" not in head and "last step" not in after
  assert body.count("if ") == 2
  assert_close(jax.jit(f)(x), jax.jit(lambda x: pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((32, 16), jnp.float32), grid=(2, 4),
      in_specs=[pl.BlockSpec((16, 16), lambda i, k: (i, k))],
      out_specs=pl.BlockSpec((16, 16), lambda i, k: (i, 0)),
      scratch_shapes=[pltpu.VMEM((16, 16), jnp.float32)],
      backend="interpret")(x))(x))


def test_grid_of_rank_four_flattens_program_ids():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1
  x = jnp.zeros((2, 3, 4, 5, 8))
  spec = pl.BlockSpec((None, None, None, None, 8),
                      lambda a, b, c, d: (a, b, c, d, 0))
  f = lambda x: pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                               grid=(2, 3, 4, 5), in_specs=[spec],
                               out_specs=spec)(x)
  (src,) = lowering_triton.to_source(f, x)
  assert "flattened into tl.program_id(0)" in src
  assert "GRID = (120, 1, 1)" in src


def test_programs_start_in_row_major_grid_order():
  # The last parallel dim is CUDA's fastest axis (x), as the grid's
  # row-major order has it; the second-to-last is y, the first z.
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2
  x = array(5, (2, 3, 5, 8), jnp.float32)
  spec = pl.BlockSpec((None, None, None, 8), lambda a, b, c: (a, b, c, 0))
  f = lambda x: pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                               grid=(2, 3, 5), in_specs=[spec],
                               out_specs=spec, backend="triton_interpret")(x)
  (src,) = lowering_triton.to_source(f, x)
  assert "a = tl.program_id(2)" in src and "c = tl.program_id(0)" in src
  assert "GRID = (5, 3, 2)" in src
  assert_close(jax.jit(f)(x), x * 2)


def test_compiler_params_reach_source_and_binary():
  x = jnp.arange(256.)
  f = lambda x: blocked_add(x, x, compiler_params=plt.CompilerParams(
      num_warps=8, num_stages=2))
  (src,) = lowering_triton.to_source(f, x)
  assert "num_warps=8, num_stages=2" in src
  (k,) = lowering_triton.compile_aot(f, x, target="sm_90")
  assert k.num_warps == 8 and k.num_stages == 2


def test_to_source_walks_nested_jaxprs():
  x = jnp.arange(256.)

  @jax.jit
  def f(x):
    y = jax.lax.cond(x[0] > 0, lambda: blocked_add(x, x), lambda: x)
    return jax.jit(lambda z: blocked_add(z, z, block=64))(y)
  srcs = lowering_triton.to_source(f, x)
  assert len(srcs) == 2
  assert "tl.arange(0, 128)" in srcs[0] and "tl.arange(0, 64)" in srcs[1]


def test_dump_flag_writes_each_kernel(tmp_path):
  jax.config.update("jax_pallas_dump_triton_to", str(tmp_path))
  try:
    x = jnp.arange(300.)
    got = jax.jit(lambda x: blocked_add(x, x, backend="triton_interpret"))(x)
  finally:
    jax.config.update("jax_pallas_dump_triton_to", "")
  assert_close(got, 2 * x)
  files = os.listdir(tmp_path)
  assert len(files) == 1 and files[0].startswith("add_kernel_")
  text = (tmp_path / files[0]).read_text()
  assert "@triton.jit" in text and "def add_kernel(" in text


# ------------------------------------------------------------------ AOT

@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compile_aot_returns_cubin_ptx_shared_and_warps(arch):
  def kernel(x_ref, y_ref, o_ref):
    acc = jnp.zeros((32, 32), jnp.float32)

    def body(k, acc):
      a = x_ref[:, pl.ds(k * 32, 32)]
      b = y_ref[pl.ds(k * 32, 32), :]
      return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)
    o_ref[...] = lax.fori_loop(0, 4, body, acc).astype(o_ref.dtype)
  x = jnp.ones((64, 128), jnp.bfloat16)
  y = jnp.ones((128, 64), jnp.bfloat16)
  f = lambda x, y: pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((64, 64), jnp.bfloat16), grid=(2, 2),
      in_specs=[pl.BlockSpec((32, 128), lambda i, j: (i, 0)),
                pl.BlockSpec((128, 32), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((32, 32), lambda i, j: (i, j)))(x, y)
  (k,) = lowering_triton.compile_aot(f, x, y, target=arch)
  assert k.cubin[:4] == b"\x7fELF"
  assert f".target {arch}" in k.ptx
  assert isinstance(k.shared, int) and k.shared > 0     # pipelined tiles
  assert k.num_warps == 4 and k.target == arch
  got = jax.jit(lambda x, y: pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((64, 64), jnp.bfloat16), grid=(2, 2),
      in_specs=[pl.BlockSpec((32, 128), lambda i, j: (i, 0)),
                pl.BlockSpec((128, 32), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((32, 32), lambda i, j: (i, j)),
      backend="triton_interpret")(x, y))(x, y)
  assert_close(got, jnp.full((64, 64), 128.0), jnp.bfloat16)


# ------------------------------------------------------------------ GPU lowering

class _FakeGpuTriton:
  """Stands in for jaxlib's CUDA Triton plugin, recording what it is given."""

  def __init__(self):
    self.kernels, self.calls = [], []
    outer = self

    class TritonKernel:
      def __init__(self, *args):
        outer.kernels.append(args)

    class TritonKernelCall:
      def __init__(self, kernel, gx, gy, gz, params):
        outer.calls.append(((gx, gy, gz), params))

      def to_proto(self, name, metadata):
        return b"kernel-call:" + name.encode()

    self.TritonKernel, self.TritonKernelCall = TritonKernel, TritonKernelCall

  @staticmethod
  def create_array_parameter(bytes_to_zero, divisibility):
    return ("array", bytes_to_zero, divisibility)

  @staticmethod
  def get_compute_capability(device):
    return 90


@pytest.fixture
def fake_gpu_plugin(monkeypatch):
  from dsl.core.jax_internals import gpu_triton
  fake = _FakeGpuTriton()
  for name in ("TritonKernel", "TritonKernelCall", "create_array_parameter",
               "get_compute_capability"):
    monkeypatch.setattr(gpu_triton, name, getattr(fake, name), raising=False)
  return fake


def test_gpu_lowering_emits_the_triton_kernel_call(fake_gpu_plugin):
  # output read before written: not zeroed first (output memory a kernel
  # has not written holds garbage on the GPU, poison on the host backends)
  def kernel(x_ref, o_ref, acc_ref):
    o_ref[...] += x_ref[...] * 2
  x = jnp.arange(1000.)
  f = jax.jit(lambda x: pl.pallas_call(
      kernel, (jax.ShapeDtypeStruct((1000,), jnp.float32),),
      grid=(8,), in_specs=[pl.BlockSpec((128,), lambda i: (i,))],
      out_specs=[pl.BlockSpec((128,), lambda i: (i,))],
      scratch_shapes=[pltpu.VMEM((8,), jnp.float32)])(x))
  text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
  assert "custom_call @triton_kernel_call_ffi" in text
  assert "opaque" in text
  (kernel_args,) = fake_gpu_plugin.kernels
  assert kernel_args[0] == "kernel" and kernel_args[1] == 4   # name, warps
  assert isinstance(kernel_args[4], str) and ".entry kernel" in kernel_args[4]
  ((grid, params),) = fake_gpu_plugin.calls
  assert grid == (8, 1, 1)
  assert params == [("array", 0, 16), ("array", 0, 16)]


def test_gpu_lowering_aliases_outputs(fake_gpu_plugin):
  x = jnp.arange(512.)
  f = jax.jit(lambda x: blocked_add(x, x, input_output_aliases={0: 0}))
  text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
  assert "output_operand_alias" in text
  ((grid, params),) = fake_gpu_plugin.calls
  assert grid == (4, 1, 1) and [p[1] for p in params] == [0, 0, 0]


def _row_loop_sum(x):
  def kernel(x_ref, o_ref):
    o_ref[...] = lax.fori_loop(
        0, 4, lambda i, acc: acc + x_ref[pl.ds(i * 16, 16), :],
        jnp.zeros((16, 64), jnp.float32))
  return pl.pallas_call(kernel, jax.ShapeDtypeStruct((16, 64), jnp.float32),
                        in_specs=[pl.BlockSpec((64, 64), lambda: (0, 0))],
                        out_specs=pl.BlockSpec((16, 64), lambda: (0, 0)))(x)


@pytest.mark.parametrize("scratch", [True, False])
def test_gpu_lowering_passes_the_descriptors_scratch_or_drops_descriptors(
    fake_gpu_plugin, monkeypatch, scratch):
  """A kernel with tensor descriptors needs a global scratch buffer:
  jaxlib's TritonKernel gets its size and alignment; a jaxlib whose
  TritonKernel takes no scratch gets the kernel without descriptors."""
  import lowering_triton.launch
  monkeypatch.setattr(lowering_triton.launch, "_KERNELS", {})
  if not scratch:
    plain = fake_gpu_plugin.TritonKernel

    def no_scratch(*args):
      if len(args) == 9:
        raise TypeError("TritonKernel(): incompatible constructor arguments")
      return plain(*args)
    monkeypatch.setattr(gpu_triton_lib(), "TritonKernel", no_scratch)
  x = jnp.zeros((64, 64), jnp.float32)
  jax.jit(lambda x: _row_loop_sum(x)).trace(x).lower(
      lowering_platforms=("cuda",))
  (kernel_args,) = fake_gpu_plugin.kernels
  ptx = kernel_args[4]
  if scratch:
    assert len(kernel_args) == 9 and kernel_args[7] >= 128   # one descriptor
    assert "cp.async.bulk.tensor" in ptx
  else:
    assert len(kernel_args) == 7 and "cp.async.bulk" not in ptx


def gpu_triton_lib():
  from dsl.core.jax_internals import gpu_triton
  return gpu_triton


def test_gpu_backend_on_cpu_is_a_clear_error():
  x = jnp.arange(256.)
  with pytest.raises(pl.BackendError, match="runs on CUDA GPUs"):
    jax.jit(lambda x: blocked_add(x, x, backend="triton"))(x)


def test_gpu_backend_without_plugin_is_a_clear_error():
  from dsl.core.jax_internals import gpu_triton
  if hasattr(gpu_triton, "TritonKernelCall"):
    pytest.skip("this jaxlib has GPU Triton support")
  x = jnp.arange(256.)
  with pytest.raises(pl.BackendError, match="GPU Triton support"):
    jax.jit(lambda x: blocked_add(x, x, backend="triton")).trace(x).lower(
        lowering_platforms=("cuda",))


# ------------------------------------------------------------------ debugging

def test_debug_print_uses_device_print(capsys):
  def kernel(x_ref, o_ref):
    pl.debug_print("pid={} v={}", pl.program_id(0), x_ref[0])
    o_ref[...] = x_ref[...]
  out = call(kernel, jax.ShapeDtypeStruct((8,), jnp.float32), jnp.arange(8.),
             grid=(2,), in_specs=[pl.BlockSpec((4,), lambda i: (i,))],
             out_specs=pl.BlockSpec((4,), lambda i: (i,)))
  assert_close(out, jnp.arange(8.))        # waits for the kernel's prints
  printed = capsys.readouterr().out
  assert re.search(r"pid=.*\b0\b", printed) and re.search(r"v=.*\b4\.", printed)
  (src,) = lowering_triton.to_source(lambda x: pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((8,), jnp.float32), grid=(2,),
      in_specs=[pl.BlockSpec((4,), lambda i: (i,))],
      out_specs=pl.BlockSpec((4,), lambda i: (i,)))(x), jnp.arange(8.))
  assert "tl.device_print('pid=', i)" in src


@pytest.fixture
def runtime_asserts():
  jax.config.update("jax_pallas_enable_runtime_assert", True)
  yield
  jax.config.update("jax_pallas_enable_runtime_assert", False)


def _checked_kernel(x_ref, o_ref):
  pl.debug_check(jnp.all(x_ref[...] > 0), "x must be positive")
  o_ref[...] = x_ref[...]


def _checked(x):
  return pl.pallas_call(_checked_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        backend="triton_interpret")(x)


def test_runtime_assert_becomes_device_assert(runtime_asserts):
  (src,) = lowering_triton.to_source(_checked, jnp.ones(8))
  assert "tl.device_assert(" in src and "x must be positive" in src
  assert_close(jax.jit(_checked)(jnp.ones(8)), jnp.ones(8))
  with pytest.raises(Exception, match="x must be positive"):
    jax.block_until_ready(jax.jit(_checked)(-jnp.ones(8)))


def test_checks_are_skipped_without_runtime_asserts():
  (src,) = lowering_triton.to_source(_checked, jnp.ones(8))
  assert "tl.device_assert" not in src
  assert_close(jax.jit(_checked)(-jnp.ones(8)), -jnp.ones(8))


# ------------------------------------------------------------------ errors

def test_unsupported_primitive_names_primitive_kernel_and_line():
  def odd_kernel(x_ref, o_ref):
    o_ref[...] = testing.no_rule_p.bind(x_ref[...])   # UNSUPPORTED-LINE
  x = jnp.zeros(8)
  with pytest.raises(pl.BackendError) as e:
    jax.jit(lambda x: pl.pallas_call(
        odd_kernel, jax.ShapeDtypeStruct((8,), jnp.float32),
        backend="triton_interpret")(x))(x)
  msg = str(e.value)
  assert "primitive 'no_rule_for_tests'" in msg
  assert "kernel 'odd_kernel'" in msg
  assert f"test_triton_source.py:{_line_of('# UNSUPPORTED-LINE')}" in msg
  assert not isinstance(e.value, KeyError)


def test_verbose_error_marks_the_failing_equation(verbose_errors):
  def kernel(x_ref, o_ref):
    o_ref[...] = jnp.sort(x_ref[...])
  x = jnp.zeros(8)
  with pytest.raises(pl.BackendError) as e:
    lowering_triton.to_source(lambda x: pl.pallas_call(
        kernel, jax.ShapeDtypeStruct((8,), jnp.float32))(x), x)
  msg = str(e.value)
  assert "primitive 'sort'" in msg and ">>>" in msg
  assert "sort" in msg.split(">>>")[1][:400]     # the marked equation


@pytest.mark.parametrize("case", ["cas_on_padded",
                                  "array_index", "semaphore", "too_large"])
def test_unsupported_constructs_raise_clear_errors(case):
  scratch = ()
  shape = jax.ShapeDtypeStruct((10,), jnp.int32)
  x = jnp.zeros((10,), jnp.int32)
  if case == "cas_on_padded":
    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...]
      plt.atomic_cas(o_ref, x_ref[...], x_ref[...] + 1)
    match = "atomic_cas on a window that needs masking"
  elif case == "array_index":
    # (arrays of indices are blocks of pointers: test_index_arrays.py);
    # numpy moves the dims of ones a slice separates to the front
    shape = jax.ShapeDtypeStruct((5, 4), jnp.int32)
    x = jnp.zeros((5, 4, 3), jnp.int32)
    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[jnp.arange(5), :, 0]
    match = "separated from the other integer indices by a slice"
  elif case == "semaphore":
    def kernel(x_ref, o_ref, sem):
      o_ref[...] = x_ref[...]
    scratch = [pltpu.SemaphoreType.DMA(())] if hasattr(
        pltpu, "SemaphoreType") else pytest.skip("no semaphores in dsl.tpu")
    match = "semaphore"
  elif case == "too_large":
    shape = jax.ShapeDtypeStruct((2048, 1024), jnp.float32)
    x = jnp.zeros((2048, 1024), jnp.float32)
    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...] * 2
    match = "Triton's limit"
  with pytest.raises(pl.BackendError, match=match) as e:
    lowering_triton.to_source(lambda x: pl.pallas_call(
        kernel, shape, scratch_shapes=scratch)(x), x)
  assert "kernel 'kernel'" in str(e.value)


def test_scan_over_arrays_lowers_as_the_lowering_normalizes_it():
  """`to_source` shows what the lowering builds: a scan over arrays becomes
  a loop over a scoped buffer there (dsl.core.normalize), so it lowers."""
  def kernel(x_ref, o_ref):
    o_ref[...] = lax.scan(lambda c, v: (c + v, c), 0, x_ref[...])[1]
  x = jnp.arange(10, dtype=jnp.int32)
  f = lambda x: pl.pallas_call(kernel, jax.ShapeDtypeStruct((10,), jnp.int32),
                               backend="triton_interpret")(x)
  (src,) = lowering_triton.to_source(f, x)
  assert "for " in src
  np.testing.assert_array_equal(f(x), jnp.cumsum(x) - x)


def test_float32_dot_precision_follows_jax_config():
  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...])
  a = jnp.ones((16, 16))
  f = lambda a: pl.pallas_call(kernel, jax.ShapeDtypeStruct((16, 16),
                                                            jnp.float32))(a, a)
  (src,) = lowering_triton.to_source(f, a)
  assert 'input_precision="tf32"' in src
  with jax.default_matmul_precision("float32"):
    (src,) = lowering_triton.to_source(f, a)
  assert 'input_precision="ieee"' in src


def test_debug_flag_prints_the_generated_source(capsys):
  x = jnp.arange(256.)
  jax.jit(lambda x: blocked_add(x, x, backend="triton_interpret",
                                debug=True))(x)
  out = capsys.readouterr().out
  assert "--- Triton source of kernel add_kernel" in out
  assert "def add_kernel(x_ptr, y_ptr, o_ptr):" in out


def _shifted_copy_kernel(x_ref, o_ref):
  y = x_ref[...] * 2.0
  o_ref[...] = y


def test_values_take_names_from_assignments_not_keywords():
  # The index maps' arithmetic sits on the `in_specs=` / `out_specs=` lines;
  # those are keyword arguments, not variables, so no value is named after
  # them. The kernel's own `y = ...` names its value.
  x = jnp.ones((512,))

  def f(x):
    return pl.pallas_call(
        _shifted_copy_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
        in_specs=[pl.BlockSpec((128,), lambda i: (i * 2 + 1,))],
        out_specs=pl.BlockSpec((128,), lambda i: (i + 1,)), backend="triton")(x)
  (src,) = lowering_triton.to_source(f, x)
  assigned = re.findall(r"^\s+(\w+) = ", src, re.M)
  assert "in_specs" not in assigned and "out_specs" not in assigned, src
  assert "y" in assigned, src
  assert re.search(r"x_start = \w+ \* 128", src), src


def test_reshapes_that_only_add_unit_dims_index_with_none():
  """`jnp.reshape(row_sums, (n, 1))` (what reverse mode makes of a reduction
  with keepdims) is `x[:, None]`, not `tl.reshape`: Triton lays a reshaped
  row vector out whole in every thread, and a tile broadcast from it kept
  that layout (the softmax backward never finished compiling)."""
  def kernel(x_ref, o_ref):
    x = x_ref[...]
    s = jnp.sum(x, axis=1).reshape(x.shape[0], 1)      # (64,) -> (64, 1)
    c = jnp.sum(x, axis=0).reshape(1, 1, x.shape[1])   # (256,) -> (1, 1, 256)
    o_ref[...] = x * s + c[0]
  x = array(5, (128, 256), jnp.float32)
  f = lambda x: pl.pallas_call(
      kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
      in_specs=[pl.BlockSpec((64, 256), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((64, 256), lambda i: (i, 0)),
      backend="triton_interpret")(x)
  (src,) = lowering_triton.to_source(f, x)
  assert not re.search(r"tl.reshape\(sum_", src)
  assert re.search(r"= sum_\w*\[:, None\]", src)
  assert re.search(r"= sum_\w*\[None, None, :\]", src)
  blocks = x.reshape(2, 64, 256)
  want = (blocks * blocks.sum(2, keepdims=True)
          + blocks.sum(1, keepdims=True)).reshape(x.shape)
  assert_close(jax.jit(f)(x), want)


def test_fori_loops_with_run_time_bounds_become_for_loops():
  """`fori_loop` with bounds from the program id is a `while` in the jaxpr;
  it lowers to `for j in tl.range(lo, hi)` (Triton pipelines for loops, not
  while loops), its window loads unmasked where the range analysis bounds
  the counter; a loop that does not count up by one stays a `while`."""
  def kernel(x_ref, o_ref):
    i = pl.program_id(0)
    acc = lax.fori_loop(i, 2 * i + 1,
                        lambda j, acc: acc + x_ref[pl.ds(j * 8, 8), :],
                        jnp.zeros((8, 128), jnp.float32))
    halve = lax.while_loop(lambda c: c[0] > 1, lambda c: (c[0] // 2, c[1] + 1),
                           (i + 7, 0))[1]
    o_ref[...] = acc + halve.astype(jnp.float32)
  x = array(8, (64, 128), jnp.float32)
  f = lambda x, backend="triton_interpret": pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((32, 128), jnp.float32), grid=(4,),
      in_specs=[pl.BlockSpec((64, 128), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)), backend=backend)(x)
  (src,) = lowering_triton.to_source(f, x)
  assert re.search(r"for j in tl\.range\(i, \w+\):", src)
  assert src.count("while ") == 1
  assert "mask=" not in src
  assert_close(jax.jit(f)(x), jax.jit(lambda x: f(x, "interpret"))(x))


def test_broadcast_arrays_of_indices_say_what_triton_takes():
  """`x_ref.at[rows[:, None], cols[None]]` (Pallas's GPU layer norm backward):
  JAX broadcasts the two arrays of indices (its `broadcast_to` primitive,
  which dsl rewrites into lax ops every lowering has); the Triton backend
  then says what it takes instead."""
  x = jnp.zeros((8, 16), jnp.float32)

  def kernel(x_ref, o_ref):
    rows, cols = jnp.arange(8), jnp.arange(16)
    o_ref[...] = x_ref.at[rows[:, None], cols[None]][...] * 2
  f = lambda x: pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape,
                                                             x.dtype))(x)
  with pytest.raises(pl.BackendError, match="one vector of indices"):
    lowering_triton.to_source(f, x)
  np.testing.assert_array_equal(
      pl.pallas_call(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                     backend="interpret")(x + 1), 2 * (x + 1))
