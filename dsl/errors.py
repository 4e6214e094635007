"""The errors a kernel raises, for `except` clauses.

    from dsl.errors import KernelError, KernelCheckError

`KernelError` (a `ValueError`) says that a kernel or its specs are wrong,
naming the kernel, the operand and the user's line; `KernelTypeError` (also
a `TypeError`) is one about types; `BackendError` (also a
`NotImplementedError`) says that a backend cannot run the kernel.
`KernelRuntimeError` (also a `jax.errors.JaxRuntimeError`) and its kinds
`KernelCheckError`, `KernelDeadlockError`, `KernelRaceError` report a kernel
that failed while it ran on a host backend. `KernelWarning` is a warning.

Inside `jax.jit` JAX raises its own error for a kernel that fails at run
time: `kernel_error_of(e)` gives the kernel error behind it, and a function
wrapped in `raising_kernel_errors` raises the kernel error itself, chained
from JAX's.
"""
from dsl.core.errors import (BackendError, KernelCheckError,
                             KernelDeadlockError, KernelError, KernelRaceError,
                             KernelRuntimeError, KernelTypeError,
                             KernelWarning, kernel_error_of)
from dsl.core.host_failures import raising_kernel_errors

__all__ = ["BackendError", "KernelCheckError", "KernelDeadlockError",
           "KernelError", "KernelRaceError", "KernelRuntimeError",
           "KernelTypeError", "KernelWarning", "kernel_error_of",
           "raising_kernel_errors"]
