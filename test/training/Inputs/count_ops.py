"""Counts a bundle's instructions by program and op, for ops whose name starts
with one of the arguments, and how many of them carry layout = "nhwc" and
activation = "relu"."""
import collections
import json
import sys

manifest = json.load(open(sys.argv[1]))
counts = collections.Counter()
nhwc = collections.Counter()
relu = collections.Counter()
for rank in manifest["ranks"]:
    for program, instructions in rank["programs"].items():
        for ins in instructions:
            if any(ins["op"].startswith(prefix) for prefix in sys.argv[2:]):
                counts[program, ins["op"]] += 1
                attrs = ins.get("attrs") or {}
                nhwc[program, ins["op"]] += attrs.get("layout") == "nhwc"
                relu[program, ins["op"]] += attrs.get("activation") == "relu"
for (program, op), n in sorted(counts.items()):
    print(f"{program} {op} {n} layout=nhwc {nhwc[program, op]} relu {relu[program, op]}")
