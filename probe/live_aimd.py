"""Live AIMD against the simulator's N*: the pieces of ``benchmarks/bench_live_aimd.py`` that other code reuses.

The check it serves: an AIMD controller admitting Poisson arrivals well above capacity should settle, live,
where the simulator's N* (the deadline-bound capacity, :func:`metronome.sim.capacity.capacity`) says the engine
saturates. Here are

* the scenario, in the simulator (:func:`scenario`) and live (:func:`run_live_aimd`), with the same arrivals
  for one seed;
* the **settled concurrency**: the mean of the admitted sessions over the second half of a run, over step
  samples (:func:`metronome.results.settled_mean`; live ``steps.sessions``, simulated ``running + waiting``);
* the choice of deadline (:func:`binding_deadline`) and of AIMD's control interval (:func:`tune_interval`),
  both made in the simulator on a calibration before going live, as a user would;
* one run's live-vs-simulated figures (:func:`compare_run`) and the verdicts (:func:`single_run_verdict`,
  :func:`repeat_verdict`).

Nothing here imports vLLM: the engine is passed in, so the simulated half runs anywhere.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pandas as pd

from metronome.results import settled_mean
from metronome.probe.driver import PHASES  # the live driver's regime, so the default of the simulated side too

AUTO_DEADLINES = (0.040, 0.030, 0.025, 0.020, 0.015)  # largest first: best conditioned (binding_deadline)
HEADROOM = 0.75  # auto deadline: N* at most this share of the memory ceiling, so AIMD's overshoot stays off the pool
TOLERANCE = 0.10  # the target: live settled within 10% of N*; also the drift of N* (before vs after) a verdict allows

# AIMD's settings but for the interval and the starting limit. The interval is tuned on each run's own
# calibration (tune_interval) among INTERVALS; the controller starts at half the simulated N* (aimd_for), which
# keeps the ramp (+1 session an interval) short next to a 240 s run; with the longest intervals it still reaches
# into the second half, and the tuning sees that too.
AIMD = {"additive_increase": 1, "decrease_factor": 0.9, "target_fraction": 0.8, "interval_s": 2.5, "initial_limit": 2,
        "max_limit": 200}
INTERVALS = (2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0)
TUNING_SEEDS = 8


def aimd_for(aimd: dict, n_star: int, interval: float | None = None) -> dict:
    """The AIMD for a run whose simulated N* is ``n_star``: starting at half of it (and at ``interval``, if given)."""
    return {**aimd, "initial_limit": max(2, n_star // 2), **({"interval_s": interval} if interval else {})}


def rel(x, ref):
    """The relative error ``(x - ref) / ref``; None when either is unknown or ``ref`` is 0."""
    return None if x is None or ref in (None, 0) else (x - ref) / ref


# ------------------------------------------------------------------------------------------ the simulated side


def scenario(cal, aimd: dict, *, kv: str = "window", window: int, num_blocks: int, rate: float,
             duration: str, horizon: float, deadline: float, seed: int, phases: str = PHASES):
    """The scenario in the simulator: Poisson arrivals under AIMD on the run's pool, with vLLM's window
    (``kv="window"``) or unbounded KV. The interval tuning and the simulated runs beside the live ones use it."""
    from metronome.sim import scenario as sc_mod

    return sc_mod.make_scenario(calibration=cal, kv=kv, window=window,
                                arrival_rate=rate, session_duration=duration, horizon=horizon, seed=seed,
                                deadline=deadline, admission="aimd", aimd_params=aimd, num_blocks=num_blocks,
                                phases=phases)


def sim_admitted(steps: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """A simulated run's admitted sessions over time (running + waiting, per step)."""
    return steps.t_s.to_numpy(), (steps.running + steps.waiting).to_numpy()


def simulated_settled(cal, aimd: dict, *, seeds, **scenario_kw) -> list[float]:
    """Where the simulated AIMD settles (:func:`~metronome.results.settled_mean`) in the bounded :func:`scenario`,
    one value per seed."""
    from metronome.sim import scenario as sc_mod

    return [settled_mean(*sim_admitted(sc_mod.run(scenario(cal, aimd, seed=seed, **scenario_kw)).steps),
                             scenario_kw["horizon"]) for seed in seeds]


def tune_interval(cal, aimd: dict, n_star: int, intervals=INTERVALS, seeds=range(1, TUNING_SEEDS + 1),
                  **scenario_kw) -> tuple[float, dict[float, list[float]]]:
    """The control interval at which the simulated AIMD, on this calibration, settles closest to N* on average
    over ``seeds``; and each interval's settled-vs-N* errors, one per seed (how far one run may land from the
    mean: the spread a live run's verdict is up against). A short interval holds few frame ticks (its p99
    is its slowest tick) and settles above N*; a long one sees the tail of every interval and settles below; when
    slow steps come in spells (the calibration's ``jitter_shared``/``jitter_tau_s``) an interval must be longer
    to see a fair share of them."""
    errs = {}
    for interval in intervals:
        got = simulated_settled(cal, aimd_for(aimd, n_star, interval), seeds=seeds, **scenario_kw)
        errs[interval] = [math.inf if g is None else g / n_star - 1 for g in got]
    best = min(errs, key=lambda i: abs(float(np.mean(errs[i]))))
    return best, errs


def binding_deadline(cal, policy, deadlines=AUTO_DEADLINES, *, auto: bool = True, phases: str = PHASES,
                     log=lambda msg: None) -> dict | None:
    """The capacity (:func:`metronome.sim.capacity.capacity`'s dict) at the first of ``deadlines`` at which, under
    ``policy``, the deadline binds before memory with N* of at least 4 and, when ``auto``, at most
    :data:`HEADROOM` of the memory ceiling; None if none does.

    Largest first, because a p99-defined N* is better conditioned there: the fixed part of a step is a smaller
    share of the target, so the same drift of the engine's speed moves N* less."""
    from metronome.sim.capacity import capacity

    for d in deadlines:
        c = capacity(cal, policy, deadline_s=d, phases=phases)
        log(f"capacity at deadline {d * 1e3:g} ms: N*={c['n_star']} (deadline {c['deadline_n_star']}, "
            f"memory {c['memory_ceiling']}), binding={c['binding']}")
        if c["binding"] == "deadline" and c["n_star"] >= 4 and (
                not auto or c["memory_ceiling"] is None or c["n_star"] <= HEADROOM * c["memory_ceiling"]):
            return c
    return None


# ------------------------------------------------------------------------------------------ the live side


def run_live_aimd(engine, stream, out_dir, *, aimd: dict, deadline: float, rate: float, duration: str,
                  horizon: float, seed: int, phases: str = PHASES) -> dict:
    """One live AIMD run of the scenario on ``engine`` (Poisson ``rate`` arrivals of ``duration`` sessions, the
    same ones :func:`scenario` draws for ``seed``), written to ``out_dir`` by :func:`metronome.probe.live_run.run`.
    Bounded sessions are rebased at the context limit, unbounded ones finish there. Returns the run's summary,
    with the load average at its start and end."""
    from metronome.admission import AIMDParams, make_controller
    from metronome.probe.live_run import make_plans, run as live_run
    from metronome.workload import Arrivals, Durations

    ctl = make_controller("aimd", deadline, AIMDParams.from_dict(aimd))
    plans = make_plans(Arrivals("poisson", rate_per_s=rate), Durations.parse(duration), horizon, seed, phases=phases)
    load0 = os.getloadavg()[0]
    _, summary = live_run(engine, stream, plans, horizon, ctl, out_dir, deadline_s=deadline, seed=seed,
                          cap="rebase" if engine.policy.bounded else "finish", extra={"load_avg_start": load0},
                          phases=phases)
    summary["load_avg_end"] = os.getloadavg()[0]
    return summary


def live_trace(run_dir) -> tuple[np.ndarray, np.ndarray, pd.DataFrame]:
    """A live run folder's admitted sessions over time (per step) and its controller trace."""
    from pathlib import Path

    st = pd.read_parquet(Path(run_dir) / "steps.parquet")
    ctl = pd.read_parquet(Path(run_dir) / "controller.parquet")
    return st.t_s.to_numpy(), st.sessions.to_numpy(), ctl


def sim_trace(result) -> tuple[np.ndarray, np.ndarray, pd.DataFrame]:
    """The same for a simulated run (:func:`metronome.sim.scenario.run`'s result)."""
    return (*sim_admitted(result.steps), pd.DataFrame(result.controller_trace))


# ------------------------------------------------------------------------------------------ comparing


def _settled_side(trace: tuple, summary: dict, horizon: float, extra: tuple[str, ...]) -> dict:
    """One side of :func:`compare_run`: second-half means of the admitted sessions and of the controller's peak
    in-flight and limit, its cuts, and ``summary``'s figures (the shared ones, then ``extra``)."""
    t, n, ctl = trace
    keys = ("preemptions", "silent_frame_fraction", "p50_frame_latency_s", "p99_frame_latency_s", *extra)
    return {"settled_sessions": settled_mean(t, n, horizon),
            "settled_peak_in_flight": settled_mean(ctl.t_s, ctl.in_flight, horizon),
            "settled_limit": settled_mean(ctl.t_s, ctl.limit, horizon),
            "cuts": int((ctl.decision == "decrease").sum()),
            **{k: summary.get(k) for k in keys}}


def compare_run(live: tuple, live_summary: dict, sim: tuple, sim_result, horizon: float) -> dict:
    """One run's figures, live beside simulated: settled sessions, the controller's settled peak in-flight and
    limit (second-half means), its cuts, and the run's preemptions, silence and frame latency. ``live`` and
    ``sim`` are :func:`live_trace` and :func:`sim_trace`."""
    return {
        "horizon_s": horizon,
        "live": _settled_side(live, live_summary, horizon,
                              ("sessions_admitted", "sessions_planned", "load_avg_start", "load_avg_end")),
        "sim": _settled_side(sim, sim_result.summary, horizon, ("collapsed",)),
    }


def single_run_verdict(live_vs_n_star: float | None, drift: float | None, tolerance: float = TOLERANCE) -> str:
    """One run against N* from the calibration before it: ``met`` / ``missed`` within ``tolerance``, or
    ``inconclusive`` when N* before and after the run differ by more than that (``drift``: the engine changed by
    more than the tolerance being tested). Nothing settled (no admitted session in the second half) is missed."""
    if live_vs_n_star is None:
        return "missed"
    if drift is None or abs(drift) > tolerance:
        return "inconclusive"
    return "met" if abs(live_vs_n_star) <= tolerance else "missed"


def repeat_verdict(mean_vs_n_star_pooled: float | None, tolerance: float = TOLERANCE) -> str:
    """Several runs: their mean against N* from every calibration of the span pooled, ``met`` or ``missed``."""
    return ("missed" if mean_vs_n_star_pooled is None
            else "met" if abs(mean_vs_n_star_pooled) <= tolerance else "missed")
