"""
The Loom runtime's C API (runtime/include/loom/runtime.h); use the loom package.
"""

from collections.abc import Sequence
from typing import Annotated, Any

import numpy
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

class Generation:
    """A submitted request (see loom.Generation)."""

    @property
    def request(self) -> int:
        """The server's id of the request."""

    def next(self) -> int | None:
        """
        The next token, waiting for it without the GIL; None once the request ended.
        """

    @property
    def finish_reason(self) -> str:
        """
        '' while tokens may follow, else 'length', 'stop', 'cancelled' or 'error'.
        """

    def cancel(self) -> None:
        """Ends the request early: loom_server_cancel."""

class Tokenizer:
    """A bundle's tokenizer (see loom.Tokenizer)."""

    def __init__(self, path: str) -> None:
        """Opens a bundle's tokenizer or a tokenizer file: loom_tokenizer_create."""

    @property
    def vocab_size(self) -> int:
        """One more than the largest id."""

    @property
    def bos_id(self) -> int | None:
        """The begin-of-sequence id, or None."""

    @property
    def prepends_bos(self) -> bool:
        """Whether a text prompt starts with BOS (SentencePiece, as Llama)."""

    @property
    def eos_id(self) -> int | None:
        """The end-of-sequence id, or None."""

    def encode(self, text: str) -> list[int]:
        """The ids of a text."""

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ids."""

class TokenDecoder:
    """Decodes a generation's text token by token."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        """A decoder over a tokenizer: loom_token_decoder_create."""

    def push(self, token: int) -> str:
        """The text the token completes."""

    def finish(self) -> str:
        """What is still held back, at the end."""

class Server:
    """A serving bundle, running (see loom.Server)."""

    def __init__(self, bundle: str, backend: str, threads: int, max_queue: int) -> None:
        """Opens a serving bundle: loom_server_create."""

    def close(self) -> None:
        """Cancels what runs and stops the server."""

    @property
    def closed(self) -> bool:
        """Whether close() was called."""

    def submit(self, prompt: Annotated[NDArray[numpy.int32], dict(shape=(None,), order='C', device='cpu', writable=False)], max_new_tokens: int, temperature: float, top_k: int, top_p: float, repetition_penalty: float, seed: int, stop_tokens: Sequence[int]) -> Generation:
        """Queues a request: loom_server_submit."""

    def tokenizer(self) -> Tokenizer | None:
        """The bundle's tokenizer, or None."""

    def drain(self) -> None:
        """Refuses new requests and finishes the others."""

    def stats(self) -> dict:
        """The server's counters: loom_server_stats."""
