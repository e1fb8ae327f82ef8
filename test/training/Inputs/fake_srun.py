"""Starts N copies of a command as Slurm would (srun -n N), on this machine.

usage: fake_srun.py -n N [--port P] -- COMMAND...

Each copy gets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_ID and
the rendezvous MASTER_ADDR=127.0.0.1, MASTER_PORT (a free port unless given).
Waits for every copy and exits with the first non-zero status (a signal as
128 + its number), like srun.
"""
import os
import socket
import subprocess
import sys

args = sys.argv[1:]
n, port = 2, 0
while args and args[0] != "--":
    if args[0] == "-n":
        n = int(args[1])
    elif args[0] == "--port":
        port = int(args[1])
    else:
        sys.exit(f"fake_srun.py: unknown option {args[0]}")
    args = args[2:]
command = args[1:]
if not port:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
tasks = []
for rank in range(n):
    env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_NTASKS=str(n), SLURM_LOCALID=str(rank),
               SLURM_STEP_ID="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tasks.append(subprocess.Popen(command, env=env))
status = 0
for t in tasks:
    rc = t.wait()
    rc = 128 - rc if rc < 0 else rc
    status = status or rc
sys.exit(status)
