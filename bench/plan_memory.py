#!/usr/bin/env python3
"""The planner's memory prediction against the compiler's memory plan.

For each (model, precision, forced plan) it compiles a training bundle with
`loomc compile ... --no-weights` and asks `loomc plan --json` for the same
forced plan, then prints, per pipeline stage, the predicted bytes per device
(the plan's weight_gib + activation_gib: what the arena holds, without the
planner's reserve for the CUDA context and libraries) against the largest
`arena_bytes` among that stage's ranks in manifest.json (every buffer of a
rank lives in its one arena: parameters and optimizer state first, then
activations, gradients and bf16 weight copies packed by lifetime).

  python3 bench/plan_memory.py [--loomc build/compiler/loomc] [--jobs 2]

Besides models/, it writes a GPT of 1.3B parameters (24 layers, hidden
2048) with `loomc models gpt`. Not a test: it prints a table (docs/planner.md).
"""
import argparse
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import tempfile

GIB = float(1 << 30)
PRECISIONS = ["bf16", "f32"]
PLANS = {
    "dp2": "dp=2,mb=1,zero=0",
    "dp2 zero1": "dp=2,mb=1,zero=1",
    "dp2 full recompute": "dp=2,mb=1,zero=0,recompute=full",
    "dp2 mb2": "dp=2,mb=2,zero=0",
    "tp2": "tp=2,mb=1",
    "pp2 1f1b mb4": "pp=2,mb=4,schedule=1f1b",
    "pp2 1f1b mb4 full recompute": "pp=2,mb=4,schedule=1f1b,recompute=full",
    "pp2 zb-h1 mb4": "pp=2,mb=4,schedule=zb-h1",
    "pp2 vpp2 interleaved mb4": "pp=2,vpp=2,mb=4,schedule=interleaved",
    "pp2 vpp2 interleaved mb4 full recompute": "pp=2,vpp=2,mb=4,schedule=interleaved,recompute=full",
}
GPT_1_3B = ["gpt", "--layers", "24", "--hidden", "2048", "--heads", "16", "--seq", "1024",
            "--vocab", "50304"]


def run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(" ".join(cmd) + "\n" + proc.stderr.strip())
    return proc.stdout


def measure(loomc, model_path, precision, force, batch, cluster, scratch, tag):
    common = ["--batch", str(batch), "--cluster", cluster, "--force", force, "--precision", precision]
    plan_file = os.path.join(scratch, tag + ".json")
    run([loomc, "plan", model_path, "--json", plan_file] + common)
    plan = json.loads(pathlib.Path(plan_file).read_text())
    predicted = [(s["weight_gib"] + s["activation_gib"]) * GIB for s in plan["stages"]]
    bundle = os.path.join(scratch, tag + ".loom")
    run([loomc, "compile", model_path, "--train", "--fuse", "--no-weights", "-o", bundle] + common)
    manifest = json.loads(pathlib.Path(bundle, "manifest.json").read_text())
    keys = ["dp", "tp", "pp", "vpp", "microbatches", "schedule", "recompute", "zero"]
    if any(manifest["plan"].get(k) != plan.get(k) for k in keys):
        raise RuntimeError(f"{tag}: the bundle's plan is not the one predicted")
    actual = [0] * len(predicted)
    for rank in manifest["ranks"]:
        stage = rank.get("coords", {}).get("pp", 0)
        actual[stage] = max(actual[stage], rank["arena_bytes"])
    subprocess.run(["rm", "-rf", bundle])
    return predicted, actual


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loomc", default="build/compiler/loomc")
    ap.add_argument("--models", default="models", help="the models/ folder")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cluster", default="h100:2")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    loomc = os.path.abspath(args.loomc)
    with tempfile.TemporaryDirectory(prefix="plan-memory-") as scratch:
        gpt13 = os.path.join(scratch, "gpt-1.3b.mlir")
        run([loomc, "models"] + GPT_1_3B + ["-o", gpt13])
        models = [("gpt2-350m", os.path.join(args.models, "gpt2-350m.mlir")), ("gpt-1.3b", gpt13),
                  ("llama-1.1b", os.path.join(args.models, "llama-1.1b.mlir"))]
        cases = [(m, path, prec, name, force) for m, path in models for prec in PRECISIONS
                 for name, force in PLANS.items()]
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(measure, loomc, path, prec, force, args.batch, args.cluster, scratch,
                                   f"{m}-{prec}-{i}")
                       for i, (m, path, prec, name, force) in enumerate(cases)]
            results = [f.result() for f in futures]
    print(f"batch {args.batch}, {args.cluster}; GiB per device (arena: parameters, optimizer state, "
          "activations, gradients)\n")
    print("| model | precision | plan | stage | predicted | compiler | error |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    worst = 0.0
    for (m, _, prec, name, _), (predicted, actual) in zip(cases, results):
        for stage, (p, a) in enumerate(zip(predicted, actual)):
            error = p / a - 1
            worst = max(worst, abs(error))
            print(f"| {m} | {prec} | {name} | {stage} | {p / GIB:.2f} | {a / GIB:.2f} | {error * 100:+.1f}% |")
    print(f"\nworst |error| {worst * 100:.1f}%")


if __name__ == "__main__":
    sys.exit(main())
