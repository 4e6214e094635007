// The inline macros every model shares, read by builder.py. Lines that
// start with `//` are for this file only: they do not reach the model.
// `$NAME` is the code errors.NAME; the lines between `//@if OPTION` and
// `//@endif` are kept when builder.Options.OPTION is true.
/* R, M: a region and cells the kernel (or a DMA) reads; no DMA may be
   writing them */
inline chk_read(R, M, S, CODE) {
  h_k = 0;
  do
  :: h_k < NSLOTS ->
     if
     :: dma_phase[h_k] != 0 && dma_dreg[h_k] == R && (dma_dmask[h_k] & (M)) ->
        printf("@@E %d %d %d %d %d %d\n", CODE, S, dma_stmt[h_k], dma_inst[h_k], R, h_k);
        assert(no_race)
     :: else -> skip
     fi;
     h_k++
  :: else -> break
  od;
  h_k = 0  /* (a d_step must not end in a loop) */
}

/* ... that it writes: no DMA may be reading or writing them */
// A DMA reading the cells reports CODE + 1: each write check's code is
// followed by its read twin (errors.WRITE_CHECKS).
inline chk_write(R, M, S, CODE) {
  chk_read(R, M, S, CODE);
  h_k = 0;
  do
  :: h_k < NSLOTS ->
     if
     :: dma_phase[h_k] != 0 && dma_sreg[h_k] == R && (dma_smask[h_k] & (M)) ->
        printf("@@E %d %d %d %d %d %d\n", CODE + 1, S, dma_stmt[h_k], dma_inst[h_k], R, h_k);
        assert(no_race)
     :: else -> skip
     fi;
     h_k++
  :: else -> break
  od;
  h_k = 0  /* (a d_step must not end in a loop) */
}

/* the engine reads a remote DMA's source: the send semaphore goes up */
inline dma_read(K) {
  printf("@@D read %d %d %d\n", dma_stmt[K], dma_inst[K], K);
  if
  :: dma_ssem[K] > 0 -> sem[dma_ssem[K] - 1] = sem[dma_ssem[K] - 1] + dma_amt[K]
  :: else -> skip
  fi;
  dma_sreg[K] = 0; dma_smask[K] = 0; dma_ssem[K] = 0; dma_phase[K] = 2
}

/* a DMA lands: the receive semaphore goes up and the slot is free */
inline dma_land(K) {
  printf("@@D land %d %d %d\n", dma_stmt[K], dma_inst[K], K);
  if
  :: dma_remote[K] && gone[dma_fin[K]] ->
     printf("@@E $LAND_AFTER_EXIT %d %d %d %d\n", dma_stmt[K], dma_inst[K], dma_fin[K], K);
     assert(no_race)
//@if check_entry
  :: dma_remote[K] && !entered[dma_fin[K]] ->
     printf("@@E $LAND_BEFORE_ENTRY %d %d %d %d\n", dma_stmt[K], dma_inst[K], dma_fin[K], K);
     assert(no_race)
//@endif
  :: else -> skip
  fi;
  sem[dma_dsem[K] - 1] = sem[dma_dsem[K] - 1] + dma_amt[K];
  if
  :: dma_ssem[K] > 0 -> sem[dma_ssem[K] - 1] = sem[dma_ssem[K] - 1] + dma_amt[K]
  :: else -> skip
  fi;
  dma_phase[K] = 0; dma_remote[K] = 0; dma_inst[K] = 0; dma_stmt[K] = 0;
  dma_sreg[K] = 0; dma_smask[K] = 0; dma_dreg[K] = 0; dma_dmask[K] = 0;
  dma_ssem[K] = 0; dma_dsem[K] = 0; dma_amt[K] = 0; dma_fin[K] = 0
}

