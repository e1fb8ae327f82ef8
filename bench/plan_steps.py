#!/usr/bin/env python3
"""The planner's step prediction against training steps measured on GPUs.

Every run in a measurements file (bench/data/measured-h200-steps.json: model,
cluster, global batch, forced plan, measured ms per step, and the device call
that measured it) is priced by `loomc plan --force` under a profile, and the
prediction printed beside the measurement with its error. `--fit` prices the
runs again for a grid of the profile's two link terms (`link_efficiency`, the
share of the preset's link rate collectives reach, and `comm_hidden_share`,
the share of the data-parallel all-reduce the backward hides) and prints the
pair whose worst error is smallest, to refit them after the runtime changes.
`--fit-tp` grids the tensor-parallel collectives' terms instead
(`tp_link_efficiency`, the share of the link rate a large one reaches, and
`link_half_bytes`, the message size at which it reaches half of that), pricing
again only the runs with tensor parallelism.

  python3 bench/plan_steps.py [--loomc build/compiler/loomc]
      [--profile bench/data/profile-h200-gpt2-350m-bf16.json]
      [--measured bench/data/measured-h200-steps.json] [--fit | --fit-tp] [--max-error PCT]

It prints a table (docs/planner.md); test/planner/measured-steps.test runs it
with --max-error 10 (exit status 2 when a prediction is further off than
that). Exit status 1 when a run cannot be priced.
"""
import argparse
import itertools
import json
import os
import pathlib
import subprocess
import sys
import tempfile


def model_file(name, spec, loomc, tmp):
    if name not in spec:
        return f"models/{name}.mlir"
    path = os.path.join(tmp, name + ".mlir")
    if not os.path.exists(path):
        subprocess.run([loomc, "models", *spec[name], "-o", path], check=True, stdout=subprocess.DEVNULL)
    return path


def price(loomc, profile, run, model, tmp):
    out = os.path.join(tmp, "plan.json")
    r = subprocess.run([loomc, "plan", model, "--cluster", run["cluster"], "--batch", str(run["batch"]),
                        "--profile", profile, "--force", run["force"], "--json", out],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"loomc plan --force {run['force']} failed: {r.stderr.strip()[-300:]}")
    return json.load(open(out))["predicted"]["step_ms"]


def errors(loomc, profile, data, tmp, only=None):
    rows = []
    for run in data["runs"]:
        if only and not only(run):
            continue
        model = model_file(run["model"], data.get("models", {}), loomc, tmp)
        predicted = price(loomc, profile, run, model, tmp)
        rows.append((run, predicted, (predicted - run["ms"]) / run["ms"] * 100))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loomc", default="build/compiler/loomc")
    ap.add_argument("--profile", default="bench/data/profile-h200-gpt2-350m-bf16.json")
    ap.add_argument("--measured", default="bench/data/measured-h200-steps.json")
    ap.add_argument("--fit", action="store_true", help="refit link_efficiency and comm_hidden_share")
    ap.add_argument("--fit-tp", action="store_true", help="refit tp_link_efficiency and link_half_bytes")
    ap.add_argument("--max-error", type=float, help="exit 2 if a prediction is off by more (percent)")
    a = ap.parse_args()
    data = json.load(open(a.measured))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            rows = errors(a.loomc, a.profile, data, tmp)
        except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
            print(f"plan_steps: {e}", file=sys.stderr)
            return 1
        print(f"{'model':10} {'cluster':7} {'plan':46} {'predicted':>9} {'measured':>9} {'error':>7}")
        for run, p, err in rows:
            print(f"{run['model']:10} {run['cluster']:7} {run['force']:46} {p:9.1f} {run['ms']:9.1f} {err:+6.1f}%")
        worst = max(abs(e) for _, _, e in rows)
        print(f"{len(rows)} runs, worst error {worst:.1f}% ({a.profile})")
        if a.max_error is not None and worst > a.max_error:
            print(f"plan_steps: a prediction is {worst:.1f}% off its measurement (--max-error {a.max_error:g})",
                  file=sys.stderr)
            return 2
        if a.fit_tp:
            return fit_tp(a, data, rows, tmp)
        if a.fit:
            base = json.load(open(a.profile))
            grid = itertools.product([x / 100 for x in range(40, 62, 2)], [x / 10 for x in range(1, 8)])
            (worst, rms), (link, hidden) = best_fit(a, data, tmp, base, grid,
                                                    lambda p: dict(link_efficiency=p[0], comm_hidden_share=p[1]))
            print(f"fit: link_efficiency {link:.2f}, comm_hidden_share {hidden:.1f}: worst error {worst:.1f}%, "
                  f"rms {rms:.1f}% (was {base.get('link_efficiency')}, {base.get('comm_hidden_share')})")
    return 0


def best_fit(a, data, tmp, base, grid, terms, only=None, others=()):
    """Prices the runs (those `only` accepts) under `base` with `terms(point)`
    set, for each point of `grid`; the point whose worst error, then rms, over
    them and `others` (errors kept from the other runs) is smallest."""
    best = None
    path = os.path.join(tmp, "profile.json")
    for point in grid:
        json.dump(dict(base, **terms(point)), open(path, "w"))
        errs = list(others) + [e for _, _, e in errors(a.loomc, path, data, tmp, only=only)]
        score = (max(abs(e) for e in errs), (sum(e * e for e in errs) / len(errs)) ** 0.5)
        if best is None or score < best[0]:
            best = (score, point)
    return best


def fit_tp(a, data, rows, tmp):
    """Grids the tensor-parallel link terms; the other runs keep their errors."""
    base = json.load(open(a.profile))
    tp = lambda run: "tp=" in run["force"] and "tp=1," not in run["force"]
    mib = 1 << 20
    grid = itertools.product([x / 100 for x in range(50, 92, 2)], [0, 2, 4, 8, 12, 16, 24, 32, 48, 64])
    (worst, rms), (eff, half) = best_fit(a, data, tmp, base, grid,
                                         lambda p: dict(tp_link_efficiency=p[0], link_half_bytes=p[1] * mib),
                                         only=tp, others=[e for run, _, e in rows if not tp(run)])
    print(f"fit: tp_link_efficiency {eff:.2f}, link_half_bytes {half} MiB: worst error {worst:.1f}%, rms {rms:.1f}% "
          f"(was {base.get('tp_link_efficiency', base.get('link_efficiency'))}, "
          f"{base.get('link_half_bytes', 0) / mib:g} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
