"""The base classes of JAX's Pallas tests, running kernels on dsl.

`PallasTest.pallas_call` is `dsl.pallas_call(..., interpret=INTERPRET)`:
`interpret=True` runs dsl's `interpret` backend, as Pallas's `interpret=True`
runs its own interpreter. The skips follow Pallas's: interpret-mode classes
run on a CPU only, the others need a TPU or a GPU. With the environment
variable DSL_PALLAS_SUITE_ON=pallas (the harness's baseline run) it is the
installed Pallas's `pallas_call` instead.
"""
import os
import sys
import warnings

from jax.experimental import pallas as jax_pallas

import dsl
from dsl.core import config as dsl_config
from dsl.core.jax_internals import test_util as jtu


@jtu.with_config(jax_traceback_filtering="off")
class PallasTest(jtu.JaxTestCase):
  INTERPRET: bool = False

  def setUp(self):
    if self.INTERPRET and not jtu.test_device_matches(["cpu"]):
      self.skipTest("Only run interpret tests on CPU.")
    if not self.INTERPRET:
      if jtu.test_device_matches(["cpu"]):
        self.skipTest("On CPU the test works only in interpret mode")
      if (jtu.test_device_matches(["cuda"]) and
          not jtu.is_cuda_compute_capability_at_least("8.0")):
        self.skipTest("Only works on GPU with capability >= sm80")
      if (jtu.test_device_matches(["cuda"]) and dsl_config.use_mosaic_gpu()
          and not jtu.is_cuda_compute_capability_at_least("9.0")):
        self.skipTest("Mosaic GPU requires capability >= sm90")
      if sys.platform == "win32":
        self.skipTest("Only works on non-Windows platforms")
    super().setUp()
    if jtu.test_device_matches(["gpu"]):
      self.enter_context(warnings.catch_warnings())
      warnings.filterwarnings("ignore", category=DeprecationWarning,
                              message="The Pallas Triton backend is deprecated")

  def pallas_call(self, *args, **kwargs):
    on_pallas = os.environ.get("DSL_PALLAS_SUITE_ON") == "pallas"
    call = jax_pallas.pallas_call if on_pallas else dsl.pallas_call
    return call(*args, **kwargs, interpret=self.INTERPRET)


class PallasTPUTest(PallasTest):
  """Runs on a TPU, or in interpret mode on a CPU."""

  def setUp(self):
    if not self.INTERPRET and not jtu.test_device_matches(["tpu"]):
      self.skipTest("Test requires TPUs")
    super().setUp()
