"""
The Loom runtime's C API (runtime/include/loom/runtime.h); use the loom package.
"""

from typing import Any

from numpy.typing import NDArray


class Session:
    """An open bundle (see loom.Session)."""

    def __init__(self, bundle: str, backend: str, threads: int, timeout: float) -> None:
        """Opens a bundle: loom_session_create."""

    def close(self) -> None:
        """Releases the session (views keep its memory)."""

    @property
    def closed(self) -> bool:
        """Whether close() was called."""

    @property
    def inputs(self) -> list[tuple[str, str, list[int], int]]:
        """(name, dtype, shape, nbytes) of each input, in the bundle's order."""

    @property
    def outputs(self) -> list[tuple[str, str, list[int], int]]:
        """(name, dtype, shape, nbytes) of each output, in the bundle's order."""

    @property
    def device(self) -> tuple[str, int]:
        """('cpu', 0) or ('cuda', ordinal)."""

    @property
    def rank(self) -> int:
        """This session's rank in its bundle."""

    @property
    def num_ranks(self) -> int:
        """The bundle's rank count."""

    @property
    def step(self) -> int:
        """Optimizer steps taken so far."""

    def bind(self, name: str, array: object | None) -> None:
        """Copies an array (host or this session's GPU) into the named input."""

    def forward(self) -> None:
        """Runs the forward pass."""

    def train_step(self) -> float:
        """One training step; returns the loss."""

    def output(self, name: str) -> NDArray:
        """A NumPy copy of an output."""

    def output_view(self, name: str) -> Any:
        """A DLPack view of an output in the runtime's memory."""

    def output_address(self, name: str) -> int:
        """The address of an output in the runtime's memory."""

    def save_checkpoint(self, path: str) -> None:
        """Parameters, optimizer state and step to a safetensors file."""

    def load_checkpoint(self, path: str) -> None:
        """Restores a checkpoint; a bad file changes nothing."""

    def save_weights(self, path: str) -> None:
        """Parameters to a safetensors file."""

    def load_weights(self, path: str) -> None:
        """Parameters from a safetensors file; a bad file changes nothing."""
