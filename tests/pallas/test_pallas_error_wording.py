"""dsl's errors for bad pallas_calls carry Pallas's wording (code that
matches Pallas's message matches ours), and dsl's masked loads and stores
print in a jaxpr as Pallas's do. Each case runs the same call on Pallas
(interpret mode) and on dsl and checks both against one pattern."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as jpl
from jax.experimental.pallas import triton as jplt

import dsl
from dsl import triton as dplt
from dsl.core.inspection import traced_kernels

A = np.arange(256, dtype=np.int32)
X = np.arange(8 * 128, dtype=np.int32).reshape(8, 128)
F32 = jax.ShapeDtypeStruct(X.shape, jnp.float32)


def _one_result_index_map():
  return 0, 0


def _float_index_map(i):
  return 5.


def _returns_zero(x_ref, o_ref):
  return 0


# name -> (exception class both raise, pattern, the bad call as a function
# of the Pallas module). The patterns are Pallas's sentences.
CASES = {
    "kernel arity": (TypeError, r"takes 1 positional argument but 2 were given",
                     lambda pl: pl.pallas_call(lambda x_ref: None,
                                               out_shape=A)(A)),
    "kernel returns a value": (
        ValueError, r"The kernel function .* _returns_zero at "
        r".*test_pallas_error_wording\.py:\d+ should return None",
        lambda pl: pl.pallas_call(_returns_zero, out_shape=A)(A)),
    "in_specs not a sequence": (
        ValueError, r"`in_specs` must be a tuple or a list",
        lambda pl: pl.pallas_call(lambda x_ref, o_ref: None, out_shape=A,
                                  in_specs=pl.BlockSpec((4,), lambda: 0))),
    "index map arity": (
        TypeError, r"missing 2 required positional arguments: 'i' and 'j'",
        lambda pl: pl.pallas_call(
            lambda x_ref, o_ref: None, out_shape=A,
            in_specs=[pl.BlockSpec((4,), lambda i, j: 0)])(A)),
    "index map results": (
        ValueError, r"Index map function _one_result_index_map at "
        r".*test_pallas_error_wording\.py.* for args\[0\]\['one'\] must "
        r"return 1 values to match .*Currently returning 2 values",
        lambda pl: pl.pallas_call(
            lambda x_ref, o_ref: None, out_shape=A,
            in_specs=[dict(one=pl.BlockSpec((4,), _one_result_index_map),
                           two=pl.BlockSpec((8,), _one_result_index_map))])(
                               dict(one=A, two=A))),
    "index map dtype": (
        ValueError, r"Index map function _float_index_map at "
        r".*test_pallas_error_wording\.py.* for args\[0\] must return "
        r"integer scalars\. Output\[0\] has type .*float",
        lambda pl: pl.pallas_call(
            lambda x_ref, o_ref: None, out_shape=A, grid=(1,),
            in_specs=[pl.BlockSpec((4,), _float_index_map)])(A)),
    "out_specs tree": (
        ValueError, r"Pytree for `out_specs` and `out_shape` do not match\. "
        r"There are 1 mismatches, including:.* `out_specs` is a tuple of "
        r"length 1 but `out_shape` is a tuple of length 2",
        lambda pl: pl.pallas_call(
            lambda x_ref, o1_ref: None, out_shape=[A, A],
            out_specs=[pl.BlockSpec((6,), lambda i: i)])(A)),
    "block rank of an input": (
        ValueError, r"Block shape for args\[0\] .* must have the same number "
        r"of dimensions as the array shape",
        lambda pl: pl.pallas_call(
            lambda x_ref, o_ref: None, out_shape=[A],
            in_specs=[pl.BlockSpec((1, 1), lambda: (0, 0))])(A)),
    "block rank of an output": (
        ValueError, r"Block shape for outputs\[0\] .* must have the same "
        r"number of dimensions as the array shape",
        lambda pl: pl.pallas_call(
            lambda x_ref, o_ref: None, out_shape=[A],
            out_specs=[pl.BlockSpec((1, 1), lambda: 0)])(A)),
    "alias input index": (
        ValueError, r"input_output_aliases contains the mapping '2:0' with "
        r"input index 2 outside the range \[0, 2\)",
        lambda pl: pl.pallas_call(lambda x_ref, y_ref, o_ref: None,
                                  out_shape=[X],
                                  input_output_aliases={2: 0})(X, X)),
    "alias output index": (
        ValueError, r"input_output_aliases contains the mapping '1:1' with "
        r"output index 1 outside the range \[0, 1\)",
        lambda pl: pl.pallas_call(lambda x_ref, y_ref, o_ref: None,
                                  out_shape=[X],
                                  input_output_aliases={1: 1})(X, X)),
    "alias abstract value": (
        ValueError, r"input_output_aliases contains the mapping '1:0' "
        r"referring to input\[1\] with abstract value .*int32\[8,128\].* "
        r"output\[0\] with a different abstract value .*float32\[8,128\]",
        lambda pl: pl.pallas_call(lambda x_ref, y_ref, o_ref: None,
                                  out_shape=[F32],
                                  input_output_aliases={1: 0})(X, X)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_errors_carry_pallas_wording(case):
  cls, pattern, call = CASES[case]
  for pl in (jpl, dsl):
    with pytest.raises(cls) as info:
      call(pl)
    assert re.search(pattern, str(info.value), re.DOTALL), (pl.__name__,
                                                            str(info.value))
  assert isinstance(info.value, dsl.KernelError)


def _ref_to_dot(x_ref, y_ref, o_ref):
  o_ref[...] = jax.lax.dot_general(x_ref, y_ref, (((1,), (0,)), ((), ())))


def _ref_to_sum(x_ref, y_ref, o_ref):
  o_ref[...] = jnp.sum(y_ref) + x_ref[...]


def test_ref_passed_to_a_primitive_names_the_operand_only_when_it_is_known():
  """JAX's message, as Pallas raises it; dsl adds the operand when one ref
  alone was passed to the failing function, none when several were."""
  x = jnp.ones((8, 32), jnp.float32)
  y = jnp.ones((32, 8), jnp.float32)
  out = jax.ShapeDtypeStruct((8, 8), jnp.float32)
  pattern = r"Attempting to pass a Ref .* to a primitive"
  for pl in (jpl, dsl):
    with pytest.raises(ValueError, match=pattern):
      pl.pallas_call(_ref_to_dot, out_shape=out, interpret=True)(x, y)
  with pytest.raises(dsl.KernelError) as info:
    dsl.pallas_call(_ref_to_dot, out_shape=out)(x, y)
  assert re.match(r"kernel '_ref_to_dot': ValueError", str(info.value))
  with pytest.raises(dsl.KernelError) as info:
    dsl.pallas_call(_ref_to_sum, out_shape=jax.ShapeDtypeStruct(
        (8, 32), jnp.float32))(x, y)
  assert re.match(r"kernel '_ref_to_sum', y_ref \(in_specs\[1\]\): y_ref is "
                  r"a ref, not a value", str(info.value))


def _masked_copy(pl, plt):
  def kernel(x_ref, m_ref, o_ref):
    rows = (pl.ds(0, 3), slice(None))
    v = plt.load(x_ref.at[rows], mask=m_ref[...], other=0.)
    plt.store(o_ref.at[rows], v, mask=m_ref[...])
  return kernel


def _printed_kernel(pl, plt):
  x = jnp.ones((4, 2), jnp.float32)
  m = jnp.ones((3, 2), bool)
  call = pl.pallas_call(_masked_copy(pl, plt),
                        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        interpret=True)
  if pl is dsl:
    [(spec, _)] = traced_kernels(call, x, m)
    text = str(spec.jaxpr)
  else:
    text = str(jax.make_jaxpr(call)(x, m))
  np.testing.assert_array_equal(call(x, m)[:3], x[:3])
  return text


def test_masked_loads_and_stores_print_as_pallas_prints_them():
  for pl, plt in ((jpl, jplt), (dsl, dplt)):
    text = _printed_kernel(pl, plt)
    assert re.search(r"\w+:f32\[3,2\] <- \w+\[:3,:\] mask=\w+ other=\w+",
                     text), text
    # Pallas's store is a swap whose old value it prints too.
    assert re.search(r"\w+\[:3,:\] <- (\w+\[:3,:\], )?\w+ mask=\w+",
                     text), text
