#!/usr/bin/env bash
# bcachefilter: the filter's version.
#
#  nbdkit --version names the filter's own version, --dump-plugin gives
#  bcachefilter_version=, --help shows it in the longname.

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

filter_requires

tmpdir d
version="$(bcachefilter-show --version | awk '{ print $2 }')"
test -n "$version"

nbdkit --filter="$BCACHEFILTER_SO" memory 1M --version > "$d/version"
cat "$d/version"
grep -qx "nbdkit-bcachefilter-filter $version" "$d/version" ||
    fail "nbdkit --version does not show the filter's version $version"
nbdkit --filter="$BCACHEFILTER_SO" memory --dump-plugin > "$d/dump"
grep -qx "bcachefilter_version=$version" "$d/dump" ||
    fail "nbdkit --dump-plugin does not show bcachefilter_version=$version"
nbdkit --filter="$BCACHEFILTER_SO" memory --help > "$d/help"
grep -qF "filter: bcachefilter (bcachefilter $version: " "$d/help" ||
    fail "nbdkit --help does not show the filter's version"
