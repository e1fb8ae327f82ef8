#!/usr/bin/env python3
"""Draws a loom-run --trace timeline as an SVG picture (for docs/images).

usage: scripts/trace-svg.py TRACE.json OUT.svg [--last-step] [--title T]

One row per rank and track; boxes coloured by kind (matrix products,
attention, collectives, sends and receives, the rest). --last-steps-of N K
draws the last K of the N steps the trace holds (by time: the trace's span
divided by N), so warm-up steps are left out.
"""
import argparse
import html
import json

ap = argparse.ArgumentParser()
ap.add_argument("trace")
ap.add_argument("out")
ap.add_argument("--last-step", action="store_true")
ap.add_argument("--title", default="")
args = ap.parse_args()

doc = json.load(open(args.trace))
events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
          if e["ph"] == "M" and e["name"] == "thread_name"}
t0 = min(e["ts"] for e in events)
t1 = max(e["ts"] + e["dur"] for e in events)
if args.last_step:
    starts = [e["ts"] for e in events if e["pid"] == min(procs) and
              any(p in e.get("args", {}).get("instruction", "") for p in ("forward[0]", "step[0]"))]
    if starts:
        t0 = max(starts)
        events = [e for e in events if e["ts"] >= t0]

def kind(name):
    if name == "matmul":
        return "#4e79a7", "matrix products"
    if name.startswith("attention"):
        return "#9467bd", "attention"
    if name in ("all_reduce", "reduce_scatter", "all_gather", "global_norm"):
        return "#e15759", "collectives"
    if name in ("send", "recv"):
        return "#f28e2b", "send / recv"
    return "#a0a0a0", "other kernels"

rows = sorted(tracks)
left, width, row_h, top = 260, 1000, 26, 50
height = top + row_h * len(rows) + 70
scale = width / (t1 - t0)
out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">'
       % (left + width + 20, height), '<rect width="100%" height="100%" fill="white"/>']
out.append('<text x="10" y="22" font-size="15" font-weight="bold">%s</text>' % html.escape(args.title))
for i, key in enumerate(rows):
    y = top + i * row_h
    out.append('<text x="10" y="%d">%s: %s</text>' % (y + 17, html.escape(procs.get(key[0], "rank %d" % key[0])),
                                                    html.escape(tracks[key])))
    out.append('<rect x="%d" y="%d" width="%d" height="%d" fill="#f4f4f4"/>' % (left, y + 2, width, row_h - 4))
# Boxes per row; neighbours of one kind closer than half a pixel merge (a
# run of small kernels is one box, as a viewer draws it zoomed out).
for key in rows:
    y = top + rows.index(key) * row_h
    boxes = []
    for e in sorted((e for e in events if (e["pid"], e["tid"]) == key), key=lambda e: e["ts"]):
        x0 = left + max(0.0, e["ts"] - t0) * scale
        x1 = left + (e["ts"] + e["dur"] - t0) * scale
        colour, label = kind(e["name"])
        if boxes and boxes[-1][2] == colour and x0 - boxes[-1][1] < 0.5:
            boxes[-1][1] = max(boxes[-1][1], x1)
            boxes[-1][3] += 1
        else:
            boxes.append([x0, x1, colour, 1, label])
    for x0, x1, colour, n, label in boxes:
        out.append('<rect x="%.2f" y="%d" width="%.2f" height="%d" fill="%s"><title>%s: %d</title></rect>'
                   % (x0, y + 4, max(0.5, x1 - x0), row_h - 8, colour, html.escape(label), n))
axis_y = top + row_h * len(rows) + 14
span_ms = (t1 - t0) / 1000
tick = 1
for t in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000):
    if span_ms / t <= 12:
        tick = t
        break
k = 0
while k * tick <= span_ms + 1e-9:
    x = left + k * tick * 1000 * scale
    out.append('<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#888"/>' % (x, axis_y - 6, x, axis_y))
    out.append('<text x="%.1f" y="%d" text-anchor="middle">%g ms</text>' % (x, axis_y + 12, round(k * tick, 3)))
    k += 1
legend = []
for name in ("matmul", "attention", "all_reduce", "send", "other"):
    colour, label = kind(name)
    legend.append((colour, label))
x = left
for colour, label in legend:
    out.append('<rect x="%d" y="%d" width="12" height="12" fill="%s"/>' % (x, axis_y + 24, colour))
    out.append('<text x="%d" y="%d">%s</text>' % (x + 16, axis_y + 34, label))
    x += 140
out.append("</svg>")
open(args.out, "w").write("\n".join(out))
print("wrote %s: %d events, %.2f ms" % (args.out, len(events), span_ms))
