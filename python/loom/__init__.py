"""Loom's runtime from Python: open a compiled bundle, bind NumPy arrays or
DLPack tensors (PyTorch, JAX; GPU tensors stay on the GPU), run forward passes
and training steps, read outputs as NumPy copies or zero-copy DLPack views,
save and load checkpoints and weights, and generate from a serving bundle
token by token. See docs/python.md.

    import numpy as np, loom
    with loom.Session("gpt.loom") as s:
        loss = s.train_step(tokens=x, targets=y)
    with loom.Server("gpt.serve") as server:
        for token in server.generate([1, 2, 3], max_new_tokens=8):
            print(token)
"""

from ._errors import LoomError
from .data import token_batch
from .server import Generation, Server, Tokenizer
from .session import Session, TensorInfo

__version__ = "0.1.0"
__all__ = ["Generation", "LoomError", "Server", "Session", "TensorInfo", "Tokenizer", "token_batch"]
