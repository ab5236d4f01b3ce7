"""One results schema: the summary keys a simulated and a live run share, and the one percentile they use.

``metronome-sim run`` (:func:`metronome.sim.scenario.summarize`) and ``metronome-probe run`` / ``validate``
(:func:`metronome.probe.summary.summarize`) both build the shared part of their ``summary.json`` with
:func:`shared_summary`: every key of :data:`SUMMARY_KEYS` is computed by the same code, from frame, step and
session figures of the same meaning, so a key means the same thing (and has the same unit) in both. Each side
adds keys that only make sense there: :data:`SIM_ONLY_KEYS`, :data:`LIVE_ONLY_KEYS`.

**Times** are seconds from the run's start: simulated time, or the live driver's clock. In both step tables a
step row's ``t_s`` is when the step *started* and ``step_s`` how long it took (the live driver also records
``t_end_s``, when the engine's step returned and the driver had its outputs).

**Percentiles.** Every percentile the project reports (run summaries, the admission controllers' interval
statistic, the live Prometheus gauges, calibration summaries) is :func:`weighted_percentile`: the nearest-rank
("inverted CDF") percentile, always one of the observed values, never an interpolation, so "p99 frame latency"
is one number for one set of samples wherever it is computed.

**Silent frames, by what they are** (:func:`silent_cause`; the frames tables' ``silent_preempted``,
``silent_waiting`` and ``silent_departed`` columns and the summaries' ``*_fraction`` keys, live and simulated). A
silent frame got no token at all. It is exactly one of:

* *silent after a preemption* (``silent_preempted``): its session had been admitted (given blocks) before the
  frame ticked and then stopped getting tokens, because it was preempted (by the engine, or by the deadlock rule
  when it was starved of blocks) or lost its KV with the engine: the frames owed when it lost its place, and those
  ticking while it waits to be readmitted and re-prefills;
* *silent while waiting to be admitted* (``silent_waiting``): its session had not yet been admitted when the frame
  ticked (past the gate, waiting in the front end's queue for the blocks its first frame needs);
* *flushed silent at departure* (``silent_departed``): answered as its session ended, with nothing for it yet (the
  backlog of frames an engine slower than the frame clock owes a session, answered silent when it departs). No
  preemption is involved: a departing session that had lost its place owes none.

**Collapsed** (the definition every report uses): the pool saturated (``t_sat_observed_s`` is set) *and*
afterwards at least :data:`COLLAPSE_SILENT_FRACTION` (1%) of all frames answered were silent after a preemption:
sessions already talking stopped getting tokens. Frames flushed silent at departure do not count (an engine
behind the frame clock answers them so whether or not the pool ran dry), nor do frames of sessions waiting for
their first admission: a run that only queues new arrivals at the memory ceiling is not collapsed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from metronome.percentile_kernel import percentile_sorted, percentiles_whole, whole_total, whole_weights
from metronome.serving import EndReason, frame_is_silent

__all__ = [
    "COLLAPSE_SILENT_FRACTION",
    "LIVE_ONLY_KEYS",
    "REFUSED_REASONS",
    "SILENT_DEPARTED",
    "SILENT_PREEMPTED",
    "SILENT_WAITING",
    "SIM_ONLY_KEYS",
    "SUMMARY_KEYS",
    "SummaryKey",
    "UNIT_TYPES",
    "check_types",
    "collapse_decided",
    "collapsed",
    "percentile",
    "percentiles",
    "shared_keys",
    "shared_summary",
    "silent_cause",
    "weighted_percentile",
    "weighted_percentiles",
    "wilson_interval",
]

COLLAPSE_SILENT_FRACTION = 0.01
# what a silent frame is (module docstring; :func:`silent_cause`): 0 not silent
SILENT_PREEMPTED, SILENT_WAITING, SILENT_DEPARTED = 1, 2, 3
# sessions-table end reasons that mean the admission gate turned the session away (``sessions_refused``)
REFUSED_REASONS = EndReason.NOT_ADMITTED
DIGITS = 6  # figures in seconds and fractions are rounded to 1e-6 (a microsecond) in both summaries


# ---------------------------------------------------------------------------------------------------
# The percentile
# ---------------------------------------------------------------------------------------------------
def weighted_percentile(values, weights, q: float) -> float | None:
    """Weighted nearest-rank ("higher", inverted-CDF) percentile; ``None`` when the total weight is 0.

    The result is the smallest value ``v`` whose cumulative weight reaches ``q/100`` of the total
    weight, i.e. ``min{v : W(x <= v) >= q/100 · W}``. With unit weights this is the classic nearest-rank
    percentile (``numpy.percentile(..., method="inverted_cdf")``): always one of the observed values,
    never an interpolation, so a p99 over 100 frames is the 99th-fastest frame. Ties in value are
    broken by a stable sort, so the result is deterministic. ``q`` is in (0, 100]; ``q = 100`` is the
    maximum. Zero-weight samples are ignored; negative weights are an error.
    """
    return weighted_percentiles(values, weights, (q,))[0]


def _as_writable_type(a: np.ndarray) -> np.ndarray:
    """``a``, or a view of it flagged writable where its memory is: for the compiled percentile, which only reads
    it. numba compiles a function once for each type of array it is handed, and a read-only array is a type of its
    own; pandas hands out its columns read-only, while an admission controller's samples are writable, so a process
    that summarizes a run and runs a controller (every simulated run) compiled the percentile twice (1.5 s)."""
    if a.flags.writeable:
        return a
    view = a.view()
    try:
        view.flags.writeable = True
    except ValueError:  # (memory that is read-only itself: the read-only form is compiled)
        return a
    return view


def weighted_percentiles(values, weights, qs) -> list[float | None]:
    """:func:`weighted_percentile` at each of ``qs``, the samples checked once (a run's frames are millions)."""
    v = _as_writable_type(np.asarray(values, dtype=float).ravel())
    w = _as_writable_type(np.asarray(weights, dtype=float).ravel())
    if v.shape != w.shape:
        raise ValueError(f"values and weights differ in length: {v.size} vs {w.size}")
    for q in qs:
        if not 0.0 < q <= 100.0:
            raise ValueError(f"percentile must be in (0, 100], got {q}")
    kind = whole_weights(v, w)  # (one pass over millions of frame rows)
    if kind == -1:
        raise ValueError("weights must be finite and >= 0")
    if kind == -2:
        return [None] * len(qs)
    # the rule is the admission controllers' too (they run it in the simulator's compiled loop): stated there
    if kind == 1:  # whole weights (frames, steps): selected, not sorted
        return [float(x) for x in percentiles_whole(v, w, np.array(qs, dtype=float))]
    keep = w > 0
    v, w = v[keep], w[keep]
    order = np.argsort(v, kind="stable")
    v, cum = v[order], np.cumsum(w[order])
    return [float(percentile_sorted(v, cum, float(q))) for q in qs]


def percentile(values, q: float) -> float | None:
    """:func:`weighted_percentile` of unweighted samples (each counts once); ``None`` without any.
    ``NaN`` samples (e.g. a frame never answered) are left out."""
    return percentiles(values, (q,))[0]


def percentiles(values, qs) -> list[float | None]:
    """:func:`percentile` at each of ``qs``."""
    v = np.asarray(values, dtype=float).ravel()
    v = v[~np.isnan(v)]
    return weighted_percentiles(v, np.ones(v.size), qs) if v.size else [None] * len(qs)


# ---------------------------------------------------------------------------------------------------
# The schema
# ---------------------------------------------------------------------------------------------------
UNIT_TYPES = {  # what a value of each unit is in summary.json (None allowed where noted in the meaning)
    "frames": int, "steps": int, "sessions": int, "tokens": int, "blocks": int, "preemptions": int,
    "rebases": int, "fraction": float, "s": float, "bool": bool,
}


@dataclass(frozen=True)
class SummaryKey:
    name: str
    unit: str  # one of UNIT_TYPES
    meaning: str
    nullable: bool = False  # None when there is nothing to measure (no frame, no step, never saturated)


SUMMARY_KEYS: tuple[SummaryKey, ...] = (
    SummaryKey("frames", "frames", "frames answered: every frame tick of every streaming session whose answer "
               "is known (silent ones included); live, a frame still inside its deadline when the run ends is "
               "not counted (censored)"),
    SummaryKey("silent_frames", "frames", "answered frames that got no token at all"),
    SummaryKey("silent_frame_fraction", "fraction", "silent_frames / frames (0 without frames)"),
    SummaryKey("silent_preempted_fraction", "fraction", "silent after a preemption: silent frames of sessions "
               "admitted before the frame's tick that then lost their place (preempted, also when starved of "
               "blocks, or their KV lost with the engine) and wait or re-prefill, not answered at departure; "
               "over frames"),
    SummaryKey("silent_waiting_fraction", "fraction", "silent while waiting to be admitted: silent frames that "
               "ticked before their session was first admitted, not answered at departure; over frames"),
    SummaryKey("silent_departed_fraction", "fraction", "flushed silent at departure: silent frames answered as "
               "their session ended (the backlog an engine behind the frame clock owed it); over frames. The three "
               "silent_*_fraction keys sum to silent_frame_fraction (each rounded)"),
    SummaryKey("deadline_miss_fraction", "fraction", "frames not done within the deadline of their tick "
               "(silent ones answered on time do not miss), over frames"),
    SummaryKey("p50_frame_latency_s", "s", "nearest-rank p50 of answered frames' latency (done − tick), silent "
               "frames at the time they were answered", nullable=True),
    SummaryKey("p99_frame_latency_s", "s", "nearest-rank p99 of the same", nullable=True),
    SummaryKey("t_sat_observed_s", "s", "start of the first step that found the pool dry: some session needed a "
               "block and none was free (None: never)", nullable=True),
    SummaryKey("collapsed", "bool", "the pool saturated and afterwards >= COLLAPSE_SILENT_FRACTION of frames were "
               "silent after a preemption (module docstring; not those flushed at departure)"),
    SummaryKey("preemptions", "preemptions", "preemptions (recompute: all the session's blocks freed); a session "
               "preempted twice counts twice"),
    SummaryKey("rebases", "rebases", "restarts of a session near max_model_len (or after an engine death) as a new "
               "request holding its last tokens"),
    SummaryKey("steps", "steps", "engine steps"),
    SummaryKey("p50_step_latency_s", "s", "nearest-rank p50 of the steps' duration (step_s)", nullable=True),
    SummaryKey("p99_step_latency_s", "s", "nearest-rank p99 of the steps' duration", nullable=True),
    SummaryKey("peak_used_blocks", "blocks", "most KV blocks held by sessions at once"),
    SummaryKey("usable_blocks", "blocks", "KV blocks sessions can hold (vLLM's pool less its null block)"),
    SummaryKey("peak_pool_occupancy", "fraction", "peak_used_blocks / usable_blocks"),
    SummaryKey("sessions_offered", "sessions", "sessions that arrived during the run"),
    SummaryKey("sessions_admitted", "sessions", "sessions that got into the engine (were given blocks) at least once"),
    SummaryKey("sessions_refused", "sessions", "sessions the admission controller refused (or that timed out in "
               "its queue)"),
    SummaryKey("tokens_total", "tokens", "output tokens delivered in answered frames"),
)

SIM_ONLY_KEYS = {
    "calibration": "the calibration's name", "provenance": "how the calibration was obtained",
    "policy": "the KV policy", "workload": "arrivals and durations, in words", "admission": "the controller spec",
    "phases": "the frame clock's regime: independent (own phase per session) or aligned (lockstep)",
    "loop": "who steps the engine: driver (the front end) or vllm (vLLM's own loop, the front end a client)",
    "horizon_s": "simulated seconds", "deadline_s": "a frame's deadline (s)",
    "t_sat_predicted_s": "the fill model's saturation time (s; None without a closed form)",
    "p_saturate_predicted": "the fill model's probability that the pool saturates within the horizon",
    "memory_ceiling": "sessions the pool holds at the mean session length (the fill model)",
    "length_capped": "sessions ended at max_model_len",
    "goodput_frames_per_s": "non-silent on-time frames per simulated second",
    "goodput_sessions": "goodput in sessions (goodput_frames_per_s × frame period)",
    "steps_outside_fit": "steps outside the calibration's fitted range",
    "stopped_early_s": "when a run asked to stop once its outcome was decided stopped (s; None: it ran to the "
                       "horizon); collapsed and t_sat_observed_s are the full run's, the other figures cover only "
                       "the time simulated",
    "seed": "the workload's and the jitter's seed", "wall_s": "wall-clock seconds the simulation took",
}

LIVE_ONLY_KEYS = {
    "frames_unfinished": "answered frames that never got all their tokens (done_s null)",
    "silent_by_deadline_fraction": "frames with no token by their deadline, over frames",
    "preemptions_by_reason": "preemptions per reason (engine, pool_dry, stall, ...)",
    "readmissions": "preempted sessions readmitted (a re-prefill of their whole history)",
    "p50_rebase_frame_latency_s": "nearest-rank p50 latency of frames that carried a rebase's prefill",
    "frames_not_running": "frames that came due while their session was waiting or re-prefilling",
    "t_first_preemption_s": "start of the step after which the driver first preempted (s)",
    "t_pool_full_s": "start of the first step with no free block and requests waiting, or a stall (s)",
    "stalls": "steps that scheduled nothing while requests waited",
    "num_blocks": "vLLM's pool in blocks, its null block included (usable_blocks + 1)",
    # added by Driver.run: how the run ended, and the engine's silences and deaths
    "stopped": "the run was stopped (signal, or the engine died for good)", "stop_reason": "why (null: not stopped)",
    "t_stopped_s": "when it was stopped (s)", "engine_silent_episodes": "spells of frames waiting and no token",
    "engine_silent_s": "their total length (s)", "t_first_engine_silent_s": "start of the first (s)",
    "silence_threshold_s": "how long without a token is a silence (s)", "engine_deaths": "engine process deaths",
    "engine_restarts": "engines started again", "engine_error": "why the run stopped, when the engine died for good",
    "engine_outage_s": "seconds without an engine", "engine_outages": "[died, back] pairs (s)",
}
# metronome-probe run adds the run's options, the controller's figures, sessions_planned (plans, arrived or not),
# wall_s, engine, arrivals and durations; validate adds load_avg_start / load_avg_end.


def shared_keys() -> tuple[str, ...]:
    return tuple(k.name for k in SUMMARY_KEYS)


# ---------------------------------------------------------------------------------------------------
# Building the shared part
# ---------------------------------------------------------------------------------------------------
def _r(x, nd: int = DIGITS):
    return None if x is None else round(float(x), nd)


def silent_cause(tokens: int, departed: bool, tick_s: float, admitted_s: float) -> int:
    """What a frame answered with ``tokens`` tokens is (module docstring): 0, not silent; else
    :data:`SILENT_DEPARTED` when it is answered as its session ends (``departed``), :data:`SILENT_WAITING` when its
    tick (``tick_s``) came before its session was first admitted (``admitted_s``; NaN: never admitted), and
    :data:`SILENT_PREEMPTED` otherwise: an admitted session's frame is silent only once it lost its place. The live
    driver asks it of each frame, the simulator's records (compiled) of each answer."""
    if not frame_is_silent(tokens):
        return 0
    if departed:
        return SILENT_DEPARTED
    if not tick_s >= admitted_s:  # (NaN: never admitted)
        return SILENT_WAITING
    return SILENT_PREEMPTED


def collapsed(t_sat_s: float | None, tick_s, frames, silent_preempted) -> bool:
    """The collapse verdict (module docstring) from frame rows: tick time, frames, frames silent after a
    preemption."""
    if t_sat_s is None:
        return False
    after = np.asarray(tick_s, dtype=float) >= t_sat_s
    f_after = int(_counts(frames)[after].sum())
    s_after = int(_counts(silent_preempted)[after].sum())
    return collapse_decided(s_after, f_after, 0)


def _counts(x) -> np.ndarray:
    """Counts as an integer array: as they are when they are integers (numpy sums any integer narrower than int64
    as int64), else as int64."""
    a = np.asarray(x)
    return a if a.dtype.kind in "iu" else a.astype(np.int64)


def count_total(x) -> int:
    """The sum of counts ``x`` (:func:`_counts`), exactly: added as int64 in compiled code, in one pass over them
    as they are. numpy sums an integer narrower than int64 (the simulator's counts are int32) by casting it to int64
    in buffered chunks first; over a realistic hour's two million frame rows either way is bound by reading them
    from memory, so what this saves is small (docs/history/benchmarks.md)."""
    return int(whole_total(_as_writable_type(_counts(x))))


def collapse_decided(silent_after: int, frames_after: int, frames_left: int) -> bool:
    """Collapsed whatever happens next: ``silent_after`` frames silent after a preemption among ``frames_after``
    frames answered since t_sat, and even if all of the at most ``frames_left`` frames still to be answered came
    back non-silent the share would stay at or above :data:`COLLAPSE_SILENT_FRACTION`. With ``frames_left = 0``
    this is the verdict itself (:func:`collapsed`), so a run stopped on it ends as the full run would."""
    total = frames_after + frames_left
    return total > 0 and silent_after / total >= COLLAPSE_SILENT_FRACTION


def wilson_interval(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval (default 95%) for a binomial proportion: ``successes`` of ``trials``
    independent runs. Unlike the normal interval it stays inside [0, 1] and is not empty at 0 or all of
    ``trials`` (5 runs, none collapsed: 0-43%), which is what a Monte Carlo cell of a few runs needs."""
    if trials <= 0:
        return 0.0, 1.0
    p = successes / trials
    z2 = z * z
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / (1 + z2 / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class RunCounts:
    """A run's counts that :func:`shared_summary` reports as they are (blocks, preemptions, rebases, sessions)."""

    peak_used_blocks: int
    usable_blocks: int
    preemptions: int
    rebases: int
    sessions_offered: int
    sessions_admitted: int
    sessions_refused: int


# the frame columns shared_summary reads, one entry per frame row
SUMMARY_FRAME_COLUMNS = ("tick_s", "latency_s", "frames", "silent", "silent_preempted", "silent_waiting",
                         "silent_departed", "late", "tokens")


def shared_summary(frame_rows, step_s, t_sat_s, counts: RunCounts) -> dict:
    """The shared keys (:data:`SUMMARY_KEYS`, in that order) from a run's answered frames and its steps.

    ``frame_rows`` maps each of :data:`SUMMARY_FRAME_COLUMNS` to an array, one entry per frame row (a table with
    those columns will do): a row stands for ``frames[i]`` frames of one tick (the simulator's rows aggregate a
    tick's sessions; a live row is one frame), ``silent`` and ``late`` of which were silent or missed the
    deadline, and ``silent_preempted``, ``silent_waiting`` and ``silent_departed`` the silent ones by what they are
    (:func:`silent_cause`), with latency ``latency_s[i]`` (``NaN``: not answered with a time, left out of the
    percentiles) and ``tokens[i]`` output tokens. ``step_s`` holds every step's duration."""
    (tick_s, latency_s, frames, silent, silent_preempted, silent_waiting, silent_departed, late, tokens) = (
        np.asarray(frame_rows[c]) for c in SUMMARY_FRAME_COLUMNS)
    c = counts
    n = len(np.atleast_1d(frames))
    tick, lat = (np.asarray(x, dtype=float).reshape(n) for x in (tick_s, latency_s))

    def arr(x):  # (counts: the simulator's are int32, summed as int64 without a copy of its millions of rows)
        return _counts(x).reshape(n)

    w = arr(frames)
    n_frames = count_total(w)
    n_silent = count_total(arr(silent))
    sp = arr(silent_preempted)
    has_lat = ~np.isnan(lat)
    st = np.asarray(step_s, dtype=float).ravel()

    def frac(k):
        return _r(k / n_frames if n_frames else 0.0)

    # (every frame answered with a time, as a simulated run's: no copy of its millions of rows)
    p50, p99 = weighted_percentiles(*((lat, w) if has_lat.all() else (lat[has_lat], w[has_lat])), (50, 99))
    s50, s99 = percentiles(st, (50, 99))

    out = {
        "frames": n_frames,
        "silent_frames": n_silent,
        "silent_frame_fraction": frac(n_silent),
        "silent_preempted_fraction": frac(count_total(sp)),
        "silent_waiting_fraction": frac(count_total(arr(silent_waiting))),
        "silent_departed_fraction": frac(count_total(arr(silent_departed))),
        "deadline_miss_fraction": frac(count_total(arr(late))),
        "p50_frame_latency_s": _r(p50),
        "p99_frame_latency_s": _r(p99),
        "t_sat_observed_s": _r(t_sat_s),
        "collapsed": bool(collapsed(t_sat_s, tick, w, sp)),
        "preemptions": int(c.preemptions),
        "rebases": int(c.rebases),
        "steps": int(st.size),
        "p50_step_latency_s": _r(s50),
        "p99_step_latency_s": _r(s99),
        "peak_used_blocks": int(c.peak_used_blocks),
        "usable_blocks": int(c.usable_blocks),
        "peak_pool_occupancy": _r(c.peak_used_blocks / c.usable_blocks if c.usable_blocks else 0.0),
        "sessions_offered": int(c.sessions_offered),
        "sessions_admitted": int(c.sessions_admitted),
        "sessions_refused": int(c.sessions_refused),
        "tokens_total": count_total(arr(tokens)),
    }
    assert tuple(out) == shared_keys()
    return out


def check_types(summary: dict) -> list[str]:
    """Shared keys that are missing from ``summary`` or whose value is not of their unit's type."""
    bad = []
    for k in SUMMARY_KEYS:
        if k.name not in summary:
            bad.append(f"{k.name}: missing")
            continue
        v, want = summary[k.name], UNIT_TYPES[k.unit]
        if v is None and k.nullable:
            continue
        ok = isinstance(v, bool) if want is bool else (
            isinstance(v, want) and not isinstance(v, bool) and (want is not float or math.isfinite(v)))
        if not ok:
            bad.append(f"{k.name}: {v!r} is not {want.__name__} ({k.unit})")
    return bad


def settled_mean(t: np.ndarray, y: np.ndarray, horizon_s: float) -> float | None:
    """The settled value of a run: the mean of ``y`` over the samples at or after ``horizon_s / 2`` (None: no such
    sample). The settled concurrency of a live or simulated AIMD run is this over its admitted sessions per step."""
    t, y = np.asarray(t, dtype=float), np.asarray(y, dtype=float)
    late = y[(t >= horizon_s / 2) & np.isfinite(y)]
    return float(late.mean()) if late.size else None
