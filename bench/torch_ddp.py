"""GPT training throughput in PyTorch across the GPUs of one node: DDP and FSDP2.

The model of bench/torch_gpt.py (what `loomc models gpt` writes), AdamW, global batch
split over the ranks, f32 weights with TF32 matmuls (as Loom's CUDA backend today) or
bf16 autocast. Rank 0 prints one line per mode: tokens/s for the whole node and per GPU,
and ms per step, after warm-up.

usage: torchrun --nproc_per_node=N bench/torch_ddp.py [--layers 24 --hidden 1024
       --heads 16 --batch 8 --steps 10 --modes ddp-fp32,fsdp2-fp32]
"""
import time

import torch
import torch.distributed as dist

from loom_vs_torch import each_mode_distributed
from torch_gpt import GPT, arguments, training_step


def run(mode, a, rank, world):
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    model = GPT(a.layers, a.hidden, a.heads, a.seq, a.vocab).cuda()
    if mode.startswith("ddp"):
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    else:
        from torch.distributed.fsdp import fully_shard  # FSDP2 (torch >= 2.6)

        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    dtype = torch.bfloat16 if mode.endswith("bf16") else None
    local = a.batch // world
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    tokens = torch.randint(0, a.vocab, (local, a.seq), device="cuda", generator=g)
    targets = torch.roll(tokens, -1, 1)

    step = training_step(model, model, opt, dtype, tokens, targets)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / a.steps
    if rank == 0:
        tps = a.batch * a.seq / dt
        print(f"torch {mode:11s} x{world}: {tps:10.0f} tokens/s ({tps / world:8.0f} per GPU)  "
              f"{dt * 1e3:8.1f} ms/step  loss {loss.item():.4f}", flush=True)
    del model, opt
    torch.cuda.empty_cache()


if __name__ == "__main__":
    a = arguments("ddp-fp32,fsdp2-fp32")
    each_mode_distributed(a.modes, lambda mode, rank, world: run(mode, a, rank, world))
