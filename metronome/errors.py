"""The one error type users can cause.

Anything a user can get wrong (a flag, a file, a calibration, an engine that will not start) is raised
as :class:`MetronomeError` with a one-line message. The CLIs print that line and exit with code 2.
Any other exception is a bug and keeps its traceback.
"""


class MetronomeError(Exception):
    """A user-facing error: one line, no traceback."""

    exit_code = 2

    def __init__(self, message: str):
        message = " ".join(str(message).split())  # always one line
        super().__init__(message)


class CalibrationError(MetronomeError):
    """A calibration file or preset is missing, malformed or inconsistent."""
