"""Checks a loom-run --trace file: valid Chrome trace-event JSON, complete.

usage: check_trace.py TRACE BUNDLE STEPS [TRACK...]

Every rank of BUNDLE is a process named after its rank; every instruction of
the programs a training step runs appears once per step on that rank's
compute track (or, for an async collective, on its communication track);
intervals on one track do not overlap; each TRACK named must appear.
"""
import collections
import json
import sys

trace_path, bundle, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
want_tracks = set(sys.argv[4:])
doc = json.load(open(trace_path))
manifest = json.load(open(bundle + "/manifest.json"))
events = doc["traceEvents"]
names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
spans = [e for e in events if e["ph"] == "X"]
bad = []
for e in spans:
    for key in ("name", "cat", "pid", "tid", "ts", "dur"):
        if key not in e:
            bad.append("event without %s: %r" % (key, e))
    if e["dur"] < 0 or e["ts"] < 0:
        bad.append("negative time: %r" % e)
    if tracks.get((e["pid"], e["tid"])) != e["cat"]:
        bad.append("event on an unnamed track: %r" % e)
for rank in manifest["ranks"]:
    r = rank["rank"]
    if not names.get(r, "").startswith("rank %d" % r):
        bad.append("rank %d has no process name" % r)
    programs = [p for p in ("step", "forward", "backward", "update") if p in rank["programs"]]
    if "step" in programs:
        programs = [p for p in programs if p not in ("forward", "backward")]
    expected = collections.Counter()
    for p in programs:
        for ins in rank["programs"][p]:
            expected[ins["op"]] += steps
    got = collections.Counter(e["name"] for e in spans if e["pid"] == r)
    if got != expected:
        diff = {op: (got[op], expected[op]) for op in set(got) | set(expected) if got[op] != expected[op]}
        bad.append("rank %d: events (got, expected) differ: %r" % (r, diff))
by_track = collections.defaultdict(list)
for e in spans:
    by_track[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
for key, iv in by_track.items():
    iv.sort()
    for (a0, a1), (b0, b1) in zip(iv, iv[1:]):
        if b0 < a1 - 1e-3:
            bad.append("overlapping events on %r at %.3f us" % (key, b0))
            break
missing = want_tracks - set(tracks.values())
if missing:
    bad.append("no track named %s" % ", ".join(sorted(missing)))
if bad:
    print("\n".join(bad[:20]))
    sys.exit(1)
print("trace ok: %d events, %d ranks, tracks %s" % (len(spans), len(names), ", ".join(sorted(set(tracks.values())))))
