#!/usr/bin/env python3
"""Reads the kernel timelines that runtime/tools/kernel-trace.cpp writes.

  kernel_timeline.py summary T.csv [--device D] [--steps K]
      per GPU, the mean of the last K steps: the step, the time some compute
      kernel runs, the time NCCL runs, both at once, NCCL alone (exposed) and
      neither (idle), then the kernels that take the most time a step, with
      the share of each that ran beside NCCL.
  kernel_timeline.py compare A.csv B.csv [--device-a D] [--device-b D]
      the same kernels a step in A (say one GPU) and in B (say a dp2 rank):
      where B's compute time goes, each kernel's time beside NCCL and away
      from it, against A's.

Steps are found from the optimizer's kernel (--marker, a regex, "adam" by
default: the generated update and the runtime's adamwKernel): a step ends where a run of marker kernels ends. Kernels whose name
matches --comm (nccl) are communication; every other kernel, copy and memset
is compute. Times are GPU times from CUPTI, one clock for every GPU.
"""
import argparse
import bisect
import collections
import csv
import re
import sys


def load(path):
    by_device = collections.defaultdict(list)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            try:
                rec = (int(row["start_ns"]), int(row["end_ns"]), row["name"], int(row["stream"]), row["kind"])
            except (KeyError, ValueError) as e:
                sys.exit(f"kernel_timeline: {path}: not a kernel-trace CSV ({e})")
            by_device[int(row["device"])].append(rec)
    for recs in by_device.values():
        recs.sort()
    if not by_device:
        sys.exit(f"kernel_timeline: {path} holds no records (was LOOM_KERNEL_TRACE set and the program run to its end?)")
    return by_device


def step_windows(recs, marker, gap_ns=1_000_000):
    ends, last = [], None
    for start, end, name, _, _ in recs:
        if marker.search(name):
            if last is not None and start - last > gap_ns:
                ends.append(last)
            last = end if last is None else max(last, end)
    if last is not None:
        ends.append(last)
    return list(zip(ends, ends[1:]))


def union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def length(intervals):
    return sum(e - s for s, e in intervals)


def intersect(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append([s, e])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def overlap_with(s, e, merged, starts):
    """Time of [s, e) covered by the sorted, disjoint intervals `merged`."""
    i = max(bisect.bisect_right(starts, s) - 1, 0)
    t = 0
    while i < len(merged) and merged[i][0] < e:
        t += max(0, min(e, merged[i][1]) - max(s, merged[i][0]))
        i += 1
    return t


def analyse(recs, window, comm):
    lo, hi = window
    inside = [r for r in recs if r[0] >= lo and r[1] <= hi]
    compute = union([[s, e] for s, e, n, _, _ in inside if not comm.search(n)])
    nccl = union([[s, e] for s, e, n, _, _ in inside if comm.search(n)])
    both = intersect(compute, nccl)
    starts = [s for s, _ in nccl]
    kernels = collections.defaultdict(lambda: [0, 0, 0, 0, 0])
    # name -> [ns, ns beside NCCL, count, ns of the runs mostly beside NCCL, their count]
    for s, e, n, _, _ in inside:
        k = kernels[n]
        k[0] += e - s
        k[2] += 1
        if not comm.search(n):
            beside = overlap_with(s, e, nccl, starts)
            k[1] += beside
            if 2 * beside > e - s:
                k[3] += e - s
                k[4] += 1
    return {
        "step": hi - lo,
        "compute": length(compute),
        "nccl": length(nccl),
        "both": length(both),
        "kernels": kernels,
    }


def mean_steps(recs, args, comm):
    windows = step_windows(recs, re.compile(args.marker))
    if not windows:
        sys.exit(f"kernel_timeline: no two runs of the marker kernel /{args.marker}/: pass --marker")
    windows = windows[-args.steps:] if args.steps else windows[len(windows) // 2:]
    results = [analyse(recs, w, comm) for w in windows]
    n = len(results)
    total = {k: sum(r[k] for r in results) / n for k in ("step", "compute", "nccl", "both")}
    kernels = collections.defaultdict(lambda: [0.0] * 5)
    for r in results:
        for name, values in r["kernels"].items():
            k = kernels[name]
            for i, v in enumerate(values):
                k[i] += v / n
    total["kernels"] = kernels
    total["steps"] = n
    return total


def ms(ns):
    return ns / 1e6


def print_summary(label, t):
    exposed = t["nccl"] - t["both"]
    idle = t["step"] - t["compute"] - exposed
    print(f"{label}: {t['steps']} steps; step {ms(t['step']):.2f} ms: compute {ms(t['compute']):.2f} "
          f"(beside NCCL {ms(t['both']):.2f}), NCCL {ms(t['nccl']):.2f} (alone {ms(exposed):.2f}), idle {ms(idle):.2f}")


def top(kernels, comm, n):
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:n]
    for name, (t, beside, count, _, _) in rows:
        share = "" if comm.search(name) else f"{100 * beside / t:5.1f}% beside NCCL" if t else ""
        print(f"  {ms(t):8.3f} ms  {count:6.0f}x  {share:20s} {name[:110]}")


def cmd_summary(args):
    comm = re.compile(args.comm)
    for device, recs in sorted(load(args.trace).items()):
        if args.device is not None and device != args.device:
            continue
        t = mean_steps(recs, args, comm)
        print_summary(f"GPU {device}", t)
        top(t["kernels"], comm, args.top)


def cmd_compare(args):
    comm = re.compile(args.comm)
    a = mean_steps(load(args.a)[args.device_a], args, comm)
    b = mean_steps(load(args.b)[args.device_b], args, comm)
    print_summary(f"A ({args.a}, GPU {args.device_a})", a)
    print_summary(f"B ({args.b}, GPU {args.device_b})", b)
    names = set(a["kernels"]) | set(b["kernels"])
    rows = []
    for name in names:
        if comm.search(name):
            continue
        ta, _, ca, _, _ = a["kernels"].get(name, (0,) * 5)
        tb, beside, cb, tbb, cbb = b["kernels"].get(name, (0,) * 5)
        rows.append((tb - ta, name, ta, tb, beside, ca, cb, tbb, cbb))
    rows.sort(key=lambda r: -abs(r[0]))
    grown = sum(r[0] for r in rows)
    print(f"compute kernels: B - A = {ms(grown):+.3f} ms a step (sum of kernel times, overlapping kernels counted twice)")
    print("  mean us of one run: A's; B's away from NCCL; B's mostly beside it (count)")
    print(f"  {'B - A':>9}  {'A ms':>8}  {'B ms':>8}  {'beside':>7}  {'A us':>8} {'B away':>8} {'B beside':>8} ({'n':>4})  kernel")
    for d, name, ta, tb, beside, ca, cb, tbb, cbb in rows[: args.top]:
        mean_a = ta / ca / 1e3 if ca else 0
        away = (tb - tbb) / (cb - cbb) / 1e3 if cb - cbb > 0.5 else float("nan")
        near = tbb / cbb / 1e3 if cbb > 0.5 else float("nan")
        print(f"  {ms(d):+9.3f}  {ms(ta):8.3f}  {ms(tb):8.3f}  {100 * beside / tb if tb else 0:6.1f}%  "
              f"{mean_a:8.1f} {away:8.1f} {near:8.1f} ({cbb:4.0f})  {name[:80]}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--marker", default="adam", help="regex of the kernel that ends a step")
    p.add_argument("--comm", default="(?i)nccl", help="regex of communication kernels")
    p.add_argument("--steps", type=int, default=0, help="the last K steps (default: the later half)")
    p.add_argument("--top", type=int, default=25)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summary")
    s.add_argument("trace")
    s.add_argument("--device", type=int)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--device-a", type=int, default=0)
    c.add_argument("--device-b", type=int, default=0)
    args = p.parse_args()
    {"summary": cmd_summary, "compare": cmd_compare}[args.cmd](args)


if __name__ == "__main__":
    main()
