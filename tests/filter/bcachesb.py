#!/usr/bin/env python3
# bcachefilter tests: read and rewrite bcache superblocks in image files,
# as the kernel would (tests/test-filter-bdev.sh, tests/kernel/).
#
#   bcachesb.py show IMG [FIELD]       the superblock at byte 4096 as JSON
#                                      (or one field of it)
#   bcachesb.py set-state IMG SET STATE
#                                      a backing device's set_uuid and
#                                      BDEV_STATE (none|clean|dirty|stale),
#                                      checksum recomputed: what the kernel
#                                      writes on attach, detach, and when
#                                      dirty data appears or is written back
#   bcachesb.py poison IMG BYTE        overwrite a backing device's data
#                                      region (from data_offset) with BYTE,
#                                      keeping its superblock
#
# The checksum is the kernel's bch_crc64 (CRC-64/ECMA-182, MSB first, init
# and final xor ~0) over bytes [8, 208 + 8 * keys) of the area
# (research/bcache.md §1.2).  The fields are decoded here independently of
# core/format.c, so the tests check the C code against a second reading.
import json
import os
import struct
import sys

SB_OFFSET = 4096
MAGIC = bytes.fromhex("c68573f64e1a45ca8265f57f48ba6d81")
STATES = ["none", "clean", "dirty", "stale"]
MODES = ["writethrough", "writeback", "writearound", "none"]

_POLY = 0x42F0E1EBA9EA3693
_MASK = (1 << 64) - 1
_TABLE = []
for _i in range(256):
    _c = _i << 56
    for _ in range(8):
        _c = ((_c << 1) ^ _POLY) if _c >> 63 else (_c << 1)
        _c &= _MASK
    _TABLE.append(_c)


def crc64(data):
    crc = _MASK
    for b in data:
        crc = _TABLE[((crc >> 56) ^ b) & 0xff] ^ ((crc << 8) & _MASK)
    return crc ^ _MASK


def uuid_str(b):
    h = b.hex()
    return f"{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def read_area(path):
    with open(path, "rb") as f:
        f.seek(SB_OFFSET)
        return bytearray(f.read(4096))


def csum(area):
    keys = min(struct.unpack_from("<H", area, 206)[0], 256)
    return crc64(bytes(area[8:208 + 8 * keys]))


def decode(area):
    stored, offset, version = struct.unpack_from("<QQQ", area, 0)
    flags = struct.unpack_from("<Q", area, 104)[0]
    d = {
        "magic_ok": bytes(area[24:40]) == MAGIC,
        "csum_ok": stored == csum(area),
        "offset": offset,
        "version": version,
        "uuid": uuid_str(area[40:56]),
        "set_uuid": uuid_str(area[56:72]),
        "label": bytes(area[72:104]).rstrip(b"\0").decode("latin1"),
        "seq": struct.unpack_from("<Q", area, 112)[0],
        "block_size": struct.unpack_from("<H", area, 192)[0],
    }
    if version in (1, 4, 6):
        d["kind"] = "backing"
        d["data_offset"] = 16 if version == 1 else \
            struct.unpack_from("<Q", area, 184)[0]
        d["cache_mode"] = MODES[flags & 0xf] if flags & 0xf < 4 else flags & 0xf
        d["state"] = STATES[(flags >> 61) & 3]
    else:
        d["kind"] = "cache"
        d["nbuckets"] = struct.unpack_from("<Q", area, 184)[0]
        d["bucket_size"] = struct.unpack_from("<H", area, 194)[0]
        d["sync"] = bool(flags & 1)
        # Feature words exist from version 5 (bcachefilter sets bit 63,
        # its write-intent bit, while write-intent marks may exist).
        d["feature_incompat"] = struct.unpack_from("<Q", area, 128)[0] \
            if version == 5 else 0
    return d


def backing_or_die(path):
    area = read_area(path)
    d = decode(area)
    if not d["magic_ok"] or not d["csum_ok"] or d["kind"] != "backing":
        sys.exit(f"bcachesb: {path}: not a valid bcache backing superblock: {d}")
    return area, d


def cmd_show(path, field=None):
    d = decode(read_area(path))
    print(d[field] if field else json.dumps(d, indent=1))


def cmd_set_state(path, set_uuid, state):
    area, _ = backing_or_die(path)
    area[56:72] = bytes.fromhex(set_uuid.replace("-", ""))
    flags = struct.unpack_from("<Q", area, 104)[0]
    flags = (flags & ~(3 << 61)) | (STATES.index(state) << 61)
    struct.pack_into("<Q", area, 104, flags)
    struct.pack_into("<Q", area, 0, csum(area))
    with open(path, "r+b") as f:
        f.seek(SB_OFFSET)
        f.write(area)


def cmd_poison(path, byte):
    _, d = backing_or_die(path)
    start = d["data_offset"] * 512
    size = os.path.getsize(path)
    chunk = bytes([int(byte, 0)]) * (1 << 20)
    with open(path, "r+b") as f:
        f.seek(start)
        left = size - start
        while left > 0:
            n = min(left, len(chunk))
            f.write(chunk[:n])
            left -= n


def main():
    a = sys.argv[1:]
    if len(a) >= 2 and a[0] == "show":
        cmd_show(*a[1:3])
    elif len(a) == 4 and a[0] == "set-state":
        cmd_set_state(a[1], a[2], a[3])
    elif len(a) == 3 and a[0] == "poison":
        cmd_poison(a[1], a[2])
    else:
        sys.exit("usage: bcachesb.py show IMG [FIELD] | set-state IMG SET "
                 "STATE | poison IMG BYTE")


if __name__ == "__main__":
    main()
