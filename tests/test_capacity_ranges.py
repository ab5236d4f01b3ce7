"""N* over the step terms' ranges (metronome.sim.capacity.sensitivity): the interval brackets the central N* and every
tornado bar, each variant's search from near the central N* finds what a search from one session finds, the
dominant term is the one whose range is widest in effect, and `metronome-sim capacity` prints and writes them.

The expected values here come from the plain search (doubling from one session, then bisection) on calibrations
moved by hand with Calibration.with_term, never from the functions under test.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from metronome import calibration
from metronome.kv_policy import KVPolicy
from metronome.sim.capacity import capacity, deadline_n_star, ranged_terms, sensitivity
from sim_cli_helpers import run_cli

POLICY = KVPolicy.sinks(16, 16, 368)
DEADLINE_S = 0.08
# the term a test widens: small today (20 us a sequence, estimated), so it is not the dominant term unless widened
WIDENED = "vLLM per sequence (scheduler, sampler, detokeniser)"
WIDEN = 16.0  # its range: value/16 .. value·16


def plain_n_star(cal) -> int:
    """The deadline-bound N* by the plain search from one session (capacity's own, without a start)."""
    return deadline_n_star(cal, POLICY, DEADLINE_S)[0]


def moved(cal, **ends):
    """``cal`` with every ranged term at the given end ("low" or "high"), by hand."""
    (end,) = ends.values()
    for t in ranged_terms(cal, POLICY):
        cal = cal.with_term(t.name, t.bounds()[0 if end == "low" else 1])
    return cal


@pytest.fixture(scope="module")
def moshi():
    cal = calibration.load("moshi-7b-h200")
    return cal, capacity(cal, POLICY, DEADLINE_S, ranges=True)


def test_the_interval_brackets_the_central_n_star_and_every_bar(moshi):
    cal, cap = moshi
    r = cap["ranges"]
    central = cap["deadline_n_star"]
    slow, fast = r["deadline_n_star_interval_sessions"]
    assert r["ranged_terms"] == len(r["tornado"]) >= 3
    assert slow < central < fast  # estimated terms at 2x either way move it both ways
    for b in r["tornado"]:  # (p99 is not exactly monotone in N under independent phases: a session either side)
        low, high = b["deadline_n_star_at_low_sessions"], b["deadline_n_star_at_high_sessions"]
        assert slow <= high <= central + 1 and central - 1 <= low <= fast
    # the ends are every term at its high, then at its low, at once: the plain search on those calibrations
    assert (slow, fast) == (plain_n_star(moved(cal, end="high")), plain_n_star(moved(cal, end="low")))
    # the binding N*'s interval is the deadline-bound one capped by the memory ceiling (512 here)
    assert r["n_star_interval_sessions"] == [min(slow, 512), min(fast, 512)] and cap["memory_ceiling"] == 512


def test_each_bar_is_its_term_alone_at_its_low_and_its_high(moshi):
    cal, cap = moshi
    bars = cap["ranges"]["tornado"]
    assert [b["swing_sessions"] for b in bars] == sorted((b["swing_sessions"] for b in bars), reverse=True)
    for b in bars[:2] + bars[-1:]:  # the widest two and the narrowest: searched from near N* and from one alike
        t = next(t for t in cal.terms_for(POLICY) if t.name == b["term"])
        assert (b["low_s"], b["high_s"]) == t.bounds() and b["value_s"] == t.value
        assert b["deadline_n_star_at_low_sessions"] == plain_n_star(cal.with_term(t.name, t.bounds()[0]))
        assert b["deadline_n_star_at_high_sessions"] == plain_n_star(cal.with_term(t.name, t.bounds()[1]))
        assert b["unit"] == "s " + calibration.COEFFICIENT_UNITS[t.coefficient]


def test_a_search_from_a_guess_finds_what_the_search_from_one_finds():
    """Up from a guess below N*, down from one above, and down to 0 when even one session misses."""
    cal = calibration.load("moshi-7b-h200")
    n = plain_n_star(cal)
    for start in (1, n // 3, n - 1, n, n + 1, 3 * n):
        assert deadline_n_star(cal, POLICY, DEADLINE_S, start=start)[0] == n, start
    assert deadline_n_star(cal, POLICY, 0.002, start=n)[0] == 0 == deadline_n_star(cal, POLICY, 0.002)[0]


def widened(tmp_path, factor: float = WIDEN):
    """moshi-7b-h200 with WIDENED's range set to value/factor .. value·factor, as a file."""
    cal = calibration.load("moshi-7b-h200")

    def widen(terms):
        return tuple(replace(t, low=t.value / factor, high=t.value * factor) if t.name == WIDENED else t
                     for t in terms)

    sl = cal.step_latency
    cal = replace(cal, name="moshi-widened", step_latency=replace(sl, terms=widen(sl.terms)),
                  stack_options=tuple(replace(s, terms=widen(s.terms)) for s in cal.stack_options))
    path = tmp_path / "widened.json"
    path.write_text(cal.to_json())
    return path


def test_the_dominant_term_is_the_one_whose_range_is_widened(tmp_path, moshi):
    path = widened(tmp_path)
    cal = calibration.load(str(path))
    assert moshi[1]["ranges"]["dominant_term"] != WIDENED  # (so the widening is what makes it dominant)
    cap = capacity(cal, POLICY, DEADLINE_S)
    r = sensitivity(cal, POLICY, cap)
    assert r["dominant_term"] == WIDENED == r["tornado"][0]["term"]
    value = next(t.value for t in cal.terms_for(POLICY) if t.name == WIDENED)
    low, high = plain_n_star(cal.with_term(WIDENED, value / WIDEN)), plain_n_star(cal.with_term(WIDENED, value * WIDEN))
    assert (r["tornado"][0]["deadline_n_star_at_low_sessions"], r["tornado"][0]["deadline_n_star_at_high_sessions"]) \
        == (low, high)
    assert low - high > max(b["swing_sessions"] for b in r["tornado"][1:])


def test_memory_binding_keeps_n_star_and_says_the_ranges_move_the_deadline_bound_one():
    cal = calibration.load("moshi-7b-h200")
    small = replace(cal, engine=replace(cal.engine, num_blocks=2000))  # 80 bounded sessions
    cap = capacity(small, POLICY, DEADLINE_S, ranges=True)
    r = cap["ranges"]
    assert cap["binding"] == "memory" and cap["n_star"] == 80
    assert r["n_star_interval_sessions"] == [80, 80]  # the slow end still carries more than the pool holds
    assert r["deadline_n_star_interval_sessions"][0] > 80
    from metronome.sim.capacity import interval_words

    words = interval_words(cap)
    assert words.startswith("memory binds, so the terms' ranges move only the deadline-bound N*: ")
    lo, hi = r["deadline_n_star_interval_sessions"]
    assert f"({lo}–{hi}; moved most by \"{r['dominant_term']}\")" in words


def test_the_capacity_command_prints_the_interval_and_writes_it_with_units(tmp_path):
    path = widened(tmp_path)
    out = tmp_path / "cap"
    ran = run_cli("capacity", "--calibration", str(path), "--kv", "sinks", "--sinks", "16", "--window", "368",
                  "--out", str(out))
    assert ran.returncode == 0, ran.stderr
    res = json.loads((out / "capacity.json").read_text())
    r = res["ranges"]
    lo, hi = r["n_star_interval_sessions"]
    printed = " ".join(ran.stdout.split())  # (a narrow terminal wraps it between words)
    line = f'N* = {res["n_star"]:,} sessions ({lo:,}–{hi:,} over the terms\' ranges; moved most by "{WIDENED}"'
    assert line in printed, ran.stdout
    fast = r["deadline_n_star_interval_sessions"][1]
    assert fast > hi == res["memory_ceiling"] == 512  # every term at its low: more than the pool holds
    assert f'{WIDENED}"; at their fast end memory caps it at 512)' in printed
    assert r["dominant_term"] == WIDENED and r["definition"]
    bar = r["tornado"][0]
    assert {"value_s", "low_s", "high_s", "deadline_n_star_at_low_sessions", "deadline_n_star_at_high_sessions",
            "swing_sessions", "unit"} <= set(bar) and bar["unit"] == "s per sequence"
    # the terms that move N* are listed with their two N*
    assert f"{bar['deadline_n_star_at_low_sessions']:,} · {bar['deadline_n_star_at_high_sessions']:,}" in printed
