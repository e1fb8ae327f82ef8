"""Kills `loomc compile -o DIR` over an existing bundle at varied moments and
checks that DIR then holds the old bundle or the new one, whole, never a mix,
and that interrupted compiles leave no growing litter beside it.

usage: kill_compile.py LOOMC MODEL WORKDIR [KILLS]
"""
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time

loomc, model, work = sys.argv[1:4]
kills = int(sys.argv[4]) if len(sys.argv) > 4 else 12
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
target = os.path.join(work, "out.loom")

def compile_args(seed, out):
    return [loomc, "compile", model, "--train", "--batch", "4", "--seed", str(seed), "-o", out]

def contents(path):
    """Every file of a bundle by relative path, with its digest."""
    found = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            found[os.path.relpath(full, path)] = hashlib.sha256(open(full, "rb").read()).hexdigest()
    return found

# The two bundles (different seeds: different weights, the same manifest).
subprocess.run(compile_args(1, os.path.join(work, "old.loom")), check=True, stdout=subprocess.DEVNULL)
start = time.time()
subprocess.run(compile_args(2, os.path.join(work, "new.loom")), check=True, stdout=subprocess.DEVNULL)
seconds = time.time() - start
old, new = contents(os.path.join(work, "old.loom")), contents(os.path.join(work, "new.loom"))
assert old != new, "the two seeds gave the same bundle"

outcomes = {"old": 0, "new": 0}
for k in range(kills):
    if not os.path.exists(target) or contents(target) != old:
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(os.path.join(work, "old.loom"), target)
    job = subprocess.Popen(compile_args(2, target), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(seconds * 2.5 * k / max(1, kills - 1))  # from at once to well after it would end
    job.send_signal(signal.SIGKILL)
    job.wait()
    now = contents(target) if os.path.isdir(target) else None
    if now == old:
        outcomes["old"] += 1
    elif now == new:
        outcomes["new"] += 1
    else:
        sys.exit(f"kill {k} at {seconds * 2.5 * k / max(1, kills - 1):.3f} s left {target} neither the old "
                 f"bundle nor the new one: {sorted(now or {})}")
# A compile that finishes clears what the killed ones left beside the bundle.
subprocess.run(compile_args(2, target), check=True, stdout=subprocess.DEVNULL)
litter = [name for name in os.listdir(work) if name.startswith("out.loom.")]
if litter:
    sys.exit(f"interrupted compiles left {litter} beside the bundle")
if contents(target) != new:
    sys.exit("the last compile did not leave the new bundle")
print(f"{kills} kills over {seconds:.2f} s of compiling: the old bundle {outcomes['old']} times, the new "
      f"one {outcomes['new']} times, never a mix; no litter left")
