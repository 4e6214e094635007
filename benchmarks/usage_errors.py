"""The one error type the CLI turns into a one-line message and exit code 2."""


class UsageError(Exception):
  """A bad command line: unknown kernel, unavailable backend, bad size, ..."""
