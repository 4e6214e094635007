"""The errors a Promela model reports, as one table.

A failing check in the model prints `@@E code arg...` and then asserts a
variable named after the kind of error (`no_race`, `sem_balanced`,
`valid_model`: pan's "assertion violated" names it). The builder writes
those lines from `ERRORS` (`fail`, and the codes of prelude.pml); trail.py
reads them back and words the message from the same entry.

An entry's `args` name the printf arguments after the code, in order:

  stmt    the statement (@@stmt id) that failed
  dma     the statement that started the DMA involved
  issuer  the instance that issued that DMA, plus one (dma_inst[])
  inst    an instance
  region  a buffer region (@@buf)
  owner   an entered[]/gone[] index: an instance, or NINST + device
  slot    the DMA queue slot
  sem     a semaphore index (@@sem); value: its count
  device  a device id

and `message` is worded from them: trail.py renders each name in the
kernel's terms (`{stmt}` as `{at}`, "file:line (what it does)", and
`{line}`, "file:line"), plus `{actor}`, the process that failed, and
`{devices}`, the device count. `line` names the argument whose statement is
the kernel line to point at (None: none).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

# kind of error -> the variable its failing assertion names
ASSERTION = {"race": "no_race", "semaphore": "sem_balanced",
             "error": "valid_model"}
KIND_OF_ASSERTION = {v: k for k, v in ASSERTION.items()}


@dataclasses.dataclass(frozen=True)
class Error:
  kind: str                  # race | semaphore | error
  args: tuple                # printf arguments after the code (see above)
  message: str               # worded from the arguments' renderings
  line: Optional[str]        # the argument whose kernel line to report


# printf arguments of chk_read / chk_write (prelude.pml)
_CHECK = ("stmt", "dma", "issuer", "region", "slot")
# a DMA of `issuer` that lands in, or is still writing into, `owner`
_DMA_INTO = ("dma", "issuer", "owner", "slot")

_WRITING = "while the DMA started at {dma} by {issuer} is still writing into it"
_READING = "while the DMA started at {dma} by {issuer} is still reading from it"
_STARTS = "{actor} starts a DMA "
_PIPELINE = ("the pipeline copies the block {region} in/out at the end of a "
             "grid step ")
_FREES = "{actor} frees {region} when its run_scoped ends at {line} "

READ_VS_DMA_WRITE = 1
WRITE_VS_DMA_WRITE = 2
WRITE_VS_DMA_READ = 3
DMA_SRC_VS_DMA_WRITE = 4
DMA_DST_VS_DMA_WRITE = 5
DMA_DST_VS_DMA_READ = 6
PIPELINE_VS_DMA_WRITE = 7
PIPELINE_VS_DMA_READ = 8
SCOPE_VS_DMA_WRITE = 9
SCOPE_VS_DMA_READ = 10
LAND_AFTER_EXIT = 11
LAND_BEFORE_ENTRY = 12
EXIT_OWN_DMA = 13
EXIT_PEER_DMA = 14
EXIT_SEM = 15
EXIT_RECV_SEM = 16
SIGNAL_AFTER_EXIT = 17
SIGNAL_BEFORE_ENTRY = 18
BAD_DEVICE = 19
SCOPE_SEM = 20

ERRORS: dict[int, Error] = {
    READ_VS_DMA_WRITE: Error(
        "race", _CHECK, "{actor} reads {region} at {at} " + _WRITING, "stmt"),
    WRITE_VS_DMA_WRITE: Error(
        "race", _CHECK, "{actor} writes {region} at {at} " + _WRITING, "stmt"),
    WRITE_VS_DMA_READ: Error(
        "race", _CHECK, "{actor} overwrites {region} at {at} " + _READING,
        "stmt"),
    DMA_SRC_VS_DMA_WRITE: Error(
        "race", _CHECK, _STARTS + "out of {region} at {at} " + _WRITING,
        "stmt"),
    DMA_DST_VS_DMA_WRITE: Error(
        "race", _CHECK, _STARTS + "into {region} at {at} " + _WRITING, "stmt"),
    DMA_DST_VS_DMA_READ: Error(
        "race", _CHECK, _STARTS + "into {region} at {at} " + _READING, "stmt"),
    PIPELINE_VS_DMA_WRITE: Error("race", _CHECK, _PIPELINE + _WRITING, "stmt"),
    PIPELINE_VS_DMA_READ: Error("race", _CHECK, _PIPELINE + _READING, "stmt"),
    SCOPE_VS_DMA_WRITE: Error("race", _CHECK, _FREES + _WRITING, "stmt"),
    SCOPE_VS_DMA_READ: Error("race", _CHECK, _FREES + _READING, "stmt"),
    LAND_AFTER_EXIT: Error(
        "race", _DMA_INTO,
        "{owner} left the kernel while {issuer} still wrote into it: the DMA "
        "started at {dma} lands after it ended", "dma"),
    LAND_BEFORE_ENTRY: Error(
        "race", _DMA_INTO,
        "the DMA started at {dma} by {issuer} lands in {owner} before that "
        "device entered the kernel (its buffers may still belong to the "
        "previous op); make the devices meet on the barrier semaphore first",
        "dma"),
    EXIT_OWN_DMA: Error(
        "semaphore", ("dma", "inst", "owner", "slot"),
        "{inst} leaves the kernel while its DMA started at {dma} is still in "
        "flight: it was never waited for, and its semaphore will be left "
        "non-zero", "dma"),
    EXIT_PEER_DMA: Error(
        "race", _DMA_INTO,
        "{owner} leaves the kernel while the DMA started at {dma} by {issuer} "
        "still writes into it", "dma"),
    EXIT_SEM: Error(
        "semaphore", ("sem", "value", "owner"),
        "{sem} is {value}, not 0, when {owner} leaves the kernel (a DMA never "
        "waited for, or more signals than waits)", None),
    EXIT_RECV_SEM: Error(
        "race", ("sem", "value", "owner"),
        "{owner} leaves the kernel with {sem} at {value}: a peer's DMA into it "
        "was never waited for (the device left while the peer still wrote "
        "into it)", None),
    SIGNAL_AFTER_EXIT: Error(
        "semaphore", ("stmt", "owner", "inst"),
        "{actor} signals {owner} at {at} after that device left the kernel "
        "(more signals than waits)", "stmt"),
    SIGNAL_BEFORE_ENTRY: Error(
        "race", ("stmt", "owner", "inst"),
        "{actor} signals {owner} at {at} before that device entered the "
        "kernel; meet on the barrier semaphore first", "stmt"),
    BAD_DEVICE: Error(
        "error", ("stmt", "device"),
        "{actor} names device {device} at {at}, but there are {devices} "
        "devices", "stmt"),
    SCOPE_SEM: Error(
        "semaphore", ("sem", "value", "inst"),
        "{sem} is {value}, not 0, at the end of its run_scoped", None),
}

# chk_write(R, M, S, CODE) reports CODE when a DMA writes the cells and
# CODE + 1 when one reads them: each write check's code is followed by its
# read twin.
WRITE_CHECKS = {WRITE_VS_DMA_WRITE: WRITE_VS_DMA_READ,
                DMA_DST_VS_DMA_WRITE: DMA_DST_VS_DMA_READ,
                PIPELINE_VS_DMA_WRITE: PIPELINE_VS_DMA_READ,
                SCOPE_VS_DMA_WRITE: SCOPE_VS_DMA_READ}
assert all(r == w + 1 for w, r in WRITE_CHECKS.items())

# name -> code, for the `$NAME`s of prelude.pml
CODES = {name: code for name, code in globals().items()
         if name.isupper() and isinstance(code, int) and code in ERRORS}


def fail(code: int, *args: str) -> str:
  """The Promela that reports error `code` with `args` (Promela
  expressions, one per name in its `args`) and fails its assertion."""
  e = ERRORS[code]
  assert len(args) == len(e.args), (code, args)
  fmt = " ".join(["@@E", str(code)] + ["%d"] * len(args))
  return (f'printf("{fmt}\\n", {", ".join(args)}); '
          f"assert({ASSERTION[e.kind]})")
