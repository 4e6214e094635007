"""Decisions that the processes of a multi-process JAX job take together.

In a job of several processes (`jax.distributed.initialize`, a process per
host), every process traces the same SPMD program, and each must compile the
same one: a choice that depends on the process (timing on its own devices,
its own cache file) would give the hosts different kernels. Such a choice is
made by the first process and shared with the others through the job's
key-value store, as JAX shares the executables process 0 compiles
(`first_process_decides`). The store needs no devices, so this works while
a function is being traced.
"""
from __future__ import annotations

from typing import Callable

import jax
from dsl.core.jax_internals import distributed

# How long a process waits for process 0's decision (it may be searching).
TIMEOUT_MS = 30 * 60 * 1000


def first_process_decides(decide: Callable[[], int], key: str) -> int:
  """`decide()` as process 0 returns it, in every process of the job; the
  others do not call it and wait for it. `key` names the decision (the
  same in every process). In a single process: `decide()`."""
  client = distributed.global_state.client
  if jax.process_count() == 1 or client is None:
    return decide()
  key = f"dsl/decision/{key}"
  if jax.process_index() == 0:
    value = int(decide())
    client.key_value_set(key, str(value), allow_overwrite=True)
    return value
  return int(client.blocking_key_value_get(key, TIMEOUT_MS))
