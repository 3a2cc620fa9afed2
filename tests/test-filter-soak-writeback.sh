#!/usr/bin/env bash
# bcachefilter: the soak of the real nbdkit process (test-filter-soak.sh)
# in writeback mode only: 30 kill -9 of a writeback proxy under 4
# libnbd connections of random writes, reads, trims, zeroes, NBD_CMD_CACHE
# and flushes, each restart checked against the model (every write
# acknowledged before the last completed flush is there, nothing older
# than it anywhere; the export is not the truth while data is dirty),
# fsck and --verify of every killed cache; then the dirty data drained
# and the export compared with the model (issue 14: "kill -9 ... 30
# cycles in make check").  Longer runs: bench/soak.sh.
# Bugs it found, each now with a unit test of its own: writes over dirty
# data that dropped it (stop 20), cutoffs that let dirty data fill the
# cache, and an open that found no room in the journal after a crash in
# the middle of a checkpoint (core/super.c, TEST_SEED=40342).
export SOAK_MODES=writeback
export SOAK_MIN_ROUNDS="${SOAK_MIN_ROUNDS:-30}"
export BCACHEFILTER_SOAK_SECONDS="${BCACHEFILTER_SOAK_SECONDS:-0}"
# A 16 MiB export (twice the 8 MiB cache) halves the check after each
# restart, which dominates a round, and keeps 30 rounds within a few
# minutes of make check.
export SOAK_EXPORT_SIZE="${SOAK_EXPORT_SIZE:-16M}"
exec bash "$(dirname "$0")/test-filter-soak.sh"
