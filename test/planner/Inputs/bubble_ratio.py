"""Prints the second plan's (ZB-H1) predicted bubble over the first's (1F1B),
and what Qi et al.'s formulas give for it from the slowest stage's forward F,
backward B + W and weight-gradient W times: (F + B - 2W) / (F + B), and
whether the two are within 0.1. The planner simulates both schedules with each
stage's own times, which the closed form (every stage the slowest) does not."""
import json
import sys

a, b = (json.load(open(p)) for p in sys.argv[1:3])
ratio = b["predicted"]["bubble_ms"] / a["predicted"]["bubble_ms"]
slowest = max(b["stages"], key=lambda s: s["forward_ms"] + s["backward_ms"])
f, bw, w = slowest["forward_ms"], slowest["backward_ms"], slowest["weight_grad_ms"]
formula = (f + bw - 2 * w) / (f + bw)
print(f"{b['schedule']} bubble / {a['schedule']} bubble {ratio:.3f}, "
      f"formula {formula:.3f} ({'within 0.1' if abs(ratio - formula) < 0.1 else 'further apart'})")
