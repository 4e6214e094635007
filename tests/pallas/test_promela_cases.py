"""The verification corpus (promela_corpus.py) through SPIN: the correct
kernels verify `ok`, each broken variant is reported with the kind of its
bug, and its counterexample speaks in the corpus's lines."""
import pytest

import lowering_mosaic.verify as verify
from lowering_mosaic.verification.promela import spin_available
from benchmarks.promela_corpus import CORPUS, Case

SPIN_OK, SPIN_WHY = spin_available()
pytestmark = pytest.mark.skipif(not SPIN_OK, reason=SPIN_WHY)


def run_case(case: Case, **kw):
  f, args = case.build()
  return verify(f, *args, timeout_s=120, **kw)


@pytest.mark.parametrize("case", CORPUS, ids=[c.name for c in CORPUS])
def test_corpus(case):
  rep = run_case(case)
  assert rep.kind == case.expected, str(rep)
  assert rep.num_devices == case.devices
  assert rep.states > 0
  if case.expected == "ok":
    assert not rep.trail and not rep.message
    return
  # The counterexample speaks in the corpus's lines.
  assert rep.trail, str(rep)
  assert any(s.line and "/promela_corpus.py:" in s.line
             for s in rep.trail), str(rep)
  assert rep.message.startswith(case.expected), rep.message
  if case.expected == "deadlock":
    assert rep.blocked and all("/promela_corpus.py:" in b.line
                               for b in rep.blocked)


def test_every_kind_is_caught():
  kinds = {c.expected for c in CORPUS if c.bug}
  assert kinds == {"race", "deadlock", "semaphore"}
