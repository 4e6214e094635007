"""The interpret backend: kernels run as plain JAX ops, on any platform.

Importing the package registers backend "interpret" with dsl.core.backends.
"""
from dsl.core import backends as _backends
from dsl.interpret.execute import run
from dsl.interpret.launch import interpret_lowering

_backends.register_backend("interpret", interpret_lowering)

__all__ = ["run"]
