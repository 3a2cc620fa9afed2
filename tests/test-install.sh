#!/usr/bin/env bash
# bcachefilter: what `make install` installs works from where it lands.
#
# README.md ("Building by hand") documents `make install`; this installs
# the build tree into a temporary DESTDIR and uses only what landed there:
#
#  1. libbcachecore.so exports only names its installed headers declare
#     (checked with nm -D, where nm exists);
#  2. a small program built with `pkg-config --cflags --libs bcachecore`
#     (PKG_CONFIG_SYSROOT_DIR points pkg-config into the DESTDIR) probes a
#     blank file: BCF_DEVICE_BLANK;
#  3. nbdkit runs the installed filter by path in front of the memory
#     plugin, as README.md's "Using it" does, and a block written through
#     it reads back;
#  4. after nbdkit stops, the program probes the cache file the filter
#     made (opened read-only, checked): BCF_DEVICE_CACHE, and the
#     installed bcachefilter-show accepts it.
#
# Skips (77) if nbdkit, libnbd's python module (filter_requires),
# pkg-config or a C compiler is missing.

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

: "${CC:=cc}"
filter_requires
requires pkg-config --version
requires "$CC" --version
if [ -z "$abs_top_builddir" ] || [ ! -f "$abs_top_builddir/Makefile" ]; then
    echo "$0: test skipped because abs_top_builddir is not a build tree"
    exit 77
fi

tmpdir d
dest="$d/dest"

# The outer make's flags (its jobserver, -k, a DESTDIR) are not ours.
env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL -u DESTDIR \
    ${MAKE:-make} -s -C "$abs_top_builddir" install DESTDIR="$dest" \
    >"$d/install.log" 2>&1 || { cat "$d/install.log"; fail "make install failed"; }

pc="$(find "$dest" -name bcachecore.pc)"
so="$(find "$dest" -name nbdkit-bcachefilter-filter.so)"
lib="$(find "$dest" -name 'libbcachecore.so.*' -type f)"
show="$(find "$dest" -path '*/bin/bcachefilter-show')"
test -n "$pc" || fail "bcachecore.pc was not installed"
test -n "$so" || fail "the filter was not installed"
test -n "$lib" || fail "libbcachecore.so was not installed"
test -n "$show" || fail "bcachefilter-show was not installed"
test -n "$(find "$dest" -name bcachefilter-ctl.1)" || fail "man pages were not installed"
incdir="$(find "$dest" -type d -path '*/include/bcachefilter')"
test -f "$incdir/cache.h" || fail "the headers were not installed"
test ! -e "$incdir/cleanup.h" || fail "cleanup.h is internal but was installed"

# 1. No internal symbol leaks out of the shared library.
if nm --version >/dev/null 2>&1; then
    nm -D --defined-only "$lib" | awk 'NF == 3 { print $3 }' > "$d/syms"
    test -s "$d/syms" || fail "$lib exports nothing"
    while read -r sym; do
        grep -qw -- "$sym" "$incdir"/*.h ||
            fail "$lib exports $sym, which no installed header declares"
    done < "$d/syms"
fi

# 2. A program built against the installed library only.
cat > "$d/probe.c" <<'EOF'
#include <stdio.h>
#include <string.h>
#include <bcachefilter/probe.h>

/* probe FILE KIND-NUMBER [check]: exit 0 if the verdict is that kind. */
int
main (int argc, char *argv[])
{
  struct bcf_probe_opts opts = { .check = argc > 3 };
  struct bcf_device_verdict v;
  char err[256];
  int want = argv[2][0] - '0';

  if (bcf_device_probe (argv[1], &opts, &v, err, sizeof err) != 0) {
    fprintf (stderr, "probe: %s: %s\n", argv[1], err);
    return 2;
  }
  printf ("probe: %s: kind %d (%s)\n", argv[1], (int) v.kind, v.reason);
  return (int) v.kind == want ? 0 : 1;
}
EOF
export PKG_CONFIG_SYSROOT_DIR="$dest"
export PKG_CONFIG_PATH="$(dirname "$pc")${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
# shellcheck disable=SC2046
"$CC" -std=gnu11 -Wall -Werror -o "$d/probe" "$d/probe.c" \
      $(pkg-config --cflags --libs bcachecore)
export LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ldd "$d/probe" | grep -F "$(dirname "$lib")/libbcachecore.so" ||
    fail "probe is not linked with the installed libbcachecore"

blank=0 cache=2   # enum bcf_device_kind
truncate -s 32M "$d/blank.img"
"$d/probe" "$d/blank.img" $blank

# 3. The installed filter, by path, as in README.md's "Using it".
start_nbdkit -P "$d/nbdkit.pid" -U "$d/sock" --filter="$so" memory 64M \
    bcache="$d/cache.img" bcache-size=32M bcache-ctl="$d/ctl.sock"
nbdio "$d/sock" fill 8192 4096 0x5a
nbdio "$d/sock" flush
nbdio "$d/sock" check 8192 4096 0x5a
nbdio "$d/sock" check 0 4096 0x00
stop_nbdkit "$nbdkit_pid"

# 4. The installed library and tool read what the installed filter wrote.
"$d/probe" "$d/cache.img" $cache check
"$show" "$d/cache.img"
