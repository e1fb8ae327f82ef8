"""Kills one rank of a running multi-process job and checks the others stop.

usage: kill_rank.py --rank-env NAME=VALUE --after TEXT --within SECONDS LOG -- LAUNCHER...

Starts LAUNCHER (mpirun, fake_srun.py) with stdout and stderr to LOG, waits
until LOG shows TEXT (a step was trained), then sends SIGKILL to the loom-run
process whose environment holds NAME=VALUE (the rank to kill). Passes when
the launcher then exits with a non-zero status within SECONDS; fails (and
kills the whole job) if it is still running, so the test never hangs.
"""
import os
import signal
import subprocess
import sys
import time

args = sys.argv[1:]
opts = {}
while args[0].startswith("--"):
    if args[0] == "--":
        break
    opts[args[0]] = args[1]
    args = args[2:]
log, command = args[0], args[2:]
name, _, value = opts["--rank-env"].partition("=")
within = float(opts["--within"])

def descendants(root):
    children = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    found, pending = [], [root]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found

def target(root):
    for pid in descendants(root):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        except OSError:
            continue
        if exe == "loom-run" and f"{name}={value}".encode() in environ:
            return pid
    return None

out = open(log, "w")
job = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
deadline = time.time() + 120
try:
    while opts["--after"] not in open(log).read():
        if job.poll() is not None or time.time() > deadline:
            sys.exit(f"kill_rank.py: the job ended or took too long before '{opts['--after']}':\n" + open(log).read())
        time.sleep(0.05)
    victim = target(job.pid)
    if victim is None:
        sys.exit(f"kill_rank.py: no loom-run process with {name}={value} under the launcher")
    os.kill(victim, signal.SIGKILL)
    killed = time.time()
    try:
        rc = job.wait(timeout=within)
    except subprocess.TimeoutExpired:
        sys.exit(f"kill_rank.py: the job still runs {within} s after rank {value} was killed")
    print(f"killed pid {victim} ({name}={value}); the job exited with status {rc} after "
          f"{time.time() - killed:.1f} s")
    sys.exit(0 if rc != 0 else f"kill_rank.py: the job exited with status 0 after a rank was killed")
finally:
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
