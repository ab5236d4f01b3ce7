"""Pooling calibrations of one engine (``metronome-probe pool``, ``metronome.probe.pooling.pool_calibrations``): no engine needed.

Each calibration folder here is written as ``metronome-probe calibrate`` leaves it (``calibration.json``, the
``grid`` journal, ``done.jsonl``), with paced runs whose step times carry a known jitter: a calm engine (small
jitter) and a noisy one (slow spells), so what the pooled fit must find is known.
"""

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from metronome import calibration
from metronome.errors import MetronomeError
from metronome.kv_policy import KVPolicy
from metronome.fit import fit_step_latency, pool_grids
from metronome.probe.pooling import pool_calibrations
from metronome.probe.records import Journal
from metronome.sim.capacity import capacity

NO_VLLM = "import sys; sys.modules['vllm'] = None; from metronome.cli.probe_cli import main; sys.exit(main())"
BASE = calibration.load("moshi-7b-h200")
PERIOD = BASE.stream.frame_period_s
# as metronome-probe calibrate writes it without --time-stages: no stack (the preset's own terms not listed)
BARE = replace(BASE, stack="", stack_options=(), step_latency=replace(BASE.step_latency, terms=(), plugin_terms=()))


def _grid(seed: int, noise: float, spells: float, ticks: int = 150) -> list[dict]:
    """Rows as calibrate journals them: prefill shapes, and paced runs of 4, 8 and 16 sessions (a frame's chunk
    step, then a decode step) whose time is ``2 ms + 0.1 ms/session + 20 us/new token`` times a lognormal jitter
    with a slow AR(1) part of weight ``spells``."""
    rng = np.random.default_rng(seed)
    rows = []
    for n in (1, 2, 4):
        for rep in range(3):
            rows.append({"attempt": 0, "phase": f"grid N={n} C=128", "kind": "prefill", "chunk_tokens": 0,
                         "batch": n, "new_tokens": 128 * n,
                         "context_tokens": 128 * n, "first": False, "preemptions": 0,
                         "step_s": (2e-3 + 1e-4 * n + 2e-5 * 128 * n) * (1 + 0.01 * rep)})
    for n in (4, 8, 16):
        a, phi = 0.0, np.exp(-PERIOD / 1.0)
        for t in range(ticks):
            a = phi * a + np.sqrt(1 - phi ** 2) * rng.normal()
            for first, new in ((True, 15 * n), (False, n)):
                z = np.sqrt(spells) * a + np.sqrt(1 - spells) * rng.normal()
                rows.append({"attempt": 0, "phase": f"paced N={n}", "kind": "paced", "chunk_tokens": 0,
                             "batch": n, "new_tokens": new,
                             "context_tokens": 128 * n, "first": first, "preemptions": 0, "tick": t,
                             "step_s": (2e-3 + 1e-4 * n + 2e-5 * new) * float(np.exp(noise * z))})
    return rows


def _folder(root, name, rows, cal=BARE, done=True):
    d = root / name
    d.mkdir()
    (d / "calibration.json").write_text(cal.to_json())
    j = Journal(d, "grid")
    j.extend(rows)
    j.close()
    if done:
        m = Journal(d, "done")
        for phase in sorted({r["phase"] for r in rows}):
            m.append({"event": "done", "phase": phase, "attempt": 0, "result": {}})
        m.close()
    return d


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cals")
    return {"calm": _folder(root, "calm", _grid(1, 0.08, 0.0)),
            "calm2": _folder(root, "calm2", _grid(2, 0.08, 0.0)),
            "noisy": _folder(root, "noisy", _grid(3, 0.3, 0.6))}


def _p99(fit):
    return dict(map(tuple, fit["jitter"]))[0.99]


def test_pool_grids_keeps_each_run_apart_and_the_kind_first(folders):
    a, b = _grid(1, 0.1, 0.0), _grid(2, 0.1, 0.0)
    import pandas as pd

    g = pool_grids([pd.DataFrame(a), pd.DataFrame(b)])
    assert len(g) == len(a) + len(b)
    assert set(g.phase) == {f"{p} #{k}" for k, rows in ((1, a), (2, b)) for p in {r["phase"] for r in rows}}
    for kind in ("paced", "grid"):  # the fit picks its points by the kind at the start of the label
        assert all(p.startswith(kind) for p in g.phase if kind in p)


def test_a_calibration_pooled_with_itself_fits_what_it_fits_alone(folders, tmp_path):
    """Two copies of the same samples: every situation's median, every quantile and every tick correlation is
    unchanged (quantiles up to interpolation), so the pooled model is the model alone (a check that pooling adds
    no bias of its own)."""
    import pandas as pd

    twin = _folder(tmp_path, "twin", _grid(1, 0.08, 0.0))
    cal, fit = pool_calibrations([folders["calm"], twin])
    alone = fit_step_latency(pd.DataFrame(_grid(1, 0.08, 0.0)), PERIOD)
    for k in ("base_s", "per_seq_s", "per_context_token_s", "per_new_token_s", "frame_first_s"):
        assert fit[k] == pytest.approx(alone[k], rel=1e-6, abs=1e-12)
    # the same order statistics, interpolated between twice as many points
    assert [p for p, _ in fit["jitter"]] == [p for p, _ in alone["jitter"]]
    assert np.allclose([r for _, r in fit["jitter"]], [r for _, r in alone["jitter"]], rtol=0.02)
    assert fit["jitter_correlation"]["shared"] == alone["jitter_correlation"]["shared"]
    assert cal.step_latency.base_s == pytest.approx(alone["base_s"], rel=1e-6)


def test_pooled_tail_lies_between_the_runs_and_spells_are_found(folders):
    cal, fit = pool_calibrations([folders["calm"], folders["noisy"]])
    each = [s["jitter_p99"] for s in fit["per_source"]]
    assert each[0] < _p99(fit) < each[1]
    assert each[0] < 1.35 < 1.7 < each[1]  # the two engines really differ: lognormal 0.08 vs 0.3 at p99
    noisy = fit["per_source"][1]["jitter_correlation"]
    assert noisy["shared"] > 0.3 and fit["per_source"][0]["jitter_correlation"]["shared"] < 0.1
    assert 0 < cal.step_latency.jitter_shared < noisy["shared"]
    # the model is the one both were drawn from (medians: 2 ms + 0.1 ms/session + 20 us/new token)
    sl = cal.step_latency
    assert sl.step_s(8, 1024, 120) == pytest.approx(2e-3 + 8e-4 + 2.4e-3, rel=0.05)
    assert [s["dir"] for s in fit["per_source"]] == [str(folders["calm"]), str(folders["noisy"])]


def test_the_pooled_calibration_is_the_first_ones_engine_with_the_pooled_step_model(folders):
    cal, fit = pool_calibrations([folders["calm"], folders["calm2"], folders["noisy"]])
    assert (cal.model, cal.engine, cal.stream) == (BASE.model, BASE.engine, BASE.stream)
    assert any("pooled step samples of 3 calibration runs" in n for n in cal.provenance.notes)
    assert "pooled over 3 runs" in cal.provenance.source
    back = calibration.from_dict(json.loads(cal.to_json()))
    assert back.step_latency == cal.step_latency
    # the simulator takes it: a noisier tail pooled in means a smaller deadline-bound N*
    pol = KVPolicy.window(BASE.engine.block_size_tokens, 512)
    calm, _ = pool_calibrations([folders["calm"], folders["calm2"]])
    # in lockstep: the claim holds in either regime, and under independent phases these jittered calibrations
    # run step by step (the compiled loop does not cover correlated jitter): 11 minutes against seconds
    n_calm = capacity(calm, pol, deadline_s=0.08, phases="aligned")["deadline_n_star"]
    n_mixed = capacity(cal, pol, deadline_s=0.08, phases="aligned")["deadline_n_star"]
    assert n_mixed < n_calm


def test_a_pooled_calibration_keeps_the_stages_of_its_stack(tmp_path):
    """The stack's stage terms (here the preset's; calibrate --time-stages writes measured ones) are not in the
    step samples pooled: they stay on top of the pooled backbone, and another stack swaps them as it would have."""
    runs = [_folder(tmp_path, f"run{k}", _grid(k, 0.08, 0.0), cal=BASE) for k in (1, 2)]
    cal, fit = pool_calibrations(runs)
    assert cal.stack == BASE.stack == "batched-graphs"
    stage = calibration.sum_terms(BASE.stack_pricing(BASE.stack).terms)
    for k in calibration.COEFFICIENTS:  # the pooled fit plus the stages (as the preset adds them: 1e-12 relative)
        assert getattr(cal.step_latency, k) == pytest.approx(fit[k] + stage[k], rel=1e-12, abs=1e-18), k
    assert stage["per_seq_s"] > 0 and stage["base_s"] > 0
    other = cal.with_stack("vllm-omni-duplex")
    extra = calibration.sum_terms(BASE.stack_pricing("vllm-omni-duplex").terms)
    assert other.step_latency.per_seq_s == pytest.approx(fit["per_seq_s"] + extra["per_seq_s"], rel=1e-12)
    back = calibration.from_dict(json.loads(cal.to_json()))  # (the loader checks the terms add up)
    assert back.step_latency == cal.step_latency


@pytest.mark.parametrize("change,what", [
    (lambda c: replace(c, engine=replace(c.engine, num_blocks=c.engine.num_blocks // 2)), "engine"),
    (lambda c: replace(c, stream=replace(c.stream, frame_period_s=0.16)), "stream"),
    (lambda c: replace(c, provenance=replace(c.provenance, source=c.provenance.source + " --kv window")),
     "provenance.source"),
])
def test_calibrations_of_another_engine_are_refused(folders, tmp_path, change, what):
    other = _folder(tmp_path, "other", _grid(4, 0.1, 0.0), cal=change(BASE))
    with pytest.raises(MetronomeError, match=rf"another engine .*\({what} differs\)"):
        pool_calibrations([folders["calm"], other])


def test_bad_folders_are_refused(folders, tmp_path):
    with pytest.raises(MetronomeError, match="at least two"):
        pool_calibrations([folders["calm"]])
    with pytest.raises(MetronomeError, match="no calibration.json"):
        pool_calibrations([folders["calm"], tmp_path])
    unfinished = _folder(tmp_path, "unfinished", _grid(5, 0.1, 0.0), done=False)  # no phase ever completed
    with pytest.raises(MetronomeError, match="no completed step samples"):
        pool_calibrations([folders["calm"], unfinished])


def _probe(*args):
    return subprocess.run([sys.executable, "-c", NO_VLLM, *args], capture_output=True, text=True, timeout=120)


def test_cli_writes_a_calibration_the_simulator_loads_without_vllm(folders, tmp_path):
    out = tmp_path / "pooled.json"
    r = _probe("pool", str(folders["calm"]), str(folders["noisy"]), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert f"calibration: {out} (pooled from 2 calibrations" in r.stdout
    assert "step jitter p99 x" in r.stdout and str(folders["noisy"]) in r.stdout
    cal = calibration.load_file(out)
    assert cal.step_latency.jitter and cal.engine == BASE.engine


@pytest.mark.parametrize("args,message", [
    (["{calm}"], "pooling needs at least two calibration folders"),
    (["{calm}", "{missing}"], "no calibration.json"),
    (["{calm}", "{calm2}", "--out", "{nodir}"], "does not exist"),
])
def test_cli_bad_input_is_one_line_exit_2_and_writes_nothing(folders, tmp_path, args, message):
    names = {"calm": folders["calm"], "calm2": folders["calm2"], "missing": tmp_path / "missing",
             "nodir": tmp_path / "nodir" / "x.json"}
    argv = [a.format(**names) for a in args]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "x.json")]
    r = _probe("pool", *argv)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
    assert not list(tmp_path.glob("*.json")) and not list(tmp_path.glob("*.partial"))


def test_cli_overwrites_only_its_own_file_and_only_with_replace(folders, tmp_path):
    out = tmp_path / "pooled.json"
    out.write_text("mine")
    for replace in ([], ["--replace"]):  # a file Metronome did not write is never overwritten
        r = _probe("pool", str(folders["calm"]), str(folders["calm2"]), "--out", str(out), *replace)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "is a file Metronome did not write" in r.stderr
        assert out.read_text() == "mine"
    out = tmp_path / "ours.json"
    r = _probe("pool", str(folders["calm"]), str(folders["calm2"]), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["written_by"]["command"] == "metronome-probe pool"  # how it is known as ours
    r = _probe("pool", str(folders["calm"]), str(folders["calm2"]), "--out", str(out))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "pass --replace" in r.stderr
    r = _probe("pool", str(folders["calm"]), str(folders["calm2"]), "--out", str(out), "--replace")
    assert r.returncode == 0, r.stderr
    assert calibration.load_file(out).engine == BASE.engine
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".json", ".partial")) == ["ours.json",
                                                                                               "pooled.json"]
