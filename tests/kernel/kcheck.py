#!/usr/bin/env python3
# bcachefilter kernel test: the host side's data work (run with a python
# that has libnbd's "nbd" module: kernel.sh's kcheck).
#
#   kcheck.py pattern FILE OFF LEN SEED
#       write LEN deterministic pseudo-random bytes (from SEED) into FILE
#       at OFF
#   kcheck.py workload URI --mirror F --log F --ops N --seed S
#             [--min B] [--max B] [--write-frac P] [--duration S] [--verify]
#       random reads and writes (4 KiB aligned) through an NBD export,
#       every write also made to the mirror file (the export's expected
#       content) and logged ("sent" before, "done" after: a kill -9 may
#       leave the last ones half done); reads are checked against the
#       mirror.  --verify reads everything once more at the end (so most
#       of it is cached).  Prints a JSON summary; exits 1 on a mismatch.
#   kcheck.py cached BTREE_JSON --sectors N [--inode I] [--shift D]
#             [--dirty] --out F
#       the sectors a cache holds data for, from bcachefilter-show --btree
#       -v --json, as client sectors (key sector - D, clipped to
#       [0, N)): a JSON list of [start, end) runs.  --dirty: only those
#       of dirty keys (data the backing device may not have)
#   kcheck.py dirty-overlay BTREE_JSON CACHE IMG --sectors N [--shift D]
#       write into IMG (client sectors) the cache's data of every dirty
#       key: where the cache holds dirty data, it, not the backing store,
#       has the newest data, and a kernel serves it from the cache (a
#       kill -9 can leave a write's dirty key durable before its backing
#       write).  Prints how many sectors.
#   kcheck.py compare --dump F --expect F --cached F --poison BYTE
#       what was read through a cache whose backing copy was poisoned:
#       every cached sector must read as expected, every other as the
#       poison.  Prints the counts; exits 1 unless all is right
#   kcheck.py kwrites LIST PAT --n N --size BYTES --seed S
#       N non-overlapping write ranges (4 KiB aligned, 4-64 KiB) inside
#       SIZE bytes ("OFFSET LENGTH" lines in LIST) and their data back to
#       back in PAT, for a VM script to write with dd
#   kcheck.py apply-writes FILE LIST PAT
#       make those writes to FILE (the expected content after them)
#   kcheck.py roundtrip --first F --final F --orig F --after F --out F
#             --kwrites LIST
#       the client view the filter must serve from a cache the kernel
#       used: a sector the final cache holds that the filter had cached
#       (--first) and the kernel did not write reads as the data the
#       filter cached (--orig: the export before the kernel), everything
#       else as the backing copy the kernel left (--after); prints how
#       many sectors of each kind, and how many must come from the cache
#       (they differ from --after)
#   kcheck.py differ A B [--cached F]
#       how many 512-byte sectors of files A and B (the same size) differ;
#       with --cached (a list from `cached`), also how many of those lie
#       outside its runs.  Prints JSON
#   kcheck.py dump URI OUT
#       read a whole export into OUT, 64 KiB at a time in shuffled order
#
# Sectors are 512 bytes.  Everything is deterministic for a given seed.
import argparse
import json
import os
import random
import sys
import time

SECTOR = 512


def prng(n, seed):
    return random.Random(seed).randbytes(n)


def cmd_pattern(a):
    with open(a.file, "r+b" if os.path.exists(a.file) else "wb") as f:
        f.seek(a.off)
        left, i = a.len, 0
        while left:
            n = min(left, 4 << 20)
            f.write(prng(n, f"{a.seed}:{i}"))
            left -= n
            i += 1


def cmd_workload(a):
    import nbd
    h = nbd.NBD()
    h.connect_uri(a.uri)
    size = h.get_size()
    rng = random.Random(a.seed)
    mirror = open(a.mirror, "r+b")
    if os.fstat(mirror.fileno()).st_size != size:
        sys.exit(f"kcheck: the mirror is not {size} bytes")
    log = open(a.log, "w")
    st = {"writes": 0, "reads": 0, "read_mismatches": 0, "error": None}
    end = time.time() + a.duration if a.duration else None
    i = 0
    try:
        while (a.ops is None or i < a.ops) and (end is None or time.time() < end):
            i += 1
            n = rng.randrange(a.min // 4096, a.max // 4096 + 1) * 4096
            off = rng.randrange(0, (size - n) // 4096 + 1) * 4096
            if rng.random() < a.write_frac:
                buf = rng.randbytes(n)
                log.write(json.dumps({"w": [off, n], "state": "sent"}) + "\n")
                log.flush()
                h.pwrite(buf, off)
                mirror.seek(off)
                mirror.write(buf)
                log.write(json.dumps({"w": [off, n], "state": "done"}) + "\n")
                st["writes"] += 1
            else:
                got = h.pread(n, off)
                mirror.seek(off)
                if got != mirror.read(n):
                    st["read_mismatches"] += 1
                st["reads"] += 1
        if a.verify:
            for pos in range(0, size, 1 << 20):
                n = min(1 << 20, size - pos)
                mirror.seek(pos)
                if h.pread(n, pos) != mirror.read(n):
                    st["read_mismatches"] += 1
        h.flush()
        h.shutdown()
    except nbd.Error as e:      # the proxy was killed (the crash test)
        st["error"] = str(e)
    st["ops"] = i
    print(json.dumps(st))
    sys.exit(1 if st["read_mismatches"] else 0)


def load_cached(path):
    return [tuple(r) for r in json.load(open(path))]


def cached_bitmap(runs, n):
    bm = bytearray(n)
    for s, e in runs:
        bm[s:e] = b"\1" * (e - s)
    return bm


def leaf_keys(btree, inode, shift, sectors):
    """The data keys of inode in a bcachefilter-show --btree -v --json
    dump, each with its client sectors [s, e) (key sector - shift,
    clipped to [0, sectors)); keys outside are left out."""
    for node in btree["nodes"]:
        if node["level"] != 0:
            continue
        for k in node.get("key_list", []):
            if k["inode"] != inode or k["check"] or k["stale"] or not k["ptrs"]:
                continue
            s = max(k["start"] - shift, 0)
            e = min(k["offset"] - shift, sectors)
            if s < e:
                yield k, s, e


def cmd_cached(a):
    j = json.load(open(a.btree))
    runs = [[s, e] for k, s, e in leaf_keys(j, a.inode, a.shift, a.sectors)
            if k["dirty"] or not a.dirty]
    runs.sort()
    merged = []
    for s, e in runs:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    json.dump(merged, open(a.out, "w"))
    print(json.dumps({"runs": len(merged),
                      "sectors": sum(e - s for s, e in merged)}))


def cmd_dirty_overlay(a):
    j = json.load(open(a.btree))
    n = 0
    with open(a.cache, "rb") as c, open(a.img, "r+b") as out:
        for k, s, e in leaf_keys(j, 0, a.shift, a.sectors):
            if not k["dirty"]:
                continue
            c.seek((k["ptrs"][0]["offset"] + s + a.shift - k["start"]) * SECTOR)
            out.seek(s * SECTOR)
            out.write(c.read((e - s) * SECTOR))
            n += e - s
    print(json.dumps({"dirty_sectors": n}))


def cmd_compare(a):
    dump = open(a.dump, "rb").read()
    expect = open(a.expect, "rb").read()
    n = len(dump) // SECTOR
    if len(expect) < len(dump):
        sys.exit("kcheck: the expected image is shorter than the dump")
    cached = cached_bitmap(load_cached(a.cached), n)
    poison = bytes([int(a.poison, 0)]) * SECTOR
    res = {"sectors": n, "cached": 0, "cached_right": 0, "uncached_poison": 0,
           "wrong": 0, "first_wrong": []}
    for x in range(n):
        got = dump[x * SECTOR:(x + 1) * SECTOR]
        if cached[x]:
            res["cached"] += 1
            ok = got == expect[x * SECTOR:(x + 1) * SECTOR]
            res["cached_right"] += ok
        else:
            ok = got == poison
            res["uncached_poison"] += ok
        if not ok:
            res["wrong"] += 1
            if len(res["first_wrong"]) < 8:
                res["first_wrong"].append({"sector": x, "cached": bool(cached[x])})
    res["verdict"] = "PASS" if res["wrong"] == 0 and res["cached"] else "FAIL"
    print(json.dumps(res))
    sys.exit(0 if res["verdict"] == "PASS" else 1)


def cmd_kwrites(a):
    rng = random.Random(a.seed)
    used, out = set(), []
    while len(out) < a.n:
        n = rng.randrange(1, 17) * 4096
        off = rng.randrange(0, (a.size - n) // 4096) * 4096
        blocks = set(range(off // 4096, (off + n) // 4096))
        if blocks & used:
            continue
        used |= blocks
        out.append((off, n))
    with open(a.list, "w") as f:
        for off, n in out:
            f.write(f"{off} {n}\n")
    with open(a.pat, "wb") as f:
        f.write(prng(sum(n for _, n in out), f"pat:{a.seed}"))


def read_kwrites(path):
    return [tuple(map(int, line.split())) for line in open(path)]


def cmd_apply_writes(a):
    pat = open(a.pat, "rb").read()
    po = 0
    with open(a.file, "r+b") as f:
        for off, n in read_kwrites(a.list):
            f.seek(off)
            f.write(pat[po:po + n])
            po += n


def cmd_roundtrip(a):
    orig = open(a.orig, "rb").read()
    after = open(a.after, "rb").read()
    n = len(after) // SECTOR
    first = cached_bitmap(load_cached(a.first), n)
    final = cached_bitmap(load_cached(a.final), n)
    written = bytearray(n)
    for off, ln in read_kwrites(a.kwrites):
        written[off // SECTOR:(off + ln) // SECTOR] = b"\1" * (ln // SECTOR)
    out = bytearray(after)
    st = {"sectors": n, "cached_by_filter": 0, "cached_by_kernel": 0,
          "from_cache_only": 0}
    for x in range(n):
        if not final[x]:
            continue
        if first[x] and not written[x]:
            out[x * SECTOR:(x + 1) * SECTOR] = orig[x * SECTOR:(x + 1) * SECTOR]
            st["cached_by_filter"] += 1
            if orig[x * SECTOR:(x + 1) * SECTOR] != after[x * SECTOR:(x + 1) * SECTOR]:
                st["from_cache_only"] += 1
        else:
            st["cached_by_kernel"] += 1
    open(a.out, "wb").write(out)
    print(json.dumps(st))


def cmd_differ(a):
    st = {"sectors": 0, "differ": 0}
    bm = None
    if a.cached:
        n = os.path.getsize(a.a) // SECTOR
        bm = cached_bitmap(load_cached(a.cached), n)
        st["differ_outside"] = 0
    with open(a.a, "rb") as fa, open(a.b, "rb") as fb:
        x = 0
        while True:
            ba, bb = fa.read(1 << 20), fb.read(1 << 20)
            if len(ba) != len(bb):
                sys.exit("kcheck: the files differ in size")
            if not ba:
                break
            for i in range(0, len(ba) if ba != bb else 0, SECTOR):
                if ba[i:i + SECTOR] != bb[i:i + SECTOR]:
                    st["differ"] += 1
                    if bm is not None and not bm[x + i // SECTOR]:
                        st["differ_outside"] += 1
            x += len(ba) // SECTOR
        st["sectors"] = x
    print(json.dumps(st))


def cmd_dump(a):
    import nbd
    h = nbd.NBD()
    h.connect_uri(a.uri)
    size = h.get_size()
    chunks = list(range(0, size, 65536))
    random.Random(7).shuffle(chunks)
    with open(a.out, "wb") as f:
        f.truncate(size)
        for pos in chunks:
            f.seek(pos)
            f.write(h.pread(min(65536, size - pos), pos))
    h.shutdown()


def main():
    p = argparse.ArgumentParser(prog="kcheck.py")
    sp = p.add_subparsers(dest="cmd", required=True)
    s = sp.add_parser("pattern")
    s.add_argument("file"); s.add_argument("off", type=int)
    s.add_argument("len", type=int); s.add_argument("seed")
    s.set_defaults(f=cmd_pattern)
    s = sp.add_parser("workload")
    s.add_argument("uri"); s.add_argument("--mirror", required=True)
    s.add_argument("--log", required=True); s.add_argument("--ops", type=int)
    s.add_argument("--seed", default="1")
    s.add_argument("--min", type=int, default=4096)
    s.add_argument("--max", type=int, default=65536)
    s.add_argument("--write-frac", type=float, default=0.6)
    s.add_argument("--duration", type=float)
    s.add_argument("--verify", action="store_true")
    s.set_defaults(f=cmd_workload)
    s = sp.add_parser("cached")
    s.add_argument("btree"); s.add_argument("--sectors", type=int, required=True)
    s.add_argument("--inode", type=int, default=0)
    s.add_argument("--shift", type=int, default=0)
    s.add_argument("--dirty", action="store_true")
    s.add_argument("--out", required=True)
    s.set_defaults(f=cmd_cached)
    s = sp.add_parser("dirty-overlay")
    s.add_argument("btree"); s.add_argument("cache"); s.add_argument("img")
    s.add_argument("--sectors", type=int, required=True)
    s.add_argument("--shift", type=int, default=0)
    s.set_defaults(f=cmd_dirty_overlay)
    s = sp.add_parser("compare")
    s.add_argument("--dump", required=True); s.add_argument("--expect", required=True)
    s.add_argument("--cached", required=True); s.add_argument("--poison", required=True)
    s.set_defaults(f=cmd_compare)
    s = sp.add_parser("kwrites")
    s.add_argument("list"); s.add_argument("pat")
    s.add_argument("--n", type=int, default=32)
    s.add_argument("--size", type=int, required=True)
    s.add_argument("--seed", default="k")
    s.set_defaults(f=cmd_kwrites)
    s = sp.add_parser("apply-writes")
    s.add_argument("file"); s.add_argument("list"); s.add_argument("pat")
    s.set_defaults(f=cmd_apply_writes)
    s = sp.add_parser("roundtrip")
    for o in ("--first", "--final", "--orig", "--after", "--out", "--kwrites"):
        s.add_argument(o, required=True)
    s.set_defaults(f=cmd_roundtrip)
    s = sp.add_parser("differ")
    s.add_argument("a"); s.add_argument("b"); s.add_argument("--cached")
    s.set_defaults(f=cmd_differ)
    s = sp.add_parser("dump")
    s.add_argument("uri"); s.add_argument("out")
    s.set_defaults(f=cmd_dump)
    a = p.parse_args()
    a.f(a)


if __name__ == "__main__":
    main()
