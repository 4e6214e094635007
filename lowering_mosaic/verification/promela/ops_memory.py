"""Kernel reads and writes of buffers: loads and stores of every flavour
become `Access` statements over the window they touch; an op with no rule
that takes a memref is modelled as writing all of it."""
from __future__ import annotations

from dsl.core.jax_internals import ir

from lowering_mosaic.verification.promela import model as M
from lowering_mosaic.verification.promela.model import const
from lowering_mosaic.verification.promela.mosaic_ir import (ModelError,
                                                            handles, is_memref,
                                                            location_of,
                                                            shape_of)
from lowering_mosaic.verification.promela.views import View


def _access(x, op, env, out, kind, base, indices, vshape, strides=None):
  v = x.view(env, base, op, "accessed")
  if isinstance(v.base, M.SemArray):
    raise ModelError(f"{op.operation.name} reads a semaphore as data")
  rank = len(v.dims) if not v.opaque else 0
  idx = [x.int_value(env, i) for i in indices]
  if v.opaque:
    w = v.window()
  else:
    vshape = list(vshape)
    sizes = [1] * (rank - len(vshape)) + vshape
    if strides:
      strides = [int(s) for s in strides]
      sizes = [(n - 1) * s + 1 for n, s in zip(sizes, strides)]
    sizes = [min(n, full) for n, full in zip(sizes, v.shape)]
    w = v.window(idx + [const(0)] * (rank - len(idx)), sizes)
  v.base.windows.append(w)
  _, nm = location_of(op)
  verb = "reads" if kind == "read" else "writes"
  out.append(M.Access(kind, w, x.info(op, f"{verb} {w.describe()}"
                                      + (f" ({nm})" if nm else ""))))


def _vshape(t):
  return list(shape_of(t)) if isinstance(t, ir.ShapedType) else []


@handles("vector.load", "tpu.load")
def _vector_load(x, op, env, out):
  _access(x, op, env, out, "read", op.operands[0], list(op.operands[1:]) if
          op.operation.name == "vector.load" else list(op.indices),
          _vshape(op.results[0].type))
  env[op.results[0]] = None


@handles("memref.load")
def _memref_load(x, op, env, out):
  _access(x, op, env, out, "read", op.operands[0], list(op.operands[1:]), [])
  env[op.results[0]] = None


@handles("vector.store")
def _vector_store(x, op, env, out):
  _access(x, op, env, out, "write", op.operands[1], list(op.operands[2:]),
          _vshape(op.operands[0].type))


@handles("memref.store")
def _memref_store(x, op, env, out):
  _access(x, op, env, out, "write", op.operands[1], list(op.operands[2:]), [])


@handles("tpu.store", "tpu.vector_store")
def _tpu_store(x, op, env, out):
  strides = None
  if "strides" in op.attributes:
    strides = list(ir.DenseI32ArrayAttr(op.attributes["strides"])) or None
  _access(x, op, env, out, "write", op.base, list(op.indices),
          _vshape(op.valueToStore.type), strides)


@handles("tpu.strided_load")
def _strided_load(x, op, env, out):
  strides = list(ir.DenseI32ArrayAttr(op.attributes["strides"]))
  _access(x, op, env, out, "read", op.base, list(op.indices),
          _vshape(op.results[0].type), strides)
  env[op.results[0]] = None


@handles("tpu.strided_store")
def _strided_store(x, op, env, out):
  strides = list(ir.DenseI32ArrayAttr(op.attributes["strides"]))
  _access(x, op, env, out, "write", op.base, list(op.indices),
          _vshape(op.valueToStore.type), strides)


@handles("vector.transfer_read")
def _transfer_read(x, op, env, out):
  _access(x, op, env, out, "read", op.operands[0], list(op.indices),
          _vshape(op.results[0].type))
  env[op.results[0]] = None


@handles("vector.transfer_write")
def _transfer_write(x, op, env, out):
  _access(x, op, env, out, "write", op.operands[1], list(op.indices),
          _vshape(op.operands[0].type))


def unknown_op(x, op, env, out):
  """Ops with no rule: data ops are invisible; memref operands are
  conservatively written; results are unknown values."""
  views = [env.get(v) for v in op.operands if isinstance(env.get(v), View)]
  if op.regions and len(op.regions) and any(len(r.blocks) for r in op.regions):
    raise ModelError(f"{op.operation.name} at {location_of(op)[0]}: an op "
                     "with regions the Promela export does not know")
  for v in views:
    if isinstance(v.base, M.SemArray):
      raise ModelError(f"{op.operation.name} at {location_of(op)[0]}: an op "
                       "on semaphores that the Promela export does not model")
    if isinstance(v.base, M.Buffer):
      w = v.window()
      v.base.windows.append(w)
      x.note(f"{op.operation.name} is modelled as writing its whole memref "
             "operand")
      out.append(M.Access("write", w, x.info(
          op, f"{op.operation.name} touches {w.describe()}")))
  for r in op.results:
    if is_memref(r.type) and views:
      v = views[0]
      env[r] = View(v.base, v.offsets, v.sizes, [], True)
    else:
      env[r] = None
