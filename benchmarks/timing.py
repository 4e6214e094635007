"""The benchmark timer lives in `dsl.timing` (so that `dsl.autotune` times
configs with it too); this module keeps the old import path."""
from dsl.timing import (Memory, Stats, measure, memory_of,  # noqa: F401
                        prepare, run_interleaved, time_queued)
