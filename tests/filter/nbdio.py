#!/usr/bin/env python3
# bcachefilter tests: single NBD operations from the shell, through
# libnbd's python module.
#
#   nbdio.py SOCKET COMMAND ARGS...
#
# COMMAND is one of (sizes take k/M suffixes; offsets are bytes):
#   size                     print the export size
#   fill OFF LEN BYTE        write LEN bytes of BYTE (e.g. 0xab) at OFF
#   check OFF LEN BYTE       read and compare with BYTE; exit 2 if different
#   wfile OFF FILE           write the contents of FILE at OFF
#   rfile OFF LEN FILE       read LEN bytes at OFF into FILE
#   sha OFF LEN              print the sha256 of the bytes read
#   dump FILE                read the whole export into FILE
#   cache OFF LEN            NBD_CMD_CACHE (prefetch)
#   flush                    NBD_CMD_FLUSH
#   flags                    print the export's flags (can_* = 0/1)
# Requests are split into 1 MiB pieces.  An NBD error prints
# "nbdio: error: ..." with the errno name and exits 1.
import hashlib
import sys

import nbd

CHUNK = 1 << 20


def num(s):
    s = s.strip()
    mult = {"k": 1 << 10, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s[-1] in mult:
        return int(s[:-1], 0) * mult[s[-1]]
    return int(s, 0)


def pieces(off, length):
    end = off + length
    while off < end:
        n = min(CHUNK, end - off)
        yield off, n
        off += n


def main():
    sock, cmd, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    h = nbd.NBD()
    h.connect_unix(sock)
    try:
        if cmd == "size":
            print(h.get_size())
        elif cmd == "fill":
            off, length, byte = num(args[0]), num(args[1]), num(args[2])
            for o, n in pieces(off, length):
                h.pwrite(bytes([byte]) * n, o)
        elif cmd == "check":
            off, length, byte = num(args[0]), num(args[1]), num(args[2])
            for o, n in pieces(off, length):
                buf = h.pread(n, o)
                if buf != bytes([byte]) * n:
                    i = next(i for i in range(n) if buf[i] != byte)
                    print("nbdio: byte %d (offset %d) is 0x%02x, expected "
                          "0x%02x" % (o + i - off, o + i, buf[i], byte),
                          file=sys.stderr)
                    sys.exit(2)
        elif cmd == "wfile":
            off = num(args[0])
            with open(args[1], "rb") as f:
                data = f.read()
            for o, n in pieces(off, len(data)):
                h.pwrite(data[o - off:o - off + n], o)
        elif cmd == "rfile":
            off, length = num(args[0]), num(args[1])
            with open(args[2], "wb") as f:
                for o, n in pieces(off, length):
                    f.write(h.pread(n, o))
        elif cmd == "sha":
            off, length = num(args[0]), num(args[1])
            m = hashlib.sha256()
            for o, n in pieces(off, length):
                m.update(h.pread(n, o))
            print(m.hexdigest())
        elif cmd == "dump":
            with open(args[0], "wb") as f:
                for o, n in pieces(0, h.get_size()):
                    f.write(h.pread(n, o))
        elif cmd == "cache":
            off, length = num(args[0]), num(args[1])
            for o, n in pieces(off, length):
                h.cache(n, o)
        elif cmd == "flush":
            h.flush()
        elif cmd == "flags":
            for f in ("can_cache", "can_df", "can_fast_zero", "can_flush",
                      "can_fua", "can_meta_context", "can_multi_conn",
                      "can_trim", "can_zero", "is_read_only"):
                if f == "can_meta_context":
                    v = h.can_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
                else:
                    v = getattr(h, f)()
                print("%s=%d" % (f, v))
        else:
            print("nbdio: unknown command %s" % cmd, file=sys.stderr)
            sys.exit(3)
    except nbd.Error as e:
        print("nbdio: error: %s (errno %s)" % (e.string, e.errno),
              file=sys.stderr)
        sys.exit(1)
    try:
        h.shutdown()
    except nbd.Error:
        pass


main()
