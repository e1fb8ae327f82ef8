"""ResNet-50 training throughput in PyTorch (eager and torch.compile), for comparison with Loom.

Same network as `loomc models resnet` writes (ResNet-50 v1.5: the stride on the 3x3
convolution of each stage's first bottleneck, batch norm with the batch's statistics,
no bias in the convolutions), written in plain torch.nn so that torchvision is not
needed. SGD with momentum 0.9 at lr 0.1, synthetic images and labels, channels_last
memory format. Prints one line per mode: images/s and ms per step, after warm-up.

usage: python3 bench/torch_resnet.py [--image 224 --classes 1000 --batch 32 --steps 20
       --modes eager-fp32,compile-fp32,eager-bf16,compile-bf16]
       [--loom BUNDLE.loom ... [--loom-run build-device/runtime/loom-run]]
       torchrun --nproc_per_node=N bench/torch_resnet.py --batch GLOBAL --modes ddp-eager-bf16,ddp-compile-bf16

Under torchrun, modes starting `ddp-` wrap the network in DistributedDataParallel
(its default buckets, gradients all-reduced as they are ready) and --batch is the
global batch, split over the ranks; rank 0 prints images/s of the whole node.

With --loom, each bundle (compiled for the same network and batch) trains first with
`loom-run --backend cuda` in the same invocation and is reported in the same format,
followed by its speed relative to each PyTorch mode.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from loom_vs_torch import compare, each_mode_distributed, time_steps, train_loom


def conv_bn(cin, cout, k, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout))


class Bottleneck(nn.Module):
    def __init__(self, cin, mid, cout, stride):
        super().__init__()
        self.c1 = conv_bn(cin, mid, 1)
        self.c2 = conv_bn(mid, mid, 3, stride)
        self.c3 = conv_bn(mid, cout, 1)
        self.down = conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x):
        y = F.relu(self.c1(x))
        y = F.relu(self.c2(y))
        y = self.c3(y)
        return F.relu(y + (self.down(x) if self.down is not None else x))


class ResNet50(nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.stem = conv_bn(3, 64, 7, 2)
        layers, cin = [], 64
        for mid, cout, blocks, stride in ((64, 256, 3, 1), (128, 512, 4, 2), (256, 1024, 6, 2), (512, 2048, 3, 2)):
            for i in range(blocks):
                layers.append(Bottleneck(cin, mid, cout, stride if i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(2048, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.stem(x)), 3, 2, 1)
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def run(mode, a, rank=0, world=1):
    torch.manual_seed(0)
    # fp32 modes take TF32 products, as Loom's f32 bundles do by default.
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    model = ResNet50(a.classes).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp = mode.startswith("ddp-")
    if ddp:
        if world < 2:
            raise RuntimeError("ddp modes run under torchrun with at least two processes")
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    step_fn = torch.compile(model) if mode.removeprefix("ddp-").startswith("compile") else model
    dtype = torch.bfloat16 if mode.endswith("bf16") else None
    local = a.batch // world if ddp else a.batch
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    images = torch.randn(local, 3, a.image, a.image, device="cuda", generator=g).to(memory_format=torch.channels_last)
    labels = torch.randint(0, a.classes, (local,), device="cuda", generator=g)

    def step():
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(step_fn(images), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if ddp:
        dist.barrier()
    dt, loss = time_steps(step, a.steps)
    ips = a.batch / dt
    if rank == 0:
        label = f"{mode} x{world}" if ddp else mode
        print(f"torch {label:13s} {ips:10.0f} images/s  {dt * 1e3:8.1f} ms/step  loss {loss.item():.4f}", flush=True)
    del model, opt
    torch.cuda.empty_cache()
    return ips


def arguments():
    p = argparse.ArgumentParser()
    p.add_argument("--image", type=int, default=224)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--modes", default="eager-fp32,compile-fp32,eager-bf16,compile-bf16")
    p.add_argument("--loom", nargs="*", default=[], help="Loom bundles to train first, same network and batch")
    p.add_argument("--loom-run", default="build-device/runtime/loom-run")
    return p.parse_args()


if __name__ == "__main__":
    a = arguments()
    if "WORLD_SIZE" in os.environ:  # under torchrun: every mode across the ranks
        each_mode_distributed(a.modes, lambda mode, rank, world: run(mode, a, rank, world),
                              lambda world: f"GPU: {world} x {torch.cuda.get_device_name()}, torch {torch.__version__}, "
                              f"ResNet-50 {a.image}x{a.image}, {a.classes} classes, global batch {a.batch}")
        raise SystemExit(0)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"ResNet-50 {a.image}x{a.image}, {a.classes} classes, batch {a.batch}")

    def loom(bundle, name):
        ips, ms = train_loom(bundle, a.loom_run, a.steps, "examples")
        print(f"{name:19s} {ips:10.0f} images/s  {ms:8.1f} ms/step", flush=True)
        return ips

    compare(a.loom, a.modes, loom, lambda mode: run(mode, a))
