"""Checks that two loom-run logs report bit-identical losses for the steps both have."""
import re
import sys

def losses(path):
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step (\d+)/\d+  loss (\S+)", open(path).read(), re.M)}

a, b = losses(sys.argv[1]), losses(sys.argv[2])
common = sorted(set(a) & set(b))
bad = [s for s in common if a[s] != b[s]]
print(f"{len(common)} common steps, {len(bad)} differ")
sys.exit(0 if common and not bad else 1)
