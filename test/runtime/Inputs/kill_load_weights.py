"""Kills `loom-run BUNDLE` at varied moments from its start to after its end,
across its session's loading of the bundle's weights (`Session::loadWeights`,
which `loom_session_load_weights` calls), and checks that no file of the
bundle changed or was added and that a later run loads the weights and gives
the same outputs, byte for byte.

usage: kill_load_weights.py LOOM_RUN BUNDLE WORKDIR [KILLS]
"""
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time

loom_run, bundle, work = sys.argv[1:4]
kills = int(sys.argv[4]) if len(sys.argv) > 4 else 12
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)

def contents(path):
    """Every file of a directory by name, with its digest."""
    return {name: hashlib.sha256(open(os.path.join(path, name), "rb").read()).hexdigest()
            for name in os.listdir(path)}

def outputs(name):
    out = os.path.join(work, name)
    subprocess.run([loom_run, bundle, "--output", out], check=True, stdout=subprocess.DEVNULL)
    return hashlib.sha256(open(out, "rb").read()).hexdigest()

before = contents(bundle)
start = time.time()
expected = outputs("before.safetensors")
seconds = time.time() - start

cut_off = 0
for k in range(kills):
    moment = seconds * 1.2 * k / max(1, kills - 1)  # from at once to after it would end
    job = subprocess.Popen([loom_run, bundle], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(moment)
    job.send_signal(signal.SIGKILL)
    cut_off += job.wait() == -signal.SIGKILL
    if contents(bundle) != before:
        sys.exit(f"kill {k} at {moment:.3f} s changed {bundle}: {sorted(contents(bundle))}")
if outputs("after.safetensors") != expected:
    sys.exit("after the kills the bundle's weights give other outputs")
print(f"{kills} kills over {seconds:.2f} s of loading and running ({cut_off} before it "
      f"ended): the bundle unchanged, the same outputs after")
