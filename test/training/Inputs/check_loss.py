"""Checks a loom-run training log: the final loss is at least `drop` below the first."""
import re
import sys

losses = [float(m.group(1)) for m in re.finditer(r"^step \d+/\d+  loss ([0-9.eE+-]+)", open(sys.argv[1]).read(), re.M)]
drop = float(sys.argv[2])
first, last = losses[0], losses[-1]
print(f"{len(losses)} steps, loss {first:.4f} -> {last:.4f} ({(1 - last / first) * 100:.1f}% lower)")
sys.exit(0 if last <= (1 - drop) * first else 1)
