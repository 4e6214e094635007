"""Integer ops: the `arith` ops on integers and indices (and
`tpu.device_id`) become Promela expressions over the process's variables;
any other value is unknown (None)."""
from __future__ import annotations

from dsl.core.jax_internals import ir

from lowering_mosaic.verification.promela import model as M
from lowering_mosaic.verification.promela.model import (binop, const, select,
                                                        var)
from lowering_mosaic.verification.promela.mosaic_ir import handles, is_int


_BIN = {"arith.addi": "+", "arith.subi": "-", "arith.muli": "*",
        "arith.divsi": "/", "arith.divui": "/", "arith.remsi": "%",
        "arith.remui": "%", "arith.andi": "&", "arith.ori": "|",
        "arith.xori": "^", "arith.shli": "<<", "arith.shrsi": ">>",
        "arith.shrui": ">>"}

_CMP = {0: "==", 1: "!=", 2: "<", 3: "<=", 4: ">", 5: ">=", 6: "<",
        7: "<=", 8: ">", 9: ">="}


def _set_int(x, op, env, out, value):
  """Binds the op's integer result; long expressions become a variable."""
  r = op.results[0]
  if not is_int(r.type):
    env[r] = None
    return
  if value is not None and value.const is None and len(value.text) > 160:
    name = x.fresh("t")
    out.append(M.Assign(name, value))
    value = var(name)
  env[r] = value


@handles(*_BIN)
def _binary(x, op, env, out):
  a, b = (x.int_value(env, v) for v in op.operands)
  _set_int(x, op, env, out, binop(_BIN[op.operation.name], a, b))


@handles("arith.maxsi", "arith.maxui")
def _max(x, op, env, out):
  a, b = (x.int_value(env, v) for v in op.operands)
  _set_int(x, op, env, out, M.emax(a, b))


@handles("arith.minsi", "arith.minui")
def _min(x, op, env, out):
  a, b = (x.int_value(env, v) for v in op.operands)
  _set_int(x, op, env, out, M.emin(a, b))


@handles("arith.floordivsi")
def _floordiv(x, op, env, out):
  a, b = (x.int_value(env, v) for v in op.operands)
  neg = binop("-", const(0), binop("/", binop("-", binop("+", binop(
      "-", const(0), a), b), const(1)), b))
  _set_int(x, op, env, out, select(binop(">=", a, const(0)), binop("/", a, b), neg))


@handles("arith.ceildivsi", "arith.ceildivui")
def _ceildiv(x, op, env, out):
  a, b = (x.int_value(env, v) for v in op.operands)
  _set_int(x, op, env, out, binop("/", binop("-", binop("+", a, b), const(1)), b))


@handles("arith.cmpi")
def _cmpi(x, op, env, out):
  a, b = (x.int_value(env, v) for v in op.operands)
  pred = int(ir.IntegerAttr(op.attributes["predicate"]).value)
  _set_int(x, op, env, out, binop(_CMP[pred], a, b))


@handles("arith.select")
def _select(x, op, env, out):
  c, a, b = (x.int_value(env, v) for v in op.operands)
  _set_int(x, op, env, out, select(c, a, b))


@handles("arith.index_cast", "arith.index_castui", "arith.extsi",
         "arith.extui", "arith.trunci", "tpu.assume_multiple")
def _cast(x, op, env, out):
  _set_int(x, op, env, out, x.int_value(env, op.operands[0]))


@handles("arith.constant")
def _constant(x, op, env, out):
  r = op.results[0]
  if not is_int(r.type):
    env[r] = None
    return
  a = op.attributes["value"]
  if isinstance(a, ir.BoolAttr):
    env[r] = const(int(ir.BoolAttr(a).value))
  elif isinstance(a, ir.IntegerAttr):
    v = int(ir.IntegerAttr(a).value)
    if isinstance(r.type, ir.IntegerType) and ir.IntegerType(r.type).width == 1:
      v = v & 1
    env[r] = const(v)
  else:
    env[r] = None


@handles("tpu.device_id")
def _device_id(x, op, env, out):
  env[op.results[0]] = var("dev")


@handles("tpu.sem_read")
def _sem_read(x, op, env, out):
  env[op.results[0]] = None
