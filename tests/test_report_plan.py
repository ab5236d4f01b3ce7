"""The report is planned once, then assembled: the builder makes one call into metronome.report.plan, which
returns the whole report's plan, and every simulated point of a phase is listed before any of them runs."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

import metronome.report.plan as plan_module

PLAN_PY = plan_module.__file__  # as the code objects of plan.py name their file


class _RecordingCache:
    """A ResultCache that stores nothing and remembers each batch it was given: (task function, tasks)."""

    def __init__(self):
        from metronome.sim.cache import ResultCache

        self.inner = ResultCache(enabled=False)
        self.batches: list[tuple[str, list]] = []

    def map(self, executor, fn, tasks, progress=None):
        self.batches.append((fn.__name__, list(tasks)))
        return self.inner.map(executor, fn, tasks, progress=progress)

    def wrap(self, executor):
        from metronome.sim.cache import CachedExecutor

        return CachedExecutor(executor, self)

    def stats(self):
        return self.inner.stats()


def _entries_into_plan_py(run) -> list[tuple[str, str]]:
    """Run ``run()`` and return every call of a module-level function of plan.py made from another file:
    (calling file's name, function name). Methods of the plan's objects are the plan answering, not the
    builder reaching into the module, so only functions at module level count."""
    seen = []

    def prof(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_filename != PLAN_PY or "." in code.co_qualname or code.co_qualname.startswith("<"):
            return
        caller = frame.f_back
        if caller is not None and caller.f_code.co_filename != PLAN_PY:
            seen.append((Path(caller.f_code.co_filename).name, code.co_qualname))

    sys.setprofile(prof)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


@pytest.fixture(scope="module")
def small_calibrations(tmp_path_factory) -> list[str]:
    """Two small-pool Moshi calibrations (a few thousand blocks: the build takes seconds)."""
    from metronome import calibration

    folder = tmp_path_factory.mktemp("plan-once")
    out = []
    for name, preset, blocks in (("tiny-h200", "moshi-7b-h200", 2000), ("tiny-b200", "moshi-7b-b200", 2600)):
        cal = calibration.load(preset)
        p = folder / f"{name}.json"
        p.write_text(replace(cal, name=name, engine=replace(cal.engine, num_blocks=blocks)).to_json())
        out.append(str(p))
    return out


@pytest.mark.slow
def test_the_builder_plans_the_report_once_and_lists_each_phase_before_running_it(small_calibrations):
    from metronome.report import ReportOptions, build_report
    from metronome.report.plan import FILL_FRACTIONS, MC_FRACTIONS, MC_DURATION_FACTORS, SIGNAL_FRACTIONS
    from metronome.sim.executors import LocalExecutor

    options = ReportOptions(calibrations=tuple(small_calibrations), session_duration="exp:120", mc_runs=2,
                            mc_edge_runs=4)
    cache = _RecordingCache()
    box = {}
    entries = _entries_into_plan_py(lambda: box.update(data=build_report(options, executor=LocalExecutor(1),
                                                                         cache=cache)))
    # one way into the planning module for the whole build, whatever the number of calibrations or MC rounds
    assert [e for e in entries if e[0] == "build.py"] == [("build.py", "plan_report")]
    assert entries == [("build.py", "plan_report")]

    sims = [tasks for fn, tasks in cache.batches if fn == "_sim_task"]
    assert len(sims) >= 2  # a first pass, then the band's edge topped up (the test needs a refinement round)
    first, *refinements = sims
    data = box["data"]
    # the first batch holds every section's points of both calibrations (the verdict, pool fill, the latency
    # signal, the first Monte Carlo pass, both admission traces), counted from the grids' sizes here
    kinds = [kind for kind, _ in first]
    per_cal = 0
    for c in data["calibrations"]:
        n_star = c["capacity"]["n_star"]
        grid = lambda fr: len({max(1, int(round(f * n_star))) for f in fr})  # noqa: E731
        per_cal += 1 + 2 * (grid(FILL_FRACTIONS) + grid(SIGNAL_FRACTIONS)
                            + grid(MC_FRACTIONS) * len(MC_DURATION_FACTORS) * options.mc_runs + 1)
    assert len(first) == per_cal
    assert sorted(set(kinds)) == ["admission", "fill", "mc", "summary"]
    assert {p["calibration"] for _, p in first} == set(small_calibrations)
    # then only Monte Carlo top-ups
    assert all(kind == "mc" for batch in refinements for kind, _ in batch)
