"""One error type for everything a user can get wrong; the CLI prints it as one line and exits 2."""


class NpumoeError(Exception):
    """A user-facing error: bad input, a file that fails validation, a request this host cannot serve."""


class FileFormatError(NpumoeError):
    """A versioned file (plan, profile, traces) failed validation; `field` names where."""

    def __init__(self, kind: str, path: str, field: str, message: str) -> None:
        self.kind, self.path, self.field = kind, path, field
        where = f" ({path})" if path else ""
        super().__init__(f"{kind}{where}: {field}: {message}")
