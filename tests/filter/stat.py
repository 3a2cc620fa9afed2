#!/usr/bin/env python3
# bcachefilter tests: print a counter from "bcachefilter-ctl stats --json"
# (read on stdin).
#
#   bcachefilter-ctl -s SOCK stats --json | stat.py NAME
#
# The counter is looked up wherever it is in the document: a top-level
# NAME, else NAME inside a "total" object (bcache's stats_total), else the
# first NAME found in a depth-first walk.  Exits 1 if the input is not
# JSON or has no such counter.
import json
import sys


def find(doc, name):
    if isinstance(doc, dict):
        if name in doc and not isinstance(doc[name], (dict, list)):
            return doc[name]
        if isinstance(doc.get("total"), dict):
            v = find(doc["total"], name)
            if v is not None:
                return v
        for v in doc.values():
            r = find(v, name)
            if r is not None:
                return r
    elif isinstance(doc, list):
        for v in doc:
            r = find(v, name)
            if r is not None:
                return r
    return None


text = sys.stdin.read()
try:
    doc = json.loads(text)
except ValueError as e:
    print("stat.py: stats --json is not JSON (%s): %r" % (e, text[:500]),
          file=sys.stderr)
    sys.exit(1)
v = find(doc, sys.argv[1])
if v is None:
    print("stat.py: no counter %s in %s" % (sys.argv[1], text[:2000]),
          file=sys.stderr)
    sys.exit(1)
print(v)
