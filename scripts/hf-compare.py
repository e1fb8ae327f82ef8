#!/usr/bin/env python3
"""loomc import and export against transformers itself (needs torch and
transformers; CI's tests do without, see test/import/).

  prepare OUT [--loomc build/compiler/loomc]
      random-weight GPT-2 and Llama checkpoints written by save_pretrained,
      imported and compiled: OUT/NAME/hf (the checkpoint), NAME.f32.loom (CPU or
      CUDA, f32), NAME.gen.loom (batch 1, for generation), NAME.cuda.loom
      (--target cuda: bf16, fused), NAME.serve.loom and NAME.serve-cuda.loom
      (--serve: the paged key/value cache, f32 and bf16). Bundles carry their
      weights (small models).
  check OUT --loom-run build/runtime/loom-run [--backend cpu|cuda] [--loomc L]
      for each model: loom-run's logits against transformers' (f32, on the CPU),
      32 greedily generated tokens against model.generate (re-running the
      forward pass, and through the key/value cache with loom-run --generate:
      f32 must match exactly; bf16 is reported against transformers in bf16),
      and with --loomc the exported checkpoint loaded by from_pretrained
      against the original.
Prints one line per check and exits 1 if any fails.
"""
import argparse
import copy
import json
import os
import shutil
import subprocess
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file

MODELS = {
    "gpt2": ("gpt2", dict(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                          initializer_range=0.2)),
    # Head dimension 16: the smallest the bf16 attention kernels take.
    "llama-gqa": ("llama", dict(vocab_size=256, hidden_size=128, intermediate_size=320,
                                num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                max_position_embeddings=64, rope_theta=500000.0,
                                rms_norm_eps=1e-5, initializer_range=0.2)),
    "llama-tied": ("llama", dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                                 max_position_embeddings=64, tie_word_embeddings=True,
                                 initializer_range=0.2)),
}
BATCH, PROMPT, NEW = 2, 8, 32


def run(*cmd):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit("%s failed:\n%s%s" % (" ".join(map(str, cmd)), r.stdout, r.stderr))
    return r.stdout


def prepare(args):
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    for name, (kind, cfg) in MODELS.items():
        d = os.path.join(args.out, name)
        shutil.rmtree(d, ignore_errors=True)
        if kind == "gpt2":
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg))
        else:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
        model.save_pretrained(os.path.join(d, "hf"))
        # transformers 5 writes rope_parameters, 4 reads rope_theta: both, for
        # a GPU machine with either.
        path = os.path.join(d, "hf", "config.json")
        with open(path) as f:
            config = json.load(f)
        if "rope_parameters" in config:
            config["rope_theta"] = config["rope_parameters"]["rope_theta"]
            with open(path, "w") as f:
                json.dump(config, f, indent=2)
        seq = cfg.get("n_positions", cfg.get("max_position_embeddings"))
        tokens = torch.randint(0, cfg["vocab_size"], (BATCH, seq), dtype=torch.int32)
        save_file({"tokens": tokens}, os.path.join(d, "tokens.safetensors"))
        m, w = os.path.join(d, "model.mlir"), os.path.join(d, "model.safetensors")
        run(args.loomc, "import", os.path.join(d, "hf"), "-o", m, "--weights", w)
        run(args.loomc, "compile", m, "--weights", w, "--batch", BATCH, "-o", os.path.join(d, "f32.loom"))
        run(args.loomc, "compile", m, "--weights", w, "--batch", 1, "-o", os.path.join(d, "gen.loom"))
        run(args.loomc, "compile", m, "--weights", w, "--batch", BATCH, "--target", "cuda",
            "-o", os.path.join(d, "cuda.loom"))
        run(args.loomc, "compile", m, "--weights", w, "--serve", "--max-batch", 2,
            "-o", os.path.join(d, "serve.loom"))
        run(args.loomc, "compile", m, "--weights", w, "--serve", "--max-batch", 2, "--target", "cuda",
            "-o", os.path.join(d, "serve-cuda.loom"))
        print("prepared", d)


def loom_logits(args, bundle, tokens, tmp):
    save_file({"tokens": tokens.to(torch.int32).contiguous()}, tmp + ".in.safetensors")
    run(args.loom_run, bundle, "--backend", args.backend, "--input", tmp + ".in.safetensors",
        "--output", tmp + ".out.safetensors")
    out = load_file(tmp + ".out.safetensors")
    return next(iter(out.values())).float()


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens.long()).logits.float()


def greedy_check(model, prompt, got, tie, want):
    """Whether `got` (new tokens after `prompt`) is transformers' greedy
    continuation `want`, where a near-tie may go either way: at a token that
    differs, the two logits may be within `tie` x the largest logit (the
    comparison then goes on from Loom's token, with transformers' greedy
    continuation from there). Returns (ok, ties, detail)."""
    i, ties = 0, []
    while i < len(got):
        if i > 0:
            prefix = torch.tensor([prompt + got[:i]])
            with torch.no_grad():
                want = model.generate(prefix.long(), max_new_tokens=len(got) - i, do_sample=False,
                                      min_new_tokens=len(got) - i, pad_token_id=0)[0, prefix.shape[1]:].tolist()
        j = next((k for k, (a, b) in enumerate(zip(got[i:], want)) if a != b), None)
        if j is None:
            return True, ties, ""
        pos = i + j
        with torch.no_grad():
            logits = model(torch.tensor([prompt + got[:pos]]).long()).logits[0, -1].float()
        gap = (logits[want[j]] - logits[got[pos]]).item()
        scale = logits.abs().max().item()
        if gap > tie * scale:
            return False, ties, "token %d: %d where transformers gives %d (logits %.6g vs %.6g)" % (
                pos, got[pos], want[j], logits[got[pos]].item(), logits[want[j]].item())
        ties.append("token %d (gap %.2g of %.3g)" % (pos, gap, scale))
        i = pos + 1
    return True, ties, ""


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def check(args):
    failed = 0
    for name in MODELS:
        d = os.path.join(args.dir, name)
        model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(d, "hf")).eval()
        tokens = load_file(os.path.join(d, "tokens.safetensors"))["tokens"]
        ref = hf_logits(model, tokens)
        tmp = os.path.join(d, "run-" + args.backend)
        # bf16's tolerance: twice what transformers itself loses in bf16 on
        # the same weights (at least 3e-2); the random weights here are large
        # (initializer_range 0.2), so rounding grows through the layers.
        with torch.no_grad():
            model16 = copy.deepcopy(model).to(torch.bfloat16)  # model itself keeps its f32 weights
            hf16 = rel_err(model16(tokens.long()).logits.float(), ref)
        for bundle, tol in (("f32.loom", 1e-5 if args.backend == "cpu" else 1e-3),
                            ("cuda.loom", max(3e-2, 2 * hf16))):
            if bundle == "cuda.loom" and args.backend != "cuda":
                continue
            got = loom_logits(args, os.path.join(d, bundle), tokens, tmp)
            e = rel_err(got, ref)
            ok = e <= tol
            failed += not ok
            note = " (transformers in bf16: %.3g)" % hf16 if bundle == "cuda.loom" else ""
            print("%-11s %-15s %-5s logits: max relative error %.3g (tolerance %.3g)%s %s"
                  % (name, bundle, args.backend, e, tol, note, "ok" if ok else "FAIL"))
        # Greedy generation, the whole sequence run again for each new token.
        prompt = tokens[:1, :PROMPT]
        with torch.no_grad():
            want = model.generate(prompt.long(), max_new_tokens=NEW, do_sample=False,
                                  min_new_tokens=NEW, pad_token_id=0)[0, PROMPT:].tolist()
        seq = tokens.shape[1]
        ids = prompt[0].tolist()
        for _ in range(NEW):
            padded = torch.tensor([ids + [0] * (seq - len(ids))], dtype=torch.int32)
            logits = loom_logits(args, os.path.join(d, "gen.loom"), padded, tmp)
            ids.append(int(logits[0, len(ids) - 1].argmax()))
        got = ids[PROMPT:]
        # A near-tie: within 100x the f32 logits' tolerance of 1e-5 (CPU) or
        # 1e-6 (what the GPU reaches with TF32 off), relative to the largest logit.
        tie = 1e-4
        ok, ties, detail = greedy_check(model, prompt[0].tolist(), got, tie, want)
        failed += not ok
        print("%-11s gen.loom        %-5s greedy: %d of %d tokens as transformers%s %s"
              % (name, args.backend, sum(a == b for a, b in zip(got, want)), NEW,
                 " (near-ties, where either token is greedy: %s)" % ", ".join(ties) if ties else "",
                 "ok" if ok else "FAIL " + detail))
        # Greedy generation through the paged key/value cache (loom-run
        # --generate on the serving bundles): f32 exactly as transformers; bf16
        # reported against transformers run in bf16 (summation orders differ,
        # so near-ties may go either way: informational).
        with open(tmp + ".prompt.txt", "w") as f:
            f.write(" ".join(str(int(t)) for t in prompt[0]) + "\n")
        serves = [("serve.loom", want)]
        if args.backend == "cuda":
            with torch.no_grad():
                want16 = model16.generate(
                    prompt.long(), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW,
                    pad_token_id=0)[0, PROMPT:].tolist()
            serves.append(("serve-cuda.loom", want16))
        for bundle, reference in serves:
            out = run(args.loom_run, os.path.join(d, bundle), "--backend", args.backend, "--prompt",
                      tmp + ".prompt.txt", "--max-new", NEW)
            line = [l for l in out.splitlines() if l.startswith("request 0: ")][0]
            got = [int(t) for t in line.split(":")[2].split()]
            same = sum(a == b for a, b in zip(got, reference))
            exact = bundle == "serve.loom"
            if exact:
                ok, ties, detail = greedy_check(model, prompt[0].tolist(), got, tie, reference)
                failed += not ok
                verdict = ("ok" if ok else "FAIL " + detail) + (
                    " (near-ties: %s)" % ", ".join(ties) if ties else "")
            else:
                verdict = "(bf16: informational; first difference at token %d)" % next(
                    (i for i, (a, b) in enumerate(zip(got, reference)) if a != b), NEW)
            print("%-11s %-15s %-5s greedy with the key/value cache: %d of %d tokens as transformers%s %s"
                  % (name, bundle, args.backend, same, NEW, " (bf16)" if not exact else "", verdict))
        if args.loomc:
            out = os.path.join(d, "exported")
            shutil.rmtree(out, ignore_errors=True)
            run(args.loomc, "export", os.path.join(d, "f32.loom"), "--to", out)
            back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
            e = (hf_logits(back, tokens) - ref).abs().max().item()
            failed += e != 0
            print("%-11s export                from_pretrained logits: max abs difference %.3g %s"
                  % (name, e, "ok" if e == 0 else "FAIL"))
    print("%d check(s) failed" % failed if failed else "all checks passed")
    return 1 if failed else 0


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("out")
    a.add_argument("--loomc", default="build/compiler/loomc")
    b = sub.add_parser("check")
    b.add_argument("dir")
    b.add_argument("--loom-run", default="build/runtime/loom-run")
    b.add_argument("--backend", default="cpu")
    b.add_argument("--loomc")
    args = p.parse_args()
    return prepare(args) if args.cmd == "prepare" else check(args)


if __name__ == "__main__":
    sys.exit(main())
