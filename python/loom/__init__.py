"""Loom's runtime from Python: open a compiled bundle, bind NumPy arrays or
DLPack tensors (PyTorch, JAX; GPU tensors stay on the GPU), run forward passes
and training steps, read outputs as NumPy copies or zero-copy DLPack views,
and save and load checkpoints and weights. See docs/python.md.

    import numpy as np, loom
    with loom.Session("gpt.loom") as s:
        loss = s.train_step(tokens=x, targets=y)
"""

from ._errors import LoomError
from .data import token_batch
from .session import Session, TensorInfo

__version__ = "0.1.0"
__all__ = ["LoomError", "Session", "TensorInfo", "token_batch"]
