"""A progress bar on stderr that appears only once a run has lasted a few
seconds; a background thread keeps its clock moving during long steps."""
from __future__ import annotations

import shutil
import sys
import threading
import time


def _clock(s: float) -> str:
  s = int(s)
  return f"{s // 60}:{s % 60:02d}"


class Progress:

  def __init__(self, total: int, *, stream=None, mode: str = "auto",
               delay: float = 2.0, refresh: float = 0.5):
    self.total = max(1, total)
    self.done = 0
    self.text = ""
    self.stream = stream or sys.stderr
    isatty = getattr(self.stream, "isatty", lambda: False)()
    self.enabled = mode == "always" or (mode == "auto" and isatty)
    self.delay = 0.0 if mode == "always" else delay
    self.start = time.monotonic()
    self._shown = False
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = None
    if self.enabled:
      self._thread = threading.Thread(target=self._tick, args=(refresh,),
                                      daemon=True)
      self._thread.start()

  def _tick(self, refresh):
    while not self._stop.wait(refresh):
      self._render()

  def status(self, text: str):
    with self._lock:
      self.text = text
    self._render()

  def advance(self, n: int = 1):
    with self._lock:
      self.done = min(self.total, self.done + n)
    self._render()

  def line(self) -> str:
    elapsed = time.monotonic() - self.start
    frac = self.done / self.total
    width = 24
    fill = int(frac * width)
    bar = "#" * fill + "." * (width - fill)
    eta = f" ~{_clock(elapsed / frac - elapsed)} left" if 0 < frac < 1 else ""
    return (f"[{bar}] {self.done}/{self.total} {frac:4.0%} "
            f"{_clock(elapsed)}{eta}  {self.text}")

  def _render(self):
    if not self.enabled or self._stop.is_set():
      return
    if time.monotonic() - self.start < self.delay:
      return
    with self._lock:
      cols = shutil.get_terminal_size((100, 20)).columns
      text = self.line()[:max(20, cols - 1)]
      self.stream.write("\r\x1b[2K" + text)
      self.stream.flush()
      self._shown = True

  def close(self):
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=1)
    with self._lock:
      if self._shown:
        self.stream.write("\r\x1b[2K")
        self.stream.flush()
