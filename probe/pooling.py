"""``metronome-probe pool``: one calibration from several calibration runs of the same engine.

No engine runs here: the runs' folders (as :mod:`metronome.probe.calibrate` leaves them) are read back and their
step samples refitted together (:func:`metronome.fit.pool_grids`, :func:`metronome.fit.fit_step_latency`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from metronome.calibration import Calibration, load_file
from metronome.errors import MetronomeError
from metronome.fit import fit_step_latency, pool_grids, step_latency_model
from metronome.probe.calibrate import backbone_fit_terms, completed_samples, utc_now

# What must agree for two calibrations to be of the same engine: their shape, pool, stream, how they were
# measured (model, KV policy) and on what.
_SAME_ENGINE = (("model", lambda c: c.model), ("engine", lambda c: c.engine), ("stream", lambda c: c.stream),
                ("provenance.source", lambda c: c.provenance.source),
                ("provenance.hardware", lambda c: c.provenance.hardware),
                ("provenance.engine", lambda c: c.provenance.engine))


def pool_calibrations(dirs: list[str | Path]) -> tuple[Calibration, dict]:
    """One calibration from several ``metronome-probe calibrate`` folders of the same engine: the first one's
    pool, KV growth and fill rate, with the step-latency model, its jitter and the jitter's spells fitted on all
    the folders' step samples together (:func:`pool_grids`). The tail of a real-time engine's step time is set by
    a few slow spells a minute, so one short calibration's p99 is a small sample; pooling calibrations taken
    over time gives the tail of the whole span. Returns the calibration and the fit (with ``per_source``: each
    folder's own jitter p99 and correlation, fitted alone)."""
    if len(dirs) < 2:
        raise MetronomeError("pooling needs at least two calibration folders")
    cals, grids = [], []
    for d in map(Path, dirs):
        f = d / "calibration.json"
        if not f.is_file():
            raise MetronomeError(f"{d}: no calibration.json (not a finished metronome-probe calibrate folder)")
        cals.append(load_file(f))
        g = completed_samples(d, "grid")
        if g.empty:
            raise MetronomeError(f"{d}: grid.jsonl holds no completed step samples to pool")
        grids.append(g)
    first = cals[0]
    for d, c in zip(dirs[1:], cals[1:]):
        for what, get in _SAME_ENGINE:
            if get(c) != get(first):
                raise MetronomeError(f"{d}: a calibration of another engine than {dirs[0]} ({what} differs); "
                                     "only calibrations of the same engine pool")
    period = first.stream.frame_period_s
    fit = fit_step_latency(pool_grids(grids), period)
    per_source = []
    for d, g in zip(dirs, grids):
        alone = fit_step_latency(g, period)
        per_source.append({"dir": str(d), "steps": int(len(g)),
                           "jitter_p99": dict(map(tuple, alone["jitter"])).get(0.99),
                           "jitter_correlation": {k: (alone["jitter_correlation"] or {}).get(k)
                                                  for k in ("shared", "tau_s", "frame")}})
    fit["per_source"] = per_source
    err = fit["error"]
    note = (f"step latency fitted on the pooled step samples of {len(dirs)} calibration runs ("
            + ", ".join(str(d) for d in dirs) + f"): median |rel err| {err['median_abs_rel']:.3f}, "
            f"p90 {err['p90_abs_rel']:.3f}")
    keep = tuple(n for n in first.provenance.notes if not n.startswith("step fit:"))
    step = step_latency_model(fit)
    if first.stack:
        # the pipeline's stages (calibrate --time-stages, or a stack a preset prices) are not in the step samples
        # pooled: the stack in use keeps its terms on top of the pooled backbone, as calibrate priced it
        bare = replace(first, step_latency=step, stack="", stack_options=())
        step = step.with_terms(backbone_fit_terms(bare) + first.stack_pricing(first.stack).terms)
        note += f"; stack {first.stack!r}'s stage terms as the first run priced them"
    cal = replace(first, step_latency=step, path="",
                  provenance=replace(first.provenance, date=utc_now(), notes=keep + (note,),
                                     source=first.provenance.source + f" (pooled over {len(dirs)} runs)"),
                  description=first.description + f"; step latency pooled over {len(dirs)} calibration runs")
    return cal, fit
