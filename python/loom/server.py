"""A serving bundle, running: generation as an iterator of tokens."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Optional, Union

import numpy as np

from . import _native
from ._errors import LoomError

PathLike = Union[str, "os.PathLike[str]"]
Prompt = Union[str, Sequence[int], np.ndarray]

_INT32 = np.iinfo(np.int32)


class Tokenizer:
    """A bundle's tokenizer: GPT-2's byte-level BPE (``tokenizer.json``) or
    SentencePiece (``tokenizer.model``), as ``loomc import`` brings it along.

    ``Tokenizer("llama.loom")`` opens a bundle's (one that carries none
    raises :class:`LoomError`), ``Tokenizer("tokenizer.json")`` a file;
    :attr:`Server.tokenizer` is the server's. Thread-safe.
    """

    def __init__(self, path: PathLike) -> None:
        """Opens the tokenizer of the bundle directory ``path``, or the
        ``tokenizer.json`` / SentencePiece ``.model`` file ``path``."""
        self._native = _native.Tokenizer(os.fspath(path))

    @classmethod
    def _wrap(cls, native: _native.Tokenizer) -> Tokenizer:
        tokenizer = cls.__new__(cls)
        tokenizer._native = native
        return tokenizer

    @property
    def vocab_size(self) -> int:
        """One more than the largest id."""
        return self._native.vocab_size

    @property
    def bos_id(self) -> Optional[int]:
        """The begin-of-sequence id, or None."""
        return self._native.bos_id

    @property
    def prepends_bos(self) -> bool:
        """Whether a text prompt starts with BOS, as the checkpoint's own
        tokenizer does (SentencePiece models: Llama's; not GPT-2's BPE).
        ``Server.generate`` applies it; ``encode`` adds no BOS."""
        return self._native.prepends_bos

    @property
    def eos_id(self) -> Optional[int]:
        """The end-of-sequence id (GPT-2's ``<|endoftext|>``, ``</s>``), or None:
        pass it in ``stop_tokens`` to end a generation there."""
        return self._native.eos_id

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, with no special token (such as BOS) added."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self._native.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``; ids outside the vocabulary decode to nothing."""
        return self._native.decode(_token_list(ids, "ids"))


class Generation:
    """One request of a :class:`Server`: an iterator of the token ids the server
    produces, each yielded as soon as it is sampled (``for token in g``).

    The iteration ends when the request does: :attr:`finish_reason` then says
    why. :meth:`close` (or leaving a ``with`` block, or dropping the last
    reference) before that cancels the request, and the server frees its
    cache for others. A request the server fails raises :class:`LoomError`.
    :meth:`text` streams the text instead, where the bundle has a tokenizer.
    """

    def __init__(self, native: _native.Generation, prompt: list[int],
                 tokenizer: Optional[Tokenizer]) -> None:
        self._native = native
        self._tokenizer = tokenizer
        self.prompt: list[int] = prompt
        """The prompt's token ids."""
        self.tokens: list[int] = []
        """The tokens yielded so far."""

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        token = self._native.next()
        if token is None:
            raise StopIteration
        self.tokens.append(token)
        return token

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = self.finish_reason or "running"
        return f"<loom.Generation request {self.request}, {len(self.tokens)} tokens, {state}>"

    @property
    def request(self) -> int:
        """The server's id of this request."""
        return self._native.request

    @property
    def finish_reason(self) -> Optional[str]:
        """None while tokens may follow; then ``"length"`` (``max_new_tokens`` or
        the bundle's ``max_seq`` reached), ``"stop"`` (a stop token, the last
        one yielded), ``"cancelled"`` (:meth:`close`, or the server closed) or
        ``"error"``. Tokens already produced may still be waiting to be read."""
        return self._native.finish_reason or None

    def close(self) -> None:
        """Cancels the request if it has not ended; the iteration then stops.
        Closing twice, or after the end, is harmless."""
        self._native.cancel()

    def text(self) -> Iterator[str]:
        """The rest of the generation as text, piece by piece as the tokens
        arrive: each piece is whole characters (a character split over tokens
        waits for its last one), and together they are
        ``tokenizer.decode(tokens)``. Needs a bundle with a tokenizer."""
        if self._tokenizer is None:
            raise LoomError("this bundle has no tokenizer: iterate over the token ids instead",
                            "invalid_argument")
        return self._pieces(_native.TokenDecoder(self._tokenizer._native))

    def _pieces(self, decoder: _native.TokenDecoder) -> Iterator[str]:
        for token in self:
            piece = decoder.push(token)
            if piece:
                yield piece
        rest = decoder.finish()
        if rest:
            yield rest


class Server:
    """A serving bundle (``loomc compile --serve``), loaded and running.

    ``Server("gpt.serve")`` opens every rank of the bundle on ``backend``
    (``"cpu"`` or ``"cuda"``) and starts the runtime's scheduler, which
    batches requests continuously over the bundle's paged key/value cache.
    :meth:`generate` submits a request and returns its tokens as an iterator
    that yields each one as it is produced. Thread-safe: generate from any
    number of threads at once; waiting for a token releases the GIL. Every
    runtime error is a :class:`LoomError` carrying the runtime's message. Use
    it as a context manager, or call :meth:`close`.
    """

    def __init__(self, bundle: PathLike, *, backend: str = "cpu", threads: int = 0,
                 max_queue: int = 1024) -> None:
        """Opens the serving bundle directory ``bundle``.

        ``threads``: the CPU backend's threads per rank (0: one per core).
        ``max_queue``: requests that may wait for a slot; more are refused with
        :class:`LoomError` code ``"resource_exhausted"``. Raises
        :class:`LoomError` for a missing or damaged bundle, one not compiled
        with ``--serve``, or an unknown backend.
        """
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str ('cpu' or 'cuda'), got {type(backend).__name__}")
        self._native = _native.Server(os.fspath(bundle), backend, int(threads), int(max_queue))
        native_tokenizer = self._native.tokenizer()
        self.tokenizer: Optional[Tokenizer] = (
            Tokenizer._wrap(native_tokenizer) if native_tokenizer is not None else None)
        """The bundle's tokenizer, or None when it carries none (then prompts are token ids)."""

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<loom.Server (closed)>"
        return f"<loom.Server, tokenizer {'yes' if self.tokenizer else 'no'}, stats {self.stats()}>"

    def close(self) -> None:
        """Cancels every request still queued or running (their iterators end
        with ``finish_reason == "cancelled"``) and stops the server; every
        other call then raises :class:`LoomError`. Closing twice is harmless."""
        self._native.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._native.closed

    def generate(self, prompt: Prompt, *, max_new_tokens: int = 16, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0,
                 seed: int = 0, stop_tokens: Iterable[int] = (), ignore_eos: bool = False) -> Generation:
        """Submits a request and returns its :class:`Generation`: iterate over
        it for the new token ids as the server produces them.

        ``prompt``: token ids (a list, or a 1-D NumPy integer array), or a
        ``str`` where the bundle carries a tokenizer. Sampling: greedy at
        ``temperature`` 0; otherwise ``top_k`` (0: off), ``top_p`` (1: off) and
        ``repetition_penalty`` (1: off) from a random stream seeded with
        ``seed``, so that a request's tokens do not depend on what it is
        batched with. The generation ends after ``max_new_tokens``, at the
        bundle's ``max_seq``, or after one of ``stop_tokens`` (yielded); a
        text prompt also after the tokenizer's end-of-sequence id, unless
        ``ignore_eos``.

        Raises :class:`LoomError` (code ``"invalid_argument"``) for a request
        that can never run, with the runtime's reason: an empty prompt or
        one of ``max_seq`` tokens or more, a token outside the vocabulary,
        bad sampling parameters, a text prompt without a tokenizer; code
        ``"resource_exhausted"`` when ``max_queue`` requests already wait.
        ``TypeError`` for a prompt that is no token ids.
        """
        stops = _token_list(stop_tokens, "stop_tokens")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise LoomError("this bundle has no tokenizer; pass token ids", "invalid_argument")
            # BOS first where the checkpoint's own tokenizer adds it (Llama's
            # SentencePiece), as loom-run --prompt-text and loom-serve do.
            bos = [self.tokenizer.bos_id] if self.tokenizer.prepends_bos else []
            ids = np.asarray(bos + self.tokenizer.encode(prompt), dtype=np.int32)
            eos = self.tokenizer.eos_id
            if eos is not None and not ignore_eos:
                stops.append(eos)
        else:
            ids = _token_array(prompt, "prompt")
        native = self._native.submit(ids, int(max_new_tokens), float(temperature), int(top_k),
                                     float(top_p), float(repetition_penalty), int(seed), stops)
        return Generation(native, ids.tolist(), self.tokenizer)

    def drain(self) -> None:
        """Refuses new requests, waits until every queued and running one has
        finished, and stops the scheduler (what a server does on SIGTERM)."""
        self._native.drain()

    def stats(self) -> dict[str, int]:
        """The server's counters: ``submitted``, ``finished``, ``refused``,
        ``cancelled``, ``prompt_tokens``, ``generated_tokens``, ``steps``,
        ``waiting``, ``running``, ``free_blocks``, ``total_blocks``."""
        return self._native.stats()


def _token_array(tokens: Any, what: str) -> np.ndarray:
    """Token ids as a contiguous 1-D int32 array, refusing what is no ids."""
    array = np.asarray(tokens)
    if array.size == 0:
        return np.zeros(0, np.int32)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise TypeError(f"{what} must be token ids: a list of ints or a 1-D integer array, "
                        f"got {_describe(tokens, array)}")
    if array.min() < _INT32.min or array.max() > _INT32.max:
        raise LoomError(f"{what} holds {int(array.max()) if array.max() > _INT32.max else int(array.min())}, "
                        "which is no token id", "invalid_argument")
    return np.ascontiguousarray(array, dtype=np.int32)


def _token_list(tokens: Iterable[int], what: str) -> list[int]:
    if isinstance(tokens, (str, bytes)):
        raise TypeError(f"{what} must be token ids, got {type(tokens).__name__}")
    return _token_array(list(tokens) if not isinstance(tokens, np.ndarray) else tokens, what).tolist()


def _describe(value: Any, array: np.ndarray) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of {array.dtype} with shape {array.shape}"
    return f"{type(value).__name__} ({array.dtype} with shape {array.shape})"


__all__ = ["Generation", "Server", "Tokenizer"]
