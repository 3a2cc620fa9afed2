#!/usr/bin/env python3
# bcachefilter tests: unaligned and out-of-range requests (used by
# test-filter-bad-input.sh).
#
#   requests.py SOCKET SHADOW
#
# SHADOW is a file holding the export's current content.  With libnbd's
# client-side checks off (strict mode 0), sends requests past the end of
# the export, at huge offsets, of length zero and with unknown flags:
# each must fail with an NBD error (never succeed, never kill the
# connection or the server).  Then byte-unaligned writes, zeroes, trims
# and reads around block and bucket boundaries, each checked against the
# shadow.  Finally the whole export is read back and compared; the shadow
# is updated.  Exits 1 on the first problem.
import random
import sys

import nbd

sock, shadow_path = sys.argv[1], sys.argv[2]
shadow = bytearray(open(shadow_path, "rb").read())
h = nbd.NBD()
h.set_strict_mode(0)
h.connect_unix(sock)
size = h.get_size()
assert size == len(shadow), (size, len(shadow))


def fail(msg):
    print("requests: FAIL: %s" % msg, file=sys.stderr)
    sys.exit(1)


def must_fail(what, fn):
    try:
        fn()
    except nbd.Error as e:
        print("requests: %s: refused: %s (errno %s)" % (what, e.string,
                                                         e.errno))
        if not h.aio_is_ready() and not h.aio_is_processing():
            fail("%s: the connection is gone (%s)" % (what, e.string))
        return
    fail("%s: succeeded, but it is out of range" % what)


big = 1 << 62
must_fail("read past the end", lambda: h.pread(8192, size - 4096))
must_fail("read starting at the end", lambda: h.pread(512, size))
must_fail("read at 2^62", lambda: h.pread(4096, big))
must_fail("read at 2^64-4096", lambda: h.pread(4096, (1 << 64) - 4096))
must_fail("write past the end", lambda: h.pwrite(b"x" * 8192, size - 4096))
must_fail("write at 2^62", lambda: h.pwrite(b"x" * 512, big))
must_fail("zero past the end", lambda: h.zero(8192, size - 4096))
must_fail("trim past the end", lambda: h.trim(8192, size - 4096))
must_fail("cache past the end", lambda: h.cache(8192, size - 4096))
must_fail("write 1 byte past the end", lambda: h.pwrite(b"x", size))
# The write past the end must not have changed the last block.
if h.pread(4096, size - 4096) != shadow[size - 4096:]:
    fail("a refused write past the end changed the last block")

# Zero-length requests: the server may accept or refuse them; nothing
# may change or break.
for what, fn in (("zero-length read", lambda: h.pread(0, 4096)),
                 ("zero-length write", lambda: h.pwrite(b"", 4096)),
                 ("zero-length trim", lambda: h.trim(0, 4096))):
    try:
        fn()
        print("requests: %s: accepted" % what)
    except nbd.Error as e:
        print("requests: %s: refused: %s" % (what, e.string))

rng = random.Random(42)


def check(off, n, what):
    got = h.pread(n, off)
    if got != shadow[off:off + n]:
        i = next(i for i in range(n) if got[i] != shadow[off + i])
        fail("%s: read %d+%d differs at offset %d: got %s, expected %s"
             % (what, off, n, off + i, got[i:i + 16].hex(),
                bytes(shadow[off + i:off + i + 16]).hex()))


# Unaligned, around 512-byte sectors, 4K blocks and 64K/512K buckets.
points = [1, 511, 512, 513, 4095, 4096, 4097, 65535, 65536, 65537,
          524287, 524288, 524289, size - 4097, size - 513, size - 1]
for p in points:
    for n in (1, 3, 511, 4097, 70000):
        off = max(0, p - n // 2)
        if off + n > size:
            off = size - n
        data = rng.randbytes(n)
        h.pwrite(data, off)
        shadow[off:off + n] = data
        check(max(0, off - 100), min(size, off + n + 100) - max(0, off - 100),
              "after an unaligned write")
for p in points[::2]:
    n = rng.randint(1, 9000)
    off = min(max(0, p - n // 3), size - n)
    h.zero(n, off)
    shadow[off:off + n] = bytes(n)
    check(max(0, off - 700), min(size, off + n + 700) - max(0, off - 700),
          "after an unaligned zero")
for p in points[1::2]:
    n = rng.randint(1, 9000)
    off = min(max(0, p - n // 3), size - n)
    # Read it first so it is cached, then trim it.
    check(off, n, "before a trim")
    h.trim(n, off)
    # nbdkit's memory plugin (the remote) reads trimmed bytes as zero.
    shadow[off:off + n] = bytes(n)
    check(max(0, off - 700), min(size, off + n + 700) - max(0, off - 700),
          "after an unaligned trim")
# Unaligned reads of everything cached so far.
for _ in range(200):
    n = rng.randint(1, 100000)
    off = rng.randrange(0, size - n + 1)
    check(off, n, "unaligned read")
off = 0
while off < size:
    n = min(1 << 20, size - off)
    check(off, n, "final read")
    off += n
h.shutdown()
open(shadow_path, "wb").write(shadow)
print("requests: OK")
