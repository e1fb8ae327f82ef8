#!/usr/bin/env python3
"""Compares the last step of two loom-run --trace timelines, op by op.

usage: scripts/trace-compare.py BASE.json[.gz] OTHER.json[.gz] [--top N]

For each program (forward, backward, update...) of the last step: its span
in both traces, and the ops whose summed time changed most, for every rank
of OTHER against rank 0 of BASE (say one GPU against dp2: where does dp2's
extra time go). Then OTHER's collectives on the communication track: when
each started after its program began, and how long it took, and how much of
the change falls in instructions that ran while one of them was in flight.
Instruction indices differ between bundles (a dp2 backward has all-reduces),
so ops are compared by kind, summed over the program, and instructions one
by one as the n-th of their kind.

Use traces taken the same way: under LOOM_CUDA_TRACE_GRAPHS=1 the steps
are the graphed ones, lengthened by their event nodes.
"""
import argparse
import collections
import gzip
import json
import re

ap = argparse.ArgumentParser()
ap.add_argument("base")
ap.add_argument("other")
ap.add_argument("--top", type=int, default=6)
args = ap.parse_args()


def load(path):
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        doc = json.load(f)
    return [e for e in (doc["traceEvents"] if isinstance(doc, dict) else doc) if e.get("ph") == "X"]


def runs(events, pid, tid):
    """The program runs of one rank's track, in time order: [(program, [(op, start, dur)])]."""
    out = []
    last = None
    for e in sorted((e for e in events if e["pid"] == pid and e["tid"] == tid), key=lambda e: e["ts"]):
        what = e["args"]["instruction"]
        m = re.match(r"instruction (\w+)\[(\d+)\] '(\w+)'", what)
        # a program's closing join ("backward: the join of its collectives") ends its run
        program, index, op = (m.group(1), int(m.group(2)), m.group(3)) if m else (what.split(":")[0], 1 << 60, "join")
        if not out or out[-1][0] != program or index <= last:
            out.append((program, []))
        out[-1][1].append((op, e["ts"], e["dur"]))
        last = index
    return out


def last_run(rs, program):
    found = [r for r in rs if r[0] == program]
    return found[-1][1] if found else []


def span(ins):
    return (ins[-1][1] + ins[-1][2] - ins[0][1]) / 1e3 if ins else 0.0


def by_op(ins):
    total = collections.defaultdict(float)
    for op, _, dur in ins:
        total[op] += dur
    return total


def by_ordinal(ins):
    """{(op, n): (start, dur)}: the n-th instruction of each kind, collectives left out."""
    seen = collections.Counter()
    out = {}
    for op, start, dur in ins:
        if op not in ("all_reduce", "join"):
            out[(op, seen[op])] = (start, dur)
            seen[op] += 1
    return out


base, other = load(args.base), load(args.other)
base_runs = runs(base, 0, 0)
programs = list(dict.fromkeys(r[0] for r in base_runs))
for pid in sorted({e["pid"] for e in other}):
    other_runs = runs(other, pid, 0)
    for program in programs:
        a, b = last_run(base_runs, program), last_run(other_runs, program)
        if not a or not b:
            continue
        ta, tb = by_op(a), by_op(b)
        ops = sorted(set(ta) | set(tb), key=lambda op: -abs(tb[op] - ta[op]))[: args.top]
        print(f"rank {pid} {program}: {span(a):.3f} -> {span(b):.3f} ms;",
              ", ".join(f"{op} {(tb[op] - ta[op]) / 1e3:+.3f}" for op in ops))
    comm = runs(other, pid, 1)
    for program in programs:
        c, b = last_run(comm, program), last_run(other_runs, program)
        if not c or not b:
            continue
        print(f"rank {pid} {program} collectives (start after the program's, duration; us):",
              " ".join(f"{c_start - b[0][1]:.0f}+{dur:.0f}" for _, c_start, dur in c))
        windows = [(start, start + dur) for _, start, dur in c]
        base_by_kind = by_ordinal(last_run(base_runs, program))
        change = {True: [0, 0.0], False: [0, 0.0]}  # beside a collective: [instructions, us]
        for key, (start, dur) in by_ordinal(b).items():
            if key in base_by_kind:
                beside = any(min(start + dur, w1) > max(start, w0) for w0, w1 in windows)
                change[beside][0] += 1
                change[beside][1] += dur - base_by_kind[key][1]
        print(f"rank {pid} {program}: {change[True][0]} instructions beside a collective "
              f"{change[True][1] / 1e3:+.3f} ms, {change[False][0]} others {change[False][1] / 1e3:+.3f} ms")
