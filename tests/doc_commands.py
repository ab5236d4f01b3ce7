"""What the README and the documentation pages show, run as a user would run it (a plain module: conftest names
collide across folders).

A page shows a command's output as a ```bash block holding one command, followed by a ```text block: an excerpt
of what the command prints (or writes as Markdown into its --out folder). Lines may be left out, and a line may
end in "…" where the rest of it is left out. The check is on the figures: each line of the excerpt must have a
line of the real output that holds its first three words and its numbers, in order. The layout around them may
change (other lines added, columns added or reworded) without failing; a figure that changed does.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLIS = ("metronome-sim", "metronome-probe", "metronome-serve")

# A figure: digits with optional thousands commas and decimals, not part of a name (h200, 7b, qwen2.5, S=16 is one).
_NUMBER = re.compile(r"(?<![A-Za-z0-9_.])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?![A-Za-z0-9_])")


def numbers(line: str) -> list[str]:
    """The figures of a line, thousands commas removed: 'peak 3.333/s = 1,000 Erlangs' -> ['3.333', '1000']."""
    return [m.group(1).replace(",", "") + (m.group(2) or "") for m in _NUMBER.finditer(line)]


def _is_subsequence(needle: list[str], hay: list[str]) -> bool:
    it = iter(hay)
    return all(any(n == h for h in it) for n in needle)


def fenced_blocks(text: str) -> list[tuple[str, str, int]]:
    """(language, body, line number of the opening fence) of every fenced block in a Markdown text."""
    blocks, lang, body, start = [], None, [], 0
    for i, line in enumerate(text.splitlines(), 1):
        if lang is None:
            m = re.match(r"^```(\w*)\s*$", line)
            if m:
                lang, body, start = m.group(1), [], i
        elif line.startswith("```"):
            blocks.append((lang, "\n".join(body), start))
            lang = None
        else:
            body.append(line)
    return blocks


def commands(body: str) -> list[str]:
    """The command lines of a bash block: continuations joined, comments dropped, `a && b` split."""
    joined = re.sub(r"\\\n\s*", " ", body)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()  # a trailing comment
        if not line or line.startswith("#"):
            continue
        out += [part.strip() for part in line.split("&&") if part.strip()]
    return out


def output_pairs(text: str) -> list[tuple[str, str, int]]:
    """(command, expected output excerpt, line) for each bash block of one command followed by a text block."""
    pairs = []
    blocks = fenced_blocks(text)
    lines = text.splitlines()
    for (lang, body, start), (nlang, nbody, nstart) in zip(blocks, blocks[1:]):
        if lang != "bash" or nlang != "text":
            continue
        close = start + len(body.splitlines()) + 1  # the closing fence's line number
        if any(lines[k - 1].strip() for k in range(close + 1, nstart)):
            continue  # prose between them: not a command and its output
        cmds = commands(body)
        assert len(cmds) == 1, f"line {start}: a bash block shown with its output holds one command, not {cmds}"
        pairs.append((cmds[0], nbody, start))
    return pairs


_WORD = re.compile(r"[A-Za-z][A-Za-z*'-]*")


def mismatches(expected: str, actual: str) -> list[str]:
    """The excerpt lines that no line of the actual output matches; [] when all match. A line matches when it
    carries the excerpt line's figures in order and its first three words (so that a figure is looked for where
    the excerpt shows it, not in any line that happens to hold the same number)."""
    actual_lines = [(line.lower(), numbers(line)) for line in actual.splitlines()]
    bad = []
    for line in expected.splitlines():
        shown = line.split("…")[0]
        want, words = numbers(shown), [w.lower() for w in _WORD.findall(shown)[:3]]
        if want and not any(all(w in text for w in words) and _is_subsequence(want, have)
                            for text, have in actual_lines):
            bad.append(line.strip())
    return bad


def executable(name: str) -> str:
    """The entry point installed beside this Python (the virtual environment's), else the one on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    assert found, f"{name} is not installed: pip install -e '.[test]'"
    return found


@dataclass
class Ran:
    command: str
    returncode: int
    output: str  # stdout, stderr, then every Markdown file the command wrote, as a user would read them
    folder: Path  # the working folder it ran in (its relative --out lands here)


class Runner:
    """Runs documented commands in a scratch folder, once each per test module (a command shown on two pages
    runs once). `runs/...` and the like land in the scratch folder; `examples/` is the repository's."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="metronome-doc-commands-"))
        self._done: dict[str, Ran] = {}

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def run(self, command: str, timeout: float = 1200) -> Ran:
        if command in self._done:
            return self._done[command]
        argv = shlex.split(command)
        assert argv[0] in CLIS, f"not a Metronome command: {command}"
        folder = self.root / f"c{len(self._done)}"
        folder.mkdir()
        (folder / "examples").symlink_to(ROOT / "examples")
        # wide enough that no table or header line wraps or cuts a name
        env = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1"}
        p = subprocess.run([executable(argv[0]), *argv[1:]], cwd=folder, env=env, capture_output=True, text=True,
                           timeout=timeout)
        written = sorted(Path(d) / f for d, _, files in os.walk(folder) for f in files if f.endswith(".md"))
        output = "\n".join([p.stdout, p.stderr, *(f.read_text() for f in written)])
        ran = Ran(command, p.returncode, output, folder)
        self._done[command] = ran
        return ran


def help_text(argv: list[str]) -> str:
    """What `CLI [SUBCOMMAND] --help` prints for a documented command line (the bare `metronome-probe --model`
    form is `calibrate`)."""
    cli, rest = argv[0], argv[1:]
    if cli == "metronome-serve":
        cmd = [cli]
    elif rest and not rest[0].startswith("-"):
        cmd = [cli, rest[0]]
    else:
        cmd = [cli, "calibrate"] if cli == "metronome-probe" else [cli]
    p = subprocess.run([executable(cmd[0]), *cmd[1:], "--help"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "400"})
    assert p.returncode == 0, f"{' '.join(cmd)} --help: exit {p.returncode}\n{p.stderr}"
    return p.stdout


def flags(argv: list[str]) -> list[str]:
    return [a.split("=")[0] for a in argv if a.startswith("--")]
