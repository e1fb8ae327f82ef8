"""Kills `loom-run --save-every 1 --checkpoint DIR` over an existing checkpoint
at varied moments and checks that DIR/checkpoint.safetensors then holds the
old checkpoint or a complete new one (byte for byte the checkpoint an
uninterrupted run writes at that step, and it resumes), never a mix, and that
the next save removes what the killed saves left beside it.

usage: kill_checkpoint.py LOOM_RUN BUNDLE WORKDIR [KILLS]
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
old_step, last_step = 1, 4
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
ckdir = os.path.join(work, "ck")
target = os.path.join(ckdir, "checkpoint.safetensors")

def run(*args):
    subprocess.run([loom_run, bundle, *args], check=True, stdout=subprocess.DEVNULL)

def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()

# The checkpoint an uninterrupted run leaves at each step: the old one (step
# 1) and every one the killed runs may write (steps 2 to 4).
saved = {}
for step in range(old_step, last_step + 1):
    out = os.path.join(work, f"ref{step}")
    run("--steps", str(step), "--save-every", str(step), "--checkpoint", out)
    saved[digest(os.path.join(out, "checkpoint.safetensors"))] = step
old = os.path.join(work, f"ref{old_step}", "checkpoint.safetensors")
assert len(saved) == last_step - old_step + 1, "two steps saved the same checkpoint"

# Each killed run resumes from the old checkpoint and saves over it after
# every step, as a long training run does.
killed_args = ["--steps", str(last_step), "--save-every", "1", "--checkpoint", ckdir, "--resume", ckdir]
os.makedirs(ckdir)
shutil.copyfile(old, target)
# How long a step and its save take: from the first step the run prints to its end.
job = subprocess.Popen([loom_run, bundle, *killed_args], stdout=subprocess.PIPE, text=True)
first = None
for line in job.stdout:
    first = first or (time.time() if line.startswith("step ") else None)
assert job.wait() == 0 and first, "the uninterrupted run failed"
step_seconds = (time.time() - first) / (last_step - old_step)
assert saved.get(digest(target)) == last_step, "the uninterrupted run saved another checkpoint"

def kill_after(step, fraction):
    """Starts a run, waits for it to print `step` (the save of that step
    follows at once), sleeps `fraction` of a step and its save, and kills it;
    returns whether it was killed part-way through writing a checkpoint."""
    job = subprocess.Popen([loom_run, bundle, *killed_args], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    for line in job.stdout:
        if line.startswith(f"step {step}/"):
            break
    time.sleep(fraction * step_seconds)
    job.send_signal(signal.SIGKILL)
    job.wait()
    job.stdout.close()
    return os.path.exists(f"{target}.tmp-{job.pid}")

steps_seen = {}
mid_save = 0
for k in range(kills):
    if saved.get(digest(target)) != old_step:
        shutil.copyfile(old, target)
    # Each step in turn, from at once after it to after its save would end.
    step = old_step + 1 + k % (last_step - old_step)
    fraction = 1.2 * k / max(1, kills - 1)
    mid_save += kill_after(step, fraction)
    now = saved.get(digest(target)) if os.path.exists(target) else None
    if now is None:
        sys.exit(f"kill {k}, {fraction:.2f} of a step after step {step}, left {target} neither "
                 f"the old checkpoint nor a complete new one")
    steps_seen[now] = steps_seen.get(now, 0) + 1
# Every checkpoint a kill left resumes (the old one, and each new one seen).
for step in steps_seen:
    out = subprocess.run([loom_run, bundle, "--steps", str(step), "--resume",
                          os.path.join(work, f"ref{step}")], check=True, capture_output=True, text=True)
    if f"at step {step}" not in out.stdout:
        sys.exit(f"the checkpoint of step {step} did not resume: {out.stdout}")
# A save that finishes clears what the killed ones left beside the checkpoint.
shutil.copyfile(old, target)
run(*killed_args)
litter = sorted(name for name in os.listdir(ckdir) if name != "checkpoint.safetensors")
if litter:
    sys.exit(f"interrupted saves left {litter} beside the checkpoint")
if saved.get(digest(target)) != last_step:
    sys.exit("the last run did not leave the checkpoint of its last step")
print(f"{kills} kills over steps of {step_seconds:.2f} s with their saves, {mid_save} of them part-way "
      f"through a save: left the checkpoint of step " + ", ".join(f"{s} {n} times" for s, n in sorted(steps_seen.items())) +
      "; never a mix; no litter left")
