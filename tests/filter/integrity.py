#!/usr/bin/env python3
# bcachefilter tests: random I/O from parallel NBD connections, verified
# against a shadow copy (used by test-filter-integrity.sh and
# test-filter-bad-input.sh).
#
#   integrity.py --sock SOCK --shadow FILE [--init] [--seed N]
#                [--threads T] [--ops N] [--stripe B] [--max-len B]
#                [--verify-first] [--no-final-verify] [--errors]
#                [--uncertain FILE] [--read-only]
#
# The shadow (a file as big as the export) is what the export must hold;
# --init starts it as zeros (a fresh memory plugin remote).  T threads,
# each with its own connection, do N operations each: reads (checked
# against the shadow), writes (plain or FUA), write-zeroes (sometimes
# fast, sometimes NO_HOLE), trims (the remote is nbdkit's memory plugin,
# which reads trimmed bytes as zero; the filter forwards trims, DESIGN.md),
# NBD_CMD_CACHE and flushes; aligned and byte-unaligned, up to --max-len.
# Thread i owns the stripes (of B bytes) whose index is i modulo T, so
# every byte has one writer and the shadow is exact; stripes interleave,
# so the threads share buckets and btree nodes in the cache.  Some runs
# of operations are sequential (to cross the sequential cutoff).
# Afterwards one more connection reads the whole export and compares it
# with the shadow, and checks that block status never reports zeros
# where the shadow has data.  The shadow is saved for the next run.
#
# --read-only: only reads and NBD_CMD_CACHE (the proxy may be killed
# under it: the run's status is then meaningless, the shadow unchanged).
#
# --errors: the remote injects errors (nbdkit's error filter).  An
# operation may then fail: a failed read is fine (never wrong data, if it
# succeeds); the bytes of a failed write/zero/trim become "uncertain"
# (old or new) until the next successful write covers them; their map is
# kept in --uncertain FILE across runs.  No other error is allowed.
#
# Any mismatch prints the offset, the expected and actual bytes, and the
# thread's recent operations, and exits 1.
import argparse
import errno
import os
import random
import sys
import threading
import time

import nbd

p = argparse.ArgumentParser()
p.add_argument("--sock", required=True)
p.add_argument("--shadow", required=True)
p.add_argument("--init", action="store_true")
p.add_argument("--seed", type=int, default=1)
p.add_argument("--threads", type=int, default=4)
p.add_argument("--ops", type=int, default=300)
p.add_argument("--stripe", type=int, default=256 * 1024)
p.add_argument("--max-len", type=int, default=128 * 1024)
p.add_argument("--verify-first", action="store_true")
p.add_argument("--no-final-verify", action="store_true")
p.add_argument("--errors", action="store_true")
p.add_argument("--read-only", action="store_true")
p.add_argument("--uncertain")
p.add_argument("--label", default="")
args = p.parse_args()

label = args.label or os.path.basename(args.sock)


def connect():
    h = nbd.NBD()
    h.set_handle_name(label)
    h.connect_unix(args.sock)
    return h


h0 = connect()
size = h0.get_size()
if args.init:
    shadow = bytearray(size)
else:
    with open(args.shadow, "rb") as f:
        shadow = bytearray(f.read())
if len(shadow) != size:
    sys.exit("integrity: export size %d, shadow size %d" % (size, len(shadow)))

# uncertain[i] = 1: byte i may hold the old or the new value of a failed
# write (only with --errors).  alt[i] is the other acceptable value.
uncertain = bytearray(size if args.errors else 0)
alt = bytearray(size if args.errors else 0)
if args.errors and args.uncertain and os.path.exists(args.uncertain):
    with open(args.uncertain, "rb") as f:
        d = f.read()
    uncertain[:] = d[:size]
    alt[:] = d[size:]

failed = threading.Event()
lock = threading.Lock()
counts = {}


def count(what):
    with lock:
        counts[what] = counts.get(what, 0) + 1


def report(msg, hist):
    with lock:
        print("integrity[%s]: FAIL: %s" % (label, msg), file=sys.stderr)
        if hist:
            print("  recent operations of this connection (oldest first):",
                  file=sys.stderr)
            for h in hist[-12:]:
                print("   ", h, file=sys.stderr)
    failed.set()


def check(buf, off, hist, what):
    """Compare buf read at off with the shadow.  True if equal."""
    exp = shadow[off:off + len(buf)]
    if buf == exp:
        return True
    for i in range(len(buf)):
        if buf[i] != exp[i]:
            if args.errors and (uncertain[off + i] == 2 or
                                (uncertain[off + i] and
                                 buf[i] == alt[off + i])):
                continue
            a = max(0, i - 8)
            report("%s: offset %d (request %d+%d, byte %d): got %s, "
                   "expected %s"
                   % (what, off + i, off, len(buf), i,
                      bytes(buf[a:a + 24]).hex(),
                      bytes(exp[a:a + 24]).hex()), hist)
            return False
    return True


def certain(off, data):
    shadow[off:off + len(data)] = data
    if args.errors:
        uncertain[off:off + len(data)] = bytes(len(data))


def make_uncertain(off, data):
    """A write of data at off failed: each byte is old or new."""
    n = len(data)
    for i in range(n):
        o = off + i
        if uncertain[o]:
            # Already two candidates; keep the shadow's and add nothing:
            # too rare to model exactly, so accept anything later.
            alt[o] = data[i]
            uncertain[o] = 2
        elif shadow[o] != data[i]:
            alt[o] = data[i]
            uncertain[o] = 1


def nbd_errno(e):
    return e.errno if e.errno is not None else -1


def worker(tid):
    rng = random.Random(args.seed * 7919 + tid)
    h = connect()
    hist = []
    nstripes = size // args.stripe
    mine = [s for s in range(nstripes) if s % args.threads == tid]
    can_trim = h.can_trim()
    can_zero = h.can_zero()
    can_fast_zero = h.can_fast_zero()
    can_cache = h.can_cache()
    can_fua = h.can_fua()
    seq = None          # (next offset, end, is_write) of a sequential run

    def pick():
        s = rng.choice(mine) * args.stripe
        if rng.random() < 0.5:
            bs = 4096
            n = rng.randint(1, args.max_len // bs) * bs
            n = min(n, args.stripe)
            o = s + rng.randrange(0, (args.stripe - n) // bs + 1) * bs
        else:
            n = rng.randint(1, args.max_len)
            n = min(n, args.stripe)
            o = s + rng.randrange(0, args.stripe - n + 1)
        return o, n

    for _ in range(args.ops):
        if failed.is_set():
            return
        if seq is None and rng.random() < 0.03:
            s = rng.choice(mine) * args.stripe
            seq = [s, s + args.stripe, rng.random() < 0.5]
        if seq is not None:
            n = min(32768, seq[1] - seq[0])
            o = seq[0]
            op = "write" if seq[2] and not args.read_only else "read"
            seq[0] += n
            if seq[0] >= seq[1]:
                seq = None
        else:
            r = rng.random()
            o, n = pick()
            if args.read_only:
                op = "read" if r < 0.8 else "cache"
            elif r < 0.40:
                op = "read"
            elif r < 0.72:
                op = "write"
            elif r < 0.80:
                op = "zero"
            elif r < 0.88:
                op = "trim"
            elif r < 0.93:
                op = "cache"
            else:
                op = "flush"
        try:
            if op == "read":
                hist.append("read %d+%d" % (o, n))
                buf = h.pread(n, o)
                if not check(buf, o, hist, "read"):
                    return
            elif op == "write":
                data = rng.randbytes(n)
                fl = nbd.CMD_FLAG_FUA if can_fua and rng.random() < 0.2 else 0
                hist.append("write %d+%d%s" % (o, n, " fua" if fl else ""))
                try:
                    h.pwrite(data, o, fl)
                except nbd.Error:
                    if not args.errors:
                        raise
                    make_uncertain(o, data)
                    count("failed write")
                    continue
                certain(o, data)
            elif op == "zero" and can_zero:
                fl = 0
                if can_fast_zero and rng.random() < 0.3:
                    fl |= nbd.CMD_FLAG_FAST_ZERO
                if rng.random() < 0.3:
                    fl |= nbd.CMD_FLAG_NO_HOLE
                hist.append("zero %d+%d flags=%d" % (o, n, fl))
                try:
                    h.zero(n, o, fl)
                except nbd.Error as e:
                    if (fl & nbd.CMD_FLAG_FAST_ZERO) and \
                       nbd_errno(e) == errno.ENOTSUP:
                        count("fast zero refused")
                        continue        # nothing was changed
                    if not args.errors:
                        raise
                    make_uncertain(o, bytes(n))
                    count("failed zero")
                    continue
                certain(o, bytes(n))
            elif op == "trim" and can_trim:
                hist.append("trim %d+%d" % (o, n))
                try:
                    h.trim(n, o)
                except nbd.Error:
                    if not args.errors:
                        raise
                    make_uncertain(o, bytes(n))
                    count("failed trim")
                    continue
                certain(o, bytes(n))
            elif op == "cache" and can_cache:
                hist.append("cache %d+%d" % (o, n))
                h.cache(n, o)
            elif op == "flush":
                hist.append("flush")
                h.flush()
            else:
                continue
            count(op)
        except nbd.Error as e:
            if args.errors and op in ("read", "cache", "flush"):
                count("failed " + op)
                continue
            report("%s %d+%d: unexpected NBD error: %s (errno %s)"
                   % (op, o, n, e.string, e.errno), hist)
            return
    try:
        h.shutdown()
    except nbd.Error:
        pass


def verify(what):
    # Read the whole export with 4 connections in parallel.
    ok = []

    def part(lo, hi):
        h = connect()
        off = lo
        tries = 0
        while off < hi:
            n = min(1 << 20, hi - off)
            try:
                buf = h.pread(n, off)
            except nbd.Error as e:
                if args.errors and tries < 1000:
                    tries += 1
                    continue
                report("%s: reading %d+%d: %s" % (what, off, n, e.string),
                       [])
                return
            if not check(buf, off, [], what):
                return
            off += n
        h.shutdown()
        ok.append(1)

    step = -(-size // 4 // (1 << 20)) << 20
    ts = [threading.Thread(target=part, args=(lo, min(size, lo + step)))
          for lo in range(0, size, step)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if len(ok) != len(ts):
        return False
    h = connect()
    # Block status must never say "zero" where the data is not zero.
    if h.can_meta_context(nbd.CONTEXT_BASE_ALLOCATION):
        bad = []
        reached = [0]

        def cb(metacontext, offset, entries, err):
            if metacontext != nbd.CONTEXT_BASE_ALLOCATION:
                return 0
            o = offset
            for i in range(0, len(entries), 2):
                ln, fl = entries[i], entries[i + 1]
                if fl & nbd.STATE_ZERO:
                    seg = shadow[o:min(o + ln, size)]
                    if seg.count(0) != len(seg):
                        bad.append((o, ln, fl))
                o += ln
            reached[0] = max(reached[0], o)
            return 0
        off = 0
        while off < size:
            n = min(1 << 24, size - off)
            try:
                h.block_status(n, off, cb)
            except nbd.Error as e:
                if args.errors:
                    break
                report("%s: block status %d+%d: %s"
                       % (what, off, n, e.string), [])
                return False
            if reached[0] <= off:
                report("%s: block status at %d made no progress"
                       % (what, off), [])
                return False
            off = reached[0]
        for o, ln, fl in bad:
            # Uncertain bytes could legitimately be zero now.
            seg = range(o, min(o + ln, size))
            if any(shadow[i] != 0 and not (args.errors and uncertain[i])
                   for i in seg):
                report("%s: block status reports zeros at %d+%d (flags %d) "
                       "but the data there is not zero" % (what, o, ln, fl),
                       [])
                return False
    h.shutdown()
    return True


t0 = time.time()
if args.verify_first and not verify("verify before the workload"):
    sys.exit(1)
threads = [threading.Thread(target=worker, args=(i,))
           for i in range(args.threads)]
for t in threads:
    t.start()
for t in threads:
    t.join()
if failed.is_set():
    sys.exit(1)
if not args.no_final_verify and not verify("verify after the workload"):
    sys.exit(1)
with open(args.shadow + ".tmp", "wb") as f:
    f.write(shadow)
os.replace(args.shadow + ".tmp", args.shadow)
if args.errors and args.uncertain:
    with open(args.uncertain, "wb") as f:
        f.write(uncertain + alt)
print("integrity[%s]: seed %d, %d threads: %s in %.1f s"
      % (label, args.seed, args.threads,
         ", ".join("%d %s" % (v, k) for k, v in sorted(counts.items())),
         time.time() - t0))
