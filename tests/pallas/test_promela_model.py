"""Model extraction and Promela text, on Mosaic modules written by hand.

These modules use the op vocabulary of lowering_mosaic's output
(`tpu.enqueue_dma`, `tpu.wait_dma` / `wait_dma2`, `tpu.sem_signal`, `tpu.sem_wait`,
`tpu.device_id`, `tpu.region`, memrefs in `#tpu.memory_space<...>`, `scf`),
parsed with jaxlib's MLIR bindings, so the extractor is tested on shapes of
code the DSL does not produce today (scf.while, unknown branch conditions,
modules without the `dsl.*` annotations).
"""
from __future__ import annotations

import re

import pytest
from dsl.core.jax_internals import ir, mlir as jax_mlir, tpu

from lowering_mosaic.verification.promela import (Options, extract, run_spin,
                                                  spin_available)
from lowering_mosaic.verification.promela import model as M
from lowering_mosaic.verification.promela.builder import build
from lowering_mosaic.verification.promela.trail import ModelInfo

SPIN_OK, SPIN_WHY = spin_available()
needs_spin = pytest.mark.skipif(not SPIN_OK, reason=SPIN_WHY)

ANY = "#tpu.memory_space<any>"
VMEM = "#tpu.memory_space<vmem>"
SMEM = "#tpu.memory_space<smem>"
SEMS = "#tpu.memory_space<semaphore_mem>"
DSEM = f"memref<!tpu.dma_semaphore, {SEMS}>"


def parse(text: str) -> ir.Module:
  ctx = jax_mlir.make_ir_context()
  tpu.register_dialect(ctx)
  with ctx:
    return ir.Module.parse(text)


def kernel(body: str, args: str, attrs: str = "") -> str:
  attrs = f" attributes {{{attrs}}}" if attrs else ""
  return (f'module {{\n  func.func @main({args}){attrs} {{\n{body}\n'
          f'    return\n  }}\n}}\n')


def loc(line: int, name: str = "op") -> str:
  return f'loc("{name}"("kern.py":{line}:0))'


# A loop over two chunks: each is copied HBM -> VMEM slot i and read after
# its wait; `{wait}` is replaced to make broken variants.
LOOP = kernel(f"""
    %c0 = arith.constant 0 : i32
    %c1 = arith.constant 1 : i32
    %c2 = arith.constant 2 : i32
    %z = arith.constant 0 : index
    scf.for %i = %c0 to %c2 step %c1 : i32 {{
      %s = tpu.memref_slice %x[%i, %c0, %c0] : memref<2x8x128xf32, {ANY}> -> memref<1x8x128xf32, {ANY}>
      %d = tpu.memref_slice %buf[%i, %c0, %c0] : memref<2x8x128xf32, {VMEM}> -> memref<1x8x128xf32, {VMEM}>
      %m = tpu.memref_slice %sem[%i] : memref<2x!tpu.dma_semaphore, {SEMS}> -> memref<1x!tpu.dma_semaphore, {SEMS}>
      %q = tpu.memref_squeeze %m : memref<1x!tpu.dma_semaphore, {SEMS}> -> {DSEM}
      tpu.enqueue_dma source(%s : memref<1x8x128xf32, {ANY}>) target(%d : memref<1x8x128xf32, {VMEM}>) target_semaphore(%q : {DSEM}) {loc(10, "dma_start")}
      {{wait}}
      %ii = arith.index_cast %i : i32 to index
      %v = vector.load %buf[%ii, %z, %z] : memref<2x8x128xf32, {VMEM}>, vector<1x8x128xf32> {loc(12, "get")}
    }} {loc(9, "scan")}
""", f"%x: memref<2x8x128xf32, {ANY}>, %buf: memref<2x8x128xf32, {VMEM}>, "
     f"%sem: memref<2x!tpu.dma_semaphore, {SEMS}>")

WAIT = (f"tpu.wait_dma2 semaphore(%q : {DSEM}) src(%s : memref<1x8x128xf32, "
        f"{ANY}>) dst(%d : memref<1x8x128xf32, {VMEM}>) {loc(11, 'dma_wait')}")
# The same wait as jax 0.12's Pallas writes it: the whole copy, and the end
# awaited.
WAIT_COPY = (f"tpu.wait_dma source(%s : memref<1x8x128xf32, {ANY}>) "
             f"target(%d : memref<1x8x128xf32, {VMEM}>) "
             f"target_semaphore(%q : {DSEM}) {{wait_target = true}} "
             f"{loc(11, 'dma_wait')}")


@pytest.mark.parametrize("wait", [WAIT, WAIT_COPY])
def test_loop_module_model(wait):
  km = extract(parse(LOOP.replace("{wait}", wait)))
  assert km.num_devices == 1 and km.grid == ()
  names = [b.name for b in km.buffers]
  assert names == ["arg0", "arg1"]           # no dsl.operand_names: argK
  assert [s.kind for s in km.sems] == ["dma"]
  (loop,) = km.body
  assert isinstance(loop, M.Loop) and loop.hi.const == 2
  kinds = [type(s).__name__ for s in loop.body]
  assert kinds == ["DmaStart", "DmaWait", "Access"]
  start = loop.body[0]
  assert start.nbytes == 8 * 128 * 4 and not start.remote
  assert start.info.line == "kern.py:10"
  text = build(km)
  # slot i of the VMEM buffer is its own cell: the layout cut dim 0 in two
  assert km.buffers[1].cell_dims == ((0, 2, 1),)
  assert re.search(r"/\* @s\d+ kern\.py:10: DMA arg0\[", text)
  assert "RANGE(" in text


@needs_spin
@pytest.mark.parametrize("wait", [WAIT, WAIT_COPY])
def test_loop_module_ok_and_broken(wait):
  ok = run_spin(build(extract(parse(LOOP.replace("{wait}", wait)))))
  assert ok.kind == "ok", ok
  racy = run_spin(build(extract(parse(LOOP.replace("{wait}", "")))))
  assert racy.kind == "race", racy
  assert racy.error_line == "kern.py:12"
  assert "reads" in racy.message and "kern.py:10" in racy.message


@needs_spin
def test_unknown_branch_condition_takes_both_ways():
  """The wait sits under a branch on an SMEM value: the model cannot know
  it, so it explores the way that skips the wait."""
  body = LOOP.replace("{wait}", f"""
      %k = memref.load %flag[%z] : memref<1xi32, {SMEM}>
      %c = arith.cmpi eq, %k, %c0 : i32
      scf.if %c {{
        {WAIT}
      }} {loc(11, 'cond')}""").replace(
          f"%sem: memref<2x!tpu.dma_semaphore, {SEMS}>",
          f"%sem: memref<2x!tpu.dma_semaphore, {SEMS}>, "
          f"%flag: memref<1xi32, {SMEM}>")
  km = extract(parse(body))
  assert any("either way" in n for n in km.notes)
  rep = run_spin(build(km))
  assert rep.kind == "race", rep


@needs_spin
def test_static_branch_keeps_one_side():
  body = LOOP.replace("{wait}", f"""
      %c = arith.cmpi slt, %c0, %c1 : i32
      scf.if %c {{
        {WAIT}
      }}""")
  km = extract(parse(body))
  assert not any(isinstance(s, M.If) for s in M.walk(km.body))
  assert run_spin(build(km)).kind == "ok"


@needs_spin
def test_while_loop_and_region():
  """scf.while counting to 2 around a run_scoped-style region whose DMA is
  waited (ok) or not (the region frees its buffer with the DMA in flight)."""
  def module(wait: bool):
    w = (f"tpu.wait_dma2 semaphore(%s : {DSEM}) src(%x : memref<8x128xf32, "
         f"{ANY}>) dst(%a : memref<8x128xf32, {VMEM}>)") if wait else ""
    return kernel(f"""
    %c0 = arith.constant 0 : i32
    %c1 = arith.constant 1 : i32
    %c2 = arith.constant 2 : i32
    %r = scf.while (%n = %c0) : (i32) -> i32 {{
      %go = arith.cmpi slt, %n, %c2 : i32
      scf.condition(%go) %n : i32
    }} do {{
    ^bb0(%m: i32):
      "tpu.region"() ({{
        %a = memref.alloca() : memref<8x128xf32, {VMEM}>
        %s = tpu.sem_alloc : {DSEM}
        tpu.enqueue_dma source(%x : memref<8x128xf32, {ANY}>) target(%a : memref<8x128xf32, {VMEM}>) target_semaphore(%s : {DSEM}) {loc(20, "dma_start")}
        {w}
        tpu.yield
      }}) : () -> () {loc(19, "run_scoped")}
      %next = arith.addi %m, %c1 : i32
      scf.yield %next : i32
    }}
""", f"%x: memref<8x128xf32, {ANY}>")
  km = extract(parse(module(True)))
  assert any(isinstance(s, M.While) for s in M.walk(km.body))
  assert any(isinstance(s, M.ScopeEnd) for s in M.walk(km.body))
  assert run_spin(build(km)).kind == "ok"
  bad = run_spin(build(extract(parse(module(False)))))
  assert bad.kind == "race" and "run_scoped" in bad.message, bad


BARRIER = kernel(f"""
    %c1 = arith.constant 1 : i32
    %c2 = arith.constant 2 : i32
    %me = tpu.device_id : i32
    %p = arith.addi %me, %c1 : i32
    %peer = arith.remsi %p, %c2 : i32
    %b = tpu.sem_barrier : memref<!tpu.semaphore, {SEMS}>
    tpu.sem_signal %b, %c1 device_id %peer : memref<!tpu.semaphore, {SEMS}> {loc(30, "semaphore_signal")}
    tpu.sem_wait %b, {{amount}} : memref<!tpu.semaphore, {SEMS}> {loc(31, "semaphore_wait")}
""", "")


@needs_spin
@pytest.mark.parametrize("amount,kind", [("%c1", "ok"), ("%c2", "deadlock")])
def test_barrier_between_two_devices(amount, kind):
  km = extract(parse(BARRIER.replace("{amount}", amount)), num_devices=2)
  assert km.num_devices == 2
  rep = run_spin(build(km))
  assert rep.kind == kind, rep
  if kind == "deadlock":
    assert {b.line for b in rep.blocked} == {"kern.py:31"}
    assert len(rep.blocked) == 2


@needs_spin
def test_remote_signal_to_a_missing_device_is_an_error():
  text = BARRIER.replace("{amount}", "%c1").replace(
      "%peer = arith.remsi %p, %c2 : i32", "%peer = arith.addi %p, %c1 : i32")
  rep = run_spin(build(extract(parse(text), num_devices=2)))
  assert rep.kind == "error" and "device" in rep.message, rep


def test_model_header_describes_itself():
  km = extract(parse(BARRIER.replace("{amount}", "%c1")), num_devices=3)
  text = build(km, Options(queue=2))
  info = ModelInfo.parse(text)
  assert info.devices == 3 and info.par == 1
  assert [s.kind for s in info.sems] == ["barrier"]
  assert info.procs[1] == "DMA engine of device 0"
  assert info.procs[4] == "device 0 kernel"
  # every @sN marker names a statement of the header table
  assert set(info.line_stmt.values()) <= set(info.stmts)
  assert "#define Q 2" in text


def test_expressions_fold_and_stay_c_like():
  a = M.var("dev")
  assert M.binop("+", M.const(2), M.const(3)).const == 5
  assert M.binop("/", M.const(-7), M.const(2)).const == -3     # C truncation
  assert M.binop("%", M.const(-7), M.const(2)).const == -1
  assert M.binop("*", a, M.const(1)) is a
  assert M.binop("+", a, None) is None
  assert M.select(M.const(0), a, M.const(4)).const == 4
  assert M.binop("%", a, M.const(4)).text == "(dev % 4)"


def test_cell_layout_follows_the_windows():
  buf = M.Buffer("b", "vmem", (4, 16, 128), 4, "instance", "scratch")
  buf.windows = [M.Window(buf, [M.var("k"), M.const(0), M.const(0)],
                          [1, 16, 128]),
                 M.Window(buf, [M.const(0), M.const(8), M.const(0)],
                          [4, 8, 128])]
  M.layout_cells(buf)
  assert buf.cell_dims == ((0, 4, 1), (1, 2, 8))
  assert buf.ncells == 8
  M.layout_cells(buf, max_cells=4)
  assert buf.ncells <= 4


def test_unknown_ops_on_semaphores_are_refused(tmp_path):
  import jax
  from lowering_mosaic.verification.promela import ModelError, maybe_dump
  text = kernel(f"""
    %c0 = arith.constant 0 : i32
    %s = tpu.memref_slice %sem[%c0] : memref<2x!tpu.dma_semaphore, {SEMS}> -> memref<1x!tpu.dma_semaphore, {SEMS}>
    %r = memref.cast %s : memref<1x!tpu.dma_semaphore, {SEMS}> to memref<?x!tpu.dma_semaphore, {SEMS}>
    "test.mystery"(%sem) : (memref<2x!tpu.dma_semaphore, {SEMS}>) -> ()
""", f"%sem: memref<2x!tpu.dma_semaphore, {SEMS}>")
  ctx = jax_mlir.make_ir_context()
  tpu.register_dialect(ctx)
  ctx.allow_unregistered_dialects = True
  with ctx:
    module = ir.Module.parse(text)
  with pytest.raises(ModelError, match="test.mystery"):
    extract(module)
  jax.config.update("jax_pallas_dump_promela_to", str(tmp_path))
  try:
    with pytest.warns(RuntimeWarning, match="no Promela model"):
      assert maybe_dump(module, "mystery") is None
  finally:
    jax.config.update("jax_pallas_dump_promela_to", "")
