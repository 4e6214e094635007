"""The generated Triton source (readability, padding, dump flag), ahead-of-time
compilation, the GPU lowering (with a stand-in for jaxlib's GPU plugin),
debug printing and run-time asserts, and the errors for unsupported
constructs."""
import os
import re

import jax
import jax.numpy as jnp
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
  return testing.line_of(__file__, marker)


def blocked_add(x, y, block=128, **kw):
  return pl.pallas_call(
      add_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(pl.cdiv(x.shape[0], block),),
      in_specs=[pl.BlockSpec((block,), lambda i: (i,))] * 2,
      out_specs=pl.BlockSpec((block,), lambda i: (i,)), **kw)(x, y)


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


def _row_blocks_copy(x, rows, backend=None):
  spec = pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0))
  return pl.pallas_call(
      lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
      jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // rows,),
      in_specs=[spec], out_specs=spec, backend=backend,
      compiler_params=plt.CompilerParams(num_warps=4))(x)


@pytest.mark.parametrize("rows,cols,dtype,summed", [
    (16, 128, jnp.bfloat16, True),      # 32 bytes of the tile per thread
    (64, 1024, jnp.float32, False),     # 2 KiB per thread
])
def test_tile_offsets_are_summed_in_int32_where_a_thread_holds_few_vectors(
    rows, cols, dtype, summed):
  """The block's start goes first, one pointer for the tile; the lanes'
  offsets are summed in int32 (as Pallas sums them) when a thread holds at
  most 64 bytes of the tile, else added to the pointer one by one (its
  vectors then lie at constant displacements from one pointer). Both
  forms read and write the same elements."""
  x = (jnp.arange(4 * rows * cols) % 251).reshape(4 * rows, cols).astype(dtype)
  (src,) = lowering_triton.to_source(lambda x: _row_blocks_copy(x, rows), x)
  lanes = f"tl.arange(0, {rows})[:, None] * {cols} + x_cols[None, :]"
  start = f"tl.load(x_ptr + x_start0 * {cols} + "
  assert (start + f"({lanes}))" if summed else start + lanes + ")") in src
  out = _row_blocks_copy(x, rows, backend="triton_interpret")
  assert_close(out, x)


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
  # each id's range is stated to the compiler (the interpreter checks it)
  for name, size in (("a", 2), ("b", 3), ("c", 5)):
    assert f"tl.assume({name} < {size})" in src
  assert_close(jax.jit(f)(x), x * 2)


def test_a_two_branch_cond_runs_branch_zero_first_as_jax_numbers_them():
  """`lax.cond(p, t, f)` is `cond(index, f, t)` in JAX: the lowering tests
  `index == 0` for `f` (as Pallas's lowering does; the compiler then proves
  more of what follows, e.g. a loop's trip count under the condition)."""
  def kernel(n_ref, x_ref, o_ref):
    n = n_ref[0]
    o_ref[...] = lax.cond(n > 3, lambda: x_ref[...] * 2,
                          lambda: x_ref[...] + 1)
  x = array(6, (16,), jnp.float32)
  for n, want in ((5, x * 2), (1, x + 1)):
    f = lambda n, x: pl.pallas_call(
        kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec((16,))],
        backend="triton_interpret")(n, x)
    (src,) = lowering_triton.to_source(f, jnp.array([n], jnp.int32), x)
    body = src[src.index("@triton.jit"):]
    header = re.search(r"\n( *)if (.*) == 0:\n", body)
    assert header and ".to(tl.int32)" in header.group(2)
    false_arm = body[header.end():body.index("else:", header.end())]
    assert " + 1" in false_arm and " * 2" not in false_arm
    assert_close(jax.jit(f)(jnp.array([n], jnp.int32), x), want)


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
