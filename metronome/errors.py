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


def run_command(prog: str, main, *args, command: str | None = None) -> int:
    """``main(*args)`` as a command ends: its return code (0 for None); a :class:`MetronomeError` as one line on
    stderr, ``prog: error: ...``, and its exit code; Ctrl-C as one line and 130. The CLIs and the examples all
    end this way. ``command`` (default ``prog``; ``metronome-sim run``) is the name every output folder this
    run writes is marked with (:mod:`metronome.outputs`): set here, once, for every caller."""
    from metronome.outputs import writing_as  # (outputs imports this module)

    with writing_as(command or prog):
        try:
            return main(*args) or 0
        except MetronomeError as exc:
            sys.stderr.write(f"{prog}: error: {exc}\n")
            return exc.exit_code
        except KeyboardInterrupt:
            sys.stderr.write(f"{prog}: interrupted\n")
            return 130
