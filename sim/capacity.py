"""Capacity: the memory ceiling, the deadline-bound N*, and which of the two binds.

* **memory ceiling** — the most sessions the pool can hold (the fill model; for unbounded KV, at the
  end of a session of the given length);
* **deadline-bound N\\*** — the largest N whose p99 frame latency meets ``target_fraction × deadline``
  with the pool taken away as a limit (so only latency decides): N sessions in steady state (their
  windows full, or, unbounded, over a whole session), found by doubling then bisection on N — p99 frame
  latency is monotone in N here. Under ``independent`` phases (the default) the N sessions tick at their own
  seeded phases, so a step batches only the frames that have arrived; ``aligned`` measures the lockstep;
* **binding** — the smaller of the two; ``n_star`` is that smaller number.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from metronome.calibration import Calibration
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
                    phases: str = "independent") -> tuple[int, list[tuple[int, float]]]:
    """Largest N with p99 ≤ target (0 if even one session misses); also every (N, p99) evaluated."""
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

    if not ok(1):
        return 0, sorted(seen.items())
    lo, hi = 1, 2
    while hi <= n_max and ok(hi):
        lo, hi = hi, hi * 2
    if hi > n_max:
        return n_max, sorted(seen.items())
    while hi - lo > 1:  # invariant: ok(lo), not ok(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo, sorted(seen.items())


def capacity(cal: Calibration, policy: KVPolicy, deadline_s: float | None = None, target_fraction: float = 0.8,
             percentile: float = 99.0, duration_s: float | None = None,
             progress: Callable[[int, float], None] | None = None, phases: str = "independent") -> dict:
    deadline_s = deadline_s or cal.stream.frame_period_s
    fm = FillModel(cal, policy, phases)
    ceiling = fm.memory_ceiling(duration_s if duration_s is not None else (None if policy.bounded else 600.0))
    n_dead, evals = deadline_n_star(cal, policy, deadline_s, target_fraction, percentile, duration_s,
                                    progress=progress, phases=phases)
    binding = "deadline"
    if ceiling is not None and ceiling < n_dead:
        binding = "max_num_seqs" if fm.seqs_bind else "memory"
    n_star = min(n_dead, ceiling) if ceiling is not None else n_dead
    return {
        "calibration": cal.name,
        "provenance": cal.provenance.kind,
        "policy": policy.describe(),
        "phases": phases,
        "deadline_s": deadline_s,
        "target_latency_s": target_fraction * deadline_s,
        "percentile": percentile,
        "session_duration_s": duration_s,
        "memory_ceiling": ceiling,
        "deadline_n_star": n_dead,
        "n_star": n_star,
        "binding": binding,
        "evaluations": [{"sessions": n, "p_latency_s": round(float(v), 6)} for n, v in evals],
    }
