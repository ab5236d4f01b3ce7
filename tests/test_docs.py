"""The documentation site: it builds with `mkdocs build --strict` (a broken link, a missing anchor, a page left out
of the navigation or an API page whose module is gone fails), it has the pages a user looks for, the figures its
pages show as a command's output are what the command prints today, and the page of environment variables lists
every one the code reads."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from doc_commands import ROOT, Runner, fenced_blocks, mismatches, output_pairs

DOCS = ROOT / "docs"

# The site's pages a user looks for (what the README links to), and a phrase each must render.
PAGES = {
    "index.html": "The problem it exists for",
    "getting-started.html": "Install and a first plan",
    "capacity-plan.html": "Deadline-bound N",
    "fleet.html": "Erlang B",
    "probe.html": "Pooling calibrations",
    "serving.html": "Deploying",
    "serve.html": "protocol",
    "vllm-bound.html": "GPU check",
    "simulator.html": "The engine model",
    "presets.html": "What a calibration is",
    "validation.html": "The engine model against vLLM",
    "benchmarks.html": "bench_sim.py",
    "files.html": "METRONOME_CACHE_DIR",
    "contributing.html": "Rules",
    "history/index.html": "History",
    # the API reference, rendered from the docstrings
    "reference/core.html": "KVPolicy",
    "reference/sim.html": "metronome.sim.capacity",
    "reference/live.html": "metronome.probe.driver",
}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(out)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert "No module named mkdocs" not in p.stderr, "MkDocs is missing: pip install -e '.[test]'"
    assert p.returncode == 0, f"mkdocs build --strict failed:\n{p.stderr[-4000:]}"
    return out


def test_site_builds_strict(site):
    assert (site / "index.html").is_file()


@pytest.mark.parametrize("page", sorted(PAGES))
def test_site_has_the_page(site, page):
    html = (site / page).read_text()
    text = re.sub(r"<[^>]+>", "", html)
    assert PAGES[page] in text, f"{page} does not show {PAGES[page]!r}"


def test_api_reference_comes_from_the_docstrings(site):
    # the docstring of the KV policy module, as written in the code, appears on the reference page
    import metronome.kv_policy

    first = metronome.kv_policy.__doc__.strip().splitlines()[0]
    words = re.sub(r"``?", "", first).split()[:6]
    text = re.sub(r"<[^>]+>", "", (site / "reference" / "core.html").read_text())
    assert " ".join(words) in re.sub(r"\s+", " ", text)


# --- figures shown as a command's output -------------------------------------------------------------------------

def _pages() -> list[Path]:
    # dated pages keep figures as they were measured; every other page shows today's
    return sorted(p for p in DOCS.rglob("*.md") if "history" not in p.relative_to(DOCS).parts)


PAIRS = [(page.relative_to(ROOT).as_posix(), *pair) for page in _pages() for pair in output_pairs(page.read_text())]


# Design notes and pages of measured runs, whose text blocks show logs, messages or a measurement as taken
DESCRIPTIVE = {"live.md", "serve.md", "serve-plan.md", "front-end.md", "bound.md", "gpu-pricing.md", "report-example.md"}


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in _pages() if p.name not in DESCRIPTIVE])
def test_every_output_shown_on_a_page_is_checked(page):
    # a text block shows a command's output: it must follow the command's own block, or nothing checks it
    text = (ROOT / page).read_text()
    shown = [start for lang, _, start in fenced_blocks(text) if lang == "text"]
    assert len(shown) == len(output_pairs(text)), f"{page}: a text block at lines {shown} follows no command"


def test_docs_show_preset_figures_as_checked_command_output():
    # the pages that quote N*, memory ceilings and GPUs for a load do so through checked output excerpts
    pages = {page for page, *_ in PAIRS}
    assert {"docs/simulator.md", "docs/presets.md", "docs/fleet.md"} <= pages, pages


@pytest.fixture(scope="module")
def runner():
    r = Runner()
    yield r
    r.close()


@pytest.mark.slow
@pytest.mark.parametrize("page,command,expected,line", PAIRS, ids=[f"{p}:{n}" for p, _, _, n in PAIRS])
def test_docs_output_excerpt_matches_the_command(runner, page, command, expected, line):
    ran = runner.run(command)
    assert ran.returncode == 0, f"{command}: exit {ran.returncode}\n{ran.output[-3000:]}"
    bad = mismatches(expected, ran.output)
    assert not bad, (f"{page} line {line}: the output shown for `{command}` no longer matches what it prints; "
                     f"lines whose figures differ: {bad}\n--- it printed:\n{ran.output[:4000]}")


# --- environment variables ---------------------------------------------------------------------------------------

SOURCES = [*(ROOT / d for d in ("metronome", "sim", "probe", "serve")), ROOT / "scripts"]
# read from the environment by the code, by name (a constant naming a variable counts too: CACHE_ENV = "...")
_READ = re.compile(r"""environ(?:\.get)?[(\[]\s*["']([A-Z][A-Z0-9_]+)["']|(?:\b|_)ENV\w*\s*=\s*["']([A-Z][A-Z0-9_]+)["']"""
                   r"""|\$\{?([A-Z][A-Z0-9_]{2,})""")
# variables the code sets for the engine's own process rather than reads from the user (documented where they
# matter: the live driver's page)
_SET_FOR_ENGINE = {"VLLM_ENABLE_V1_MULTIPROCESSING", "TOKENIZERS_PARALLELISM", "VLLM_CPU_OMP_THREADS_BIND"}


def _variables_read() -> set[str]:
    names = set()
    for src in SOURCES:
        for f in src.rglob("*"):
            if f.suffix in (".py", ".sh") and f.is_file():
                for m in _READ.finditer(f.read_text()):
                    names.add(next(g for g in m.groups() if g))
    # the shell's own
    return names - _SET_FOR_ENGINE - {"BASH_SOURCE", "PWD"}


def test_files_page_lists_every_environment_variable_the_code_reads():
    page = (DOCS / "files.md").read_text()
    read = _variables_read()
    assert {"METRONOME_CACHE", "METRONOME_CACHE_DIR", "METRONOME_KV_SINKS"} <= read, read  # the scan still works
    missing = sorted(v for v in read if f"`{v}`" not in page)
    assert not missing, f"docs/files.md does not list {missing}"


def test_files_page_lists_no_variable_the_code_does_not_know():
    table = re.findall(r"^\| `([A-Z][A-Z0-9_]+)` \|", (DOCS / "files.md").read_text(), re.MULTILINE)
    assert len(table) >= 5
    code = "\n".join(f.read_text() for src in SOURCES for f in src.rglob("*") if f.suffix in (".py", ".sh"))
    # numba's cache folder is numba's own; the rest must be named somewhere in the code
    stale = [v for v in table if v not in code and v != "NUMBA_CACHE_DIR"]
    assert not stale, f"docs/files.md lists variables nothing reads: {stale}"
