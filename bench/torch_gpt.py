"""GPT training throughput in PyTorch (eager and torch.compile), for comparison with Loom.

Same model as `loomc models gpt` writes (pre-LayerNorm, tanh GELU, tied embeddings,
fused QKV with biases), AdamW, synthetic tokens. Prints one line per mode:
tokens/s, TFLOP/s (6N + 12 L h s per token) and ms per step, after warm-up.

usage: python3 bench/torch_gpt.py [--layers 24 --hidden 1024 --heads 16 --seq 1024
       --vocab 50304 --batch 8 --steps 10 --modes eager-fp32,compile-fp32,eager-bf16,compile-bf16]
       [--loom BUNDLE.loom ... [--loom-run build-device/runtime/loom-run]] [--profile N]

With --loom, each bundle (compiled for the same model and batch) trains first with
`loom-run --backend cuda` in the same invocation, and is reported in the same format,
FLOPs counted the same way, followed by Loom's speed relative to each PyTorch mode.
"""
import argparse
import math
import re
import subprocess
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, 4 * h)
        self.out = nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, h, heads, seq, vocab):
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        # GPT-2 initialisation, as `loomc models gpt` declares it.
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=0.01 if name == "wpe.weight" else std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens, targets):
        x = self.wte(tokens) + self.wpe.weight[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def training_step(step_fn, model, opt, dtype, tokens, targets):
    """One AdamW step with gradient clipping at 1.0, as Loom's bundles take it."""

    def step():
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            loss = step_fn(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def run(mode, a):
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    model = GPT(a.layers, a.hidden, a.heads, a.seq, a.vocab).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    step_fn = model
    if mode.startswith("compile"):
        step_fn = torch.compile(model)
    dtype = torch.bfloat16 if mode.endswith("bf16") else None
    n_params = sum(p.numel() for p in model.parameters())
    flops_per_token = 6 * n_params + 12 * a.layers * a.hidden * a.seq
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq), device="cuda")
    targets = torch.roll(tokens, -1, 1)

    step = training_step(step_fn, model, opt, dtype, tokens, targets)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / a.steps
    tps = a.batch * a.seq / dt
    print(f"torch {mode:13s} {tps:10.0f} tokens/s  {tps * flops_per_token / 1e12:6.1f} TFLOP/s  "
          f"{dt * 1e3:8.1f} ms/step  loss {loss.item():.4f}  params {n_params / 1e6:.1f}M", flush=True)
    if a.profile:
        profile_kernels(step, mode, a.profile)
    del model, opt
    torch.cuda.empty_cache()
    return tps


def profile_kernels(step, mode, top, steps=3):
    """The GPU kernels of `steps` steps by their time per step (torch.profiler), the `top` longest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if us > 0:
            rows.append((us / steps / 1e3, e.count // steps, e.key))
    rows.sort(reverse=True)
    print(f"  {mode}: {sum(r[0] for r in rows):.1f} ms of kernels per step; the {top} longest:")
    for ms, count, name in rows[:top]:
        print(f"  {ms:7.2f} ms {count:5d}x  {name[:110]}")


def loom(bundle, a):
    """Trains a Loom bundle on the GPU; returns (tokens/s, ms/step) as loom-run measured them."""
    cmd = [a.loom_run, bundle, "--backend", "cuda", "--steps", str(a.steps + 3)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    found = re.search(r"trained: ([\d.]+) ms per step, (\d+) tokens/s", out.stdout)
    if out.returncode != 0 or not found:
        raise RuntimeError(f"{' '.join(cmd)} failed: {(out.stderr or out.stdout).strip()[-300:]}")
    return float(found.group(2)), float(found.group(1))


def flops_per_token(a):
    with torch.device("meta"):
        n_params = sum(p.numel() for p in GPT(a.layers, a.hidden, a.heads, a.seq, a.vocab).parameters())
    return 6 * n_params + 12 * a.layers * a.hidden * a.seq


def arguments(modes):
    """The model, batch and timing options both benchmarks take."""
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--modes", default=modes)
    p.add_argument("--loom", nargs="*", default=[], help="Loom bundles to train first, same model and batch")
    p.add_argument("--loom-run", default="build-device/runtime/loom-run")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after each mode's timing, list its N longest GPU kernels per step (torch.profiler)")
    return p.parse_args()


if __name__ == "__main__":
    a = arguments("eager-fp32,compile-fp32,eager-bf16,compile-bf16")
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    fpt = flops_per_token(a)
    results = {}
    for bundle in a.loom:
        name = "loom " + bundle.rstrip("/").split("/")[-1].removesuffix(".loom")
        try:
            tps, ms = loom(bundle, a)
            results[name] = tps
            print(f"{name:19s} {tps:10.0f} tokens/s  {tps * fpt / 1e12:6.1f} TFLOP/s  {ms:8.1f} ms/step", flush=True)
        except Exception as e:
            print(f"{name}: failed: {e}")
    torch_rates = {}
    for mode in a.modes.split(","):
        try:
            torch_rates[mode] = run(mode, a)
        except Exception as e:  # report and go on: one failing mode should not hide the rest
            print(f"torch {mode}: failed: {type(e).__name__}: {e}")
    for name, tps in results.items():
        ratios = ", ".join(f"{tps / r:.2f}x torch {m}" for m, r in torch_rates.items() if r)
        print(f"{name}: {ratios}")
