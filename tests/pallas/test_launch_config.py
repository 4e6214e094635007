"""The Triton launch parameters (`lowering_triton.launch_config`): a
kernel's compiler params, Pallas's defaults without them, and the kernels
of reverse mode, whose warps come from their input blocks unless they
have a dot. Checked on the generated kernels (no compile needed), then
on sm_90 for the register use the rule is for."""
import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import pytest

import dsl as pl
from dsl import triton as plt
from lowering_triton import aot, launch_config, ptx_stats
from lowering_triton.kernel import generate

# the modules (`kernels.rms_norm` is also the function's name)
mm = importlib.import_module("kernels.matmul")
rn = importlib.import_module("kernels.rms_norm")
S = jax.ShapeDtypeStruct
ROWS = S((2048, 1024), jnp.float32)
COLS = S((1024,), jnp.float32)


def _launches(f, *args):
  """{kernel name: (num_warps, num_stages)} of the kernels of `f(*args)`."""
  out = {}
  for spec in aot.kernel_specs(f, *args):
    gk = generate(spec)
    out[gk.name] = (gk.num_warps, gk.num_stages)
  return out


def _rms_forward(x, w):
  return rn.forward(x, w, eps=1e-6, backend="triton", block_rows=16)[0]


def _loss_grad(f, n):
  return jax.grad(lambda *a: jnp.sum(f(*a) * a[0]), tuple(range(n)))


def _scale(x_ref, o_ref):
  o_ref[...] = x_ref[...] * 2.0


def _scale_call(x, compiler_params=None):
  spec = pl.BlockSpec((16, 1024), lambda i: (i, 0))
  return pl.pallas_call(_scale, S(x.shape, x.dtype), grid=(x.shape[0] // 16,),
                        in_specs=[spec], out_specs=spec, backend="triton",
                        compiler_params=compiler_params, name="scale")(x)


def test_a_kernel_without_params_gets_pallas_defaults_and_params_are_kept():
  assert _launches(_scale_call, ROWS) == {"scale": (4, 3)}
  cp = plt.CompilerParams(num_warps=2, num_stages=1)
  assert _launches(functools.partial(_scale_call, compiler_params=cp),
                   ROWS) == {"scale": (2, 1)}


def test_the_transposed_row_kernel_takes_warps_from_its_blocks():
  """RMS norm's forward runs 8 warps (its compiler params); the transposed
  kernel derived from it reads x and the output's cotangent, two (16, 1024)
  float32 blocks: 64 words a thread at 8 warps each, so 16 warps."""
  launches = _launches(_loss_grad(_rms_forward, 2), ROWS, COLS)
  assert launches["rms_norm_fwd"] == (8, 3)
  assert launches["rms_norm_fwd_transpose"] == (16, 3)


def test_a_derived_kernel_never_gets_fewer_warps_than_it_inherits():
  small = S((64, 128), jnp.float32)
  f = lambda x, w: rn.forward(x, w, eps=1e-6, backend="triton",
                              block_rows=16)[0]
  launches = _launches(_loss_grad(f, 2), small, S((128,), jnp.float32))
  # blocks of 16 x 128 ask for one warp; the forward's params give 4
  assert launches["rms_norm_fwd_transpose"] == launches["rms_norm_fwd"] == (
      4, 3)


def test_derived_kernels_with_a_dot_keep_the_forwards_warps():
  """matmul_2d's forward runs Pallas's default 4 warps; its dx and dy
  kernels have dots over the forward's tiles and keep them."""
  x = S((256, 256), jnp.float32)
  f = lambda a, b: mm.matmul_2d(a, b, backend="triton", blocks=(64, 64, 32))
  specs = aot.kernel_specs(jax.grad(lambda a, b: jnp.sum(f(a, b)), (0, 1)),
                           x, x)
  derived = [s for s in specs if s.launch_inherited]
  assert len(derived) == 2 and not specs[0].launch_inherited
  for spec in specs:
    assert launch_config.launch_config(spec) == (4, 3), spec.name


def _rows_call(x):
  spec = pl.BlockSpec(x.shape, lambda i: (0, 0))
  return pl.pallas_call(_scale, S(x.shape, x.dtype), grid=(1,),
                        in_specs=[spec], out_specs=spec, backend="triton",
                        name="scale")(x)


@pytest.mark.parametrize("shape,dtype,warps", [
    ((16, 2048), jnp.float32, 16),    # 32768 words: 64 a thread at 16
    ((16, 1024), jnp.float32, 8),
    ((16, 1024), jnp.bfloat16, 8),    # computed in 32-bit registers
    ((8, 128), jnp.float32, 1),
    ((1024, 1024), jnp.float32, 16)])  # at most MAX_WARPS
def test_block_warps_is_the_fewest_power_of_two_within_the_budget(
    shape, dtype, warps):
  (spec,) = aot.kernel_specs(_rows_call, S(shape, dtype))
  assert launch_config.block_warps(spec) == warps


def test_the_derived_rms_norm_backward_does_not_spill_on_sm_90():
  """What the rule is for: at its forward's 8 warps the transposed kernel
  took 245 registers; at 16 it takes at most 128 and spills nothing."""
  kernels = aot.compile_aot(_loss_grad(_rms_forward, 2), ROWS, COLS)
  (k,) = [k for k in kernels if k.name == "rms_norm_fwd_transpose"]
  st = k.stats()
  assert k.num_warps == 16
  assert not st.spills
  if ptx_stats.cuobjdump() is not None:    # triton ships it
    assert st.registers <= 128 and st.spill_bytes == 0


def test_spill_bytes_count_the_stack_frame_ptxas_spills_to():
  st = ptx_stats.PtxStats(ptx_stats.ptx_stats("").kernel, (), (),
                          registers=32, stack_bytes=3096, local_bytes=0)
  assert st.spill_bytes == 3096 and st.spills
  assert not dataclasses.replace(st, stack_bytes=0).spills
