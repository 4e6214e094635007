"""The proof that a kernel writes an aliased output block whole at each
first visit (dsl/transforms/first_visit_writes.py). Where it holds, the
Mosaic lowering keeps no copy-in of the aliased input (its module is
Pallas's); where a first visit is missed, the copy-in stays and every
backend gives the reference, which starts the block from its input.

The kernels follow megablox's gmm with `existing_out`: a grid (n, g, k),
an output block (t[g], n) for a scalar-prefetch array t of tiles, and the
block written from the existing output under a condition before the
kernel accumulates into it.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dsl as pl
from dsl import tpu as pltpu
from dsl.transforms import grid_terms as T
from dsl.transforms.aliased_reads import reading_aliased_outputs
from dsl.transforms.first_visit_writes import written_at_first_visits
from tests.pallas import mosaic_golden as golden

F32 = jnp.float32
TILES = np.array([0, 0, 1, 2, 2], np.int32)    # t: the row tile of step g
OTHER = np.array([0, 1, 1, 1, 2], np.int32)    # u: changes where t does not
N, K, BM, BN = 2, 2, 8, 128
G = len(TILES)


def _prev(g):
  return jnp.where(g > 0, g - 1, 0)


# name -> the condition under which the kernel writes the block, at grid
# ids (n, g, k), and whether it covers every first visit in grid order
CONDITIONS = {
    "megablox": (lambda t, u, n, g, k: (k == 0) & (
        (g == 0) | (t[g] != t[_prev(g)])), True),
    "max index": (lambda t, u, n, g, k: (k == 0) & (
        (g == 0) | (t[jnp.maximum(g - 1, 0)] != t[g])), True),
    "only g == 0": (lambda t, u, n, g, k: (k == 0) & (g == 0), False),
    "only the tile change": (lambda t, u, n, g, k: (k == 0) & (
        t[g] != t[_prev(g)]), False),
    "another prefetch array": (lambda t, u, n, g, k: (k == 0) & (
        (g == 0) | (u[g] != u[_prev(g)])), False),
    "the tile two steps back": (lambda t, u, n, g, k: (k == 0) & (
        (g == 0) | (t[g] != t[jnp.maximum(g - 2, 0)])), False),
    "for g descending": (lambda t, u, n, g, k: (k == 0) & (
        (g == G - 1) | (t[g] != t[jnp.minimum(g + 1, G - 1)])), False),
    "k at its last step": (lambda t, u, n, g, k: (k == K - 1) & (
        (g == 0) | (t[g] != t[_prev(g)])), False),
}


def _gmm_like(pl, pltpu, cond, order="ngk", read_first=False,
              semantics=("arbitrary",) * 3, **call):
  """A pallas_call of `pl` (dsl or Pallas) on (t, u, x, existing); `call`:
  the backend (dsl) or interpret mode (Pallas)."""
  def kernel(t_ref, u_ref, x_ref, e_ref, o_ref):
    ids = {d: pl.program_id(i) for i, d in enumerate(order)}
    if read_first:
      o_ref[...] += x_ref[...]

    @pl.when(cond(t_ref, u_ref, ids["n"], ids["g"], ids["k"]))
    def _():
      o_ref[...] = e_ref[...]
    if not read_first:
      o_ref[...] += x_ref[...]

  def by_name(f):
    return lambda *a: f(**dict(zip(order, a[:3])), t=a[3])
  sizes = {"n": N, "g": len(TILES), "k": K}
  out_spec = pl.BlockSpec((BM, BN), by_name(lambda n, g, k, t: (t[g], n)))
  x_spec = pl.BlockSpec((None, None, BM, BN), by_name(
      lambda n, g, k, t: (g, k, 0, n)))
  return pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((3 * BM, N * BN), F32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=tuple(sizes[d] for d in order),
          in_specs=[x_spec, out_spec], out_specs=out_spec),
      input_output_aliases={3: 0},
      compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
      **call)


def _args():
  x = jax.random.normal(jax.random.key(0), (len(TILES), K, BM, N * BN), F32)
  e = jax.random.normal(jax.random.key(1), (3 * BM, N * BN), F32)
  return jnp.asarray(TILES), jnp.asarray(OTHER), x, e


def _reference(t, u, x, e, cond, order="ngk"):
  """The kernel run step by step in grid order on numpy: the output starts
  as the existing output (its aliased input), each step's block is the
  output's memory there, written back after the step."""
  t, u, x = np.asarray(t), np.asarray(u), np.asarray(x)
  out = np.asarray(e).copy()
  sizes = {"n": N, "g": len(TILES), "k": K}
  for step in np.ndindex(*(sizes[d] for d in order)):
    ids = dict(zip(order, step))
    n, g, k = ids["n"], ids["g"], ids["k"]
    rows, cols = slice(t[g] * BM, (t[g] + 1) * BM), slice(n * BN, (n + 1) * BN)
    if cond(t, u, n, g, k):
      out[rows, cols] = np.asarray(e)[rows, cols]
    out[rows, cols] += x[g, k, :, cols]
  return out


def _spec(f, args):
  return jax.make_jaxpr(f)(*args).jaxpr.eqns[0].params["spec"]


def _module(f, args) -> str:
  (call,) = golden.lower_tpu(f, *args)
  return call.module


def _check_results(args, **kw):
  want = _reference(*args, kw["cond"], kw.get("order", "ngk"))
  for backend in ("interpret", "mosaic_interpret"):
    got = _gmm_like(pl, pltpu, backend=backend, **kw)(*args)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5,
                               err_msg=backend)


@pytest.mark.parametrize("name", list(CONDITIONS))
def test_condition_proved_only_where_it_covers_every_first_visit(name):
  cond, covers = CONDITIONS[name]
  args = _args()
  f = _gmm_like(pl, pltpu, cond)
  spec = _spec(f, args)
  assert written_at_first_visits(spec, 0) is covers
  assert (reading_aliased_outputs(spec) is None) is covers
  # windows: x, existing and the output (and existing once more to copy in)
  assert _module(f, args).count("transform_indices") == (3 if covers else 4)
  _check_results(args, cond=cond)


def test_proved_kernel_lowers_to_pallas_module_and_agrees_with_pallas():
  jpl = pytest.importorskip("jax.experimental.pallas")
  jpltpu = pytest.importorskip("jax.experimental.pallas.tpu")
  cond, _ = CONDITIONS["megablox"]
  args = _args()
  ours = _module(_gmm_like(pl, pltpu, cond), args)
  theirs = _module(_gmm_like(jpl, jpltpu, cond), args)
  assert ours == theirs, golden.diff(ours, theirs)
  got = _gmm_like(pl, pltpu, cond, backend="mosaic_interpret")(*args)
  pallas = _gmm_like(jpl, jpltpu, cond,
                     interpret=jpltpu.InterpretParams())(*args)
  np.testing.assert_allclose(got, pallas, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got, _reference(*args, cond), rtol=1e-5, atol=1e-5)


def test_a_condition_for_another_grid_order_is_not_proved():
  """With g outer, the block (t[g], n) changes at every step of n: the
  tile-change condition misses the first visits at n > 0. (The grid leaves
  and comes back to blocks, which a TPU refuses at run time.)"""
  cond, _ = CONDITIONS["megablox"]
  args = _args()
  f = _gmm_like(pl, pltpu, cond, order="gnk")
  assert not written_at_first_visits(_spec(f, args), 0)
  assert _module(f, args).count("transform_indices") == 4


def test_a_read_before_the_write_is_not_proved():
  cond, _ = CONDITIONS["megablox"]
  args = _args()
  spec = _spec(_gmm_like(pl, pltpu, cond, read_first=True), args)
  assert not written_at_first_visits(spec, 0)
  assert reading_aliased_outputs(spec) is not None


def test_a_dim_split_over_cores_needs_no_change_of_block():
  """A "parallel" dim may be split over cores: each part starts a run of
  visits wherever it starts, so the tile-change condition no longer covers
  a step of g; the dims before it may be split freely."""
  cond, _ = CONDITIONS["megablox"]
  args = _args()
  split_g = _spec(_gmm_like(pl, pltpu, cond, semantics=(
      "arbitrary", "parallel", "arbitrary")), args)
  split_n = _spec(_gmm_like(pl, pltpu, cond, semantics=(
      "parallel", "arbitrary", "arbitrary")), args)
  assert not written_at_first_visits(split_g, 0)
  assert written_at_first_visits(split_n, 0)


def test_accumulator_started_from_the_existing_output_is_proved():
  """The accumulator pattern on an aliased output with static index maps:
  written whole at k == 0, accumulated at every step."""
  def kernel(x_ref, e_ref, o_ref):
    @pl.when(pl.program_id(1) == 0)
    def _():
      o_ref[...] = e_ref[...] * 2

    o_ref[...] += x_ref[...]
  x = jax.random.normal(jax.random.key(2), (2 * BM, 3 * BN), F32)
  e = jax.random.normal(jax.random.key(3), (2 * BM, BN), F32)
  spec = pl.BlockSpec((BM, BN), lambda i, k: (i, 0))
  f = lambda backend: pl.pallas_call(
      kernel, jax.ShapeDtypeStruct(e.shape, F32), grid=(2, 3),
      in_specs=[pl.BlockSpec((BM, BN), lambda i, k: (i, k)), spec],
      out_specs=spec, input_output_aliases={1: 0}, backend=backend)
  assert written_at_first_visits(_spec(f(None), (x, e)), 0)
  want = 2 * e + x.reshape(2 * BM, 3, BN).sum(1)
  for backend in ("interpret", "mosaic_interpret"):
    np.testing.assert_allclose(f(backend)(x, e), want, rtol=1e-5,
                               atol=1e-5, err_msg=backend)


def _lin(**atoms):
  terms = {T.Atom("id", int(k[1:])): v for k, v in atoms.items() if k != "c"}
  return T.Lin.from_dict(terms, atoms.get("c", 0))


def test_terms_normalize_and_decide():
  g, k = _lin(i1=1), _lin(i2=1)
  read = lambda i: T.Lin.of(T.Atom("read", (0, (i,), None)))
  bounds = {T.Atom("id", 1): (0, 4), T.Atom("id", 2): (0, 1)}
  # a != b is b != a; 2g - 2 == 0 is g - 1 == 0; g < 1 is not g >= 1
  assert T.cmp("ne", read(g) - read(g - T.const(1))) == T.cmp(
      "ne", read(g - T.const(1)) - read(g))
  assert T.cmp("eq", g.scaled(2) - T.const(2)) == T.cmp("eq", g - T.const(1))
  assert T.negate(T.cmp("lt", g - T.const(1))) == T.cmp("ge", g - T.const(1))
  # where(g > 0, g - 1, 0) is g - 1 once g >= 1
  prev = T.select(T.cmp("gt", g), [T.const(0), g - T.const(1)])
  changed = T.cmp("ne", read(g) - read(g - T.const(1)))
  goal = T.conj([T.cmp("eq", k), T.disj([
      T.cmp("eq", g), T.cmp("ne", read(g) - read(prev))])])
  assert T.implies([T.cmp("eq", k), T.cmp("ge", g - T.const(1)), changed],
                   goal, bounds)
  # without the change of tile, or at k == 1, it does not follow
  assert not T.implies([T.cmp("eq", k), T.cmp("ge", g - T.const(1))],
                       goal, bounds)
  assert not T.implies([T.cmp("ge", k - T.const(1)), changed], goal, bounds)
  # contradicting hypotheses prove anything; an id past its grid size
  assert T.implies([T.cmp("eq", g), T.cmp("ge", g - T.const(1))], False,
                   bounds)
  assert T.implies([T.cmp("ge", k - T.const(2))], False, bounds)


# A grammar of conditions and index maps over a grid (i, j, k) and a
# prefetch array t, for a property check of the proof against brute force.
_GRID = (2, 3, 2)
_ATOMS = [
    lambda t, i, j, k: i == 0, lambda t, i, j, k: j == 0,
    lambda t, i, j, k: k == 0, lambda t, i, j, k: k == 1,
    lambda t, i, j, k: j > 0,
    lambda t, i, j, k: t[j] != t[jnp.maximum(j - 1, 0)],
    lambda t, i, j, k: t[j] != t[jnp.where(j > 0, j - 1, 0)],
    lambda t, i, j, k: t[j] == t[jnp.minimum(j + 1, 2)],
    lambda t, i, j, k: t[i] != t[0],
]
_INDEX_MAPS = [
    lambda i, j, k, t: (t[j], i), lambda i, j, k, t: (i, 0),
    lambda i, j, k, t: (j, i), lambda i, j, k, t: (0, 0),
    lambda i, j, k, t: (t[j], 0), lambda i, j, k, t: (i, j + k),
]


def _random_condition(rng):
  def pick(depth):
    if depth == 0 or rng.random() < 0.4:
      atom = _ATOMS[rng.integers(len(_ATOMS))]
      return ((lambda *a: jnp.logical_not(atom(*a))) if rng.random() < 0.2
              else atom)
    a, b = pick(depth - 1), pick(depth - 1)
    if rng.random() < 0.5:
      return lambda *x: a(*x) & b(*x)
    return lambda *x: a(*x) | b(*x)
  return pick(3)


def _proved(cond, index_map):
  def kernel(t_ref, e_ref, o_ref):
    ids = [pl.program_id(d) for d in range(3)]

    @pl.when(cond(t_ref, *ids))
    def _():
      o_ref[...] = e_ref[...]
    o_ref[...] += 1.0
  spec = pl.BlockSpec((BM, BN), index_map)
  f = pl.pallas_call(
      kernel, jax.ShapeDtypeStruct((3 * BM, 6 * BN), F32),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=_GRID, in_specs=[spec],
          out_specs=spec),
      input_output_aliases={1: 0})
  e = jnp.zeros((3 * BM, 6 * BN), F32)
  return written_at_first_visits(_spec(f, (jnp.zeros(3, jnp.int32), e)), 0)


def _holds(cond, index_map, t) -> bool:
  """Whether `cond` holds at every first visit of the block, row-major."""
  before = None
  for step in np.ndindex(*_GRID):
    block = tuple(int(b) for b in index_map(*step, t))
    if block != before and not bool(cond(t, *step)):
      return False
    before = block
  return True


def test_proofs_agree_with_brute_force_over_prefetch_values():
  """Random conditions and index maps: what is proved holds at every first
  visit for every prefetch array of values 0..2 (never a false proof), and
  the proof is not vacuous."""
  rng = np.random.default_rng(0)
  tables = [np.array(t) for t in np.ndindex(3, 3, 3)]
  proved = holds = 0
  for _ in range(150):
    cond = _random_condition(rng)
    index_map = _INDEX_MAPS[rng.integers(len(_INDEX_MAPS))]
    always = all(_holds(cond, index_map, t) for t in tables)
    if _proved(cond, index_map):
      proved += 1
      assert always
    holds += always
  assert proved >= 5 and holds >= proved
