"""Counts a bundle's instructions by program and op, for ops whose name starts
with one of the arguments, and how many of them carry layout = "nhwc"."""
import collections
import json
import sys

manifest = json.load(open(sys.argv[1]))
counts = collections.Counter()
nhwc = collections.Counter()
for rank in manifest["ranks"]:
    for program, instructions in rank["programs"].items():
        for ins in instructions:
            if any(ins["op"].startswith(prefix) for prefix in sys.argv[2:]):
                counts[program, ins["op"]] += 1
                nhwc[program, ins["op"]] += (ins.get("attrs") or {}).get("layout") == "nhwc"
for (program, op), n in sorted(counts.items()):
    print(f"{program} {op} {n} layout=nhwc {nhwc[program, op]}")
