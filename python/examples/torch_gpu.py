"""Runs a bundle on the GPU from PyTorch tensors, without copies (docs/python.md).

usage: python torch_gpu.py BUNDLE
BUNDLE: loomc compile models/gpt-tiny.mlir --batch 2 -o gpt-infer.loom (any inference bundle
whose input is 'tokens'). The tokens never leave the GPU: the runtime copies them device to
device into its memory, and the logits are a view of that memory, not a copy.
"""
import sys
import torch
import loom

with loom.Session(sys.argv[1], backend="cuda") as session:
    info = session.inputs["tokens"]
    tokens = torch.randint(0, 256, info.shape, dtype=torch.int32, device="cuda")
    session.forward(tokens=tokens)
    logits = torch.from_dlpack(session.output_view("logits"))  # a view: no copy
    assert logits.is_cuda and logits.data_ptr() == session.output_address("logits")
    print("logits", tuple(logits.shape), "on", logits.device, "next tokens", logits[:, -1].argmax(-1).tolist())
