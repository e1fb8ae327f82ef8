"""Checks that two loom-run logs report the same losses within a relative tolerance."""
import re
import sys

def losses(path):
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^step (\d+)/\d+  loss (\S+)", open(path).read(), re.M)}

a, b, tol = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
common = sorted(set(a) & set(b))
worst = max(abs(a[s] - b[s]) / abs(b[s]) for s in common) if common else float("inf")
print(f"{len(common)} common steps, worst relative difference {worst:.2e} (tolerance {tol})")
sys.exit(0 if common and worst <= tol else 1)
