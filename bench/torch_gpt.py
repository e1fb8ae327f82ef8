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

import torch
import torch.nn as nn
import torch.nn.functional as F

from loom_vs_torch import compare, time_steps, train_loom


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

    dt, loss = time_steps(step, a.steps)
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

    def loom(bundle, name):
        tps, ms = train_loom(bundle, a.loom_run, a.steps, "tokens")
        print(f"{name:19s} {tps:10.0f} tokens/s  {tps * fpt / 1e12:6.1f} TFLOP/s  {ms:8.1f} ms/step", flush=True)
        return tps

    compare(a.loom, a.modes, loom, lambda mode: run(mode, a))
