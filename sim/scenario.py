"""One simulated run: a scenario in, steps/frames/sessions tables and a summary out.

The summary's shared keys (frames, silent and late fractions, latency percentiles, t_sat, collapse, pool,
sessions) are built by :func:`metronome.results.shared_summary`, the same code a live run's summary uses; the
keys only a simulation has are listed in :data:`metronome.results.SIM_ONLY_KEYS`. **Collapsed** is defined
there too (:data:`~metronome.results.COLLAPSE_SILENT_FRACTION`, re-exported here).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import pandas as pd
import simpy

from metronome import serving
from metronome.calibration import Calibration
from metronome.errors import MetronomeError
from metronome.fill_model import FillModel
from metronome.front_end import FrontEndOptions, Roster, tokens_within
from metronome.kv_policy import KVPolicy
from metronome.outputs import atomic_dir, write_json
from metronome.results import (COLLAPSE_SILENT_FRACTION, REFUSED_REASONS, collapse_decided,  # noqa: F401 (re-export)
                               RunCounts, count_total, shared_summary)
from metronome.workload import Arrivals, Durations, draw, draw_phases

from metronome.sim.engine import SimEngine


@dataclass(frozen=True)
class Scenario:
    calibration: Calibration
    policy: KVPolicy
    arrivals: Arrivals
    horizon_s: float
    durations: Durations | None = None  # None: sessions last until the horizon
    seed: int = 0
    deadline_s: float | None = None  # default: the frame period
    admission: object = None  # a factory () -> controller, or None (admit everything)
    admission_label: str = "none"
    phases: str = "independent"  # serving.PHASES: each client on its own clock, or all in lockstep
    loop: str = "driver"  # serving.LOOPS: the front end steps vLLM, or is a client of vLLM's own loop
    # the step jitter's own seed (None: ``seed``): the same workload and phases with another draw of the engine's
    # jitter, as validate asks how far one draw's latency lands from another's
    jitter_seed: int | None = None
    # a mix of streams: session k (in arrival order) streams token_mix[k % len] (input, output tokens per frame,
    # at most the stream's); empty: every session the calibration's stream
    token_mix: tuple[tuple[int, int], ...] = ()
    # a mix of clocks: session k (in arrival order) streams a frame every period_mix[k % len][0] seconds, each due
    # period_mix[k % len][1] seconds after its tick (independent phases: its phase slot is one of its own period);
    # empty: every session the calibration's period and the run's deadline
    period_mix: tuple[tuple[float, float], ...] = ()

    def __post_init__(self):
        serving.check_phases(self.phases)
        serving.check_loop(self.loop)
        if not (self.horizon_s > 0) or not math.isfinite(self.horizon_s):
            raise MetronomeError(f"--horizon must be a positive number of seconds, got {self.horizon_s}")
        if self.deadline_s is not None and not (self.deadline_s > 0):
            raise MetronomeError(f"--deadline must be positive seconds, got {self.deadline_s}")
        if self.policy.block_size != self.calibration.engine.block_size_tokens:
            raise MetronomeError("the KV policy's block size differs from the calibration's")
        fm = FillModel(self.calibration, self.policy, self.phases)
        st = self.calibration.stream
        for n_in, n_out in self.token_mix:
            if not (tokens_within(n_in, st.input_tokens_per_frame)
                    and tokens_within(n_out, st.output_tokens_per_frame)):
                raise MetronomeError(f"a stream of the mix has 1 to {st.input_tokens_per_frame} input and 1 to "
                                     f"{st.output_tokens_per_frame} output tokens a frame, got ({n_in}, {n_out})")
        for period_s, deadline_s in self.period_mix:
            if not (0 < period_s < math.inf and 0 < deadline_s < math.inf):
                raise MetronomeError(f"a clock of the mix has a positive period and deadline in seconds, got "
                                     f"({period_s!r}, {deadline_s!r})")
        if self.period_mix and self.phases == "aligned":
            raise MetronomeError("a mix of clocks needs independent phases: in lockstep every session ticks together")
        one = self.policy.resident_blocks(st.prompt_tokens + st.kv_tokens_per_frame)
        if fm.usable_blocks < int(one):
            raise MetronomeError(
                f"the pool ({fm.usable_blocks} usable blocks) is too small for one session's first frame")
        if self.policy.bounded and fm.usable_blocks < (fm.peak_resident_blocks or 0):
            raise MetronomeError(
                f"the pool ({fm.usable_blocks} usable blocks) is too small for one session under "
                f"{self.policy.describe()} ({fm.peak_resident_blocks} blocks)")

    @property
    def deadline(self) -> float:
        return self.deadline_s if self.deadline_s is not None else self.calibration.stream.frame_period_s

    def with_seed(self, seed: int) -> "Scenario":
        return replace(self, seed=seed)


@dataclass
class Result:
    scenario: Scenario
    summary: dict
    steps: pd.DataFrame
    frames: pd.DataFrame
    sessions: pd.DataFrame
    controller_trace: list | None = None
    fast_steps: int = 0  # engine steps computed in fast-forwarded spans (the tables do not depend on it)
    loop_departures: int = 0  # departures the compiled loop took itself (nor do they)
    loop_first_frames: int = 0  # sessions' first frames the compiled loop handed to the engine (nor do they)
    loop_preemptions: int = 0  # sessions the compiled loop preempted and readmitted (nor do they)
    loop_readmissions: int = 0
    loop_arrivals: int = 0  # arrivals the compiled loop took, the gate's refusals and admissions (nor do they)
    loop_refused: int = 0
    loop_admissions: int = 0
    # how often each of EngineModel.RULES decided a step (on every path: the compiled loop runs the same step)
    rules_reached: dict | None = None


def workload(sc: Scenario) -> tuple[np.ndarray, np.ndarray]:
    """Arrival times and durations: :func:`metronome.workload.draw`, as a live run draws its sessions."""
    return draw(sc.arrivals, sc.durations, sc.horizon_s, sc.seed)


def run(sc: Scenario, fast_forward: bool = True, check_invariants: bool = False, engine_model=None,
        stop_when_decided: bool = False) -> Result:
    """Simulate one scenario. ``engine_model``: the scheduler class (default :class:`metronome.serving.EngineModel`;
    the differential test passes an adapter over vLLM's own scheduler).

    ``stop_when_decided``: stop as soon as the run's outcome can no longer change (:class:`_Decided`): it has
    collapsed whatever the frames still to come, or every session has ended. ``collapsed`` and
    ``t_sat_observed_s`` are then the full run's; the other figures cover only the time simulated, and
    ``stopped_early_s`` says when it stopped (None when it ran to the horizon). For Monte Carlo cells, where
    only those two matter and an overloaded run past its collapse is the simulator's slowest work."""
    wall0 = time.perf_counter()
    arrival, duration = workload(sc)
    env = simpy.Environment()
    controller = sc.admission() if callable(sc.admission) else None
    eng = SimEngine(env, sc.calibration, sc.policy, roster(sc, arrival, duration),
                    sc.horizon_s, sc.deadline, controller=controller, fast_forward=fast_forward,
                    check_invariants=check_invariants, seed=sc.seed if sc.jitter_seed is None else sc.jitter_seed,
                    options=FrontEndOptions(phases=sc.phases, loop=sc.loop),
                    **({"engine_model": engine_model} if engine_model is not None else {}))
    eng.start()
    stopped = None
    if stop_when_decided:
        # SimPy runs in chunks: run(until=t) stops before the events at t and the next call takes them up in
        # the same order, so a run that is never stopped is the same run as one call to the horizon
        decided = _Decided(eng)
        chunk = sc.horizon_s / DECIDE_CHUNKS
        # the compiled loop hands back every few looks (it changes nothing simulated; each pause costs a
        # Python call, which a run that is never decided early pays in full)
        eng.pause_every_s = chunk * DECIDE_PAUSE_CHUNKS
        for k in range(1, DECIDE_CHUNKS + 1):
            t = sc.horizon_s if k == DECIDE_CHUNKS else k * chunk
            env.run(until=t)
            if k < DECIDE_CHUNKS and decided():
                stopped = round(t, 6)
                break
    else:
        env.run(until=sc.horizon_s)
    eng.finalize()
    steps, frames = eng.steps.frame(), eng.frames.frame()
    eng.release()
    sessions = pd.DataFrame({
        "session": np.arange(arrival.size),
        "arrival_s": eng.arrival,
        "admitted_s": eng.s_admitted,
        "ended_s": eng.s_ended,
        "end_reason": eng.s_end_reason.astype(str),
        "frames": eng.s_frames,
        "silent_frames": eng.s_silent,
        "deadline_misses": eng.s_late,
        "tokens": eng.s_tokens,
        "preemptions": eng.s_preempt,
        "rebases": eng.s_rebase,
    })
    summary = summarize(sc, eng, steps, frames, sessions)
    summary["stopped_early_s"] = stopped
    summary["wall_s"] = round(time.perf_counter() - wall0, 4)
    trace = controller.trace() if controller is not None and hasattr(controller, "trace") else None
    return Result(sc, summary, steps, frames, sessions, trace, fast_steps=eng.fast_steps,
                  loop_departures=eng.loop_departures, loop_first_frames=eng.loop_first_frames,
                  loop_preemptions=eng.loop_preemptions, loop_readmissions=eng.loop_readmissions,
                  loop_arrivals=eng.loop_arrivals, loop_refused=eng.loop_refused, loop_admissions=eng.loop_admissions,
                  rules_reached=dict(getattr(eng.model, "reached", {})) or None)


DECIDE_PAUSE_CHUNKS = 4  # ... and the compiled loop pauses for a look at every 4th
DECIDE_CHUNKS = 200  # a run that stops once decided looks at the engine this many times over its horizon


class _Decided:
    """Whether a running engine's outcome is settled: every session has ended (nothing can change), the pool
    can no longer run dry (so neither t_sat nor collapse can happen), or it has collapsed whatever the frames
    still to be answered are (:func:`metronome.results.collapse_decided`).

    **Can no longer run dry**: t_sat is the first step that preempted, and the engine preempts only when a
    session needs a block the pool does not have. A session never holds more blocks than its history at the
    end of its life needs (``resident_blocks`` of the prompt and every frame it can still answer, one frame
    more for a chunk in flight; a bounded policy's peak at most), so when those maxima of the sessions not yet
    ended (arrived or not) sum to at most the pool less vLLM's watermark, no allocation can fail from then on.

    When nothing delays a session's entry (no admission controller: it enters at its arrival and leaves
    ``duration`` later), the bound follows time: session ``i`` holds at most the blocks of its prompt and the
    frames ticked by ``t`` (one more in flight) while it is alive, and nothing after it leaves. That sum only grows
    between departures, so its largest value from now on is at a departure (just before it) or at the horizon:
    computed once for each, the run can no longer run dry once the largest still ahead fits. Sessions that do not
    all live to their peak at once then stop a long run long before the last of them has ended.

    The frames still to come are bounded from above: a session's frames tick from when it entered (at or after
    its arrival) until it leaves (``duration`` later) or the horizon, so it answers at most
    ``floor(min(duration, horizon - arrival) / P) + 2`` frames in all (the 2: a tick at each end), less those it
    has answered (``s_frames``); frames answered but not yet written to the frames table are added back. The
    silent frames after t_sat only grow. The frames table is read once, chunk by chunk, as it grows."""

    def __init__(self, eng: SimEngine):
        from metronome.sim.engine import ENDED, REFUSED

        self.eng = eng
        self.terminal = (ENDED, REFUSED)
        span = np.minimum(eng.duration, eng.horizon - eng.arrival)
        self.most = np.where(span >= 0, np.floor(span / eng.P) + 2, 0).astype(np.int64)
        self.seen = 0  # frames-table rows already counted
        self.frames_after = self.silent_after = 0
        st, policy = eng.cal.stream, eng.policy
        # the tokens a session holds once ``frames`` of its frames have ticked (and one more is in flight)
        self.tokens_at = lambda frames: max(st.prompt_tokens, 1) + st.kv_tokens_per_frame * (frames + 1)
        self.max_blocks = np.asarray(policy.resident_blocks(self.tokens_at(self.most)), dtype=np.int64)
        if policy.bounded:
            self.max_blocks = np.minimum(self.max_blocks, FillModel(eng.cal, policy).peak_resident_blocks)
        self.room = eng.num_blocks - eng.cal.engine.watermark_blocks
        self.ahead_t = self.ahead_peak = None  # the time-following bound: its times and the largest sum from each on
        if eng.controller is None:
            self.ahead_t, self.ahead_peak = self._peaks_ahead()

    def _peaks_ahead(self):
        """The times the blocks sessions can hold peak (each departure, and the horizon) and, for each, the largest
        sum of those maxima from then on."""
        eng = self.eng
        arr, end = eng.arrival, eng.arrival + eng.duration
        t = np.unique(np.append(end[end < eng.horizon], eng.horizon))
        peaks = np.zeros(t.size, dtype=np.int64)
        for k0 in range(0, t.size, 256):  # (in chunks: times × sessions)
            tk = t[k0:k0 + 256, None]
            alive = (arr[None, :] <= tk) & (end[None, :] >= tk) & (arr[None, :] < eng.horizon)
            frames = np.minimum(np.floor((tk - arr[None, :]) / eng.P).astype(np.int64) + 2, self.most[None, :])
            blocks = np.minimum(np.asarray(eng.policy.resident_blocks(self.tokens_at(np.maximum(frames, 0)))),
                                self.max_blocks[None, :])
            peaks[k0:k0 + 256] = np.where(alive, blocks, 0).sum(axis=1)
        return t, np.maximum.accumulate(peaks[::-1])[::-1]

    def _cannot_run_dry(self, done) -> bool:
        if self.ahead_t is not None:
            k = int(np.searchsorted(self.ahead_t, self.eng.env.now))
            return k >= self.ahead_t.size or int(self.ahead_peak[k]) <= self.room
        return int(self.max_blocks[~done].sum()) <= self.room

    def __call__(self) -> bool:
        eng = self.eng
        done = np.isin(eng.state, self.terminal)
        if done.all() and eng.next_arrival >= len(eng.arrival):
            return True
        if eng.t_sat is None:
            return self._cannot_run_dry(done)
        fr, r0 = eng.frames, self.seen  # the rows recorded since the last look
        after = fr.column("tick_s")[r0:] >= eng.t_sat
        self.frames_after += int(fr.column("frames")[r0:][after].sum())
        self.silent_after += int(fr.column("silent_preempted")[r0:][after].sum())
        self.seen = fr.rows
        buffered = eng.buffered_answers()
        left = int(np.maximum(self.most - eng.s_frames, 0)[~done].sum()) + buffered
        return collapse_decided(self.silent_after, self.frames_after, left)


def _predictions(sc: Scenario) -> dict:
    fm = FillModel(sc.calibration, sc.policy, sc.phases)
    out = {"t_sat_predicted_s": None, "p_saturate_predicted": None,
           "memory_ceiling": fm.memory_ceiling(sc.durations.mean_s if sc.durations else sc.horizon_s)}
    if sc.arrivals.kind == "all":
        t = fm.t_sat(sc.arrivals.sessions)
        out["t_sat_predicted_s"] = t
        durations = sc.durations or Durations("fixed", sc.horizon_s * 2)
        out["p_saturate_predicted"] = fm.p_saturate_fixed(sc.arrivals.sessions, durations, sc.horizon_s)
    elif sc.arrivals.kind == "poisson":  # (a rate pattern has no closed form here)
        durations = sc.durations or Durations("fixed", sc.horizon_s * 2)
        out["p_saturate_predicted"] = fm.p_saturate_poisson(sc.arrivals.rate_per_s, durations, sc.horizon_s)
    return out


def summarize(sc: Scenario, eng: SimEngine, steps: pd.DataFrame, frames: pd.DataFrame,
              sessions: pd.DataFrame) -> dict:
    """The run's summary: the shared keys (:func:`metronome.results.shared_summary`), then the simulator's own
    (:data:`metronome.results.SIM_ONLY_KEYS`)."""
    pred = _predictions(sc)
    rng_fit = sc.calibration.step_latency.fitted_range
    outside = 0
    if len(steps) and rng_fit:
        bad = np.zeros(len(steps), dtype=bool)
        for key, col in (("batch", "batch"), ("context_tokens", "context_tokens"), ("new_tokens", "new_tokens")):
            if key in rng_fit:
                lo, hi = rng_fit[key]
                v = steps[col].to_numpy()
                bad |= (v < lo) | (v > hi)
        outside = int(bad.sum())
    shared = shared_summary(frames, steps["step_s"].to_numpy(), eng.t_sat, RunCounts(
        peak_used_blocks=eng.peak_used, usable_blocks=eng.num_blocks,
        preemptions=int(sessions["preemptions"].sum()), rebases=int(sessions["rebases"].sum()),
        sessions_offered=len(sessions),
        sessions_admitted=int(np.isfinite(sessions["admitted_s"].to_numpy()).sum()),
        sessions_refused=int(sessions["end_reason"].isin(REFUSED_REASONS).sum())))
    # goodput: frames delivered non-silent and on time, per simulated second (every non-silent frame, less those
    # of the rows that missed their deadline: few rows)
    late = np.flatnonzero(frames["late"].to_numpy() > 0)
    good = shared["frames"] - shared["silent_frames"] - count_total(
        frames["frames"].to_numpy()[late] - frames["silent"].to_numpy()[late])

    def r(x, nd=6):
        return None if x is None else round(float(x), nd)

    return {
        "calibration": sc.calibration.name,
        "provenance": sc.calibration.provenance.kind,
        "policy": sc.policy.describe(),
        "workload": sc.arrivals.describe() + (f", durations {sc.durations.describe()}" if sc.durations else ""),
        "admission": sc.admission_label,
        "phases": sc.phases,
        "loop": sc.loop,
        "horizon_s": sc.horizon_s,
        "deadline_s": sc.deadline,
        "t_sat_predicted_s": r(pred["t_sat_predicted_s"], 4),
        "p_saturate_predicted": r(pred["p_saturate_predicted"], 6),
        "memory_ceiling": pred["memory_ceiling"],
        **shared,
        "length_capped": int((sessions["end_reason"] == "length").sum()),
        "goodput_frames_per_s": r(good / sc.horizon_s, 4),
        "goodput_sessions": r(good / sc.horizon_s * sc.calibration.stream.frame_period_s, 3),
        "steps_outside_fit": outside,
        "seed": sc.seed,
    }


# ------------------------------------------------------------------------------------------ output
def write(result: Result, out_dir: str | Path, replace: bool = False) -> Path:
    """Write summary.json and the steps/frames/sessions Parquet into ``out_dir``, all at once
    (:func:`metronome.outputs.atomic_dir`)."""
    with atomic_dir(out_dir, replace) as tmp:
        result.steps.to_parquet(tmp / "steps.parquet", index=False)
        result.frames.to_parquet(tmp / "frames.parquet", index=False)
        result.sessions.to_parquet(tmp / "sessions.parquet", index=False)
        if result.controller_trace is not None:
            pd.DataFrame(result.controller_trace).to_parquet(tmp / "controller.parquet", index=False)
        write_json(tmp / "summary.json", result.summary)
    return Path(out_dir)


def roster(sc: Scenario, arrival: np.ndarray, duration: np.ndarray) -> Roster:
    """The scenario's sessions as a front end takes them: arrivals, durations, phases and the stream each runs."""
    slots = draw_phases(arrival.size, sc.phases, sc.seed)
    order = np.argsort(np.argsort(arrival, kind="stable"), kind="stable")  # each session's place in arrival order
    own = {}
    if sc.token_mix:
        mix = np.array(sc.token_mix, dtype=np.int64)[order % len(sc.token_mix)]
        own.update(input_tokens=mix[:, 0], output_tokens=mix[:, 1])
    if sc.period_mix:
        mix = np.array(sc.period_mix, dtype=np.float64)[order % len(sc.period_mix)]
        own.update(period_s=mix[:, 0], deadline_s=mix[:, 1])
    return Roster(arrival, duration, slots, **own)


# ------------------------------------------------------------------------------- from plain options
@dataclass(frozen=True)
class PlainOptions:
    """A scenario's plain values, as the CLI and a what-if grid point give them (:func:`make_scenario`): the
    workload (``sessions`` at t=0 or over ``ramp_s``, or Poisson at ``arrival_rate``, or a ``rate_pattern``; each
    lasting ``session_duration``), the run (``horizon`` and ``deadline`` in seconds, ``seed``, ``phases``,
    ``loop``), the admission (``admission``, ``aimd_params``) and the pool (``num_blocks``)."""

    sessions: int | None = None
    arrival_rate: float | None = None
    ramp_s: float | None = None
    session_duration: str | float | None = None
    horizon: float = 600.0
    seed: int = 0
    deadline: float | None = None
    admission: str = "none"
    aimd_params: str | dict | None = None
    num_blocks: int | None = None
    rate_pattern: str | None = None
    phases: str = "independent"
    loop: str = "driver"


PLAIN_NAMES = frozenset(f.name for f in fields(PlainOptions))


def make_scenario(calibration: str | Calibration = "moshi-7b-h200", kv: str = "unbounded", **values) -> Scenario:
    """Build a scenario from the CLI's plain values (a what-if grid point is such a dict): ``values`` are
    :class:`PlainOptions`' and the KV policy's (``window=368, sinks=16``: :func:`metronome.kv_policy.policy_params`)."""
    from metronome import calibration as calmod
    from metronome.kv_policy import make_policy

    o = PlainOptions(**{k: v for k, v in values.items() if k in PLAIN_NAMES})
    policy_params = {k: v for k, v in values.items() if k not in PLAIN_NAMES}
    sessions, arrival_rate, ramp_s, session_duration, rate_pattern = (o.sessions, o.arrival_rate, o.ramp_s,
                                                                      o.session_duration, o.rate_pattern)
    num_blocks, deadline = o.num_blocks, o.deadline
    cal = calibration if isinstance(calibration, Calibration) else calmod.load(calibration)
    if num_blocks is not None:
        if num_blocks <= 0:
            raise MetronomeError(f"--num-blocks must be positive, got {num_blocks}")
        cal = replace(cal, engine=replace(cal.engine, num_blocks=int(num_blocks)))
    policy = make_policy(kv, cal.engine.block_size_tokens, **policy_params)
    if rate_pattern is not None:
        if sessions is not None or arrival_rate is not None:
            raise MetronomeError("give one of --sessions, --arrival-rate or --rate-pattern")
        if not session_duration:
            raise MetronomeError("--rate-pattern needs --session-duration (sessions must also leave)")
        arrivals = Arrivals.parse_pattern(rate_pattern)
    elif arrival_rate is not None:
        if sessions is not None and ramp_s is None:
            raise MetronomeError("give either --sessions or --arrival-rate, not both")
        if not session_duration:
            raise MetronomeError("--arrival-rate needs --session-duration (sessions must also leave)")
        arrivals = Arrivals("poisson", rate_per_s=float(arrival_rate))
    elif ramp_s is not None:
        arrivals = Arrivals("ramp", sessions=int(sessions or 0), ramp_s=float(ramp_s))
    else:
        if sessions is None:
            raise MetronomeError("give --sessions N or --arrival-rate R")
        arrivals = Arrivals("all", sessions=int(sessions))
    durations = None
    if session_duration not in (None, ""):
        durations = Durations.parse(str(session_duration))
    label, factory = _admission(o.admission, o.aimd_params, deadline or cal.stream.frame_period_s)
    return Scenario(cal, policy, arrivals, float(o.horizon), durations=durations, seed=int(o.seed),
                    deadline_s=deadline, admission=factory, admission_label=label, phases=o.phases, loop=o.loop)


def _admission(spec: str | None, aimd_params, deadline_s: float):
    """A registered controller's spec (``none``, ``static:N``, ``aimd``, ...) → (label, picklable controller
    factory)."""
    import functools

    from metronome import admission as adm

    spec = (spec or "none").strip()
    params = None
    if aimd_params is not None:  # read even where it cannot apply: a missing file is always an error
        params = adm.read_params(aimd_params)
    if spec == "none":
        return "none", None
    adm.make_controller(spec, deadline_s, params)  # validate now: one-line error before any work
    return spec, functools.partial(adm.make_controller, spec, deadline_s, params)
