"""The base of every backend's compiler parameters (`pl.CompilerParams`)."""


class CompilerParams:
  """Base class of `tpu.CompilerParams` and `triton.CompilerParams`: code
  may test `isinstance(params, pl.CompilerParams)`."""
  __slots__ = ()
