"""Runs `loomc verify` on prefixes of every model file; each must fail cleanly (exit 1)."""
import os
import subprocess
import sys
import tempfile

loomc, models = sys.argv[1], sys.argv[2]
failures = 0
with tempfile.TemporaryDirectory() as tmp:
    for name in sorted(os.listdir(models)):
        if not name.endswith(".mlir"):
            continue
        text = open(os.path.join(models, name)).read()
        for i in range(1, 12):
            cut = len(text) * i // 12
            path = os.path.join(tmp, "cut.mlir")
            with open(path, "w") as f:
                f.write(text[:cut])
            r = subprocess.run([loomc, "verify", path], capture_output=True, text=True)
            if r.returncode != 1 or "error:" not in r.stderr:
                print(f"{name} cut at {cut}: exit {r.returncode}\n{r.stderr[-2000:]}")
                failures += 1
print(f"{failures} failures")
sys.exit(1 if failures else 0)
