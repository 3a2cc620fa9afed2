#!/usr/bin/env bash
# bcachefilter: a cache the filter used, its proxy stopped cleanly (SIGTERM),
# is read by a real Linux kernel through a poisoned copy of the backing
# device, written by it, and served by the filter again (issue 16; the
# steps are in tests/kernel/filter-cache.sh).

source "$(dirname "$0")/filter-cache.sh"
filter_cache_case clean
