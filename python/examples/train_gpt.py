"""Trains the small GPT from NumPy token ids (docs/python.md).

usage: python train_gpt.py BUNDLE [TOKENS.bin] [STEPS]
BUNDLE: loomc compile models/gpt-tiny.mlir --train --batch 4 -o gpt.loom
TOKENS.bin: uint16 token ids, as loom-run --data reads them (default: a repeating pattern).
"""
import sys
import numpy as np
import loom

data = np.fromfile(sys.argv[2], dtype=np.uint16) if len(sys.argv) > 2 else np.arange(20000) % 16 + 1
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 40
with loom.Session(sys.argv[1]) as session:
    batch, seq = session.inputs["tokens"].shape
    for step in range(1, steps + 1):
        tokens, targets = loom.token_batch(data, step, batch, seq)
        loss = session.train_step(tokens=tokens, targets=targets)
        print(f"step {step}/{steps}  loss {loss:.6f}")
    session.save_checkpoint("gpt-checkpoint.safetensors")
