#!/usr/bin/env python3
# bcachefilter tests: one round of the kill -9 soak (test-filter-soak.sh).
#
#   soak.py --sock PROXY --remote REMOTE --state FILE --mode MODE
#           [--init] [--verify-only] [--seed N] [--seconds S]
#           [--conns C] [--qd Q] [--started FILE] [--pidfile FILE]
#           [--label L]
#
# --init: fill the remote (REMOTE, nbdkit's memory plugin) with random
# data of the seed, directly, and start the model (tests/filter/shadow.py)
# in FILE from it.  Otherwise the model is loaded from FILE, as the last
# round left it, and a round is:
#
#  1. Verify, after the restart that follows a kill: read the whole
#     export through the proxy; every byte must be one the model allows
#     after a crash (its durable value, or the data of a write that was
#     in flight, failed, or in writeback mode not yet flushed).  Where
#     the export is the truth (every mode but writeback, whose dirty data
#     the export may not have yet) the proxy's view must equal the
#     export, read directly from REMOTE.  The view then becomes the model
#     (from now on every byte must read that value: I2).  The model is
#     saved.
#  2. Touch --started FILE, and run the workload (shadow.Workload: C
#     connections of Q requests in flight each, every read checked, every
#     request bounded) for S seconds or until the proxy is killed.  The
#     model is saved with what was in flight at the kill.
#
# --verify-only: step 1 alone (and the model is saved).  --export-truth
# makes step 1 compare with the export in writeback mode too (after
# writeback has drained the dirty data).
#
# Exit status: 0 the round ran to its end, 3 the proxy was killed (in
# step 1 the model is then left as it was), 1 a check failed (the model
# is not saved: rerun with the seed).
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shadow as sh  # noqa: E402


p = argparse.ArgumentParser()
p.add_argument("--sock", required=True)
p.add_argument("--remote", required=True)
p.add_argument("--state", required=True)
p.add_argument("--mode", required=True)
p.add_argument("--init", action="store_true")
p.add_argument("--verify-only", action="store_true")
p.add_argument("--export-truth", action="store_true")
p.add_argument("--seed", type=int, default=1)
p.add_argument("--seconds", type=float, default=10)
p.add_argument("--conns", type=int, default=4)
p.add_argument("--qd", type=int, default=4)
p.add_argument("--started")
p.add_argument("--pidfile")
p.add_argument("--label", default="soak")
args = p.parse_args()

durability = "flushed" if args.mode == "writeback" else "acked"
export_truth = durability == "acked" or args.export_truth
label = args.label


def say(msg):
    print("soak[%s]: %s" % (label, msg), flush=True)


def fail(msg):
    print("soak[%s]: FAIL: %s" % (label, msg), file=sys.stderr, flush=True)
    sys.exit(1)


def alive():
    """Is the proxy (--pidfile) still running (not dead, not a zombie)?"""
    try:
        pid = int(open(args.pidfile).read())
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, ValueError, IndexError):
        return False


def init():
    try:
        s = sh.init_remote(args.remote, args.seed, durability)
    except RuntimeError as e:
        fail("init: %s" % e)
    s.save(args.state)
    say("initialised the remote (%d bytes) and the model" % s.size)


def verify(s):
    """Step 1.  False if the proxy was killed meanwhile."""
    t0 = time.monotonic()
    view, msg = sh.check_export(s, args.sock,
                                args.remote if export_truth else None,
                                crash=True,
                                alive=alive if args.pidfile else None)
    if msg:
        fail("after the restart: %s" % msg)
    if view is None:
        say("the proxy was killed while the export was being verified")
        return False
    unc = s.uncertain_bytes()
    s.resolve(view)
    s.save(args.state)
    say("verified %d bytes%s in %.1f s (%d bytes of in-flight or "
        "unflushed writes resolved)"
        % (s.size, " (proxy = export)" if export_truth else "",
           time.monotonic() - t0, unc))
    return True


def main():
    if args.init:
        init()
        return 0
    s = sh.Shadow.load(args.state, durability)
    if not verify(s):
        return 3
    if args.verify_only:
        return 0
    if args.started:
        open(args.started, "w").close()
    w = sh.Workload(s, args.sock, conns=args.conns, qd=args.qd,
                    seed=args.seed, seconds=args.seconds, label=label,
                    alive=alive if args.pidfile else None)
    w.start().join()
    if not w.problems:
        s.save(args.state)
    for m in w.problems:
        print("soak[%s]: FAIL: %s" % (label, m), file=sys.stderr)
    say("seed %d: %s in %.1f s%s; %d bytes of in-flight or unflushed "
        "writes"
        % (args.seed, w.summary(), w.elapsed,
           " (the proxy was killed)" if w.gone else "",
           s.uncertain_bytes()))
    if w.problems:
        return 1
    return 3 if w.gone else 0


sys.exit(main())
