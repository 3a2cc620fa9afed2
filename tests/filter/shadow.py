# bcachefilter tests: what an export may hold, and NBD requests that
# cannot hang (a module used by soak.py and faults.py).
#
# Shadow: a model of the export, byte by byte.
#
#   latest    the last acknowledged value of each byte: what a read must
#             return (I1, no stale reads).
#   durable   the value each byte must hold after a crash of the proxy.
#   records   writes (and zeroes and trims, as zeros: the remote is
#             nbdkit's memory plugin) whose data a byte may also hold:
#               "inflight"  sent, not answered yet (or lost in a crash);
#               "failed"    answered with an error: old or new, unknown;
#               "acked"     acknowledged but not yet durable (durability
#                           "flushed" only, see below).
#
# Two durability models, chosen by the cache mode under test:
#
#   "acked"    (writethrough, writearound, none).  A write completes only
#              when the export has it, and the remote nbdkit keeps running
#              when the proxy is killed, so every acknowledged write is
#              there after a crash whether or not a flush followed: at
#              acknowledgement a write's data goes into durable as well.
#              The export is the truth: the proxy's view must equal it.
#   "flushed"  (writeback).  An acknowledged write may live only in the
#              cache until a flush, or the FUA write itself, completes
#              (I3).  At acknowledgement it goes into latest and stays a
#              record; a completed FUA write, and a completed flush for
#              every write acknowledged before the flush was sent (on any
#              connection if the export advertises multi-conn, else on
#              the flush's own), moves it into durable.  After a crash a
#              byte holds its durable value or the data of any later
#              write (acknowledged or not).  The export is not the truth
#              until writeback has drained the dirty data.
#
# A record leaves the model when a write that covers its bytes becomes
# durable after it (the bytes are then certain); a write never overlaps
# one in flight (the drivers give every byte one writer, which keeps at
# most one request on it at a time), so completion order is write order.
#
# check() says whether a view (bytes read at an offset) is allowed:
# during a run, each byte must be latest or the data of an in-flight or
# failed write; after a crash, durable or the data of any record.
# resolve() then takes a view that passed as the new truth: after a
# crash "every sector reads the same value every time" (I2), so whatever
# a byte came back as is what it must read from then on.
#
# Client: one NBD connection (libnbd's aio calls) on which every request
# has a deadline: a request not answered in time raises Hang, so no test
# waits for ever.  Completions report ("ok" | "error" | "gone", errno):
# "gone" when the connection died (the server was killed), "error" for
# an error reply on a live connection.
#
# Locking: a Shadow is shared by the driver's threads; its methods take
# its lock.  A Client belongs to one thread.
import bisect
import errno
import os
import pickle
import random
import threading
import time

import nbd


class Rec:
    __slots__ = ("off", "data", "state", "seq", "conn", "fua")

    def __init__(self, off, data, conn, fua):
        self.off, self.data, self.conn, self.fua = off, data, conn, fua
        self.state, self.seq = "inflight", 0

    @property
    def end(self):
        return self.off + len(self.data)


class Shadow:
    def __init__(self, size, durability="acked", data=None):
        if durability not in ("acked", "flushed"):
            raise ValueError("durability must be acked or flushed")
        self.size = size
        self.durability = durability
        self.latest = bytearray(data if data is not None else size)
        self.durable = bytearray(self.latest)
        self.records = []
        self.seq = 0
        self.multi_conn = True
        self.lock = threading.Lock()

    # -- persistence (between the runs of a driver) --------------------
    def save(self, path):
        with self.lock:
            state = (self.size, self.durability, bytes(self.latest),
                     bytes(self.durable),
                     [(r.off, r.data, r.state, r.seq, r.conn, r.fua)
                      for r in self.records], self.seq)
        with open(path + ".tmp", "wb") as f:
            pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(path + ".tmp", path)

    @classmethod
    def load(cls, path, durability=None):
        with open(path, "rb") as f:
            size, dur, latest, durable, recs, seq = pickle.load(f)
        s = cls(size, durability or dur)
        s.latest[:] = latest
        s.durable[:] = durable
        for off, data, state, rseq, conn, fua in recs:
            r = Rec(off, data, conn, fua)
            r.state, r.seq = state, rseq
            s.records.append(r)
        s.seq = seq
        return s

    # -- the life of a write -------------------------------------------
    def begin_write(self, off, data, conn, fua=False):
        r = Rec(off, bytes(data), conn, fua)
        with self.lock:
            self.records.append(r)
        return r

    def write_done(self, r):
        """The write was acknowledged."""
        with self.lock:
            self.seq += 1
            r.state, r.seq = "acked", self.seq
            self.latest[r.off:r.end] = r.data
            if self.durability == "acked" or r.fua:
                self._make_durable(r)

    def write_failed(self, r):
        """The write was answered with an error: each byte old or new."""
        with self.lock:
            self.seq += 1
            r.state, r.seq = "failed", self.seq

    def flush_begin(self, conn):
        with self.lock:
            return (self.seq, conn)

    def flush_done(self, token):
        """A flush sent when the completion counter was token completed."""
        upto, conn = token
        if self.durability != "flushed":
            return
        with self.lock:
            done = sorted((r for r in self.records
                           if r.state == "acked" and r.seq <= upto and
                           (self.multi_conn or r.conn == conn)),
                          key=lambda r: r.seq)
            for r in done:
                if r in self.records:
                    self._make_durable(r)

    def _make_durable(self, r):
        """r's data is in durable; drop what it supersedes (lock held)."""
        self.durable[r.off:r.end] = r.data
        keep = []
        for o in self.records:
            if o is r:
                continue
            if o.state == "inflight" or o.seq > r.seq or \
               o.end <= r.off or o.off >= r.end:
                keep.append(o)
                continue
            # o is older and overlaps r: keep only what r does not cover.
            if o.off < r.off:
                keep.append(self._piece(o, o.off, r.off))
            if o.end > r.end:
                keep.append(self._piece(o, r.end, o.end))
        self.records = keep

    @staticmethod
    def _piece(o, lo, hi):
        p = Rec(lo, o.data[lo - o.off:hi - o.off], o.conn, o.fua)
        p.state, p.seq = o.state, o.seq
        return p

    # -- checking ------------------------------------------------------
    def check(self, view, off, crash=False):
        """None if view (read at off) is allowed, else a message."""
        base = self.durable if crash else self.latest
        n = len(view)
        if view == base[off:off + n]:
            return None
        with self.lock:
            recs = [r for r in self.records
                    if r.off < off + n and r.end > off and
                    (crash or r.state != "acked")]
        for p in _unexplained(view, base, off, recs):
            b = view[p - off]
            here = [r for r in recs if r.off <= p < r.end]
            cands = sorted({base[p]} | {r.data[p - r.off] for r in here})
            lo = max(off, p - 8)
            return ("offset %d: 0x%02x, allowed %s (%s); bytes from %d: "
                    "read %s, %s %s; %s"
                    % (p, b, " ".join("0x%02x" % c for c in cands),
                       "after a crash" if crash else "during the run",
                       lo, bytes(view[lo - off:lo - off + 24]).hex(),
                       "durable" if crash else "latest",
                       bytes(base[lo:lo + 24]).hex(),
                       "writes that may have changed it: " +
                       ", ".join("%s %d+%d" % (r.state, r.off, len(r.data))
                                 for r in here)
                       if here else "no write in flight, failed or "
                       "unflushed covers it"))
        return None

    def set(self, off, data):
        """The export now holds data at off, for sure (written directly
        to the remote while the proxy caches nothing there)."""
        end = off + len(data)
        with self.lock:
            self.latest[off:end] = data
            self.durable[off:end] = data
            keep = []
            for r in self.records:
                if r.end <= off or r.off >= end:
                    keep.append(r)
                    continue
                if r.off < off:
                    keep.append(self._piece(r, r.off, off))
                if r.end > end:
                    keep.append(self._piece(r, end, r.end))
            self.records = keep

    def uncertain_bytes(self):
        with self.lock:
            return sum(len(r.data) for r in self.records)

    def resolve(self, view):
        """A checked full view is now the truth."""
        with self.lock:
            self.latest[:] = view
            self.durable[:] = view
            self.records = []


def _unexplained(view, base, off, recs):
    """Yield, in order, the offsets where view (at off) holds a byte that
    is neither base's nor that of a record covering it.

    Byte by byte this is what check() means, but a view after a crash
    differs from base wherever an unflushed write landed, megabytes of
    it, and a Python loop over every such byte was most of the writeback
    soak's time.  So each 4 KiB chunk that differs is cut at the
    records' edges into segments that one set of records covers; a
    segment equal to base or to one record's data is allowed whole, and
    only the others (a view mixing several writes) are checked byte by
    byte."""
    n = len(view)
    step = 4096
    recs = sorted(recs, key=lambda r: r.off)
    starts = [r.off for r in recs]
    longest = max((len(r.data) for r in recs), default=0)
    for i in range(0, n, step):
        lo, hi = off + i, off + min(i + step, n)
        v = view[i:hi - off]
        if v == base[lo:hi]:
            continue
        # The records that start before hi and may reach past lo.
        j = bisect.bisect_left(starts, hi)
        k = bisect.bisect_right(starts, lo - longest, 0, j)
        here = [r for r in recs[k:j] if r.end > lo]
        cuts = sorted({lo, hi} | {x for r in here for x in (r.off, r.end)
                                  if lo < x < hi})
        for a, b in zip(cuts, cuts[1:]):
            seg = view[a - off:b - off]
            if seg == base[a:b]:
                continue
            cover = [r for r in here if r.off <= a and r.end >= b]
            if any(r.data[a - r.off:b - r.off] == seg for r in cover):
                continue
            for p in range(a, b):
                x = seg[p - a]
                if x != base[p] and \
                   not any(r.data[p - r.off] == x for r in cover):
                    yield p


def _mismatches(view, base, off):
    """Yield the offsets where view (at off) differs from base."""
    n = len(view)
    step = 4096
    for i in range(0, n, step):
        a = view[i:i + step]
        b = base[off + i:off + i + len(a)]
        if a != b:
            for j in range(len(a)):
                if a[j] != b[j]:
                    yield off + i + j


def first_difference(a, b):
    """The first offset where the byte strings differ, or None."""
    for p in _mismatches(a, b, 0):
        return p
    return None


# ---------------------------------------------------------------------
def errname(n):
    return errno.errorcode.get(n, "errno %d" % n)


class Hang(Exception):
    pass


class Op:
    __slots__ = ("kind", "off", "n", "buf", "cookie", "deadline", "rec",
                 "token", "t0", "flags")

    def describe(self):
        return "%s %d+%d flags=%d" % (self.kind, self.off, self.n, self.flags)


class Client:
    """One connection; every request has a deadline of `timeout` s."""

    def __init__(self, sock, name="", timeout=60.0):
        self.h = nbd.NBD()
        if name:
            self.h.set_handle_name(name)
        self.h.connect_unix(sock)
        self.timeout = timeout
        self.ops = []
        self.gone = False

    def __getattr__(self, name):        # can_fua, get_size, ...
        return getattr(self.h, name)

    def submit(self, kind, off=0, n=0, data=None, flags=0):
        """Send a request.  Returns the Op, or None if the connection is
        gone (the server was killed)."""
        op = Op()
        op.kind, op.off, op.n, op.flags = kind, off, n, flags
        op.buf = op.rec = op.token = None
        op.t0 = time.monotonic()
        op.deadline = op.t0 + self.timeout
        try:
            if kind == "read":
                op.buf = nbd.Buffer(n)
                op.cookie = self.h.aio_pread(op.buf, off, flags=flags)
            elif kind == "write":
                op.buf = nbd.Buffer.from_bytearray(bytearray(data))
                op.cookie = self.h.aio_pwrite(op.buf, off, flags=flags)
            elif kind == "zero":
                op.cookie = self.h.aio_zero(n, off, flags=flags)
            elif kind == "trim":
                op.cookie = self.h.aio_trim(n, off, flags=flags)
            elif kind == "cache":
                op.cookie = self.h.aio_cache(n, off)
            elif kind == "flush":
                op.cookie = self.h.aio_flush()
            else:
                raise ValueError(kind)
        except nbd.Error:
            if self._dead():
                self.gone = True
                return None
            raise
        self.ops.append(op)
        return op

    def _dead(self):
        return self.h.aio_is_dead() or self.h.aio_is_closed()

    def overlaps(self, off, n):
        return any(o.n and o.off < off + n and off < o.off + o.n
                   for o in self.ops)

    def reap(self, wait_ms=100):
        """Wait (up to wait_ms) for answers.  Returns a list of (op,
        status, errno, message) for the requests that completed: status
        "ok", "error" (an error reply) or "gone" (the connection died).
        Raises Hang if a request passed its deadline."""
        done = []
        if not self.ops:
            return done
        if not self.gone:
            try:
                self.h.poll(wait_ms)
            except nbd.Error:
                pass
            if self._dead():
                self.gone = True
        for op in list(self.ops):
            try:
                if not self.h.aio_command_completed(op.cookie):
                    continue
                done.append((op, "ok", 0, ""))
            except nbd.Error as e:
                st = "gone" if self._dead() else "error"
                done.append((op, st, e.errnum or -1, e.string))
            self.ops.remove(op)
        if self.gone:
            for op in self.ops:
                done.append((op, "gone", errno.ENOTCONN, "connection gone"))
            self.ops = []
        now = time.monotonic()
        for op in self.ops:
            if now > op.deadline:
                raise Hang("%s: no answer after %.0f s"
                           % (op.describe(), now - op.t0))
        return done

    def drain(self):
        """Wait for every request in flight; returns their completions."""
        done = []
        while self.ops:
            done += self.reap()
        return done

    def close(self):
        if not self.gone:
            try:
                self.h.shutdown()
            except nbd.Error:
                pass


def init_remote(sock, seed, durability="acked"):
    """Fill the export at sock (directly: the remote) with random data
    of the seed; returns the Shadow that holds it."""
    c = Client(sock, "init")
    size = c.get_size()
    c.close()
    data = random.Random(seed).randbytes(size)
    write_all(sock, 0, data, "init")
    return Shadow(size, durability, data)


def gone_within(alive, seconds=2.0):
    """Does alive() turn false within seconds?  A server killed with
    SIGKILL closes its sockets while it exits, before /proc shows it
    dead (a zombie): a client can see the reset first."""
    for _ in range(int(seconds * 10)):
        if not alive():
            return True
        time.sleep(0.1)
    return not alive()


def check_export(s, proxy, remote, crash=True, alive=None):
    """Read the whole export through the proxy and check it against the
    model s (as after a crash, or as during a run); with a remote socket,
    also read the export there and require the same bytes.  Returns
    (view, None) if all is well, (None, None) if the proxy died on the
    way (alive() says it is gone), (None, message) on a problem."""
    try:
        view = read_view(proxy, s.size, "check proxy")
    except nbd.Error as e:
        if alive is not None and gone_within(alive):
            return None, None
        return None, "reading the proxy: %s" % e.string
    except RuntimeError as e:
        return None, str(e)
    if view is None:
        return None, None
    msg = s.check(view, 0, crash=crash)
    if msg:
        return None, ("the proxy's view is not one the model allows: %s"
                      % msg)
    if remote is not None:
        try:
            rview = read_view(remote, s.size, "check remote")
        except (nbd.Error, RuntimeError) as e:
            return None, "reading the export: %s" % e
        if rview != view:
            o = first_difference(view, rview)
            return None, ("the proxy's view differs from the export at "
                          "offset %d: proxy %s, export %s (the model's "
                          "value %s)" % (o, bytes(view[o:o + 16]).hex(),
                                         bytes(rview[o:o + 16]).hex(),
                                         bytes(s.durable[o:o + 16]).hex()))
    return view, None


def write_all(sock, off, data, name="write", timeout=60.0,
              chunk=1 << 20):
    """Write data at off (directly, e.g. to the remote).  Raises
    RuntimeError on any error."""
    c = Client(sock, name, timeout)
    for o in range(0, len(data), chunk):
        if c.submit("write", off + o, min(chunk, len(data) - o),
                    data[o:o + chunk]) is None:
            raise RuntimeError("%s: the connection died" % sock)
        for op, st, err, msg in c.drain():
            if st != "ok":
                raise RuntimeError("%s: writing %d+%d: %s"
                                   % (sock, op.off, op.n, msg))
    c.close()


def read_view(sock, size, name="view", timeout=60.0, chunk=1 << 20, qd=8):
    """Read the whole export.  Returns the bytes, or None if the
    connection died on the way.  An error reply raises nbd.Error-like
    RuntimeError with the range."""
    c = Client(sock, name, timeout)
    if c.get_size() != size:
        raise RuntimeError("%s: export size %d, expected %d"
                           % (sock, c.get_size(), size))
    view = bytearray(size)
    nxt = 0
    while nxt < size or c.ops:
        while nxt < size and len(c.ops) < qd:
            n = min(chunk, size - nxt)
            if c.submit("read", nxt, n) is None:
                return None
            nxt += n
        for op, st, err, msg in c.reap():
            if st == "gone":
                return None
            if st == "error":
                raise RuntimeError("%s: reading %d+%d: %s"
                                   % (sock, op.off, op.n, msg))
            view[op.off:op.off + op.n] = op.buf.to_bytearray()
    c.close()
    return view


# ---------------------------------------------------------------------
# Workload: random requests from parallel connections, checked against a
# Shadow.
#
# Each connection is one thread with up to qd requests in flight, none
# overlapping another of its own; connection i owns the stripes (of
# `stripe` bytes, inside [lo, hi)) whose index is i modulo conns, so
# every byte has one writer and at most one request on it in flight.
# Stripes interleave, so the connections share buckets and btree nodes
# in the cache.  Requests: reads (checked), writes (some FUA), zeroes
# (some NO_HOLE), trims, NBD_CMD_CACHE and flushes, by the weights in
# `mix`; aligned (4 KiB) and byte-unaligned, up to max_len; 70% of them
# in a hot eighth of the connection's stripes (so that a small cache has
# hits), and sometimes a sequential run through a whole stripe (to cross
# the sequential cutoff).
#
# With errors=True an EIO reply is allowed (counted; a failed write is a
# "failed" record, a failed read's range is kept in failed_reads); any
# other error reply, or any error reply with errors=False, is a problem.
# A connection that dies is "gone": its requests in flight stay in the
# Shadow as in flight.  If `alive` (a function) says the server is still
# running 2 s after a connection died, that is a problem too (the server
# dropped a client it should have kept).

MIX = {"read": 34, "write": 34, "zero": 8, "trim": 8, "cache": 5, "flush": 6}


class Workload:
    def __init__(self, shadow, sock, conns=4, qd=4, seed=1, seconds=10.0,
                 ops=None, lo=0, hi=None, stripe=256 * 1024,
                 max_len=128 * 1024, mix=None, errors=False, label="",
                 timeout=60.0, alive=None):
        self.shadow, self.sock = shadow, sock
        self.conns, self.qd, self.seed = conns, qd, seed
        self.seconds, self.ops_limit = seconds, ops
        self.lo, self.hi = lo, shadow.size if hi is None else hi
        self.stripe, self.max_len = stripe, max_len
        self.mix = sorted((mix or MIX).items())
        self.errors, self.label, self.timeout = errors, label, timeout
        self.alive = alive
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.counts = {}
        self.problems = []
        self.gone = False
        self.failed_reads = []
        self.ok_reads = []
        self.threads = []

    def start(self):
        self.t0 = time.monotonic()
        self.threads = [threading.Thread(target=self._conn, args=(i,))
                        for i in range(self.conns)]
        for t in self.threads:
            t.start()
        return self

    def join(self):
        for t in self.threads:
            t.join()
        self.elapsed = time.monotonic() - self.t0
        return self

    def summary(self):
        with self.lock:
            return ", ".join("%d %s" % (v, k)
                             for k, v in sorted(self.counts.items()))

    def _count(self, what):
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def _problem(self, msg, hist):
        with self.lock:
            self.problems.append(msg + "".join(
                "\n    " + h for h in
                (["recent requests of this connection (oldest first):"] +
                 hist[-12:] if hist else [])))
        self.stop.set()

    def _conn(self, tid):
        rng = random.Random(self.seed * 7919 + tid)
        hist = []
        try:
            c = Client(self.sock, "%s c%d" % (self.label, tid), self.timeout)
        except nbd.Error as e:
            with self.lock:
                self.gone = True
            self._check_gone("connect: %s" % e.string, hist)
            return
        if tid == 0:
            self.shadow.multi_conn = bool(c.can_multi_conn())
        can = {"fua": c.can_fua(), "zero": c.can_zero(),
               "trim": c.can_trim(), "cache": c.can_cache()}
        nstripes = (self.hi - self.lo) // self.stripe
        mine = [s for s in range(nstripes) if s % self.conns == tid]
        st = {"seq": None, "n": 0}
        end = time.monotonic() + self.seconds
        try:
            while not self.stop.is_set():
                while (len(c.ops) < self.qd and not c.gone and
                       time.monotonic() < end and
                       (self.ops_limit is None or
                        st["n"] < self.ops_limit)):
                    if not self._issue(c, rng, mine, can, st, hist, tid):
                        break
                if not c.ops:
                    break
                for op, status, err, msg in c.reap():
                    self._complete(op, status, err, msg, hist)
        except Hang as e:
            self._problem("%s c%d: a request hangs: %s"
                          % (self.label, tid, e), hist)
        if c.gone:
            with self.lock:
                self.gone = True
            self._check_gone("connection c%d died" % tid, hist)
        c.close()

    def _check_gone(self, what, hist):
        if self.alive is None or gone_within(self.alive):
            return
        self._problem("%s: %s, but the server is still running"
                      % (self.label, what), hist)

    def _pick_range(self, rng, mine):
        # 70% of the requests go to a hot eighth of the stripes (which
        # fits in a small cache, so there are hits to check), the rest
        # anywhere (so buckets are reclaimed).
        hot = mine[:max(1, len(mine) // 8)]
        s = self.lo + rng.choice(hot if rng.random() < 0.7 else mine) * \
            self.stripe
        if rng.random() < 0.5:
            bs = 4096
            n = min(rng.randint(1, self.max_len // bs) * bs, self.stripe)
            o = s + rng.randrange(0, (self.stripe - n) // bs + 1) * bs
        else:
            n = min(rng.randint(1, self.max_len), self.stripe)
            o = s + rng.randrange(0, self.stripe - n + 1)
        return o, n

    def _issue(self, c, rng, mine, can, st, hist, tid):
        """Send one request; False if none can be sent now."""
        seq = st["seq"]
        if seq is None and rng.random() < 0.03:
            s = self.lo + rng.choice(mine) * self.stripe
            writes = "write" in dict(self.mix) and rng.random() < 0.5
            seq = st["seq"] = [s, s + self.stripe, writes]
        if seq is not None:
            o, n = seq[0], min(32768, seq[1] - seq[0])
            if c.overlaps(o, n):
                return False
            kind = "write" if seq[2] else "read"
            seq[0] += n
            if seq[0] >= seq[1]:
                st["seq"] = None
        else:
            r = rng.randrange(sum(w for _, w in self.mix))
            for kind, w in self.mix:
                if r < w:
                    break
                r -= w
            for _ in range(8):
                o, n = self._pick_range(rng, mine)
                if not c.overlaps(o, n):
                    break
            else:
                return False
            if kind in ("zero", "trim", "cache") and not can[kind]:
                kind = "read"
        flags = 0
        data = None
        if kind == "write":
            data = rng.randbytes(n)
            if can["fua"] and rng.random() < 0.2:
                flags = nbd.CMD_FLAG_FUA
        elif kind == "zero":
            data = bytes(n)
            if rng.random() < 0.3:
                flags = nbd.CMD_FLAG_NO_HOLE
        elif kind == "trim":
            data = bytes(n)
        elif kind == "flush":
            o = n = 0
        rec = token = None
        if data is not None:
            rec = self.shadow.begin_write(o, data, tid,
                                          bool(flags & nbd.CMD_FLAG_FUA))
        if kind == "flush":
            token = self.shadow.flush_begin(tid)
        op = c.submit(kind, o, n, data if kind == "write" else None, flags)
        if op is None:
            return False        # gone: rec stays in flight
        op.rec, op.token = rec, token
        st["n"] += 1
        hist.append("sent " + op.describe())
        del hist[:-24]
        return True

    def _complete(self, op, status, err, msg, hist):
        what = op.describe()
        hist.append("%s: %s%s" % (what, status,
                                  " %s %s" % (errname(err), msg)
                                  if err else ""))
        if status == "gone":
            return
        if status == "error":
            if not self.errors or err != errno.EIO:
                if op.rec is not None:
                    self.shadow.write_failed(op.rec)
                self._problem("%s: %s: unexpected error reply: %s (%s%s)"
                              % (self.label, what, msg, errname(err),
                                 ", not EIO" if self.errors else ""), hist)
                return
            self._count("failed " + op.kind)
            if op.rec is not None:
                self.shadow.write_failed(op.rec)
            if op.kind == "read":
                with self.lock:
                    self.failed_reads.append((op.off, op.n))
            return
        self._count(op.kind)
        if op.kind == "read":
            m = self.shadow.check(op.buf.to_bytearray(), op.off)
            if m:
                self._problem("%s: %s: wrong data: %s" % (self.label, what, m),
                              hist)
            with self.lock:
                self.ok_reads.append((op.off, op.n))
        elif op.rec is not None:
            self.shadow.write_done(op.rec)
        elif op.kind == "flush":
            self.shadow.flush_done(op.token)
