"""Building blocks for writing Python source: an indented buffer and names.

Generated kernels are built line by line through `CodeBuffer`, never by
concatenating strings across modules; `Names` hands out readable, unique
identifiers (`x`, `x_1`, ...).
"""
from __future__ import annotations

import contextlib
import keyword
import re

INDENT = "    "

# Names a generated kernel must never shadow.
_RESERVED = frozenset({
    "tl", "triton", "range", "float", "int", "bool", "min", "max", "sum",
    "abs", "len", "print", "all", "any", "pow", "round", "slice", "tuple",
    "list", "dict", "type", "id", "input", "object", "None", "True", "False",
})


_IDENT = re.compile(r"[A-Za-z_]\w*")
_LOCATION = re.compile(r"^\s*# [^\s:]+\.py:\d+(:|$)")


class CodeBuffer:
  """Lines of Python source at the current indentation level.

  A line may be recorded as the pure definition of a name
  (`line(text, defines=name)`); `drop_unused_definitions` later removes the
  pure definitions nothing reads (values a rule computed for a use that was
  folded away).
  """

  def __init__(self):
    self._lines: list[str] = []
    self._defines: dict[int, str] = {}
    self._tags: dict[int, object] = {}
    self._level = 0

  def line(self, text: str = "", defines: str | None = None,
           tag: object = None) -> None:
    if not text:
      self._lines.append("")
      return
    if defines is not None:
      self._defines[len(self._lines)] = defines
    if tag is not None:
      self._tags[len(self._lines)] = tag
    for piece in text.split("\n"):
      self._lines.append(INDENT * self._level + piece if piece else "")

  def drop_tagged(self, drop) -> None:
    """Removes the tagged lines for which `drop(tag)` is true."""
    gone = {i for i, t in self._tags.items() if drop(t)}
    if not gone:
      return
    keep = [i for i in range(len(self._lines)) if i not in gone]
    self._reindex(keep)
    self._fill_empty_blocks()

  def _reindex(self, keep: list[int]) -> None:
    index = {old: new for new, old in enumerate(keep)}
    self._defines = {index[i]: n for i, n in self._defines.items()
                     if i in index}
    self._tags = {index[i]: t for i, t in self._tags.items() if i in index}
    self._lines = [self._lines[i] for i in keep]

  def drop_unused_definitions(self) -> int:
    """Removes pure definitions whose name no other line mentions."""
    removed = 0
    while True:
      uses: dict[str, int] = {}
      for i, ln in enumerate(self._lines):
        code = ln.split("#", 1)[0] if "#" in ln and "'" not in ln and \
            '"' not in ln else ln
        names = _IDENT.findall(code)
        if i in self._defines and names and names[0] == self._defines[i]:
          names = names[1:]
        for n in names:
          uses[n] = uses.get(n, 0) + 1
      dead = [i for i, name in self._defines.items() if not uses.get(name)]
      if not dead:
        return removed
      for i in dead:
        self._lines[i] = None
        removed += 1
      keep = [i for i, ln in enumerate(self._lines) if ln is not None]
      self._reindex(keep)
      self._drop_orphan_comments()
      self._fill_empty_blocks()

  def _drop_orphan_comments(self) -> None:
    """Drops `# file.py:12: ...` comments left with no code below them."""
    def indent(ln):
      return len(ln) - len(ln.lstrip())

    keep = []
    for i, ln in enumerate(self._lines):
      if _LOCATION.match(ln):
        nxt = self._lines[i + 1] if i + 1 < len(self._lines) else ""
        if (not nxt.strip() or indent(nxt) < indent(ln) or
            (_LOCATION.match(nxt) and indent(nxt) == indent(ln))):
          continue
      keep.append(i)
    self._reindex(keep)

  def _fill_empty_blocks(self) -> None:
    """A block left without statements gets a `pass`."""
    def indent(ln):
      return len(ln) - len(ln.lstrip())

    def statement(ln):
      t = ln.strip()
      return bool(t) and not t.startswith("#")

    i = 0
    while i < len(self._lines):
      ln = self._lines[i]
      if statement(ln) and ln.rstrip().endswith(":"):
        j = i + 1
        while j < len(self._lines) and not statement(self._lines[j]):
          j += 1
        if j == len(self._lines) or indent(self._lines[j]) <= indent(ln):
          self._lines.insert(i + 1, " " * indent(ln) + INDENT + "pass")
          self._defines = {(k + 1 if k > i else k): n
                           for k, n in self._defines.items()}
          self._tags = {(k + 1 if k > i else k): t
                        for k, t in self._tags.items()}
      i += 1

  def comment(self, text: str) -> None:
    for piece in text.split("\n"):
      self.line(f"# {piece}".rstrip())

  @contextlib.contextmanager
  def indent(self, header: str | None = None):
    """Writes `header` (e.g. `for k in range(4):`) and indents its body.

    A body that ends up without statements gets a `pass`.
    """
    if header is not None:
      self.line(header)
    mark = len(self._lines)
    self._level += 1
    try:
      yield
    finally:
      if not self.has_statements_since(mark):
        self.line("pass")
      self._level -= 1

  def has_statements_since(self, mark: int) -> bool:
    return any(ln.strip() and not ln.strip().startswith("#")
               for ln in self._lines[mark:])

  def mark(self) -> int:
    return len(self._lines)

  @property
  def level(self) -> int:
    return self._level

  def getvalue(self) -> str:
    return "\n".join(self._lines) + "\n"


def sanitize(hint: str) -> str:
  """A valid Python identifier close to `hint`."""
  name = re.sub(r"\W+", "_", hint).strip("_") or "v"
  if name[0].isdigit():
    name = "v" + name
  if keyword.iskeyword(name) or name in _RESERVED:
    name = name + "_"
  return name


class Names:
  """Hands out unique identifiers derived from hints."""

  def __init__(self, reserved=()):
    self._used = set(_RESERVED) | set(reserved)

  def fresh(self, hint: str) -> str:
    base = sanitize(hint)
    if base not in self._used:
      self._used.add(base)
      return base
    k = 1
    while f"{base}_{k}" in self._used:
      k += 1
    name = f"{base}_{k}"
    self._used.add(name)
    return name

  def reserve(self, name: str) -> None:
    self._used.add(name)


_SIMPLE = re.compile(r"^-?[\w.]+(\[[^\[\]]*\])?$|^[\w.]+\([^()]*\)$")


def paren(expr) -> str:
  """`expr` wrapped in parentheses unless it is a name, number or call."""
  text = str(expr)
  if _SIMPLE.match(text) and not text.startswith("-"):
    return text
  return f"({text})"
