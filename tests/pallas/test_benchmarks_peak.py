"""The benchmark CLI's device peak: the arithmetic, measured once per process
and device, and no memory-bound row above 100% of the measured copy (a row
above it re-measures the copy; rows still above are reported)."""
from __future__ import annotations

import dataclasses

import pytest

from benchmarks import peak, report
from benchmarks.runner import Case, Cell, Row
from benchmarks.suite import Add, by_name

GB = 1e9


def test_rates_count_bytes_read_and_written():
  # a 1 GiB copy in 0.511 ms moves 2 GiB: 4.2 TB/s (the H200's copy)
  assert peak.copy_rate(1 << 30, 0.511e-3) == pytest.approx(4.2e12, rel=1e-3)
  assert peak.matmul_rate(8192, 1e-3) == pytest.approx(1.0995e15, rel=1e-4)
  p = peak.Peak(1e15, 4e12, "m", "c")
  assert peak.fraction(2e12, "B/s", p) == 0.5
  assert peak.fraction(5e14, "FLOP/s", p) == 0.5


def _row(bench, size, throughput, unit="B/s", fraction=None):
  row = Row(Case(bench, size, "triton", {}), "float32", Cell(note="-"), {})
  row.throughput, row.throughput_unit = throughput, unit
  row.peak_fraction = fraction
  return row


def _rows(first: peak.Peak):
  add64 = _row(Add(), (1 << 26,), 2.46e12)      # 110% of a 2.24 TB/s copy
  add4 = _row(Add(), (1 << 22,), 1.0e12)
  mm = _row(by_name()["matmul"], (4096,) * 3, 9e14, "FLOP/s")  # not memory
  rows = [add64, add4, mm]
  for r in rows:
    r.peak_fraction = peak.fraction(r.throughput, r.throughput_unit, first)
  return rows


FIRST = peak.Peak(1e15, 2.24e12, "bfloat16 matmul 8192^3", "copy 1024 MiB")


def test_a_row_above_the_copy_remeasures_it_and_no_row_stays_above():
  rows = _rows(FIRST)
  assert [r.case.label for r in peak.over_peak(rows, FIRST)] == [
      "add 64M triton"]
  calls = []

  def again():
    calls.append(1)
    return dataclasses.replace(FIRST, bandwidth=4.2e12,
                               copy_desc="copy 2048 MiB")
  settled, notes = peak.settle(rows, FIRST, again)
  assert calls == [1] and notes == []
  assert settled.bandwidth == 4.2e12 and settled.flops == FIRST.flops
  assert "re-measured" in settled.copy_desc
  assert max(r.peak_fraction for r in rows if r.throughput_unit == "B/s") \
      < 1.0
  assert rows[0].peak_fraction == pytest.approx(2.46 / 4.2)
  assert rows[2].peak_fraction == pytest.approx(0.9)   # FLOP/s untouched


def test_rows_still_above_after_remeasuring_are_reported_not_hidden():
  rows = _rows(FIRST)
  slower = dataclasses.replace(FIRST, bandwidth=2.0e12)
  settled, notes = peak.settle(rows, FIRST, lambda: slower)
  assert settled == FIRST           # the faster of the two copies is kept
  (note,) = notes
  assert "1 row(s)" in note and "(2240 GB/s)" in note
  assert "add 64M triton (2460 GB/s)" in note and "add 4M" not in note
  assert report._peak_cell(rows[0].peak_fraction) == "110%!"
  assert report._peak_cell(rows[1].peak_fraction) == "45%"


def test_nothing_above_the_copy_measures_nothing_more():
  rows = _rows(dataclasses.replace(FIRST, bandwidth=5e12))
  def again():
    raise AssertionError("re-measured without cause")
  p = dataclasses.replace(FIRST, bandwidth=5e12)
  assert peak.settle(rows, p, again) == (p, [])


def test_the_peak_is_measured_once_per_process_and_device(monkeypatch):
  calls = []

  def fake(platform, scale, repeats):
    calls.append((platform, scale))
    return dataclasses.replace(FIRST, bandwidth=float(len(calls)))
  monkeypatch.setattr(peak, "_measure", fake)
  peak.measure_peak.cache_clear()
  try:
    a = peak.measure_peak("gpu", "NVIDIA H200")
    assert peak.measure_peak("gpu", "NVIDIA H200") is a
    b = peak.measure_peak("gpu", "NVIDIA H100 80GB HBM3")
    assert b is not a
    assert peak.remeasure("gpu").bandwidth == 3.0
    assert calls == [("gpu", 1), ("gpu", 1), ("gpu", 2)]
  finally:
    peak.measure_peak.cache_clear()


def test_a_real_copy_is_timed_on_this_machine():
  t = peak.time_copy(1 << 20, repeats=2)
  assert 0 < t < 1.0
  assert peak.copy_rate(1 << 20, t) > 0
