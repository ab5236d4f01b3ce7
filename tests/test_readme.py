"""The README as a new user reads it: short, free of history, its commands run, and every figure it quotes about a
shipped preset is what the commands print today.

Figures are read from the commands' own outputs (their JSON files, and what they print), never computed here, so a
preset or a model that changes without the README changing fails this test."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

from doc_commands import CLIS, ROOT, Runner, commands, fenced_blocks, flags, help_text, mismatches, output_pairs

README = ROOT / "README.md"
TEXT = README.read_text()

# README commands 1 and 2, exactly as a user copies them (the project's rules keep them as they are).
COMMAND_1 = ("python3 -m venv .venv && . .venv/bin/activate && pip install -e . && metronome-sim report "
             "--calibration moshi-7b-h200 --out runs/report && echo \"open runs/report/report.html\"")
COMMAND_2 = "./scripts/test.sh"

# Steps that set up the environment rather than use Metronome: checked for what they refer to, not run.
SETUP = ("python3 -m venv", ". .venv/bin/activate", "pip install", "bash scripts/", "echo ", "./scripts/test.sh")

# Commands of the README that are not run here, and why. Each is still checked: every flag it passes must be one
# its command's --help lists, so a renamed flag fails. A command listed here that the README no longer shows
# fails too, so the list stays the README's.
NOT_RUN = {
    "metronome-probe --model tiny --out runs/tiny": "calibrates the live vLLM engine: minutes (tests/live runs it)",
    "metronome-probe validate --model tiny --sinks 32 --out runs/validate":
        "calibrates and runs vLLM live three times: minutes (tests/live runs it)",
    "metronome-sim report --calibration runs/validate/calibration/calibration.json --live runs/validate "
    "--out runs/tiny-report": "needs the validate run above",
    "metronome-serve --model tiny --kv sinks --sinks 32 --window 128 --num-blocks 256 --admission aimd --port 8000":
        "a server: runs until stopped (tests/live/test_serve.py runs it)",
}

# The README's planner's path, as it names the commands (the figures below are read from their outputs).
CAPACITY = "metronome-sim capacity --calibration moshi-7b-h200 --kv sinks --sinks 16 --window 368"
REPORT = "metronome-sim report --calibration moshi-7b-h200 --out runs/report"
FLEET = "metronome-sim fleet --calibration moshi-7b-h200 --kv sinks --sinks 16 --window 368 --arrival-rate 3.333"


def readme_commands() -> list[str]:
    return [c for lang, body, _ in fenced_blocks(TEXT) if lang == "bash" for c in commands(body)]


def metronome_commands() -> list[str]:
    return [c for c in readme_commands() if shlex.split(c)[0] in CLIS]


@pytest.fixture(scope="module")
def runner():
    r = Runner()
    yield r
    r.close()


# --- what the README is ---------------------------------------------------------------------------------------

def test_readme_is_at_most_250_lines():
    n = len(TEXT.splitlines())
    assert n <= 250, f"README.md has {n} lines; the rest belongs in docs/"


HISTORY = {
    # a commit hash: 7-40 hex digits with at least one digit and one letter
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
    "an issue number": re.compile(r"\bissues?\s*#?\s*\d+|(?<![\w&])#\d+\b", re.IGNORECASE),
    # a host-load reading ("load 0.9–1.7", "load ~1", "load average 2"); not "--offered-load 3.333"
    "a host-load reading": re.compile(r"(?<![-\w])load\s*(?:average\s*)?(?:[~≈]\s*)?\d", re.IGNORECASE),
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
}


@pytest.mark.parametrize("what", sorted(HISTORY))
def test_readme_carries_no_history(what):
    hits = [(i, line) for i, line in enumerate(TEXT.splitlines(), 1) if HISTORY[what].search(line)]
    assert not hits, f"README.md holds {what} (history goes to docs/history/): {hits[:3]}"


def test_readme_opens_with_the_two_set_up_commands():
    lang, body, _ = fenced_blocks(TEXT)[0]
    assert lang == "bash"
    assert [line for line in body.splitlines() if not line.startswith("#")] == [COMMAND_1, COMMAND_2]
    # CI runs command 2, and command 2 runs this suite, the documentation's build included (tests/test_docs.py)
    assert "./scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest" in (ROOT / "scripts" / "test.sh").read_text()


def test_readme_set_up_steps_refer_to_what_exists():
    pyproject = (ROOT / "pyproject.toml").read_text()
    for c in readme_commands():
        script = next((a for a in shlex.split(c) if a.startswith(("scripts/", "./scripts/"))), None)
        if script:
            assert (ROOT / script).is_file(), c
        for extra in re.findall(r"\.\[([\w-]+)\]", c):
            assert re.search(rf"^{re.escape(extra)} = \[", pyproject, re.MULTILINE), f"no extra [{extra}]: {c}"


# --- its commands run -------------------------------------------------------------------------------------------

def test_every_readme_command_is_run_or_listed_as_not_run():
    shown = metronome_commands()
    others = [c for c in readme_commands() if c not in shown and not c.startswith(SETUP)]
    assert not others, f"README commands this test does not know how to treat: {others}"
    gone = [c for c in NOT_RUN if c not in shown]
    assert not gone, f"NOT_RUN lists commands the README no longer shows: {gone}"
    assert {CAPACITY, REPORT, FLEET} <= set(shown), "the planner's path changed: update the figures' checks"


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in metronome_commands() if c not in NOT_RUN])
def test_readme_command_runs(runner, command):
    ran = runner.run(command)
    assert ran.returncode == 0, f"{command}: exit {ran.returncode}\n{ran.output[-3000:]}"


@pytest.mark.parametrize("command", sorted(NOT_RUN))
def test_readme_command_not_run_passes_only_flags_its_command_has(command):
    argv = shlex.split(command)
    text = help_text(argv)
    unknown = [f for f in flags(argv) if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]
    assert not unknown, f"{command}: {unknown} not in its --help"


def test_every_command_in_the_readme_table_exists():
    table = re.findall(r"^\| `(metronome-[a-z]+(?: [a-z-]+)?)` \|", TEXT, re.MULTILINE)
    assert len(table) >= 10, "the README's table of commands is gone"
    # metronome-sim's usage line lists its subcommands ({run,what-if,...}): one call for all of them
    sim = set(re.search(r"\{([\w,-]+)\}", help_text(["metronome-sim"])).group(1).split(","))
    for entry in table:
        cli, *sub = entry.split()
        if cli == "metronome-sim" and sub:
            assert sub[0] in sim, f"metronome-sim has no subcommand {sub[0]} (it has {sorted(sim)})"
        else:
            help_text(entry.split())


def test_every_output_shown_in_the_readme_is_checked():
    # a text block shows a command's output: it must follow the command's own block, or nothing checks it
    shown = [start for lang, _, start in fenced_blocks(TEXT) if lang == "text"]
    checked = [line for _, _, line in output_pairs(TEXT)]
    assert len(shown) == len(checked) >= 3, f"text blocks at lines {shown}; checked as output: {checked}"


@pytest.mark.slow
@pytest.mark.parametrize("command,expected,line", output_pairs(TEXT), ids=[f"line{n}" for _, _, n in output_pairs(TEXT)])
def test_readme_output_excerpt_matches_the_command(runner, command, expected, line):
    ran = runner.run(command)
    assert ran.returncode == 0, ran.output[-3000:]
    bad = mismatches(expected, ran.output)
    assert not bad, (f"README.md line {line}: the output shown for `{command}` no longer matches what it prints; "
                     f"lines whose figures differ: {bad}\n--- it printed:\n{ran.output[:4000]}")


# --- the figures quoted in its prose ----------------------------------------------------------------------------

def _json(ran, name: str) -> dict:
    found = sorted(ran.folder.rglob(name))
    assert found, f"{ran.command} wrote no {name}"
    return json.loads(found[0].read_text())


@pytest.fixture(scope="module")
def figures(runner) -> dict:
    """The figures the README quotes, as the commands give them today (their JSON outputs)."""
    cap = _json(runner.run(CAPACITY + " --out cap"), "capacity.json")
    report = _json(runner.run(REPORT), "report.json")["calibrations"][0]
    fleet = _json(runner.run(FLEET + " --out fleet"), "fleet.json")
    # the row of the bound the README passes (the fleet may print other policies beside it)
    engines = next(c for c in fleet["calibrations"] if c["policy"] == "sinks(S=16, W=368)")
    presets = runner.run("metronome-sim calibrations")
    return {
        "n_star": cap["n_star"],
        "deadline_n_star": cap["deadline_n_star"],
        "memory_ceiling": cap["memory_ceiling"],
        "deadline_ms": round(cap["deadline_s"] * 1000),
        "target_fraction": round(cap["target_latency_s"] / cap["deadline_s"], 3),
        "unbounded_ceiling": report["memory_ceiling_unbounded"],
        "tokens_per_s": report["stream"]["kv_tokens_per_s"],
        "window": report["policy"]["window"],
        "sinks": report["policy"]["sinks"],
        "erlangs": round(fleet["peak_offered_erlangs"]),
        "mean_session_s": fleet["mean_session_s"],
        "gpus_pooled": engines["closed_form_engines"]["pooled"],
        "gpus_random": engines["closed_form_engines"]["random"],
        "gpus_simulated": engines["routers"]["least-loaded"]["simulated"]["engines"],
        "gpus_unbounded": engines["unbounded"]["closed_form_engines"]["pooled"],
        "n_star_unbounded": engines["unbounded"]["n_star"],
        "presets": len(re.findall(r"\b(?:moshi|qwen|minicpm)[\w.-]*-(?:h100|h200|b200)\b", presets.output)),
    }


_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten",
          11: "eleven", 12: "twelve"}

# (what, a pattern of the README's prose whose groups are the figure, the figure's key). Every pattern must match
# at least once, and every match must equal today's figure.
QUOTED = [
    ("N* = X in the prose", r"N\\\* = (\d+)", "n_star"),
    ("the memory ceiling's bullet", r"\*\*Memory ceiling\*\* \((\d+)\)", "memory_ceiling"),
    ("the deadline-bound N*'s bullet", r"\*\*Deadline-bound N\\\*\*\* \((\d+)\)", "deadline_n_star"),
    ("the unbounded ceiling's bullet", r"\*\*Unbounded memory ceiling\*\* \((\d+)\)", "unbounded_ceiling"),
    ("the pool holds only X of them", r"pool holds only (\d+) of them", "unbounded_ceiling"),
    ("the bound is worth N* / unbounded", r"worth (\d+) / \d+", "n_star"),
    ("the bound is worth N* / unbounded", r"worth \d+ / (\d+)", "unbounded_ceiling"),
    ("the deadline", r"the (\d+) ms frame deadline", "deadline_ms"),
    ("the p99 target", r"(\d\.\d+) × the \d+ ms frame deadline", "target_fraction"),
    ("Moshi's stream", r"Moshi's (\d+(?:\.\d+)?) tokens/s", "tokens_per_s"),
    ("the bound's window", r"the last (\d+) tokens, about", "window"),
    ("the bound's sinks", r"(\d+) sink tokens and", "sinks"),
    ("GPUs for the load, pooled", r"\*\*(\d+) H200s\*\*", "gpus_pooled"),
    ("GPUs for the load, random routing", r"H200s\*\* with a router\s+that finds any free GPU, (\d+) with random",
     "gpus_random"),
    ("GPUs for the load, simulated", r"confirms (\d+) with least-loaded", "gpus_simulated"),
    ("GPUs for the load without the bound", r"needs (\d+) H200s", "gpus_unbounded"),
    ("sessions per GPU without the bound", r"only the (\d+) unbounded sessions", "n_star_unbounded"),
    ("the load in Erlangs", r"1,000 / 300 s = ([\d.]+) sessions/s", None),
    ("places per GPU", r"a loss system with N\\\* = (\d+) places", "n_star"),
    ("the mix's mean length", r"sessions of (\d+) s on average", "mean_session_s"),
    ("how many presets", r"lists all (\w+)\)", "presets"),
]


@pytest.mark.slow
@pytest.mark.parametrize("what,pattern,key", QUOTED, ids=[f"{w}:{k}" for w, _, k in QUOTED])
def test_readme_figure_is_what_the_command_gives(figures, what, pattern, key):
    found = re.findall(pattern, TEXT)
    assert found, f"the README no longer quotes {what} ({pattern!r}): update this test with it"
    for value in found:
        if key is None:  # the arrival rate that makes 1,000 concurrent sessions of the default mix
            rate = float(value)
            assert round(rate * figures["mean_session_s"]) == 1000 == figures["erlangs"], (value, figures)
            continue
        want = figures[key]
        got = float(value) if re.fullmatch(r"[\d.]+", value) else next(n for n, w in _WORDS.items() if w == value)
        assert got == pytest.approx(want), f"README quotes {what} as {value}; the command gives {want}"


# --- the public figures it quotes (benchmarks/bench_anchors.py) -------------------------------------------------

ANCHORS_BENCH = "python benchmarks/bench_anchors.py"
# "... ticks in 28.0 ms at 2 sessions and 70.2 ms at 32 on its own lockstep server ... where `PRESET` prices A and
# B ms": the published figures and the preset's, as the bench prints them in its rows for those session counts
_ANCHOR_QUOTE = re.compile(r"ticks in ([\d.]+) ms at (\d+) sessions and ([\d.]+) ms at (\d+) on its own lockstep "
                           r"server .*? where `([\w.-]+)` prices ([\d.]+) and ([\d.]+) ms")


def test_readme_quotes_the_anchors_bench_as_it_prints():
    prose = re.sub(r"\s+", " ", TEXT)
    m = _ANCHOR_QUOTE.search(prose)
    assert m and ANCHORS_BENCH in prose, "the README no longer quotes the bench's PersonaPlex ticks: update this test"
    ran = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_anchors.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    published_a, n_a, published_b, n_b, preset, predicted_a, predicted_b = m.groups()
    for n, published, predicted in ((n_a, published_a, predicted_a), (n_b, published_b, predicted_b)):
        row = next((line for line in ran.stdout.splitlines() if re.search(rf"lockstep tick, {n} sessions ", line)),
                   None)
        assert row, f"the bench prints no lockstep tick at {n} sessions"
        assert f" {published} ms" in row and f" {predicted} ms" in row and f"{preset} ·" in row, (
            f"README quotes {published} ms published and {predicted} ms by {preset} at {n} sessions; the bench "
            f"prints: {row.strip()}")


# "... leaked N sessions, the server grew by M MiB (bound B), ... exited T s after SIGTERM (bound: the D s drain
# + 5 s)": the figures docs/serve.md records from benchmarks/bench_serve_faults.py (too slow to rerun here)
_FAULTS_QUOTE = re.compile(r"it leaked (\d+) sessions, the server grew by ([\d.]+) MiB \(bound (\d+)\).*? exited "
                           r"([\d.]+) s after SIGTERM \(bound: the (\d+) s drain \+ 5 s\)")


def test_readme_quotes_the_serve_faults_bench_as_the_docs_record_it():
    prose = re.sub(r"\s+", " ", TEXT)
    m = _FAULTS_QUOTE.search(prose)
    assert m, "the README no longer quotes bench_serve_faults.py: update this test"
    leaked, growth, bound, exit_s, drain = m.groups()
    serve = (ROOT / "docs" / "serve.md").read_text()
    table = serve[serve.index("## Hostile clients and faults (measured)"):]
    assert re.search(rf"\| leaked sessions: 0 \| {leaked}: ", table), leaked
    assert re.search(rf"\| RSS growth < {bound} MiB \| {re.escape(growth)} MiB ", table), growth
    assert re.search(rf"\| exit ≤ drain \+ 5 s = {int(drain) + 5} s \| {re.escape(exit_s)} s ", table), exit_s
    assert f"--drain-timeout {drain} " in table.replace("\n", " ")


def test_readme_quotes_the_simulator_speed_as_the_benchmarks_page_records_it():
    """The README's speed of the realistic hour is the figure docs/benchmarks.md records from bench_sim.py (a
    benchmark, not rerun here: timings belong to benchmarks), and its limit the one the page states."""
    prose = re.sub(r"\s+", " ", TEXT)
    m = re.search(r"realistic hour of Moshi traffic .*? at about ([\d,]+)× real time, .*? about ([\d,]+)×", prose)
    assert m, "the README no longer quotes the simulator's speed: update this test"
    page = re.sub(r"\s+", " ", (ROOT / "docs" / "benchmarks.md").read_text())
    row = re.search(r"\| realistic: Poisson 1\.5/s, exp\(300 s\), AIMD, 40 ms deadline \| about ([\d,]+)× ", page)
    assert row and row.group(1) == m.group(1), (m.group(1), row and row.group(1))
    assert f"about {m.group(2)}×" in page
