"""A compiled bundle, opened for running and training."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple, Optional, Union

import numpy as np

from . import _native
from ._errors import LoomError

PathLike = Union[str, "os.PathLike[str]"]

# DLPack's device type of CUDA memory (kDLCUDA), as __dlpack_device__ reports it.
_DLPACK_CUDA = 2
# __dlpack__(stream=1): the producer makes CUDA's legacy default stream wait
# for its own; loom_session_bind_input_from orders its copy after that stream.
_LEGACY_DEFAULT_STREAM = 1


class TensorInfo(NamedTuple):
    """An input or output of a bundle."""

    name: str
    dtype: str  # "float32", "bfloat16", "float16", "float64", "int32" or "int64"
    shape: tuple[int, ...]
    nbytes: int


class Session:
    """A bundle written by ``loomc compile``, loaded and ready to run.

    ``Session("gpt.loom")`` reads and validates the bundle, loads (or seeds)
    its weights and prepares its programs on ``backend`` (``"cpu"`` or
    ``"cuda"``). Inputs are NumPy arrays or DLPack tensors (PyTorch, JAX,
    CuPy, ...) of exactly the input's dtype and shape; a tensor on the
    session's GPU is copied device to device, never through the host.
    Outputs come back as NumPy copies (:meth:`output`) or as DLPack views of
    the runtime's own memory (:meth:`output_view`). Every runtime error is a
    :class:`LoomError` carrying the runtime's message. Use it as a context
    manager, or call :meth:`close`.
    """

    def __init__(self, bundle: PathLike, *, backend: str = "cpu", threads: int = 0,
                 timeout: float = 300.0) -> None:
        """Opens the bundle directory ``bundle``.

        ``threads``: the CPU backend's threads (0: one per core). ``timeout``:
        seconds a rank of a multi-rank bundle under ``mpirun`` waits for its
        peers. Raises :class:`LoomError` for a missing or damaged bundle or an
        unknown backend.
        """
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str ('cpu' or 'cuda'), got {type(backend).__name__}")
        self._native = _native.Session(os.fspath(bundle), backend, int(threads), float(timeout))
        self.inputs: dict[str, TensorInfo] = _infos(self._native.inputs)
        """The bundle's inputs by name, in its order."""
        self.outputs: dict[str, TensorInfo] = _infos(self._native.outputs)
        """The bundle's outputs by name, in its order (a training bundle's first is the loss)."""

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<loom.Session (closed)>"
        kind, index = self.device
        return (f"<loom.Session on {kind}:{index}, inputs {list(self.inputs)}, "
                f"outputs {list(self.outputs)}>")

    def close(self) -> None:
        """Releases the session. Views from :meth:`output_view` keep the
        runtime's memory alive until they are gone; every other call then
        raises :class:`LoomError`. Closing twice is harmless."""
        self._native.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._native.closed

    @property
    def device(self) -> tuple[str, int]:
        """Where the session's memory is: ``("cpu", 0)`` or ``("cuda", ordinal)``."""
        return self._native.device

    @property
    def rank(self) -> int:
        """This session's rank in its bundle (0 unless started by ``mpirun``)."""
        return self._native.rank

    @property
    def num_ranks(self) -> int:
        """The bundle's rank count."""
        return self._native.num_ranks

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (0 for inference bundles)."""
        return self._native.step

    def bind(self, inputs: Optional[Mapping[str, Any]] = None, /, **named: Any) -> None:
        """Copies arrays into the named inputs: ``bind(tokens=x)`` or ``bind({"tokens": x})``.

        Each array must have exactly the input's dtype and shape (see
        :attr:`inputs`) and be contiguous: a NumPy array, a Python list
        (converted to the input's dtype), or any DLPack tensor in host memory
        or on the session's GPU. Raises ``TypeError`` for a wrong dtype or a
        value that is no array, ``ValueError`` for a wrong shape or device, and
        :class:`LoomError` for an unknown name or a closed session.
        """
        for name, value in {**(inputs or {}), **named}.items():
            self._native.bind(name, self._importable(name, value))

    def forward(self, inputs: Optional[Mapping[str, Any]] = None, /, **named: Any) -> None:
        """Binds the given inputs (as :meth:`bind`), then runs the forward pass.

        Read the results with :meth:`output` or :meth:`output_view`.
        """
        self.bind(inputs, **named)
        self._native.forward()

    def train_step(self, inputs: Optional[Mapping[str, Any]] = None, /, **named: Any) -> float:
        """Binds the given inputs (as :meth:`bind`), then runs one training step
        (forward, backward, optimizer update) and returns the loss.

        The bundle must be compiled with ``loomc compile --train``.
        """
        self.bind(inputs, **named)
        return self._native.train_step()

    def output(self, name: str) -> np.ndarray:
        """A NumPy copy of the named output as the last run left it.

        bfloat16 outputs are widened to float32 (NumPy has no bfloat16; the
        conversion is exact); :meth:`output_view` gives them as they are.
        """
        return self._native.output(name)

    def output_view(self, name: str) -> Any:
        """The named output in the runtime's own memory, without a copy.

        The result implements DLPack (``__dlpack__``, ``__dlpack_device__``):
        ``torch.from_dlpack(view)``, ``jax.dlpack.from_dlpack(view)`` or, on
        the CPU, ``numpy.from_dlpack(view)``. On a GPU it stays there. Every
        run overwrites what it shows, so copy it (``.clone()``) to keep a
        result past the next :meth:`forward` or :meth:`train_step`; it keeps
        the runtime's memory alive, even past :meth:`close`. Do not write to it.
        """
        return self._native.output_view(name)

    def output_address(self, name: str) -> int:
        """The address of the named output in the runtime's memory (host or GPU):
        what a zero-copy view's ``data_ptr()`` equals."""
        return self._native.output_address(name)

    def save_checkpoint(self, path: PathLike) -> None:
        """Writes parameters, optimizer state and step to one safetensors file
        (through a temporary file and a rename, with a checksum)."""
        self._native.save_checkpoint(os.fspath(path))

    def load_checkpoint(self, path: PathLike) -> None:
        """Restores a checkpoint of this bundle; a damaged or foreign file is
        refused without changing the session."""
        self._native.load_checkpoint(os.fspath(path))

    def save_weights(self, path: PathLike) -> None:
        """Writes the parameters as safetensors (through a temporary file and a rename)."""
        self._native.save_weights(os.fspath(path))

    def load_weights(self, path: PathLike) -> None:
        """Loads parameters from safetensors; every one is checked before any is changed."""
        self._native.load_weights(os.fspath(path))

    def _importable(self, name: str, value: Any) -> Any:
        """What the native bind reads: a NumPy array, or a DLPack capsule
        made ready for the runtime's copy (GPU tensors), or the tensor."""
        if isinstance(value, np.ndarray):
            return np.ascontiguousarray(value)
        if hasattr(value, "__dlpack_device__") and hasattr(value, "__dlpack__"):
            try:
                if value.__dlpack_device__()[0] == _DLPACK_CUDA:
                    return value.__dlpack__(stream=_LEGACY_DEFAULT_STREAM)
                return value.__dlpack__()
            except (BufferError, RuntimeError) as e:
                raise TypeError(f"input '{name}': cannot export it through DLPack: {e}") from e
        if isinstance(value, (list, tuple)) and name in self.inputs:
            dtype = self.inputs[name].dtype
            if dtype != "bfloat16":
                return np.asarray(value, dtype=dtype)
        return value


def _infos(raw: list[tuple[str, str, list[int], int]]) -> dict[str, TensorInfo]:
    return {name: TensorInfo(name, dtype, tuple(shape), nbytes) for name, dtype, shape, nbytes in raw}


__all__ = ["LoomError", "Session", "TensorInfo"]
