"""Capacity: the memory ceiling, the deadline-bound N*, and which of the two binds.

* **memory ceiling** — the most sessions the pool can hold (the fill model; for unbounded KV, at the
  end of a session of the given length);
* **deadline-bound N\\*** — the largest N whose p99 frame latency meets ``target_fraction × deadline``
  with the pool taken away as a limit (so only latency decides): N sessions in steady state (their
  windows full, or, unbounded, over a whole session), found by doubling then bisection on N — p99 frame
  latency is monotone in N here. Under ``independent`` phases (the default) the N sessions tick at their own
  seeded phases, so a step batches only the frames that have arrived; ``aligned`` measures the lockstep;
* **binding** — the smaller of the two; ``n_star`` is that smaller number;
* **the interval and the tornado** (:func:`sensitivity`) — how far N* moves over the step terms' ranges. Each term
  that prices the policy's step (:meth:`Calibration.terms_for`) and has a range (:meth:`StepTerm.bounds`, low <
  high) gives two bars: the deadline-bound N* with that term at its low and at its high, every other term at its
  value. The **dominant term** is the one whose two bars are furthest apart. The **interval** is the deadline-bound
  N* with every ranged term at its high at once (the slow end) and at its low at once (the fast end): the worst and
  the best case over the ranges, so it brackets every bar. Only the deadline-bound N* moves: the memory ceiling
  does not depend on step time, so N*'s interval is ``min(memory ceiling, ·)`` of the deadline-bound one, and when
  memory binds the ranges move the deadline-bound N* alone.

  Why both ends at once rather than Monte Carlo over the ranges: a range is a plausible bound, not a distribution,
  and the terms' errors are not independent (the estimated terms share one roofline's assumptions — an efficiency,
  a rate — and the first GPU measurements put them off in the same direction). Independent draws would let the
  errors cancel and report a narrower interval than the presets justify, at hundreds of searches instead of two.

  Each variant's N* is searched from the central N* outward (:func:`deadline_n_star` with ``start``: a gallop then
  a bisection), so a term that moves N* by a few sessions costs a few simulations.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Sequence

import numpy as np

from metronome.calibration import COEFFICIENT_UNITS, Calibration, StepTerm
from metronome.errors import MetronomeError
from metronome.fill_model import FillModel
from metronome.kv_policy import KVPolicy
from metronome.workload import Arrivals

from metronome.sim.recorder import weighted_quantile
from metronome.sim.scenario import Scenario, run

UNLIMITED_POOL_BLOCKS = 2**40


def _measure_window(cal: Calibration, policy: KVPolicy, duration_s: float | None) -> tuple[float, float]:
    """(warm-up, measured span) in seconds for the steady-state latency of N sessions."""
    r = cal.stream.kv_tokens_per_s
    if policy.bounded:
        warm = (policy.kept_tokens + 2 * policy.block_size) / r
        span = max(10 * cal.stream.frame_period_s, 5.0)
        if cal.step_latency.jitter:  # a tail to measure: enough ticks that the 99th percentile is not the max,
            span = max(span, 2000 * cal.stream.frame_period_s)
            if cal.step_latency.jitter_shared:  # and, when slow steps come in spells, enough spells
                span = max(span, 500 * cal.step_latency.jitter_tau_s)
        return warm, span
    length = duration_s if duration_s and math.isfinite(duration_s) else 600.0
    return 0.0, length


def p99_at(cal: Calibration, policy: KVPolicy, n: int, deadline_s: float, percentile: float = 99.0,
           duration_s: float | None = None, phases: str = "independent") -> float:
    """p99 frame latency of N sessions, pool unlimited, over the steady-state window."""
    big = replace(cal, engine=replace(cal.engine, num_blocks=UNLIMITED_POOL_BLOCKS,
                                      max_num_seqs=max(cal.engine.max_num_seqs, UNLIMITED_POOL_BLOCKS)))
    warm, span = _measure_window(cal, policy, duration_s)
    res = run(Scenario(big, policy, Arrivals("all", sessions=n), warm + span, deadline_s=deadline_s, phases=phases))
    fr = res.frames[res.frames.tick_s >= warm]
    v = weighted_quantile(fr.latency_s.to_numpy(), fr.frames.to_numpy(), percentile / 100.0)
    return math.inf if v is None else v


def deadline_n_star(cal: Calibration, policy: KVPolicy, deadline_s: float, target_fraction: float = 0.8,
                    percentile: float = 99.0, duration_s: float | None = None, n_max: int = 1_000_000,
                    progress: Callable[[int, float], None] | None = None,
                    phases: str = "independent", start: int | None = None) -> tuple[int, list[tuple[int, float]]]:
    """Largest N with p99 ≤ target (0 if even one session misses); also every (N, p99) evaluated.

    From one session, doubling, then bisection; or, given ``start`` (a guess: the central N* when a term is moved),
    from there outward, by steps of 1, 2, 4, ... until the answer is bracketed, then bisection."""
    if not 0 < target_fraction <= 1:
        raise MetronomeError(f"target fraction must be in (0, 1], got {target_fraction}")
    target = target_fraction * deadline_s
    seen: dict[int, float] = {}

    def ok(n: int) -> bool:
        if n not in seen:
            seen[n] = p99_at(cal, policy, n, deadline_s, percentile, duration_s, phases)
            if progress:
                progress(n, seen[n])
        return seen[n] <= target

    if start is None:
        if not ok(1):
            return 0, sorted(seen.items())
        lo, hi = 1, 2
        while hi <= n_max and ok(hi):
            lo, hi = hi, hi * 2
        if hi > n_max:
            return n_max, sorted(seen.items())
    else:
        lo = hi = min(max(int(start), 1), n_max)
        step = 1
        if ok(lo):
            while True:  # up from the guess
                if lo >= n_max:
                    return n_max, sorted(seen.items())
                hi = min(lo + step, n_max)
                if not ok(hi):
                    break
                lo, step = hi, 2 * step
        else:
            while True:  # down from the guess
                if hi <= 1:
                    return 0, sorted(seen.items())
                lo = max(hi - step, 1)
                if ok(lo):
                    break
                hi, step = lo, 2 * step
    while hi - lo > 1:  # invariant: ok(lo), not ok(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo, sorted(seen.items())


def capacity(cal: Calibration, policy: KVPolicy, deadline_s: float | None = None, target_fraction: float = 0.8,
             percentile: float = 99.0, duration_s: float | None = None,
             progress: Callable[[int, float], None] | None = None, phases: str = "independent",
             ranges: bool = False) -> dict:
    """The memory ceiling, the deadline-bound N* and which binds; with ``ranges``, also N* over the step terms'
    ranges (``"ranges"``: :func:`sensitivity`)."""
    deadline_s = deadline_s or cal.stream.frame_period_s
    fm = FillModel(cal, policy, phases)
    ceiling = fm.memory_ceiling(duration_s if duration_s is not None else (None if policy.bounded else 600.0))
    n_dead, evals = deadline_n_star(cal, policy, deadline_s, target_fraction, percentile, duration_s,
                                    progress=progress, phases=phases)
    binding = "deadline"
    if ceiling is not None and ceiling < n_dead:
        binding = "max_num_seqs" if fm.seqs_bind else "memory"
    n_star = min(n_dead, ceiling) if ceiling is not None else n_dead
    res = {
        "calibration": cal.name,
        "provenance": cal.provenance.kind,
        "policy": policy.describe(),
        "phases": phases,
        "deadline_s": deadline_s,
        "target_fraction": target_fraction,
        "target_latency_s": target_fraction * deadline_s,
        "percentile": percentile,
        "session_duration_s": duration_s,
        "memory_ceiling": ceiling,
        "deadline_n_star": n_dead,
        "n_star": n_star,
        "binding": binding,
        "evaluations": [{"sessions": n, "p_latency_s": round(float(v), 6)} for n, v in evals],
    }
    if ranges:
        res["ranges"] = sensitivity(cal, policy, res, progress=progress)
    return res


# ------------------------------------------------------------------------------------------ ranges
Overrides = tuple[tuple[str, float], ...]  # (term name, value) pairs: a calibration with those terms moved
# runs the deadline-bound searches of a list of variants, in order: ({"deadline_n_star", "evaluations"} each)
Solver = Callable[[Sequence[Overrides]], list[dict]]

RANGE_DEFINITION = ("the deadline-bound N* with every ranged step term at the slow end of its range at once and at "
                    "its fast end at once; each tornado bar moves one term to its low or its high, the others at "
                    "their values; the dominant term is the one whose two bars lie furthest apart")


def ranged_terms(cal: Calibration, policy: KVPolicy) -> tuple[StepTerm, ...]:
    """The terms that price ``policy``'s step (:meth:`Calibration.terms_for`) whose range is not a point."""
    out, names = [], set()
    for t in cal.terms_for(policy):
        lo, hi = t.bounds()
        if hi <= lo:
            continue
        if t.name in names:  # Calibration.with_term moves every term of a name: two could not be moved apart
            raise MetronomeError(f"{cal.name}: two step terms are called {t.name!r}; name them apart to range them")
        names.add(t.name)
        out.append(t)
    return tuple(out)


def range_variants(cal: Calibration, policy: KVPolicy) -> list[Overrides]:
    """Every calibration the ranges need, as term overrides, once each: each ranged term at its low and at its high,
    then all of them at their highs and all at their lows (none without a ranged term)."""
    terms = ranged_terms(cal, policy)
    out: list[Overrides] = []
    for t in terms:
        lo, hi = t.bounds()
        out += [((t.name, lo),), ((t.name, hi),)]
    if terms:
        out += [tuple((t.name, t.bounds()[1]) for t in terms), tuple((t.name, t.bounds()[0]) for t in terms)]
    return list(dict.fromkeys(out))  # one term alone: its high is the slow end


def with_overrides(cal: Calibration, overrides: Overrides) -> Calibration:
    """``cal`` with each named term at the given value (coefficients re-summed)."""
    for name, value in overrides:
        cal = cal.with_term(name, value)
    return cal


def guess_n_star(cal: Calibration, variant: Calibration, policy: KVPolicy, n_central: int,
                 duration_s: float | None = None, phases: str = "independent") -> int:
    """Where a variant's search starts: a guess from the step model alone, so that a term moved alone usually lands
    within a few sessions of it and the search costs a few simulations instead of a gallop. Only the cost depends on
    it: the search finds the same N* from any start.

    A step of N sessions costs ``base + v·N`` (``base``: the step model with no session; ``v``: what a session adds,
    holding its window — unbounded, a whole session's context — and computing a frame's tokens, averaged over the
    central N*). The plain guess is the N at which the variant's step takes as long as the central step at N*: right
    in lockstep (``aligned``), where one step serves a frame of every session. Under ``independent`` phases an engine
    whose step at N* fills half the frame period or more steps back to back, each step batching the frames that
    arrived during the last, so a step lasts about ``base / (1 − v·N/period)``; latency held at the same multiple of
    it gives ``N = period/v · (1 − (1 − v·N*/period) · base'/base)``. (Where the step is short beside the period,
    as for the one-second frames of the Qwen and MiniCPM presets, the plain guess lands closer: measured by
    benchmarks/bench_capacity_ranges.py.)"""
    per_frame = cal.stream.kv_tokens_per_frame
    context = policy.kept_tokens if policy.bounded else cal.stream.kv_tokens_per_s * (duration_s or 600.0)
    period = cal.stream.frame_period_s
    n = float(n_central)

    def model(c: Calibration) -> tuple[float, float]:
        lat = c.step_latency_for(policy)
        base = float(lat.step_s(0.0, 0.0, 0.0))
        return base, (float(lat.step_s(n, n * context, n * per_frame)) - base) / n

    (base, v), (base2, v2) = model(cal), model(variant)
    cap = 4 * max(n_central, 16)
    if v2 <= 0:
        return n_central
    busy = v * n / period  # the share of a frame period the sessions' own work takes at N*
    if phases == "independent" and base > 0 and base + v * n >= period / 2 and busy < 1:
        guess = period / v2 * (1.0 - (1.0 - busy) * base2 / base)
    else:
        guess = (base + v * n - base2) / v2  # the same step time
    return int(min(max(round(guess), 1), cap))


# what a variant's search takes from the central capacity (the report's tasks carry only these)
CENTRAL_KEYS = ("deadline_s", "target_fraction", "percentile", "session_duration_s", "phases", "deadline_n_star")


def variant_n_star(cal: Calibration, policy: KVPolicy, cap: dict, overrides: Overrides,
                   progress: Callable[[int, float], None] | None = None) -> dict:
    """The deadline-bound N* of ``cal`` with ``overrides``, under the settings of the central ``cap`` (a
    :func:`capacity` result), searched outward from :func:`guess_n_star`."""
    variant = with_overrides(cal, overrides)
    start = guess_n_star(cal, variant, policy, max(cap["deadline_n_star"], 1), cap["session_duration_s"],
                         cap["phases"])
    n, evals = deadline_n_star(variant, policy, cap["deadline_s"], cap["target_fraction"], cap["percentile"],
                               cap["session_duration_s"], progress=progress, phases=cap["phases"], start=start)
    return {"deadline_n_star": n, "evaluations": len(evals), "start": start}


def summarize_ranges(cal: Calibration, policy: KVPolicy, cap: dict, solved: dict[Overrides, dict]) -> dict:
    """The interval, the tornado and the dominant term (see the module docstring) from each variant's solved
    search (``solved``: :func:`range_variants`' overrides -> :func:`variant_n_star`'s result). Sessions throughout;
    a term's value and range in seconds per its coefficient's unit."""
    terms = ranged_terms(cal, policy)
    central, ceiling = cap["deadline_n_star"], cap["memory_ceiling"]

    def binding(n: int) -> int:
        return n if ceiling is None else min(n, ceiling)

    bars = []
    for t in terms:
        lo, hi = t.bounds()
        n_lo = solved[((t.name, lo),)]["deadline_n_star"]
        n_hi = solved[((t.name, hi),)]["deadline_n_star"]
        bars.append({"term": t.name, "coefficient": t.coefficient, "unit": f"s {COEFFICIENT_UNITS[t.coefficient]}",
                     "basis": t.basis, "value_s": t.value, "low_s": lo, "high_s": hi,
                     "deadline_n_star_at_low_sessions": n_lo, "deadline_n_star_at_high_sessions": n_hi,
                     "swing_sessions": abs(n_lo - n_hi)})
    bars.sort(key=lambda b: -b["swing_sessions"])  # stable: equal swings keep the calibration's order
    if terms:
        slow = solved[tuple((t.name, t.bounds()[1]) for t in terms)]["deadline_n_star"]
        fast = solved[tuple((t.name, t.bounds()[0]) for t in terms)]["deadline_n_star"]
    else:
        slow = fast = central
    dominant = bars[0]["term"] if bars and bars[0]["swing_sessions"] > 0 else None
    return {"definition": RANGE_DEFINITION, "ranged_terms": len(terms),
            "deadline_n_star_sessions": central, "deadline_n_star_interval_sessions": [slow, fast],
            "n_star_sessions": binding(central), "n_star_interval_sessions": [binding(slow), binding(fast)],
            "memory_ceiling_sessions": ceiling, "dominant_term": dominant, "tornado": bars,
            "searches": len(solved), "evaluations": sum(r["evaluations"] for r in solved.values())}


def sensitivity(cal: Calibration, policy: KVPolicy, cap: dict, solve: Solver | None = None,
                progress: Callable[[int, float], None] | None = None) -> dict:
    """N* over the step terms' ranges (:func:`summarize_ranges`) for the central ``cap`` (a :func:`capacity`
    result of ``cal`` and ``policy``). ``solve`` runs the variants' searches (default: here, one after another,
    each evaluation reported to ``progress``; the report fans them out through its cache)."""
    variants = range_variants(cal, policy)
    if solve is None:
        def solve(vs: Sequence[Overrides]) -> list[dict]:
            return [variant_n_star(cal, policy, cap, v, progress) for v in vs]
    return summarize_ranges(cal, policy, cap, dict(zip(variants, solve(variants))))


def _n(x: int) -> str:
    return f"{x:,}"


def interval_words(cap: dict) -> str:
    """N*'s interval and its dominant term in words, for a :func:`capacity` result with ``ranges``: e.g.
    ``68–190 over the terms' ranges; moved most by "depformer"``; when memory binds, that the ranges move only the
    deadline-bound N*. Empty without ranges."""
    r = cap.get("ranges")
    if not r:
        return ""
    if not r["ranged_terms"]:
        return "no step term states a range"
    lo, hi = r["n_star_interval_sessions"]
    dlo, dhi = r["deadline_n_star_interval_sessions"]
    most = f'moved most by "{r["dominant_term"]}"' if r["dominant_term"] else "no term moves it"
    if cap["binding"] == "deadline":
        words = f"{_n(lo)}–{_n(hi)} over the terms' ranges; {most}"
        if hi < dhi:
            words += f"; at their fast end memory caps it at {_n(hi)}"
        return words
    words = (f"{cap['binding']} binds, so the terms' ranges move only the deadline-bound N*: "
             f"{_n(cap['deadline_n_star'])} ({_n(dlo)}–{_n(dhi)}; {most})")
    if lo < cap["n_star"]:
        words += f"; at their slow end the deadline binds, at {_n(lo)}"
    return words
