"""Per-run figures of a live run, from its journals (frames, steps, sessions, events): pure, no engine."""

from __future__ import annotations

import math

import numpy as np

from metronome.results import REFUSED_REASONS, RunCounts, percentile, shared_summary


def _pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile, the one every report uses (:func:`metronome.results.percentile`)."""
    v = percentile(values, q)
    return None if v is None else round(v, 6)


def summarize(frames: list[dict], steps: list[dict], sessions: list[dict], num_blocks: int,
              events: list[dict] | None = None) -> dict:
    """Per-run figures: the keys a simulated run's summary shares (:func:`metronome.results.shared_summary`,
    same meaning and unit), then the live driver's own (:data:`metronome.results.LIVE_ONLY_KEYS`).

    ``t_sat_observed_s`` is the start of the first step after which the driver (or vLLM) had to preempt, or
    that left requests waiting on an empty pool, or stalled: the moment some session needed a block and none
    was free, the simulator's ``t_sat``. What each silent frame is (``silent_preempted``, ``silent_waiting``,
    ``silent_departed``; the first decides ``collapsed``) the driver wrote in its row
    (:func:`metronome.results.silent_cause`); a remote client's rows (:mod:`metronome.probe.ws_client`) cannot
    tell, and count in none of the three. ``num_blocks`` is vLLM's pool, its null block included."""
    events = events or []
    done = [f for f in frames if not f["censored"]]
    n = len(done)
    preempts = [e for e in events if e["event"] == "preempt"]
    first_preempt = preempts[0]["t_s"] if preempts else next((s["t_s"] for s in steps if s["preemptions"]), None)
    # a stall: requests want tokens but the step scheduled nothing (paused sessions holding the whole pool)
    first_full = next((s["t_s"] for s in steps if (s["free_blocks"] == 0 and s["waiting"] > 0) or s["stalled"]),
                      None)
    sat = [t for t in (first_preempt, first_full) if t is not None]

    def cause(what: str) -> list[bool]:
        return [bool(f.get(what, False)) for f in done]

    not_running = [f for f in done if f["state"] != "running"]
    rows = {"tick_s": [f["tick_s"] for f in done],
            "latency_s": [math.nan if f["latency_s"] is None else f["latency_s"] for f in done],
            "frames": np.ones(n, dtype=np.int64), "silent": [bool(f["silent"]) for f in done],
            "silent_preempted": cause("silent_preempted"), "silent_waiting": cause("silent_waiting"),
            "silent_departed": cause("silent_departed"), "late": [not f["met_deadline"] for f in done],
            "tokens": [f["tokens_delivered"] for f in done]}
    shared = shared_summary(rows, [s["step_s"] for s in steps], min(sat) if sat else None, RunCounts(
        peak_used_blocks=max((s["used_blocks"] for s in steps), default=0), usable_blocks=num_blocks - 1,
        preemptions=len(preempts) if events else int(sum(s["preemptions"] for s in steps)),
        rebases=sum(1 for e in events if e["event"] == "rebase"),
        sessions_offered=len(sessions), sessions_admitted=sum(1 for s in sessions if s.get("admitted")),
        sessions_refused=sum(1 for s in sessions if s.get("reason") in REFUSED_REASONS)))
    return {
        **shared,
        "frames_unfinished": sum(1 for f in done if f["done_s"] is None),
        "silent_by_deadline_fraction": (sum(bool(f["silent_by_deadline"]) for f in done) / n) if n else 0.0,
        "preemptions_by_reason": {r: sum(1 for e in preempts if e.get("reason") == r)
                                  for r in sorted({e.get("reason") for e in preempts})},
        "readmissions": sum(1 for e in events if e["event"] == "readmit"),
        # the rebase cost, measured where it happens: frames that carried an S+W prefill vs the rest
        "p50_rebase_frame_latency_s": _pct([f["latency_s"] for f in done
                                            if f.get("rebased") and f["latency_s"] is not None], 50),
        "frames_not_running": len(not_running),
        "t_first_preemption_s": first_preempt,
        "t_pool_full_s": first_full,
        "stalls": sum(1 for s in steps if s["stalled"]),
        "num_blocks": num_blocks,
    }
