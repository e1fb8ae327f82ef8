"""The exception the runtime's errors become."""


class LoomError(RuntimeError):
    """An error the Loom runtime reported, with its message.

    ``code`` says what kind it is, as the C API's ``loom_status_code_t`` does:
    ``"invalid_argument"`` (a caller's mistake: a wrong name, size or option,
    a closed session), ``"invalid_bundle"`` (corrupt, truncated or foreign
    files), ``"unsupported"`` (valid, but this runtime or backend cannot run
    it), ``"io_error"`` (a file could not be read or written),
    ``"resource_exhausted"`` (full for now: a server's queue; retry later) or
    ``"internal"`` (a bug in Loom, or a failed step of a generation).
    """

    def __init__(self, message: str, code: str = "internal") -> None:
        super().__init__(message)
        self.code = code
