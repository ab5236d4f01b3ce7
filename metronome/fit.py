"""Fitting a calibration's step-latency model to measured step times: pure, no engine and no clock.

``metronome-probe calibrate`` measures steps on the live engine and journals one row per step (its ``grid``
journal: ``phase``, ``kind`` one of prefill/decode/chunk/paced, ``batch``, ``context_tokens``, ``new_tokens``,
``step_s``, ``first``, ``preemptions``, and for paced steps their frame ``tick``); this module turns such rows
into a :class:`~metronome.calibration.StepLatencyModel`: the ``linear/1`` coefficients
(:func:`fit_step_latency`), the paced steps' jitter (:func:`step_jitter`) and how that jitter hangs together in
time (:func:`jitter_correlation`). The simulator draws that jitter with :mod:`metronome.jitter`.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy.optimize import nnls

from metronome.calibration import COEFFICIENTS, StepLatencyModel, step_inputs
from metronome.errors import MetronomeError
from metronome.results import percentile


# --------------------------------------------------------------------------------------------------
# The samples


def effective_step_s(steps: pd.DataFrame, period_s: float, phases_s=(0.0,)) -> tuple[np.ndarray, np.ndarray]:
    """Each step's time as a frame sees it: from the previous step's end or the frame's tick, whichever is later,
    to its own end. Summed over a frame's steps this is the frame's latency; it includes the driver's hand-off
    between steps and its wake-up at the tick, which an engine timed alone does not show. Also whether the
    step began at a tick (after an idle gap: a frame's first step). ``phases_s``: the sessions' phases (their
    frame k ticks at k·P + φ); a step's tick is the latest of theirs at or before its start."""
    end = steps.t_end_s.to_numpy(float)
    start = steps.t_s.to_numpy(float)  # a step row's t_s is its start (metronome.results)
    ph = np.unique(np.asarray(phases_s, dtype=float))[None, :]
    tick = (np.floor((start[:, None] - ph) / period_s + 1e-9) * period_s + ph).max(axis=1)
    prev = np.concatenate([[-np.inf], end[:-1]])
    return end - np.maximum(prev, tick), tick > prev


PACED_SITUATION = ["phase", "batch", "new_tokens", "first"]  # one paced run's steps of one shape


def _usable(grid: pd.DataFrame) -> pd.DataFrame:
    """Samples without a preemption, with ``first`` as a bool."""
    g = grid[grid["preemptions"] == 0].copy()
    g["first"] = g["first"].astype(bool)
    return g


def _paced_situations(g: pd.DataFrame) -> pd.DataFrame:
    """The paced steps (of :func:`_usable` samples) in situations measured at least 5 times."""
    paced = g[g.kind == "paced"]
    return paced[paced.groupby(PACED_SITUATION).step_s.transform("size") >= 5]


def _groups(grid: pd.DataFrame) -> pd.DataFrame:
    """One row per measured situation, with the median step time over its repeats.

    Decode steps group per grid point, chunk steps per (point, chunk size), prefill steps per identical
    (point, batch, new, context) shape, paced steps per (run, batch, new tokens, first step of a frame or not).
    Medians keep a stray slow step (another process on the cores) from pulling the fit. ``first`` marks a
    situation whose steps came right after an idle gap (a frame's first step).
    """
    g = _usable(grid)
    g["point"] = g["phase"].str.replace("grid ", "", regex=False)
    cols = ["batch", "context_tokens", "new_tokens", "step_s", "first"]
    med = ["batch", "context_tokens", "new_tokens", "step_s"]
    dec = g[g.kind == "decode"].groupby(["point", "first"])[med].median().reset_index()
    dec["label"] = "decode " + dec["point"]
    chk = g[g.kind == "chunk"].groupby(["point", "chunk_tokens", "first"])[med].median().reset_index()
    chk["label"] = "chunk" + chk["chunk_tokens"].astype(str) + " " + chk["point"]
    pre = g[g.kind == "prefill"].groupby(["point", "batch", "new_tokens", "context_tokens", "first"])["step_s"].median()
    pre = pre.reset_index()
    pre["label"] = ("prefill " + pre["point"] + " b" + pre["batch"].astype(str) + " new" + pre["new_tokens"].astype(str)
                    + " ctx" + pre["context_tokens"].astype(str))
    parts = [dec[["label"] + cols], chk[["label"] + cols], pre[["label"] + cols]]
    paced = _paced_situations(g)
    if len(paced):
        pac = paced.groupby(PACED_SITUATION)[["context_tokens", "step_s"]].median().reset_index()
        pac["label"] = (pac["phase"] + " b" + pac["batch"].astype(str) + " new" + pac["new_tokens"].astype(str)
                        + np.where(pac["first"], " first", ""))
        parts.append(pac[["label"] + cols])
    return pd.concat(parts, ignore_index=True)


# --------------------------------------------------------------------------------------------------
# The jitter and its spells


JITTER_P = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0)


def step_jitter(grid: pd.DataFrame) -> list[list[float]]:
    """``(p, ratio)`` points of paced steps' time over the median of their situation (run, batch, new tokens,
    first step or not): the spread a real-time engine adds around the model. The top point is the 99.9th
    percentile, so one freak step does not set the tail. Empty without paced steps."""
    g = _paced_situations(_usable(grid))
    if len(g) < 50:
        return []
    r = (g.step_s / g.groupby(PACED_SITUATION).step_s.transform("median")).to_numpy(float)
    q = np.quantile(r, [min(p, 0.999) for p in JITTER_P])
    q = np.maximum.accumulate(np.maximum(q, 1e-3))
    return [[p, round(float(v), 6)] for p, v in zip(JITTER_P, q)]


JITTER_CORR_MAX_LAG_S = 3.0  # lags (in frames) the correlation fit looks at: up to this many seconds


def normal_scores(x: np.ndarray) -> np.ndarray:
    """Normal scores of ``x`` by rank (ties share their mean rank): the copula scale the simulator draws on."""
    from scipy.special import ndtri
    from scipy.stats import rankdata

    return ndtri((rankdata(x) - 0.5) / len(x))


def tick_correlations(run: np.ndarray, tick: np.ndarray, y: np.ndarray, max_lag: int) -> dict:
    """Correlations of scores ``y`` between steps ``0..max_lag`` frame ticks apart (lag 0: two different steps
    of the same tick), pooled over runs; with each run's length in ticks. Scores are taken as standardised
    (mean 0, variance 1 over all steps)."""
    num = np.zeros(max_lag + 1)
    den = np.zeros(max_lag + 1)
    lengths = []
    for r in pd.unique(run):
        m = run == r
        t = tick[m].astype(np.int64)
        t = t - t.min()
        n_t = np.bincount(t).astype(float)
        s_t = np.bincount(t, weights=y[m])
        q_t = np.bincount(t, weights=y[m] ** 2)
        lengths.append(len(n_t))
        num[0] += float((s_t ** 2 - q_t).sum())
        den[0] += float((n_t ** 2 - n_t).sum())
        for lag in range(1, min(max_lag, len(n_t) - 1) + 1):
            num[lag] += float(s_t[:-lag] @ s_t[lag:])
            den[lag] += float(n_t[:-lag] @ n_t[lag:])
    var = float(np.mean(y ** 2)) or 1.0
    ok = den > 0
    return {"lags": np.flatnonzero(ok), "corr": num[ok] / den[ok] / var, "run_ticks": np.array(lengths, float)}


def _demeaned_model(rho: np.ndarray, phi: np.ndarray, lags: np.ndarray, run_ticks: np.ndarray) -> np.ndarray:
    """Expected correlation at each lag of scores ``√ρ·a_t + √(1−ρ)·z`` (``a`` a unit AR(1) over ticks with
    coefficient ``phi``) once each run's mean is taken out, as ranking within a run does:
    ``ρ·(φ^lag − V)``, ``V`` the variance of a run's mean of ``a`` (averaged over the runs' lengths)."""
    phi = phi[..., None]
    v = 0.0
    for n in run_ticks:
        d = np.arange(1, int(n))
        v = v + (n + 2 * ((n - d) * phi ** d).sum(-1, keepdims=True)) / n ** 2
    v = v / len(run_ticks)
    return rho[..., None] * (phi ** lags - v)


def fit_jitter_correlation(run: np.ndarray, tick: np.ndarray, y: np.ndarray, frame_period_s: float) -> dict | None:
    """Fit the step jitter's slow-spell part ``ρ`` with its correlation time ``τ``, and its frame-only part
    ``ρ_f`` (:class:`StepLatencyModel`'s ``jitter_shared``, ``jitter_tau_s``, ``jitter_frame``) to the
    correlations of steps' normal scores ``y`` 0..3 s of frame ticks apart (:func:`tick_correlations`): least
    squares over a grid of (ρ, τ ≤ a quarter of the median run), allowing for each run's own mean having been
    taken out, with ``ρ_f`` whatever of the same-tick correlation the spells leave. None with fewer than 200 steps
    or fewer than 3 lags."""
    if len(y) < 200:
        return None
    max_lag = max(1, int(math.ceil(JITTER_CORR_MAX_LAG_S / frame_period_s)))
    tc = tick_correlations(run, tick, y, max_lag)
    lags, obs = tc["lags"], tc["corr"]
    if lags.size < 3:
        return None
    rhos = np.linspace(0.0, 0.95, 96)
    # spells longer than a quarter of a typical run cannot be told from each run's own mean (which ranking takes
    # out): left free, the fit trades a longer τ for a larger ρ and overstates how often a frame's steps are slow
    # together, and swings widely between calibrations taken minutes apart
    tau_max = max(frame_period_s, float(np.median(tc["run_ticks"])) * frame_period_s / 4)
    taus = np.geomspace(frame_period_s / 4, tau_max, 120)
    phis = np.exp(-frame_period_s / taus)
    model = _demeaned_model(rhos[:, None], phis[None, :], lags, tc["run_ticks"])  # (rho, tau, lag)
    same = (lags == 0).astype(float)
    if same.any():  # the frame-only part: what the spells leave of the same-tick correlation
        frame = np.clip(obs[0] - model[..., :1], 0.0, 0.95 - rhos[:, None, None])
        model = model + frame * same
    else:
        frame = np.zeros(model.shape[:2] + (1,))
    sse = ((model - obs) ** 2).sum(-1)
    i, j = np.unravel_index(int(np.argmin(sse)), sse.shape)
    return {"shared": round(float(rhos[i]), 4), "tau_s": round(float(taus[j]), 4),
            "frame": round(float(frame[i, j, 0]), 4),
            "lags": [int(v) for v in lags], "observed": [round(float(v), 4) for v in obs],
            "fitted": [round(float(v), 4) for v in model[i, j]], "steps": int(len(y)),
            "rmse": round(float(math.sqrt(sse[i, j] / lags.size)), 4)}


def jitter_correlation(grid: pd.DataFrame, frame_period_s: float) -> dict | None:
    """:func:`fit_jitter_correlation` on the paced steps of a calibration grid: each step's normal score within
    its situation (as :func:`step_jitter` takes ratios), its run and its frame tick. None with fewer than 200 paced
    steps (a grid without paced runs has no ``tick`` column at all)."""
    g = _paced_situations(_usable(grid))
    if len(g) < 200:
        return None
    y = g.groupby(PACED_SITUATION).step_s.transform(lambda x: normal_scores(x.to_numpy(float)))
    return fit_jitter_correlation(g.phase.to_numpy(), g["tick"].to_numpy(float), y.to_numpy(float), frame_period_s)


# --------------------------------------------------------------------------------------------------
# The step-latency model


def _nnls_rel(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative error (each row divided by its y). A column that is 0 at every point
    (a dense model's MoE input) gets coefficient 0 and is left out of the solve."""
    coef = np.zeros(X.shape[1])
    live = np.any(X != 0, axis=0)
    coef[live] = nnls(X[:, live] / y[:, None], np.ones_like(y))[0]
    return coef


def design_matrix(batch, context_tokens, new_tokens, moe_route: float = 0.0) -> np.ndarray:
    """One row per point, one column per coefficient (:func:`~metronome.calibration.step_inputs`)."""
    inputs = step_inputs(np.asarray(batch, float), np.asarray(context_tokens, float), np.asarray(new_tokens, float),
                         float(moe_route))
    return np.column_stack(np.broadcast_arrays(*inputs)).astype(float)


def fit_points(batch, context_tokens, new_tokens, step_s, moe_route: float = 0.0) -> tuple[dict, np.ndarray]:
    """The step model's coefficients fitted to measured steps (≥ 0, on relative error, no outlier pass) and each
    point's relative error (predicted − measured) / measured: what a micro-benchmark's curve (e.g.
    ``docs/measured/decode_step-*.json``) says about the model's form."""
    X = design_matrix(batch, context_tokens, new_tokens, moe_route)
    y = np.asarray(step_s, float)
    coef = _nnls_rel(X, y)
    return dict(zip(COEFFICIENTS, map(float, coef))), (X @ coef - y) / y


def fit_step_latency(grid: pd.DataFrame, frame_period_s: float | None = None, moe_route: float = 0.0) -> dict:
    """Fit the step model (:func:`~metronome.calibration.step_inputs`: ``base + per_seq·batch + per_ctx·context +
    per_new·new + moe·share of experts read``, the last for an MoE backbone whose layers route ``moe_route`` = k/E
    of their experts), plus ``frame_first`` for a step that comes after an idle gap, all ≥ 0, on relative error;
    also the paced steps' jitter (:func:`step_jitter`) and, given the frame period, how it hangs together in time
    (:func:`jitter_correlation`).

    Small decode steps weigh as much as big prefill steps. One outlier pass drops points the first fit
    misses by more than max(50%, 4 × the median miss) (interference, not the engine) and refits; the error
    of every point, dropped or not, is reported.
    """
    if grid.empty:
        raise MetronomeError("no step-latency samples to fit")
    pts = _groups(grid)
    X = np.column_stack([design_matrix(pts.batch, pts.context_tokens, pts.new_tokens, moe_route),
                         pts["first"].to_numpy(float)])
    y = pts.step_s.to_numpy(float)
    paced = pts.label.str.startswith("paced").to_numpy()
    # With paced runs, decode and chunk steps come from them: the grid's back-to-back steps are a busier,
    # warmer engine than a real-time one (they stay in per_point_rel_error, not in the fit). Prefill shapes
    # come from the grid either way.
    used = (paced | pts.label.str.startswith("prefill").to_numpy()) if paced.sum() >= 4 else np.ones(len(y), bool)
    coef = _nnls_rel(X[used], y[used])
    miss = np.abs(X @ coef - y) / y
    inlier = used & (miss <= max(0.5, 4 * float(np.median(miss[used]))))
    if inlier.sum() >= 4:
        coef = _nnls_rel(X[inlier], y[inlier])
    pred = X @ coef
    rel = (pred - y) / y
    a = np.abs(rel[inlier])
    decode = pts.label.str.startswith("decode").to_numpy()
    return {
        **{k: float(c) for k, c in zip(COEFFICIENTS, coef)}, "frame_first_s": float(coef[len(COEFFICIENTS)]),
        "moe_route": float(moe_route),
        "jitter": step_jitter(grid),
        "jitter_correlation": jitter_correlation(grid, frame_period_s) if frame_period_s else None,
        "fitted_range": {"batch": [float(pts.batch.min()), float(pts.batch.max())],
                         "context_tokens": [float(pts.context_tokens.min()), float(pts.context_tokens.max())],
                         "new_tokens": [float(pts.new_tokens.min()), float(pts.new_tokens.max())]},
        "error": {"median_abs_rel": percentile(a, 50), "p90_abs_rel": percentile(a, 90),
                  "max_abs_rel": float(np.max(a)), "rmse_s": float(np.sqrt(np.mean((pred - y)[inlier] ** 2))),
                  "points": float(used.sum()), "outliers": float((used & ~inlier).sum()),
                  "points_not_fitted": float((~used).sum()),
                  **({"median_abs_rel_decode": percentile(np.abs(rel[decode]), 50)} if decode.any() else {}),
                  **({"median_abs_rel_paced": percentile(np.abs(rel[paced]), 50)} if paced.any() else {})},
        "per_point_rel_error": {lab: float(e) for lab, e in zip(pts.label, rel)},
        "outliers": [lab for lab, ok, u in zip(pts.label, inlier, used) if u and not ok],
    }


def step_latency_model(fit: dict) -> StepLatencyModel:
    """The calibration's step-latency model from a :func:`fit_step_latency` result."""
    return StepLatencyModel(
        **{k: fit.get(k, 0.0) for k in COEFFICIENTS}, frame_first_s=fit.get("frame_first_s", 0.0),
        moe_route=fit.get("moe_route", 0.0),
        jitter=tuple(tuple(pt) for pt in fit.get("jitter", ())),
        **_correlation_fields(fit),
        fitted_range={k: tuple(v) for k, v in fit["fitted_range"].items()},
        fit_error={**fit["error"], **fit["per_point_rel_error"]})


def _correlation_fields(fit: dict) -> dict:
    """StepLatencyModel's ``jitter_shared``/``jitter_tau_s``/``jitter_frame`` from a step fit (none without jitter
    or without a correlation fit)."""
    corr = fit.get("jitter_correlation")
    if not fit.get("jitter") or not corr or not (corr["shared"] or corr["frame"]):
        return {}
    return {"jitter_shared": corr["shared"], "jitter_tau_s": corr["tau_s"], "jitter_frame": corr["frame"]}


# --------------------------------------------------------------------------------------------------
# Several runs pooled


def pool_grids(grids: list[pd.DataFrame]) -> pd.DataFrame:
    """The step samples of several calibration runs as one grid. Each run's phases get their own tag
    (``paced N=16 #1``, ``paced N=16 #2`` …; the kind stays first, the fit picks its points by it), so a
    situation's median, a paced run's ticks and the jitter's spells stay within the run
    that measured them; the fit then weighs every run's situations alike."""
    parts = []
    for k, g in enumerate(grids, start=1):
        if len(g):
            parts.append(g.assign(phase=g["phase"].astype(str) + f" #{k}"))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
