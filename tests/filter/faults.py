#!/usr/bin/env python3
# bcachefilter tests: one session of errors at the export
# (test-filter-faults.sh).
#
#   faults.py --sock PROXY --remote REMOTE --trigger FILE --state FILE
#             --mode MODE [--init] [--verify-only] [--seed N]
#             [--seconds S] [--probe BYTES] [--block BYTES]
#
# REMOTE is the export (nbdkit's memory plugin behind nbdkit's error
# filter, which injects EIO while FILE exists); the proxy reads and
# writes it through the same filter.  The model (tests/filter/shadow.py)
# is kept in --state between sessions; --init fills the remote with
# random data and starts it.  --block is the cache's block size (a read
# caches the whole blocks it touches).
#
# The export is split in two: the workload region, and the probe region
# (the last --probe bytes, default 4M), which only ever sees reads
# through the proxy.  A session:
#
#  1. Without errors: the proxy's view must be the model's and equal the
#     export.  The probe region is trimmed through the proxy (which
#     drops it from the cache) and given fresh random data A directly on
#     the remote: nothing of it is cached now.
#  2. Errors on (FILE created): for S seconds, 4 connections of random
#     reads, writes, zeroes, trims, NBD_CMD_CACHE and flushes on the
#     workload region; then (so that what they cache is not evicted by
#     the workload) reads of the probe region that read each block once
#     (Probe).  Every request is bounded (a request unanswered for 30 s
#     is a hang, and fails the test); every error reply must be EIO, the
#     connections must survive, every successful read must return the
#     right data (a byte a failed write covered may read old or new), and
#     reads, writes and probe reads must each have failed at least once
#     (else nothing was tested).
#  3. Errors off (FILE removed).  Failed reads left nothing in the
#     cache: the probe region is overwritten on the remote directly with
#     other random data B, and read through the proxy.  A block that
#     still reads A is served from the cache: that is right only for a
#     block that a successful read read (and never in mode none, which
#     caches nothing new); a block that reads neither A nor B is garbage.
#     Some block must have been read by a failed read only, and in the
#     modes that cache reads some block must be cached, or the check
#     could not fail.  Then the probe region is trimmed through the proxy.
#  4. The proxy's view is the model's (a failed write's bytes old or new)
#     and equals the export everywhere; it becomes the model.
#
# --verify-only: step 4 alone, without errors (after a restart).
# Exit status 0, or 1 with the reason on stderr.
import argparse
import errno
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shadow as sh  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--sock", required=True)
p.add_argument("--remote", required=True)
p.add_argument("--trigger", required=True)
p.add_argument("--state", required=True)
p.add_argument("--mode", required=True)
p.add_argument("--init", action="store_true")
p.add_argument("--verify-only", action="store_true")
p.add_argument("--seed", type=int, default=1)
p.add_argument("--seconds", type=float, default=5)
p.add_argument("--probe", type=int, default=4 << 20)
p.add_argument("--block", type=int, default=4096)
args = p.parse_args()
label = "faults %s" % args.mode
durability = "flushed" if args.mode == "writeback" else "acked"


def say(msg):
    print("faults[%s]: %s" % (label, msg), flush=True)


def fail(msg):
    print("faults[%s]: FAIL: %s" % (label, msg), file=sys.stderr, flush=True)
    sys.exit(1)


def errors(on):
    if on:
        open(args.trigger, "w").close()
    elif os.path.exists(args.trigger):
        os.unlink(args.trigger)


def trim(off, n):
    """Trim [off, off+n) through the proxy (errors off)."""
    c = sh.Client(args.sock, "trim", 30)
    for o in range(off, off + n, 1 << 20):
        c.submit("trim", o, min(1 << 20, off + n - o))
        for op, st, err, msg in c.drain():
            if st != "ok":
                fail("trimming %d+%d through the proxy: %s"
                     % (op.off, op.n, msg))
    c.close()


def verify(s, when):
    view, msg = sh.check_export(s, args.sock, args.remote, crash=False)
    if msg:
        fail("%s: %s" % (when, msg))
    if view is None:
        fail("%s: the proxy closed the connection" % when)
    s.resolve(view)
    s.save(args.state)
    say("%s: the proxy's view equals the export and the model" % when)


def blocks(ranges, lo, hi):
    """The blocks of [lo, hi) that the (off, n) ranges touch."""
    bs = args.block
    out = bytearray((hi - lo) // bs)
    for off, n in ranges:
        a, b = max(off, lo), min(off + n, hi)
        if a < b:
            for i in range((a - lo) // bs, (b - 1 - lo) // bs + 1):
                out[i] = 1
    return out


def probe_check(lo, hi, a, ok_reads, failed_reads):
    """Step 3: after the remote was poisoned, which blocks of the probe
    region are still served from the cache, and were they allowed to
    be?"""
    b = random.Random(args.seed * 31 + 7).randbytes(hi - lo)
    sh.write_all(args.remote, lo, b, "poison")
    c = sh.Client(args.sock, "probe", 30)
    view = bytearray()
    for o in range(lo, hi, 1 << 20):
        c.submit("read", o, min(1 << 20, hi - o))
        for op, st, err, msg in c.drain():
            if st != "ok":
                fail("reading the probe region through the proxy at %d: %s"
                     % (op.off, msg))
            view += op.buf.to_bytearray()
    c.close()
    ok = blocks(ok_reads, lo, hi)
    bad = blocks(failed_reads, lo, hi)
    bs = args.block
    cached = legit = 0
    for i in range(len(ok)):
        v = view[i * bs:(i + 1) * bs]
        if v == b[i * bs:(i + 1) * bs]:
            continue
        off = lo + i * bs
        if v != a[i * bs:(i + 1) * bs]:
            fail("probe block at %d reads neither the data the export had "
                 "(A) nor what it has now (B): garbage was cached (%s)"
                 % (off, "a read of it failed" if bad[i] else
                    "no read of it failed"))
        cached += 1
        if ok[i]:
            legit += 1
            continue
        which = [(o, n) for o, n in failed_reads if o < off + bs and
                 off < o + n]
        fail("probe block at %d is served from the cache, but no read "
             "of it succeeded: %s" % (off, "the failed read(s) %s left it "
                                      "cached" % which if which else
                                      "nothing read it at all"))
    say("probe region: %d blocks cached, all read by successful reads; "
        "%d blocks read by failed reads, %d by successful ones"
        % (cached, sum(bad), sum(ok)))
    if not sum(bad):
        fail("no block of the probe region was read by a failed read only:"
             " the check tested nothing")
    if args.mode == "none" and cached:
        fail("mode none cached %d blocks of the probe region: it caches "
             "nothing new" % cached)
    if args.mode != "none" and not cached:
        fail("no successful read of the probe region was cached: the check "
             "cannot tell a cached block from an uncached one")


class Probe:
    """Reads of the probe region [lo, hi) through the proxy, each block
    read once: the region is cut into chunks of 1 to 8 blocks, read in a
    random order from 2 connections (4 requests in flight each), each
    read a byte-unaligned part of its chunk that touches all its blocks.
    Successful reads must return the model's data; failures must be EIO;
    every request is bounded."""

    def __init__(self, s, lo, hi, seed, conns=2, qd=4):
        self.s, self.qd = s, qd
        rng = random.Random(seed)
        bs = args.block
        chunks = []
        o = lo
        while o < hi:
            n = min(rng.randint(1, 4) * bs, hi - o)
            head = rng.randrange(0, bs // 2)
            tail = rng.randrange(0, bs // 2)
            chunks.append((o + head, n - head - tail))
            o += n
        rng.shuffle(chunks)
        self.lists = [chunks[i::conns] for i in range(conns)]
        self.ok_reads, self.failed_reads, self.problems = [], [], []
        self.lock = threading.Lock()

    def run(self):
        ts = [threading.Thread(target=self._conn, args=(i,))
              for i in range(len(self.lists))]
        for t in ts:
            t.start()
        return ts

    def _conn(self, i):
        todo = list(self.lists[i])
        try:
            c = sh.Client(args.sock, "probe c%d" % i, 30)
            while todo or c.ops:
                while todo and len(c.ops) < self.qd:
                    o, n = todo.pop()
                    if c.submit("read", o, n) is None:
                        break
                for op, st, err, msg in c.reap():
                    self._done(op, st, err, msg)
                if c.gone:
                    raise RuntimeError("the connection died")
            c.close()
        except (sh.Hang, RuntimeError) as e:
            with self.lock:
                self.problems.append("probe c%d: %s" % (i, e))

    def _done(self, op, st, err, msg):
        with self.lock:
            if st == "ok":
                self.ok_reads.append((op.off, op.n))
                m = self.s.check(op.buf.to_bytearray(), op.off)
                if m:
                    self.problems.append("probe: %s: wrong data: %s"
                                         % (op.describe(), m))
            elif err == errno.EIO:
                self.failed_reads.append((op.off, op.n))
            else:
                self.problems.append("probe: %s: %s (%s, not EIO)"
                                     % (op.describe(), msg,
                                        sh.errname(err)))


def session(s):
    size = s.size
    lo, hi = size - args.probe, size
    verify(s, "before the errors")
    trim(lo, hi - lo)
    a = random.Random(args.seed * 31).randbytes(hi - lo)
    sh.write_all(args.remote, lo, a, "probe data")
    s.set(lo, a)

    errors(True)
    w = sh.Workload(s, args.sock, conns=4, qd=4, seed=args.seed,
                    seconds=args.seconds, hi=lo, errors=True,
                    label=label, timeout=30)
    r = Probe(s, lo, hi, args.seed * 31 + 3)
    w.start()
    w.join()
    # The probe last, so that what it cached is still in the cache.
    for t in r.run():
        t.join()
    errors(False)
    say("%s: %s in %.1f s" % (w.label, w.summary(), w.elapsed))
    say("probe: %d reads, %d failed" % (len(r.ok_reads) + len(r.failed_reads),
                                        len(r.failed_reads)))
    if w.gone:
        w.problems.append("a connection died under errors at the export "
                          "(the proxy must answer EIO, not hang up)")
    if w.problems or r.problems:
        for m in w.problems + r.problems:
            print("faults[%s]: FAIL: %s" % (label, m), file=sys.stderr)
        sys.exit(1)
    if not w.counts.get("failed read") or not w.counts.get("failed write") \
       or not r.failed_reads:
        fail("the export's errors hardly reached a client (%d failed "
             "reads, %d failed writes, %d failed probe reads): is the error "
             "filter working?" % (w.counts.get("failed read", 0),
                                  w.counts.get("failed write", 0),
                                  len(r.failed_reads)))
    probe_check(lo, hi, a, r.ok_reads, r.failed_reads)
    trim(lo, hi - lo)
    s.set(lo, bytes(hi - lo))
    verify(s, "after the errors")


def main():
    errors(False)
    if args.init:
        s = sh.init_remote(args.remote, args.seed, durability)
        s.save(args.state)
        say("initialised the remote (%d bytes) and the model" % s.size)
        return 0
    s = sh.Shadow.load(args.state, durability)
    t0 = time.monotonic()
    if args.verify_only:
        verify(s, "after a restart")
    else:
        session(s)
    say("done in %.1f s" % (time.monotonic() - t0))
    return 0


sys.exit(main())
