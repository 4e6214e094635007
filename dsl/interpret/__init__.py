"""The interpret backend: kernels run as plain JAX ops, on any platform."""
from dsl.interpret.execute import run

__all__ = ["run"]
