"""Helpers of the benchmark CLI's tests: the CLI run in-process, and a
private autotune cache per test."""
import pytest

from benchmarks import cli


@pytest.fixture(autouse=True)
def private_autotune_cache(tmp_path, monkeypatch):
  """Each test its own autotune cache file (imported, it is autouse in the
  importing module)."""
  monkeypatch.setenv("DSL_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))


def run_cli(capsys, *argv):
  """`python -m benchmarks ARGV` in-process: (exit code, stdout, stderr)."""
  rc = cli.main(list(argv))
  out, err = capsys.readouterr()
  return rc, out, err
