"""Does a virtual environment hold the toolchain a constraints file pins?

    python scripts/toolchain.py constraints.txt   # exit 0: yes; 1: no,
                                                  # naming what differs

`scripts/setup.sh` runs it with the venv's python to decide whether to
(re)install. Only the standard library is used.
"""
from __future__ import annotations

import importlib.metadata
import re
import sys

_PIN = re.compile(r"^\s*([A-Za-z0-9_.\-\[\]]+)\s*==\s*([^\s#;]+)")


def pins(path: str) -> dict[str, str]:
  """package -> exact version, from a constraints file's `name==version`."""
  found = {}
  with open(path) as f:
    for line in f:
      m = _PIN.match(line)
      if m:
        found[m.group(1).split("[")[0].lower()] = m.group(2)
  return found


def differences(wanted: dict[str, str]) -> list[str]:
  out = []
  for name, version in sorted(wanted.items()):
    try:
      have = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      have = None
    if have != version:
      out.append(f"{name} {have or 'missing'} (wants {version})")
  return out


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  diff = differences(pins(argv[0]))
  if diff:
    print("toolchain: " + ", ".join(diff), file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
