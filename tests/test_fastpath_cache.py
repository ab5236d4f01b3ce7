"""numba's cache of compiled code follows the form of what that code compiles in from other modules
(metronome/compiled.py): the engine step takes in the policy's residency, the simulator's loop the engine step,
the step model and the jitter ratio."""

import json
import os
import subprocess
import sys
import types

import numba as nb
import numpy as np
import pytest

from metronome import compiled, serving
from metronome.sim import fastpath as fp


def test_cached_code_of_another_form_is_dropped_and_todays_kept(tmp_path):
    old = [tmp_path / "fastpath.run_span-150.py311.nbi", tmp_path / "fastpath.run_span-150.py311.1.nbc"]
    other = tmp_path / "engine._x-1.py311.nbi"  # another module's cache is not this module's to drop
    for f in old + [other]:
        f.write_bytes(b"x")
    (tmp_path / "fastpath.form.sha256").write_text("an older form")
    assert compiled.forget_other_forms(tmp_path, "fastpath", "today") is True
    assert not any(f.exists() for f in old) and other.exists()
    assert (tmp_path / "fastpath.form.sha256").read_text() == "today"
    kept = tmp_path / "fastpath.run_span-150.py311.nbi"
    kept.write_bytes(b"compiled from today's form")
    assert compiled.forget_other_forms(tmp_path, "fastpath", "today") is False and kept.exists()
    assert compiled.forget_other_forms(tmp_path, "fastpath", "tomorrow") is True and not kept.exists()


def _foreign_compiled_modules(module) -> set:
    """The modules whose compiled functions ``module``'s own compiled functions can call: every numba dispatcher
    among its globals whose source lives elsewhere."""
    out = set()
    for v in vars(module).values():
        if isinstance(v, nb.core.registry.CPUDispatcher) and v.py_func.__module__ != module.__name__:
            out.add(v.py_func.__module__)
    return out


def _covered(parts) -> set:
    return {p.__name__ if isinstance(p, types.ModuleType) else p.__module__ for p in parts}


def test_each_guard_covers_every_module_whose_compiled_code_it_takes_in():
    # serving compiles the policy's residency; fastpath calls serving's step and compiles the step model's form
    assert _foreign_compiled_modules(serving) == {"metronome.kv_policy"}
    assert _foreign_compiled_modules(serving) <= _covered((serving.resident_blocks_of, serving.resident_tokens_of))
    assert {"metronome.serving", "metronome.calibration"} <= _foreign_compiled_modules(fp)
    assert _foreign_compiled_modules(fp) <= _covered(fp.FORM_PARTS)
    # the loop's helpers in modules of their own, each guarded the same way
    from metronome import front_rules
    from metronome.sim import reaction, recorder, span

    for module, parts in ((front_rules, front_rules.RULES_PARTS), (span, span.SPAN_PARTS),
                          (recorder, recorder.ROWS_PARTS), (reaction, reaction.REACTION_PARTS)):
        assert _foreign_compiled_modules(module) <= _covered(parts), module.__name__
    assert ({"metronome.front_rules", "metronome.sim.span", "metronome.sim.recorder", "metronome.sim.reaction"}
            <= _covered(fp.FORM_PARTS))


def test_the_loop_is_compiled_once_with_or_without_correlated_jitter():
    """The compiled loop is one machine-code body of some hundred kilobytes, compiled for each type signature its
    arguments come in (about half a minute each on a cold cache): a calibration whose step jitter has slow spells
    hands it the jitter's table, and that must come in the same types as everyone else's arrays."""
    from dataclasses import replace

    from metronome import calibration
    from metronome.kv_policy import KVPolicy
    from metronome.sim.scenario import Scenario, run
    from metronome.workload import Arrivals

    c = calibration.load("moshi-7b-h200")
    spells = replace(c, step_latency=replace(
        c.step_latency, jitter=((0.0, 0.85), (0.5, 1.0), (0.9, 1.1), (1.0, 2.0)), jitter_shared=0.6,
        jitter_tau_s=1.0, jitter_frame=0.1))
    for cal in (c, spells):
        res = run(Scenario(cal, KVPolicy.sinks(16, 16, 256), Arrivals("all", sessions=20), 5.0, seed=1))
        assert res.fast_steps > 0  # the loop ran
    assert len(fp.run_span.signatures) == 1, fp.run_span.signatures


_CALLER = '''
import sys
import numpy as np
if sys.argv[1] == "metronome":
    import metronome.compiled  # noqa: F401 (what every process that runs the simulator imports first)
import numba as nb
import records

@nb.njit(cache=True)
def first(r):
    return r.a[0]

print(first(getattr(records, sys.argv[2])(np.ones(1))))
'''


@pytest.mark.parametrize("reader", ["metronome", "numba"])
def test_a_cache_written_before_an_argument_class_moved_is_compiled_again(tmp_path, reader):
    """A cached function called with a class from another module (here ``records.Old``) has that class pickled in
    its cache index. Once the class is gone (renamed ``New``: the function's own source did not change), numba
    alone fails reading the index; with metronome's compiled module loaded the stale index reads as empty and the
    function compiles again."""
    import subprocess
    import sys

    (tmp_path / "caller.py").write_text(_CALLER)
    records = tmp_path / "records.py"
    records.write_text("from collections import namedtuple\nOld = namedtuple('Old', 'a')\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(tmp_path)}

    def call(cls):
        return subprocess.run([sys.executable, str(tmp_path / "caller.py"), reader, cls], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)

    assert call("Old").stdout.strip() == "1.0"
    records.write_text("from collections import namedtuple\nNew = namedtuple('New', 'a')\n")
    out = call("New")
    if reader == "metronome":
        assert out.returncode == 0 and out.stdout.strip() == "1.0", out.stderr[-2000:]
    else:  # (numba as it is: the reason the patch exists; should numba read it one day, the patch can go)
        assert out.returncode != 0 and "Can't get attribute 'Old'" in out.stderr, out.stderr[-2000:]


def _indexer(module: str):
    """``a[i]`` compiled as a function of module ``module``, with numba's bounds check."""
    ns = {"__name__": module}
    exec("def get(a, i):\n    return a[i]\n", ns)
    return nb.njit(boundscheck=True)(ns["get"])


def test_a_module_declared_never_negative_indexes_its_arrays_as_given():
    """compiled.indexes_never_negative: numba indexes the arrays of a declared module's functions as given (no
    wrap-around), so a negative index is out of bounds there (numba's bounds check raises), while elsewhere it
    still counts from the end."""
    compiled.indexes_never_negative("metronome_test_as_given")
    a = np.arange(5.0)
    as_given, wraps = _indexer("metronome_test_as_given"), _indexer("metronome_test_wraps")
    assert wraps(a, -1) == 4.0 and as_given(a, 4) == 4.0 and as_given(a, 0) == 0.0
    with pytest.raises(IndexError):
        as_given(a, -1)
    # the loop's module is declared (by the prefix of its functions' mangled names), a module named like it not
    assert compiled._never_negative("_ZN9metronome3sim8fastpath8run_spanB3v12B40c8tJTIeFIjx")
    assert not compiled._never_negative("_ZN9metronome3sim9fastpaths8run_spanB3v12B40c8tJTIeFIjx")


# Runs that reach every part of the loop's modules: churn under AIMD (arrivals, departures, admissions, the
# controller), both phase regimes, correlated step jitter, a pool that runs dry (preemptions, the deadlock rule,
# readmissions), history past max_model_len (rebases), the memory ceiling (sessions waiting)
_BOUNDS_CASES = """
from dataclasses import replace
from metronome import calibration
from metronome.sim import scenario as sim


def cases():
    c = calibration.load("moshi-7b-h200")
    short = replace(c, model=replace(c.model, max_model_len_tokens=600))
    jitter = ((0.0, 0.85), (0.5, 1.0), (0.99, 1.5), (1.0, 2.0))
    spells = replace(c, step_latency=replace(c.step_latency, jitter=jitter, frame_first_s=0.001, jitter_shared=0.6,
                                             jitter_tau_s=1.0, jitter_frame=0.1))
    bound = dict(kv="sinks", sinks=16, window=368)
    churn = dict(bound, arrival_rate=1.5, session_duration="exp:300", admission="aimd", deadline=0.04)
    return {
        "realistic": sim.make_scenario(c, **churn, horizon=120.0),
        "realistic aligned": sim.make_scenario(c, **churn, horizon=60.0, phases="aligned"),
        "correlated jitter": sim.make_scenario(spells, **churn, horizon=60.0),
        "dry pool": sim.make_scenario(c, kv="unbounded", sessions=300, horizon=40.0, num_blocks=2000),
        "ceiling": sim.make_scenario(c, kv="sinks", sinks=64, window=2048, sessions=500, horizon=10.0),
        "rebase": sim.make_scenario(short, kv="sinks", sinks=16, window=256, sessions=20, horizon=120.0),
    }


def summaries():
    out = {}
    for name, sc in cases().items():
        r = sim.run(sc)
        out[name] = {k: v for k, v in r.summary.items() if k != "wall_s"} | {"loop_steps": r.fast_steps}
    return out
"""


def test_the_loop_indexes_no_array_out_of_bounds(tmp_path):
    """The loop's modules index their arrays as given (compiled.indexes_never_negative): no index there may be
    negative. Runs that reach each part of the loop, compiled afresh with numba's bounds check on (an index that
    is negative, or past an array's end, raises), give the summaries they give without it."""
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(tmp_path))
    code = _BOUNDS_CASES + "\nimport json\nprint(json.dumps(summaries()))\n"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checked = json.loads(proc.stdout.strip().splitlines()[-1])
    ns = {}
    exec(_BOUNDS_CASES, ns)
    here = json.loads(json.dumps(ns["summaries"]()))
    assert checked == here
    assert all(s["loop_steps"] > 0 for s in here.values())
    assert here["rebase"]["rebases"] > 0 and here["dry pool"]["preemptions"] > 0
