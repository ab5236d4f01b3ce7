"""The one error type users can cause.

Anything a user can get wrong (a flag, a file, a calibration, an engine that will not start) is raised
as :class:`MetronomeError` with a one-line message. The CLIs print that line and exit with code 2.
Any other exception is a bug and keeps its traceback.
"""

import sys


class MetronomeError(Exception):
    """A user-facing error: one line, no traceback."""

    exit_code = 2

    def __init__(self, message: str):
        message = " ".join(str(message).split())  # always one line
        super().__init__(message)


class CalibrationError(MetronomeError):
    """A calibration file or preset is missing, malformed or inconsistent."""


def run_command(prog: str, main, *args) -> int:
    """``main(*args)`` as a command ends: its return code (0 for None); a :class:`MetronomeError` as one line on
    stderr, ``prog: error: ...``, and its exit code; Ctrl-C as one line and 130. The CLIs and the examples all
    end this way."""
    try:
        return main(*args) or 0
    except MetronomeError as exc:
        sys.stderr.write(f"{prog}: error: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: interrupted\n")
        return 130
