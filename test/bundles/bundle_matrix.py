#!/usr/bin/env python3
"""The bundle matrix: every model in models/ x {f32, bf16, --target cuda} x
{forward, training step} x {one device, dp2, tp2, tp2 with sequence parallelism,
pp2 1F1B and pp2 ZB-H1 with 4 microbatches, dp2 x tp2 x pp2 interleaved,
ZeRO-1}, compiled by loomc and
hashed file by file.

`--record` writes the hashes to the fixture (test/bundles/hashes/MODEL.json);
the default checks that today's compiler writes byte-identical bundles. A
refactor of the compiler's middle end must leave every hash as it is; where a
difference is intended, change the fixture in the same commit and say which
entries moved and why. Combinations that loomc refuses (forward bundles split
only over tp; a model without @loss) are recorded too, by the first line of
their error, so a refusal that turns into a bundle (or the reverse) shows.

The plans are forced on H100 clusters (h100:2, h100:8) so that the large
models fit the planner's memory model; the bundles are the same programs
for any cluster. Weights: the small models' weights files are hashed; the large ones compile
with --no-weights (initialising hundreds of MB per entry would dominate the
run, and weight initialisation is not part of the middle end).
"""
import argparse
import concurrent.futures
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

PRECISIONS = {
    "f32": [],
    "bf16": ["--precision", "bf16"],
    "cuda": ["--target", "cuda"],
}
PLANS = {
    "one": [],
    "dp2": ["--cluster", "h100:2", "--force", "dp=2,tp=1,pp=1,mb=1,zero=0"],
    "tp2": ["--cluster", "h100:2", "--force", "tp=2"],
    "tp2-sp": ["--cluster", "h100:2", "--force", "tp=2,sp=1"],
    "pp2-1f1b-mb4": ["--cluster", "h100:2", "--force", "dp=1,tp=1,pp=2,mb=4,schedule=1f1b,zero=0"],
    "pp2-zbh1-mb4": ["--cluster", "h100:2", "--force", "dp=1,tp=1,pp=2,mb=4,schedule=zb-h1,zero=0"],
    "dp2tp2pp2-interleaved": ["--cluster", "h100:8", "--force",
                              "dp=2,tp=2,pp=2,vpp=2,mb=4,schedule=interleaved,zero=0"],
    "zero1": ["--cluster", "h100:2", "--force", "dp=2,tp=1,pp=1,mb=1,zero=1"],
}
MODES = {"forward": [], "train": ["--train"]}
SMALL = {"gpt-tiny", "llama-tiny", "bert-tiny", "mlp"}
BATCH = 8


def entries(model):
    for precision in PRECISIONS:
        for mode in MODES:
            for plan in PLANS:
                yield f"{precision}/{mode}/{plan}"


def hash_bundle(directory):
    files = {}
    for path in sorted(pathlib.Path(directory).rglob("*")):
        if path.is_file():
            files[str(path.relative_to(directory))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return files


def compile_entry(loomc, model_path, model, entry, scratch):
    model_path_root = os.path.abspath(os.path.dirname(model_path))
    model_path = os.path.join(os.path.basename(model_path_root), os.path.basename(model_path))
    precision, mode, plan = entry.split("/")
    out = os.path.join(scratch, entry.replace("/", "_") + ".loom")
    cmd = [loomc, "compile", model_path, "--batch", str(BATCH), "--seed", "7", "-o", out]
    cmd += PRECISIONS[precision] + MODES[mode] + PLANS[plan]
    if model not in SMALL:
        cmd.append("--no-weights")
    # Errors name the model as models/X.mlir, wherever the test runs from.
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(model_path_root))
    if proc.returncode != 0:
        lines = [l for l in proc.stderr.splitlines() if l.strip()]
        return {"error": lines[0] if lines else f"exit {proc.returncode}"}
    return {"files": hash_bundle(out)}


def run(loomc, models_dir, model, jobs):
    model_path = os.path.join(models_dir, model + ".mlir")
    with tempfile.TemporaryDirectory(prefix=f"bundle-matrix-{model}-") as scratch:
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {e: pool.submit(compile_entry, loomc, model_path, model, e, scratch)
                       for e in entries(model)}
            return {e: f.result() for e, f in futures.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loomc", required=True)
    ap.add_argument("--models", required=True, help="the models/ folder")
    ap.add_argument("--fixture", required=True, help="the folder of hash files")
    ap.add_argument("--model", action="append", help="only these models (default: all)")
    ap.add_argument("--record", action="store_true", help="write the fixture instead of checking")
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args()
    args.loomc = os.path.abspath(args.loomc)
    models = args.model or sorted(p.stem for p in pathlib.Path(args.models).glob("*.mlir"))
    failures = 0
    for model in models:
        got = run(args.loomc, args.models, model, args.jobs)
        path = pathlib.Path(args.fixture) / f"{model}.json"
        if args.record:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
            built = sum(1 for v in got.values() if "files" in v)
            print(f"{model}: recorded {built} bundles, {len(got) - built} refusals")
            continue
        if not path.exists():
            print(f"{model}: no fixture at {path} (run with --record)")
            failures += 1
            continue
        want = json.loads(path.read_text())
        for entry in sorted(set(want) | set(got)):
            if want.get(entry) != got.get(entry):
                failures += 1
                print(f"{model} {entry}: differs")
                print(f"  fixture: {json.dumps(want.get(entry), sort_keys=True)}")
                print(f"  now:     {json.dumps(got.get(entry), sort_keys=True)}")
        same = sum(1 for e in got if want.get(e) == got[e])
        print(f"{model}: {same} of {len(got)} entries byte-identical")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
