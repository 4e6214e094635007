"""The Mosaic GPU modules lowered while a test runs, caught where both
dsl's and Pallas's lowerings hand them to jaxlib's Mosaic GPU library
(`core.lower_mgpu_module`: layout inference, dialect lowering), and the
helpers that compare dsl's with Pallas's: texts without SSA names, the
lines that make a schedule, the instructions that set a kernel's speed."""
from __future__ import annotations

import collections
import re

import pytest
from jax.experimental.mosaic.gpu import core as mgpu_core

import dsl as pl
from benchmarks.pallas_library.swap import original, swapped


def capture_into(monkeypatch) -> list:
  """A list that gets the (dialect text, lowered text) of each module the
  library lowers while `monkeypatch` holds."""
  out = []
  lower = mgpu_core.lower_mgpu_module

  def capture(module, *args, **kwargs):
    before = module.operation.get_asm(enable_debug_info=False)
    result = lower(module, *args, **kwargs)
    out.append((before, module.operation.get_asm(enable_debug_info=False)))
    return result
  monkeypatch.setattr(mgpu_core, "lower_mgpu_module", capture)
  return out


@pytest.fixture
def captured(monkeypatch):
  """The (dialect text, lowered text) of each module the library lowers
  while the test runs."""
  return capture_into(monkeypatch)


def canonical(text: str) -> list[str]:
  """`text` without SSA names, block labels and the dump counter."""
  text = re.sub(r"%[\w#:-]+", "%v", text)
  text = re.sub(r"\^bb\d+", "^bb", text)
  text = re.sub(r'dump_basename = "(\w+?)_\d+"', r'dump_basename = "\1"', text)
  return [line.strip() for line in text.splitlines() if line.strip()]


def lower_op_both(lower, op: str, captured):
  """[(dialect, lowered) of dsl's module, the same of Pallas's] of Pallas's
  library op `op` (swapped onto dsl, then the original) as `lower(module)`
  lowers it."""
  with pl.default_backend("mosaic_gpu"):
    lower(swapped(op))
  lower(original(op))
  return captured


def only_in(ours: list[str], theirs: list[str]) -> tuple[list, list]:
  """(the lines only `ours` has, those only `theirs` has), as multisets."""
  a, b = collections.Counter(ours), collections.Counter(theirs)
  return sorted((a - b).elements()), sorted((b - a).elements())


_KEYS = ("mosaic_gpu.wgmma", "wgmma.mma_async", "wgmma.fence",
         "wgmma.commit_group", "wgmma.wait_group", "cp.async.bulk.tensor",
         "mbarrier.try_wait", "mbarrier.arrive", "setmaxnreg", "bar.sync",
         "fastmath<afn>", "optimization_barrier")


def key_ops(text: str) -> dict[str, int]:
  """How often `text` names each of the instructions that set a kernel's
  speed: WGMMAs and their fences and waits, TMA copies, mbarrier waits and
  arrivals, register budgets, block barriers, approximate math."""
  return {k: text.count(k) for k in _KEYS}


# The ops that make a pipeline's schedule: loops and branches, shared
# memory, barriers, TMA copies, WGMMAs and their groups, register budgets.
_SCHEDULE = re.compile(
    r"scf\.(for|while|index_switch)|slice_smem|initialize_barrier|"
    r"mosaic_gpu\.(arrive|async_load|async_store|wgmma)|arrive_expect_tx|"
    r"try_wait|setmaxnreg|commit_group|wait_group")


def schedule(text: str) -> list[str]:
  """The lines of `text` (canonical) that make its schedule, in order."""
  return [line for line in canonical(text) if _SCHEDULE.search(line)]


def unnamed(text: str) -> list[str]:
  """`canonical(text)` without the kernel's name."""
  return [re.sub(r'@\w+_mosaic_gpu|@(kernel|anonymous)\b|(?<=^module )@\w+|'
                 r'dump_basename = "\w+"', "NAME", line)
          for line in canonical(text)]


def module_name(text: str) -> str:
  """The name of the module in `text`."""
  return re.search(r"^module @(\w+)", text, re.M).group(1)
