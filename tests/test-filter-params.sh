#!/usr/bin/env bash
# bcachefilter: nbdkit --filter=bcachefilter null --help lists every
# bcache-* parameter (issue 4: "listed by nbdkit --filter=bcachefilter
# null --help"), each with a description.

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

requires nbdkit --version
if [ -z "$BCACHEFILTER_SO" ] || [ ! -f "$BCACHEFILTER_SO" ]; then
    echo "$0: test skipped because the filter is not built"
    exit 77
fi

tmpdir d
nbdkit --filter="$BCACHEFILTER_SO" null --help > "$d/help" 2>&1
cat "$d/help"

for p in bcache bcache-size bcache-format bcache-mode bcache-bucket-size \
         bcache-block-size bcache-sequential-cutoff bcache-backing-uuid \
         bcache-backing-device bcache-io bcache-direct bcache-ctl \
         bcache-node-cache bcache-journal-delay bcache-write-intent \
         bcache-error-limit bcache-error-halflife \
         bcache-sequential-bypass bcache-congested-read-threshold-us \
         bcache-congested-write-threshold-us bcache-sync-writes \
         bcache-test-disable-tracker; do
    # "NAME=VALUE   description" at the start of a line.
    grep -Eq "^$p=[^ ]+ +[^ ]" "$d/help" ||
        fail "--help does not list $p= with a description"
done
# The values the filter accepts are named where there is a choice.
grep -Eq '^bcache-mode=[^ ]*writethrough' "$d/help" ||
    fail "--help does not name the bcache-mode values"
grep -Eq '^bcache-format=[^ ]*auto' "$d/help" ||
    fail "--help does not name the bcache-format values"
# The filter's own line and the plugin's still follow.
grep -q '^filter: bcachefilter' "$d/help" || fail "no 'filter: bcachefilter' line"
grep -q '^plugin: null' "$d/help" || fail "the plugin's help is missing"
