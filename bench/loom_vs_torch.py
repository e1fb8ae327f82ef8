"""What the single-GPU PyTorch comparisons share (bench/torch_gpt.py, bench/torch_resnet.py).

`time_steps` times a training step after warm-up; `train_loom` trains a Loom bundle with
`loom-run --backend cuda` and reads its own measurement; `compare` runs the Loom bundles,
then each PyTorch mode, and prints Loom's speed relative to each mode; `each_mode_distributed`
runs modes across the ranks of a torchrun job (bench/torch_ddp.py, bench/torch_resnet.py).
"""
import os
import re
import subprocess
import time

import torch


def time_steps(step, steps, warmup=3):
    """Seconds per step of `step()` over `steps` runs after `warmup`, and the last loss."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps, loss


def train_loom(bundle, loom_run, steps, unit):
    """Trains a Loom bundle on the GPU; returns (units/s, ms/step) as loom-run measured them."""
    cmd = [loom_run, bundle, "--backend", "cuda", "--steps", str(steps + 3)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    found = re.search(r"trained: ([\d.]+) ms per step, (\d+) " + unit + "/s", out.stdout)
    if out.returncode != 0 or not found:
        raise RuntimeError(f"{' '.join(cmd)} failed: {(out.stderr or out.stdout).strip()[-300:]}")
    return float(found.group(2)), float(found.group(1))


def compare(bundles, modes, loom, run):
    """loom(bundle, name) -> rate (it prints its line); run(mode) -> rate. Prints the ratios."""
    results = {}
    for bundle in bundles:
        name = "loom " + bundle.rstrip("/").split("/")[-1].removesuffix(".loom")
        try:
            results[name] = loom(bundle, name)
        except Exception as e:
            print(f"{name}: failed: {e}")
    torch_rates, runs = {}, {}  # a mode named twice (torch.compile varies between runs): its best
    for mode in modes.split(","):
        try:
            rate = run(mode)
            torch_rates[mode] = max(torch_rates.get(mode, 0), rate or 0)
            runs[mode] = runs.get(mode, 0) + 1
        except Exception as e:  # report and go on: one failing mode should not hide the rest
            print(f"torch {mode}: failed: {type(e).__name__}: {e}")
    for name, rate in results.items():
        ratios = ", ".join(f"{rate / r:.2f}x torch {m}" + (f" (its best of {runs[m]} runs)" if runs[m] > 1 else "")
                           for m, r in torch_rates.items() if r)
        print(f"{name}: {ratios}")


def each_mode_distributed(modes, run, header=None):
    """Under torchrun: joins the NCCL group, then run(mode, rank, world) for each mode; rank 0
    prints `header(world)` first and any mode's failure (the others go on)."""
    import torch.distributed as dist

    rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    if rank == 0 and header:
        print(header(world), flush=True)
    for mode in modes.split(","):
        try:
            run(mode, rank, world)
        except Exception as e:  # report and go on
            if rank == 0:
                print(f"torch {mode}: failed: {type(e).__name__}: {e}", flush=True)
    dist.destroy_process_group()
