#!/usr/bin/env python3
# bcachefilter tests: parse and check "bcachefilter-ctl stats --prometheus"
# (Prometheus's text exposition format 0.0.4), read on stdin.
#
#   prometheus.py check              every rule below, or exit 1 saying
#                                    which line breaks which
#   prometheus.py value NAME [L=V]   print the value of the sample NAME
#                                    (with label L equal to V), exit 1 if
#                                    there is none
#
# The rules checked: every line is a comment (# HELP, # TYPE) or a sample
# "name{labels} value"; every sample belongs to a family that has exactly
# one # HELP and one # TYPE before its first sample; names are
# bcachefilter_[a-z0-9_]+; a TYPE is counter, gauge or histogram; a
# counter family's name ends in _total; a histogram has only _bucket
# (with an le label, cumulative counts that never decrease, ending with
# le="+Inf"), _sum and _count samples, and its +Inf bucket equals its
# count; every value is a finite number; label values are quoted and a
# sample is never repeated.
import math
import re
import sys

NAME = re.compile(r"^bcachefilter_[a-z0-9_]+$")
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})? (\S+)$')
LABEL = re.compile(r'^\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(,|$)')


class Bad(Exception):
    pass


def parse_labels(text, lineno):
    labels = {}
    while text:
        m = LABEL.match(text)
        if not m:
            raise Bad(f"line {lineno}: bad labels {text!r}")
        labels[m.group(1)] = m.group(2)
        text = text[m.end():]
    return labels


def parse(text):
    """Families: {name: {"help", "type", "samples": [(name, labels, value)]}}."""
    fams, order = {}, []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line:
            continue
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) < 4 or parts[1] not in ("HELP", "TYPE"):
                raise Bad(f"line {lineno}: a comment that is not HELP or TYPE: {line!r}")
            f = fams.setdefault(parts[2], {"help": None, "type": None,
                                           "samples": []})
            key = parts[1].lower()
            if f[key] is not None:
                raise Bad(f"line {lineno}: a second {parts[1]} for {parts[2]}")
            if f["samples"]:
                raise Bad(f"line {lineno}: {parts[1]} after samples of {parts[2]}")
            f[key] = parts[3]
            if parts[2] not in order:
                order.append(parts[2])
            continue
        m = SAMPLE.match(line)
        if not m:
            raise Bad(f"line {lineno}: not a sample: {line!r}")
        name, labels = m.group(1), parse_labels(m.group(3) or "", lineno)
        try:
            value = float(m.group(4))
        except ValueError:
            raise Bad(f"line {lineno}: value {m.group(4)!r} is not a number")
        if math.isnan(value) or math.isinf(value):
            raise Bad(f"line {lineno}: value {m.group(4)} is not finite")
        fam = name
        for suffix in ("_bucket", "_sum", "_count"):
            base = name[:-len(suffix)]
            if name.endswith(suffix) and base in fams and \
               fams[base]["type"] == "histogram":
                fam = base
        if fam not in fams or fams[fam]["type"] is None or \
           fams[fam]["help"] is None:
            raise Bad(f"line {lineno}: {name} has no # HELP and # TYPE before it")
        fams[fam]["samples"].append((name, labels, value))
    return fams


def check(fams):
    seen = set()
    for fam, f in fams.items():
        if not NAME.match(fam):
            raise Bad(f"{fam}: not a bcachefilter_[a-z0-9_]+ name")
        if f["type"] not in ("counter", "gauge", "histogram"):
            raise Bad(f"{fam}: type {f['type']!r}")
        if not f["help"].strip():
            raise Bad(f"{fam}: empty help")
        if not f["samples"]:
            raise Bad(f"{fam}: no samples")
        if f["type"] == "counter" and not fam.endswith("_total"):
            raise Bad(f"{fam}: a counter whose name does not end in _total")
        if f["type"] != "counter" and fam.endswith("_total"):
            raise Bad(f"{fam}: a {f['type']} named like a counter")
        for name, labels, value in f["samples"]:
            key = (name, tuple(sorted(labels.items())))
            if key in seen:
                raise Bad(f"{name}{labels}: repeated")
            seen.add(key)
            if f["type"] == "counter" and value < 0:
                raise Bad(f"{name}: a negative counter")
        if f["type"] == "histogram":
            buckets = [(s[1].get("le"), s[2]) for s in f["samples"]
                       if s[0] == fam + "_bucket"]
            other = {s[0]: s[2] for s in f["samples"]
                     if s[0] != fam + "_bucket"}
            if set(other) != {fam + "_sum", fam + "_count"}:
                raise Bad(f"{fam}: samples {sorted(other)}, not _sum and _count")
            if not buckets or buckets[-1][0] != "+Inf":
                raise Bad(f"{fam}: the last bucket is not le=\"+Inf\"")
            les = [float(le) for le, _ in buckets]
            if les != sorted(les) or len(set(les)) != len(les):
                raise Bad(f"{fam}: le bounds not increasing: {les}")
            counts = [c for _, c in buckets]
            if counts != sorted(counts):
                raise Bad(f"{fam}: bucket counts decrease: {counts}")
            if counts[-1] != other[fam + "_count"]:
                raise Bad(f"{fam}: +Inf bucket {counts[-1]} != count "
                          f"{other[fam + '_count']}")


def value(fams, name, want):
    for f in fams.values():
        for n, labels, v in f["samples"]:
            if n == name and all(labels.get(k) == x for k, x in want.items()):
                return v
    return None


def main():
    text = sys.stdin.read()
    try:
        fams = parse(text)
        if sys.argv[1] == "check":
            check(fams)
            print(f"prometheus.py: {len(fams)} families, "
                  f"{sum(len(f['samples']) for f in fams.values())} samples: ok")
            return 0
        want = dict(a.split("=", 1) for a in sys.argv[3:])
        v = value(fams, sys.argv[2], want)
        if v is None:
            print(f"prometheus.py: no sample {sys.argv[2]} {want}", file=sys.stderr)
            return 1
        print(int(v) if v == int(v) else v)
        return 0
    except Bad as e:
        print(f"prometheus.py: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
