"""Tensor descriptors (lowering_triton/tma.py): whole, aligned tiles loaded
in loops go through `tl.make_tensor_descriptor`, others stay pointer loads;
the same numbers either way; on sm_90 the hot loops copy tiles with
`cp.async.bulk.tensor`, on sm_80 Triton rewrites descriptors to pointers."""
import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import dsl as pl
import kernels
import lowering_triton
from benchmarks import gpu_triton
from dsl.core import config
from lowering_triton import aot
from tests.pallas.testing import array, assert_close

S = jax.ShapeDtypeStruct


def _matmul_kernel(bk, start=lambda i, bk: i * bk):
  def kernel(x_ref, y_ref, o_ref):
    def body(i, acc):
      x = x_ref[:, pl.ds(start(i, bk), bk)]
      y = y_ref[pl.ds(start(i, bk), bk), :]
      return acc + jnp.dot(x, y, preferred_element_type=jnp.float32)
    k = x_ref.shape[1]
    o_ref[...] = lax.fori_loop(0, pl.cdiv(k, bk), body, jnp.zeros(
        o_ref.shape, jnp.float32)).astype(o_ref.dtype)
  return kernel


def _matmul(x, y, bk=16, backend="triton", block=32, **kw):
  m, k = x.shape
  n = y.shape[1]
  return pl.pallas_call(
      _matmul_kernel(bk, **kw), S((m, n), x.dtype),
      grid=(m // block, n // block),
      in_specs=[pl.BlockSpec((block, k), lambda i, j: (i, 0)),
                pl.BlockSpec((k, block), lambda i, j: (0, j))],
      out_specs=pl.BlockSpec((block, block), lambda i, j: (i, j)),
      backend=backend)(x, y)


def test_whole_aligned_tiles_in_a_loop_load_through_descriptors():
  x, y = array(1, (64, 64), jnp.float32), array(2, (64, 64), jnp.float32)
  (src,) = lowering_triton.to_source(_matmul, x, y)
  head, loop = re.split(r"for \w+ in tl\.range\(0, 4\):", src)
  assert ("x_desc = tl.make_tensor_descriptor(x_ptr, shape=[64, 64], "
          "strides=[64, 1], block_shape=[32, 16])") in head
  assert "x = x_desc.load([x_start0, mul])" in loop
  assert re.search(r"y = y_desc\.load\(\[mul\w*, y_start1\]\)", loop)
  assert "tl.load(" not in loop
  run = jax.jit(lambda x, y: _matmul(x, y, backend="triton_interpret"))
  got = run(x, y)
  with config.triton_tensor_descriptors_option(False):
    pointers = jax.jit(lambda x, y: _matmul(x, y,
                                            backend="triton_interpret"))(x, y)
  assert_close(got, pointers, tol=0)
  with jax.default_matmul_precision("float32"):
    exact = jax.jit(lambda x, y: _matmul(x, y, backend="triton_interpret"))
    assert_close(exact(x, y), x @ y, tol=1e-5)


def _desc_loads(fn, *args):
  (src,) = lowering_triton.to_source(fn, *args)
  return len(re.findall(r"_desc\.load\(", src))


@pytest.mark.parametrize("case", ["masked_tail", "unaligned_start",
                                  "outside_loops", "switched_off"])
def test_windows_that_need_masks_or_alignment_stay_pointer_loads(case):
  x, y = array(3, (64, 64), jnp.float32), array(4, (64, 64), jnp.float32)
  if case == "masked_tail":         # K = 56: the last window runs past it
    x, y = x[:, :56], y[:56]
    fn = _matmul
  elif case == "unaligned_start":   # float32 starts at i * 2: 8-byte aligned
    fn = lambda x, y: _matmul(x, y, start=lambda i, bk: i * 2)
  elif case == "outside_loops":
    fn = lambda x: pl.pallas_call(
        lambda x_ref, o_ref: o_ref.__setitem__(Ellipsis, x_ref[...] * 2),
        S(x.shape, x.dtype), grid=(2,),
        in_specs=[pl.BlockSpec((32, 64), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((32, 64), lambda i: (i, 0)))(x)
    assert _desc_loads(fn, x) == 0
    return
  else:
    fn = _matmul
  if case == "switched_off":
    with config.triton_tensor_descriptors_option(False):
      assert _desc_loads(fn, x, y) == 0
    assert _desc_loads(fn, x, y) == 2
    return
  if case == "masked_tail":
    (src,) = lowering_triton.to_source(fn, x, y)
    assert "mask=" in src
  assert _desc_loads(fn, x, y) == (1 if case == "unaligned_start" else 0)


@pytest.mark.parametrize("which", ["matmul", "flash_attention"])
def test_k_and_kv_loops_copy_tiles_with_tma_on_sm_90(which):
  """The benchmark matmul's K loop and flash attention's KV loop issue one
  `cp.async.bulk.tensor` per tile and no per-thread `cp.async`."""
  if which == "matmul":
    fn, args = gpu_triton.make_matmul(pl), (S((1024, 1024), jnp.bfloat16),) * 2
  else:
    fn = lambda q, k, v: kernels.flash_attention(q, k, v, backend="triton")
    args = (S((1, 512, 2, 128), jnp.bfloat16),) * 3
  (k,) = aot.compile_aot(fn, *args, target="sm_90")
  stats = k.stats()
  (loop,) = stats.hot_loops
  assert loop.mix.cp_async == 0 and loop.mix.cp_async_bulk >= 2
  body = "\n".join(k.ptx.splitlines()[loop.first:loop.last + 1])
  assert len(re.findall(r"cp\.async\.bulk\.tensor\.\dd", body)) >= 2
  assert int(k.metadata.global_scratch_size) > 0   # the descriptors' scratch


def test_before_sm_90_descriptors_become_pointer_loads():
  fn = gpu_triton.make_matmul(pl)
  args = (S((1024, 1024), jnp.bfloat16),) * 2
  (src,) = lowering_triton.to_source(fn, *args)
  assert "_desc.load(" in src
  (k,) = aot.compile_aot(fn, *args, target="sm_80")
  assert "cp.async.bulk" not in k.ptx and "cp.async.cg" in k.ptx
  assert not int(getattr(k.metadata, "global_scratch_size", 0) or 0)
