"""Small user kernels for the benchmark CLI's --kernel tests."""
import jax


def scale(x, *, pl, block=64):
  """Written against a `pl` parameter: runs under dsl and Pallas."""
  spec = pl.BlockSpec((block, x.shape[1]), lambda i: (i, 0))

  def scale_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + 1.0
  return pl.pallas_call(scale_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(pl.cdiv(x.shape[0], block),), in_specs=[spec],
                        out_specs=spec)(x)


def scale_ref(x):
  return x * 2.0 + 1.0


def add(x, y, *, backend=None):
  """Imports dsl itself: runs on dsl's backends only."""
  import dsl as pl
  spec = pl.BlockSpec((64,), lambda i: (i,))

  def add_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]
  return pl.pallas_call(add_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype),
                        grid=(pl.cdiv(x.shape[0], 64),), in_specs=[spec, spec],
                        out_specs=spec, backend=backend)(x, y)


def lookup(table, labels, *, backend=None):
  """Reads `table` at integer labels (values from `--inputs ...:0..N`)."""
  import dsl as pl

  def lookup_kernel(t_ref, i_ref, o_ref):
    o_ref[...] = t_ref[...][i_ref[...]]
  return pl.pallas_call(lookup_kernel,
                        jax.ShapeDtypeStruct(labels.shape, table.dtype),
                        backend=backend)(table, labels)


def lookup_ref(table, labels):
  return table[labels]
