"""User-facing errors: the CLI prints their message and exits non-zero, without a traceback."""


class BasinError(Exception):
    """Bad input from a user (an unknown name, a malformed file, impossible parameters)."""


class InputFileError(BasinError):
    """A problem in a file the user gave us, located by file and line."""

    def __init__(self, path: str, line: int | None, reason: str) -> None:
        self.path = path
        self.line = line
        self.reason = reason
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {reason}")
