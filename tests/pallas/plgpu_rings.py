"""A ring of SMEM slots between two warpgroups, the plgpu kernel the
interpret, Pallas-comparison and SPIN tests share: warpgroup 1 streams
blocks of x into the slots, warpgroup 0 computes 2x + 1 on each and stores
it back (mbarriers both ways)."""
from __future__ import annotations

import jax
from jax import lax


def producer_consumer(pl, plgpu, steps=4, slots=2, block=(64, 128), *,
                      wait_loaded=True, loaded_arrivals=1):
  """The ring kernel for `pl`/`plgpu` (dsl's or Pallas's), as a function of
  x. `wait_loaded=False` drops the consumer's wait for the copy (a race);
  `loaded_arrivals=2` expects two arrivals where the copy makes one."""
  def body(x_ref, o_ref, ring, out, loaded, consumed):
    wg = lax.axis_index("wg")

    @pl.when(wg == 1)
    def _producer():
      @pl.loop(0, steps)
      def _(i):
        slot = lax.rem(i, slots)

        @pl.when(i >= slots)
        def _():
          plgpu.barrier_wait(consumed.at[slot])
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(i * block[0], block[0])],
                                ring.at[slot], loaded.at[slot])

    @pl.when(wg == 0)
    def _consumer():
      @pl.loop(0, steps)
      def _(i):
        slot = lax.rem(i, slots)
        if wait_loaded:
          plgpu.barrier_wait(loaded.at[slot])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out[...] = ring[slot] * 2 + 1                    # the read
        plgpu.barrier_arrive(consumed.at[slot])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out, o_ref.at[pl.ds(i * block[0], block[0])])
      plgpu.wait_smem_to_gmem(0)

  def call(x):
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
        num_threads=2, thread_name="wg",
        scratch_types=(plgpu.SMEM((slots, *block), x.dtype),
                       plgpu.SMEM(block, x.dtype),
                       plgpu.Barrier(num_arrivals=loaded_arrivals,
                                     num_barriers=slots),
                       plgpu.Barrier(num_barriers=slots)))(x)
  return call
