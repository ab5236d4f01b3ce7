"""Command-line entry points (they sit on top of the core, sim and probe layers)."""

import argparse
import logging
import os

from metronome.errors import MetronomeError

# A process vLLM spawns (its engine, its workers) imports the command's module before vLLM: its loggers get the
# level the command chose (see quiet) before vLLM logs its first line, which it does before it configures logging,
# and its warnings are hidden as the command's are.
_LEVEL = os.environ.get("VLLM_LOGGING_LEVEL", "").upper()
if _LEVEL:
    logging.getLogger("vllm").setLevel(_LEVEL)
if _LEVEL in ("ERROR", "CRITICAL"):
    import warnings

    warnings.filterwarnings("ignore", module=r"(numba|vllm|torch)(\.|$)")


class ErrorParser(argparse.ArgumentParser):
    """argparse whose usage errors are :class:`MetronomeError`: one line and exit 2 through
    :func:`metronome.errors.run_command`, like every other user error."""

    def error(self, message):
        raise MetronomeError(message)


def quiet(verbose: bool, vllm: bool = True) -> None:
    """Unless ``--verbose``: vLLM logs errors only (``vllm``: the command may start it), and the warnings of vLLM,
    torch and numba, and the RuntimeWarnings of metronome's own numerics, are not shown. Call it before vLLM is
    imported: vLLM logs its first lines before it reads ``VLLM_LOGGING_LEVEL``, and the engine processes it starts
    take the level from the environment."""
    import warnings

    if vllm:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "ERROR")
        logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    if verbose:
        return
    warnings.filterwarnings("ignore", module=r"(numba|vllm|torch)(\.|$)")
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"metronome(\.|$)")


def given(args, parser: argparse.ArgumentParser, dest: str, flag: str, argv) -> bool:
    """Whether the user gave ``flag`` (its value differs from the parser's default, or it is on the command line)."""
    value = getattr(args, dest, None)
    if value is not None and value is not False and value != parser.get_default(dest):
        return True
    return any(a == flag or a.startswith(flag + "=") for a in argv or ())


def refuse_unused(args, parser: argparse.ArgumentParser, argv, rules) -> None:
    """An option that only acts with another is an error without it (it would change nothing). ``rules``:
    ``(dest, flag, applies(args) -> bool, what it needs)``; a rule whose option the command lacks is skipped."""
    for dest, flag, applies, needs in rules:
        if hasattr(args, dest) and given(args, parser, dest, flag, argv) and not applies(args):
            raise MetronomeError(f"{flag} only applies with {needs}; alone it would change nothing")


STACK_HELP = ("the serving stack the calibration is priced for, one its preset ships (metronome-sim calibrations lists "
              "them; default: the preset's first, every stage batched with CUDA graphs; docs/presets.md)")


def add_calibration_options(p: argparse.ArgumentParser, help_: str, *, append: bool = False,
                            metavar: str | None = None) -> None:
    """``--calibration`` and ``--stack``, added together: every command that takes a calibration takes the serving
    stack it is priced for (:func:`stack_specs` applies it)."""
    p.add_argument("--calibration", dest="calibration", default=None, help=help_, metavar=metavar,
                   **({"action": "append"} if append else {}))
    p.add_argument("--stack", dest="stack", default=None, metavar="NAME", help=STACK_HELP)


def stack_specs(specs, stack: str | None) -> list[str]:
    """Calibration specs (preset names or files) as ``--stack`` prices them (``NAME@STACK``,
    :func:`metronome.calibration.load` reads it), each checked: a calibration that does not ship the stack is one
    line naming the ones it does."""
    specs = list(specs)
    if not stack:
        return specs
    from metronome import calibration as calmod

    out = []
    for s in specs:
        calmod.load(s, stack=stack)
        out.append(calmod.with_stack_spec(s, stack))
    return out
