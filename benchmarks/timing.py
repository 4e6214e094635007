"""The benchmark timer lives in `dsl.tools.timing` (so that `dsl.autotune` times
configs with it too); this module keeps the old import path."""
from dsl.tools.timing import (Memory, Stats, measure, memory_of, prepare,
                              run_interleaved, time_queued)
