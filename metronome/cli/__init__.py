"""Command-line entry points (they sit on top of the core, sim and probe layers)."""

import argparse

from metronome.errors import MetronomeError


class ErrorParser(argparse.ArgumentParser):
    """argparse whose usage errors are :class:`MetronomeError`: one line and exit 2 through
    :func:`metronome.errors.run_command`, like every other user error."""

    def error(self, message):
        raise MetronomeError(message)
