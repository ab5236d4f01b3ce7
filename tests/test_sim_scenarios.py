"""The simulator's claims, as scenarios: the cliff is silent, the bound removes it, t_sat is predictable."""

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metronome import calibration, serving
from metronome.errors import MetronomeError
from metronome.kv_policy import KVPolicy
from metronome.workload import Arrivals, Durations
from metronome.sim.scenario import Scenario, run, write
from fixed_engine import fast_moshi

N = 100  # with a 2,000-block pool: t_sat = floor(2000/100)*16 tokens / 12.5 tok/s ≈ 25.7 s


def scenario(cal, policy, n=N, horizon=60.0, **kw):
    return Scenario(cal, policy, Arrivals("all", sessions=n), horizon, **kw)


@pytest.fixture(scope="module")
def cal():
    c = fast_moshi()
    return replace(c, engine=replace(c.engine, num_blocks=2_000))


@pytest.fixture(scope="module")
def cliff(cal):
    return run(scenario(cal, KVPolicy.unbounded(16)))


def test_unbounded_latency_is_flat_until_the_pool_runs_dry(cliff):
    s, steps = cliff.summary, cliff.steps
    t_sat = s["t_sat_observed_s"]
    assert t_sat is not None
    before = steps[steps.t_s < t_sat].step_s
    assert before.max() < 0.25 * s["deadline_s"]  # low
    assert before.max() / before.min() < 1.5  # and nearly flat
    assert steps[steps.t_s < t_sat].free_blocks.min() >= 0
    assert steps[steps.t_s >= t_sat].free_blocks.min() < 16  # dry


def test_the_cliff_is_silent_and_latency_metrics_do_not_show_it(cliff):
    s, frames, sessions = cliff.summary, cliff.frames, cliff.sessions
    t_sat = s["t_sat_observed_s"]
    assert s["collapsed"] is True
    assert s["preemptions"] > 0
    # victims get no tokens: silent frames appear only after saturation ...
    assert frames[frames.tick_s < t_sat].silent.sum() == 0
    after = frames[frames.tick_s >= t_sat + 1.0]
    assert (after.silent / after.frames).mean() > 0.10
    victims = sessions[sessions.silent_frames > 0]
    assert len(victims) >= 0.1 * N and (victims.preemptions > 0).all()
    # ... while every frame still comes back on time: deadline and latency metrics look healthy
    assert s["deadline_miss_fraction"] < 0.01
    assert s["p99_frame_latency_s"] < s["deadline_s"]
    assert after.latency_s.max() < s["deadline_s"]
    # only the silent-frame metric reveals it
    assert s["silent_frame_fraction"] > 0.05


def test_t_sat_prediction_within_five_percent(cal):
    for n in (50, 100, 160):
        s = run(scenario(cal, KVPolicy.unbounded(16), n=n, horizon=120.0)).summary
        pred, obs = s["t_sat_predicted_s"], s["t_sat_observed_s"]
        assert obs is not None and pred is not None
        assert abs(obs - pred) / pred <= 0.05, (n, pred, obs)


@pytest.mark.parametrize("policy", [KVPolicy.sinks(16, 16, 256), KVPolicy.window(16, 256)],
                         ids=["sinks", "window"])
def test_the_bound_never_saturates_and_holds_each_session_within_its_blocks(cal, policy):
    # check_invariants asserts, at every step, blocks per session <= sink + window blocks + 1
    res = run(scenario(cal, policy), fast_forward=False, check_invariants=True)
    s = res.summary
    assert s["t_sat_observed_s"] is None and s["preemptions"] == 0
    assert s["silent_frame_fraction"] == 0.0 and not s["collapsed"]
    per_session = res.steps.resident_blocks.max() / N
    assert per_session <= policy.sink_blocks + policy.window_blocks + 1
    assert (res.steps.resident_blocks + res.steps.free_blocks == cal.engine.num_blocks).all()


def test_bounded_latency_rises_smoothly_with_load(cal):
    big = replace(cal, engine=replace(cal.engine, num_blocks=40_000))
    p50 = []
    for n in (50, 100, 200, 400, 800):
        s = run(scenario(big, KVPolicy.sinks(16, 16, 368), n=n, horizon=40.0)).summary
        assert s["preemptions"] == 0
        p50.append(s["p50_frame_latency_s"])
    assert all(a < b for a, b in zip(p50, p50[1:])), p50
    # and the unbounded engine gives no such warning: flat, then silence
    flat = [run(scenario(cal, KVPolicy.unbounded(16), n=n, horizon=60.0)).summary for n in (100, 200)]
    assert all(f["collapsed"] for f in flat)
    assert all(f["deadline_miss_fraction"] < 0.01 for f in flat)


def test_same_seed_same_results(cal, tmp_path):
    sc = Scenario(cal, KVPolicy.unbounded(16), Arrivals("poisson", rate_per_s=4.0), 90.0,
                  durations=Durations("exponential", 30.0), seed=7)
    a, b = write(run(sc), tmp_path / "a"), write(run(sc), tmp_path / "b")
    sa, sb = (pd.read_json(p / "summary.json", typ="series").drop("wall_s") for p in (a, b))
    assert sa.equals(sb)
    for f in ("steps.parquet", "frames.parquet", "sessions.parquet"):
        assert (a / f).read_bytes() == (b / f).read_bytes()
    other = run(sc.with_seed(8)).summary
    assert other["sessions_offered"] != sa["sessions_offered"] or other["frames"] != sa["frames"]


def _tables_equal(x, y):
    for name in ("steps", "frames", "sessions"):
        pd.testing.assert_frame_equal(getattr(x, name), getattr(y, name), check_exact=True)
    assert {k: v for k, v in x.summary.items() if k != "wall_s"} == {k: v for k, v in y.summary.items() if k != "wall_s"}


@pytest.mark.parametrize("preset,policy,arrivals,durations,horizon", [
    ("moshi-7b-h200", KVPolicy.unbounded(16), Arrivals("all", sessions=120), None, 60.0),
    ("moshi-7b-h200", KVPolicy.unbounded(16), Arrivals("poisson", rate_per_s=5.0), Durations("exponential", 20.0), 60.0),
    ("moshi-7b-h200", KVPolicy.sinks(16, 16, 256), Arrivals("ramp", sessions=90, ramp_s=10.0), Durations("lognormal", 30, 0.5), 60.0),
    ("minicpm-o-4.5-h200", KVPolicy.unbounded(16), Arrivals("all", sessions=40), Durations("list", values_s=(20.0, 90.0)), 120.0),
    ("qwen2.5-omni-7b-h200", KVPolicy.window(16, 512), Arrivals("poisson", rate_per_s=1.0), Durations("exponential", 60.0), 120.0),
    # past N* (122): frames queue behind a slow engine, and sessions depart owing frames whose deadline passed
    ("moshi-7b-h200", KVPolicy.sinks(16, 16, 64), Arrivals("all", sessions=200), Durations("exponential", 15.0), 40.0),
], ids=["moshi-all", "moshi-poisson", "moshi-sinks-ramp", "minicpm-8-out", "qwen25-window", "moshi-past-n-star"])
@pytest.mark.parametrize("phases", ["aligned", "independent"])
def test_fast_forward_reproduces_the_step_by_step_engine_exactly(preset, policy, arrivals, durations, horizon, phases):
    """The compiled loop (sim/fastpath.py) under both phase regimes must give the step-by-step tables bit for
    bit, through arrivals, departures, preemption and the length limit."""
    c = calibration.load(preset)
    c = replace(c, engine=replace(c.engine, num_blocks=1_500))
    sc = Scenario(c, policy, arrivals, horizon, durations=durations, seed=3, phases=phases)
    slow = run(sc, fast_forward=False, check_invariants=True)
    fast = run(sc, fast_forward=True, check_invariants=True)
    _tables_equal(slow, fast)
    assert slow.fast_steps == 0 and fast.fast_steps > 0, "the fast path must have run"
    if durations is not None:  # the compiled loop took departures itself (FrontEnd._end), no controller counting
        assert fast.loop_departures > 0 and slow.loop_departures == 0
    if arrivals.kind != "all":  # sessions arriving during a span: their first frames became requests in the loop
        assert fast.loop_first_frames > 0 and slow.loop_first_frames == 0
        assert fast.loop_arrivals > 0 and fast.loop_admissions > 0  # in either phase regime


# Scenarios that between them make every rule of EngineModel.RULES decide steps, each compared fast against step
# by step; each names the rules it must reach (counted by the step-by-step engine, which takes every step the
# compiled loop hands back). "length_limit" is left to the vLLM differential: the front end rebases a session
# before its frame would pass max_model_len (serving.frame_fits), so no simulated request meets the cap; so is
# "long_prefill": no calibration sets vLLM's long-prefill threshold (tests/live/test_scheduler_differential.py).
RULE_SCENARIOS = {
    # a 64-token budget: 80 sessions' frames in lockstep do not fit one step
    "token-budget": ("moshi-7b-h200", dict(num_blocks=1500, max_num_batched_tokens=64), KVPolicy.sinks(16, 16, 256),
                     Arrivals("all", sessions=80), {"token_budget", "window_free"}, ("aligned",)),
    "max-num-seqs": ("moshi-7b-h200", dict(num_blocks=1500, max_num_seqs=40), KVPolicy.sinks(16, 16, 256),
                     Arrivals("poisson", rate_per_s=5.0), {"max_num_seqs", "window_free"}, ("aligned", "independent")),
    "watermark": ("moshi-7b-h200", dict(num_blocks=600, watermark_blocks=30), KVPolicy.unbounded(16),
                  Arrivals("poisson", rate_per_s=5.0), {"watermark"}, ("aligned", "independent")),
    # readmitted sessions re-prefill their history in 64-token chunks: the chunk fits, the whole sequence not
    "full-sequence-gate": ("moshi-7b-h200", dict(num_blocks=600, max_num_batched_tokens=64), KVPolicy.unbounded(16),
                           Arrivals("poisson", rate_per_s=5.0), {"full_sequence_gate", "token_budget"},
                           ("aligned", "independent")),
    # 8 tokens a frame: a dry pool meets requests in the running pass, which preempts running[-1]
    "preemption": ("minicpm-o-4.5-h200", dict(num_blocks=200), KVPolicy.unbounded(16), Arrivals("all", sessions=40),
                   {"preemption"}, ("aligned", "independent")),
    # sinks over one block (40 tokens) and a window that is not whole blocks (250)
    "sink-shape": ("moshi-7b-h200", dict(num_blocks=800), KVPolicy.sinks(16, 40, 250),
                   Arrivals("poisson", rate_per_s=5.0), {"window_free"}, ("aligned", "independent")),
}


def test_the_rule_scenarios_reach_every_rule():
    from metronome.serving import EngineModel

    covered = set().union(*(want for *_, want, _ in RULE_SCENARIOS.values()))
    assert covered | {"length_limit", "long_prefill"} == set(EngineModel.RULES)
    shape = RULE_SCENARIOS["sink-shape"][2]
    assert shape.sink_tokens > shape.block_size and shape.window_tokens % shape.block_size


@pytest.mark.parametrize("name,phases", [(n, ph) for n, v in RULE_SCENARIOS.items() for ph in v[5]])
def test_fast_and_step_by_step_agree_where_each_rule_decides(name, phases):
    preset, engine, policy, arrivals, want, _ = RULE_SCENARIOS[name]
    c = calibration.load(preset)
    c = replace(c, engine=replace(c.engine, **engine))
    sc = Scenario(c, policy, arrivals, 40.0, durations=Durations("exponential", 20.0), seed=3, phases=phases)
    slow = run(sc, fast_forward=False, check_invariants=True)
    fast = run(sc, fast_forward=True, check_invariants=True)
    _tables_equal(slow, fast)
    reached = {rule for rule, n in slow.rules_reached.items() if n}
    assert want <= reached, f"{name} under {phases} phases reached {sorted(reached)}"
    assert fast.fast_steps > 0, "the compiled loop must have run"
    # the compiled loop counts the rules its steps decide by (the tables above say they are the same steps): it too
    # reaches what the scenario was built to reach
    assert want <= {rule for rule, n in fast.rules_reached.items() if n}, f"{name}: {fast.rules_reached}"
    if "preemption" in want:  # each request the engine preempts is a session the driver's front end preempts
        assert 0 < fast.rules_reached["preemption"] <= fast.steps.preemptions.sum()


@pytest.mark.parametrize("phases", ["aligned", "independent"])
def test_the_compiled_loop_preempts_and_readmits_for_a_front_end_that_steps_vllm(phases):
    """``--loop driver``: a dry pool's victims (those vLLM preempts, and the deadlock rule's) lose their place
    and come back later as a re-prefill of their history, inside the compiled loop, bit for bit as step by
    step. Unbounded Moshi on a 400-block pool, Poisson 3/s, exp(15 s): the pool runs dry within seconds and
    departures keep freeing blocks for readmissions."""
    c = calibration.load("moshi-7b-h200")
    c = replace(c, engine=replace(c.engine, num_blocks=400))
    sc = Scenario(c, KVPolicy.unbounded(16), Arrivals("poisson", rate_per_s=3.0), 60.0,
                  durations=Durations("exponential", 15.0), seed=3, phases=phases)
    slow = run(sc, fast_forward=False, check_invariants=True)
    fast = run(sc, fast_forward=True, check_invariants=True)
    _tables_equal(slow, fast)
    pre = int(slow.steps.preemptions.sum())
    assert pre > 100 and slow.loop_preemptions == 0 and slow.loop_readmissions == 0
    # most in the loop: it hands back only what it does not take (a stall, a rebase, a span without room)
    assert fast.loop_preemptions > pre / 3 and fast.loop_readmissions > pre / 3, (
        pre, fast.loop_preemptions, fast.loop_readmissions)


def test_a_starved_victim_takes_its_own_need_with_it():
    """Worked by hand: the session admitted last (sequence 1) is starved for 5 blocks and none is free; aborting it
    frees its 2 and its need goes with it, so it is the only victim, though 2 < 5."""
    out = np.empty(2, dtype=np.int64)
    n = serving.deadlock_pick(np.array([5, 0]), np.array([1, 0]), np.array([2, 1]), np.int64(0), np.bool_(False), out)
    assert out[:n].tolist() == [0]


def test_the_deadlock_rule_tells_sessions_apart_past_256():
    """300 unbounded sessions on a 3,000-block pool: deadlocks among sessions numbered past 256, whose numbers as
    Python ints are not one object each (the rule once matched a starved session to itself by ``id``, and took
    victims beyond those it needed). The compiled loop decides on its arrays: step by step must agree."""
    c = calibration.load("moshi-7b-h200")
    c = replace(c, engine=replace(c.engine, num_blocks=3000))
    sc = Scenario(c, KVPolicy.unbounded(16), Arrivals("all", sessions=300), 30.0, seed=3, phases="independent")
    slow = run(sc, fast_forward=False, check_invariants=True)
    fast = run(sc, fast_forward=True)
    _tables_equal(slow, fast)
    assert fast.loop_preemptions > 20 and slow.sessions.preemptions[slow.sessions.session > 256].sum() > 0


@pytest.mark.parametrize("phases", ["aligned", "independent"])
def test_under_vllms_own_loop_the_compiled_loop_steps_through_preemptions(phases):
    """A client of vLLM's own loop leaves what vLLM preempts to vLLM (serving.LOOPS): the front end has nothing to
    do after such a step, so the compiled loop takes it and goes on (the engine step re-prefills the victim in
    its own queue), bit for bit as step by step."""
    c = calibration.load("minicpm-o-4.5-h200")
    c = replace(c, engine=replace(c.engine, num_blocks=200))
    sc = Scenario(c, KVPolicy.unbounded(16), Arrivals("poisson", rate_per_s=5.0), 40.0,
                  durations=Durations("exponential", 20.0), seed=3, phases=phases, loop="vllm")
    slow = run(sc, fast_forward=False, check_invariants=True)
    fast = run(sc, fast_forward=True, check_invariants=True)
    _tables_equal(slow, fast)
    # 8 tokens a frame on 200 blocks: the engine preempts, in both runs; the front end, a client of vLLM's loop,
    # takes none of those: its own victims are only a stalled step's (one that scheduled nothing)
    for res in (slow, fast):
        assert res.rules_reached["preemption"] > 0, res.rules_reached
        st = res.steps
        assert st.preemptions[st.batch > 0].sum() == 0 and st.preemptions.sum() > 0
    assert fast.fast_steps > 0.5 * fast.summary["steps"], (fast.fast_steps, fast.summary["steps"])


JITTER = ((0.0, 0.8), (0.5, 1.0), (0.99, 1.7), (1.0, 2.5))


# a measured calibration's jitter: slow spells (a shared AR(1) over frames) and a frame-only part
SPELLS = dict(jitter_shared=0.6, jitter_tau_s=0.5, jitter_frame=0.15)


@pytest.mark.parametrize("admission,kv,jitter,maxlen", [
    ("aimd", "sinks", False, None),
    ("gradient", "sinks", True, None),
    ("static:40", "unbounded", True, None),
    ("none", "sinks", False, 400),  # sessions reach max_model_len (32 s) and are rebased
    ("aimd", "unbounded", False, None),  # the pool runs dry: preemption and readmission
    ("aimd", "sinks", "spells", None),
    ("static:40", "unbounded", "spells", None),
], ids=["aimd", "gradient-jitter", "static-jitter", "rebase", "aimd-unbounded", "aimd-spells", "static-spells"])
def test_the_compiled_loop_reproduces_the_step_by_step_engine_under_independent_phases(admission, kv, jitter, maxlen):
    from metronome.sim.scenario import make_scenario

    c = calibration.load("moshi-7b-h200")
    c = replace(c, engine=replace(c.engine, num_blocks=900))
    if jitter:
        c = replace(c, step_latency=replace(c.step_latency, jitter=JITTER, frame_first_s=0.002,
                                            **(SPELLS if jitter == "spells" else {})))
    if maxlen:
        c = replace(c, model=replace(c.model, max_model_len_tokens=maxlen))
    sc = make_scenario(c, kv=kv, sinks=16 if kv == "sinks" else None, window=240 if kv == "sinks" else None,
                       arrival_rate=2.0, session_duration="exp:40", horizon=90.0, seed=5, deadline=0.04,
                       admission=admission, phases="independent")
    slow = run(sc, fast_forward=False, check_invariants=True)
    fast = run(sc, fast_forward=True, check_invariants=True)
    _tables_equal(slow, fast)
    if admission != "none":  # the controller is told the sessions in flight at each row, departures and all
        assert slow.controller_trace == fast.controller_trace
    assert fast.loop_departures > 0 and fast.loop_first_frames > 0
    # arrivals pass the gate inside the loop (the controller compiled: control_kernel), and are admitted there
    assert fast.loop_arrivals > 0 and fast.loop_admissions > 0 and slow.loop_arrivals == 0
    if admission != "none":
        assert fast.loop_refused > 0
    assert fast.fast_steps > 0.5 * fast.summary["steps"], "the compiled loop must have taken most steps"
    s = fast.summary
    if maxlen:
        assert s["rebases"] > 0
    if kv == "unbounded":
        assert s["preemptions"] > 0


def test_phases_are_seeded_and_change_the_batches_but_not_the_fill(cal):
    """Independent phases: the same seed gives the same phases; the pool fills as in the lockstep (t_sat within
    one frame period's worth of growth, 2%), while steps batch fewer frames and frame latency drops."""
    pol = KVPolicy.unbounded(16)
    a = run(scenario(cal, pol, phases="aligned"))
    i1 = run(scenario(cal, pol, phases="independent"))
    i2 = run(scenario(cal, pol, phases="independent"))
    _tables_equal(i1, i2)
    ta, ti = a.summary["t_sat_observed_s"], i1.summary["t_sat_observed_s"]
    assert abs(ti - ta) / ta < 0.02, (ta, ti)
    before = lambda r: r.steps[r.steps.t_s < 0.8 * ta]  # noqa: E731
    assert before(i1).batch.mean() < 0.5 * before(a).batch.mean()  # a step meets the frames that arrived, not all N
    assert i1.summary["p50_frame_latency_s"] < a.summary["p50_frame_latency_s"]
    P = cal.stream.frame_period_s
    phase = i1.frames.tick_s.to_numpy() - i1.frames.frame.to_numpy() * P
    assert np.unique(np.round(phase, 9)).size > 16 and (phase >= 0).all() and (phase < P).all()  # many phases
    assert (a.frames.tick_s.to_numpy() == a.frames.frame.to_numpy() * P).all()  # one clock


def test_a_client_of_vllms_own_loop_breaks_deadlocks_only_at_a_stall(cal):
    """serving.LOOPS. The driver sees each starved session after a step and aborts the newest at once, while
    others still run; a client of vLLM's own loop sees only steps that schedule nothing, and leaves the
    requests vLLM preempts in vLLM's queue. Same pool arithmetic: the pool runs dry at the same frame."""
    pol = KVPolicy.unbounded(16)
    drv = run(scenario(cal, pol, loop="driver"))
    cli = run(scenario(cal, pol, loop="vllm"))
    pre_d, pre_c = (r.steps[r.steps.preemptions > 0] for r in (drv, cli))
    assert (pre_d.batch > 0).any(), "the driver preempts starved sessions while others run"
    assert len(pre_c) > 0 and (pre_c.batch == 0).all(), "the client aborts only after a step that ran nothing"
    P = cal.stream.frame_period_s
    assert abs(cli.summary["t_sat_observed_s"] - drv.summary["t_sat_observed_s"]) < P  # the same frame ran dry
    slow = run(scenario(cal, pol, loop="vllm"), fast_forward=False, check_invariants=True)
    _tables_equal(slow, cli)
    with pytest.raises(Exception, match="--loop must be one of"):
        scenario(cal, pol, loop="async")


def test_sessions_at_max_model_len_are_rebased_under_the_bound_and_capped_without_it(cal):
    short = replace(cal, model=replace(cal.model, max_model_len_tokens=600))
    b = run(scenario(short, KVPolicy.sinks(16, 16, 256), n=20, horizon=120.0), check_invariants=True).summary
    assert b["rebases"] >= 20 and b["length_capped"] == 0 and b["silent_frame_fraction"] == 0
    u = run(scenario(short, KVPolicy.unbounded(16), n=20, horizon=120.0)).summary
    assert u["length_capped"] == 20 and u["rebases"] == 0


def test_rebase_prefill_is_counted_in_that_steps_latency(cal):
    short = replace(cal, model=replace(cal.model, max_model_len_tokens=600))
    # in lockstep the 20 sessions reach the limit on the same frame: one step carries all their re-prefills
    res = run(scenario(short, KVPolicy.sinks(16, 16, 256), n=20, horizon=60.0, phases="aligned"), fast_forward=False)
    rebase_steps = res.steps[res.steps.new_tokens > 20 * 2]
    assert len(rebase_steps) >= 1
    assert rebase_steps.new_tokens.max() >= 20 * (16 + 256)
    assert rebase_steps.step_s.max() > res.steps.step_s.median()


def test_preempted_sessions_recompute_their_whole_history(cal):
    # sessions leave, freeing blocks; a victim waiting at the head is readmitted and re-prefills everything
    sc = Scenario(cal, KVPolicy.unbounded(16), Arrivals("all", sessions=120), 120.0,
                  durations=Durations("list", values_s=(40.0, 1000.0)), seed=1)
    res = run(sc, fast_forward=False, check_invariants=True)
    s = res.summary
    assert s["preemptions"] > 0
    readmitted = res.sessions[(res.sessions.preemptions > 0) & (res.sessions.tokens > 0)]
    assert len(readmitted) > 0
    recompute = res.steps[res.steps.new_tokens > res.steps.batch * 2]
    # a history of tens of seconds: hundreds of tokens in one step, the latency wall
    assert recompute.new_tokens.max() > 300
    assert recompute.step_s.max() > 1.2 * res.steps.step_s.median()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 60), blocks=st.integers(30, 800), kind=st.sampled_from(["unbounded", "window", "sinks"]),
       rate=st.floats(0.2, 5.0), mean=st.floats(2.0, 40.0), seed=st.integers(0, 1000))
def test_pool_accounting_holds_in_any_scenario(n, blocks, kind, rate, mean, seed):
    c = calibration.load("moshi-7b-h200")
    c = replace(c, engine=replace(c.engine, num_blocks=blocks))
    pol = {"unbounded": KVPolicy.unbounded(16), "window": KVPolicy.window(16, 64),
           "sinks": KVPolicy.sinks(16, 8, 64)}[kind]
    sc = Scenario(c, pol, Arrivals("poisson", rate_per_s=rate), 30.0, durations=Durations("exponential", mean), seed=seed)
    res = run(sc, fast_forward=False, check_invariants=True)  # asserts used == Σ held, 0 <= used <= pool each step
    st_ = res.steps
    assert (st_.free_blocks >= 0).all() and (st_.resident_blocks >= 0).all()
    assert (st_.free_blocks + st_.resident_blocks == blocks).all()
    f = res.frames
    assert (f.silent <= f.frames).all() and (f.late <= f.frames).all()
    assert res.summary["frames"] == int(res.sessions.frames.sum())


def test_the_victim_is_the_most_recently_admitted_session(cal):
    # vLLM v1 preempts running[-1]: the sessions that lose their place are the last ones let in
    sc = Scenario(cal, KVPolicy.unbounded(16), Arrivals("ramp", sessions=100, ramp_s=8.0), 34.0)
    res = run(sc, fast_forward=False, check_invariants=True)
    assert res.summary["preemptions"] > 0
    order = res.sessions.sort_values("admitted_s").preemptions.to_numpy() > 0
    first_victim = int(np.argmax(order))
    assert order[first_victim:].all() and not order[:first_victim].any(), order.astype(int)


@pytest.mark.parametrize("phases", ["independent", "aligned"])
def test_sessions_that_leave_while_waiting_for_blocks_leave_inside_the_loop(phases):
    """A pool that holds about 10 bounded sessions against 40 offered: arrivals queue at the front end for blocks,
    are admitted as others leave, and some hang up still waiting; the compiled loop takes all of it as the
    step-by-step front end does (in lockstep the waiting sessions' silent frames wait for their tick's running
    frames, those of sessions admitted in the loop among them)."""
    c = calibration.load("moshi-7b-h200")
    c = replace(c, engine=replace(c.engine, num_blocks=120))
    from metronome.sim.scenario import make_scenario

    sc = make_scenario(c, kv="sinks", sinks=16, window=240, arrival_rate=2.0, session_duration="exp:20",
                       horizon=60.0, seed=5, deadline=0.04, phases=phases)
    slow = run(sc, fast_forward=False, check_invariants=True)
    fast = run(sc, fast_forward=True, check_invariants=True)
    _tables_equal(slow, fast)
    s = fast.sessions
    assert ((s.end_reason == "departed") & s.admitted_s.isna()).sum() > 10  # hung up while waiting
    assert fast.loop_arrivals > 100 and fast.loop_admissions > 20 and fast.loop_departures > 20


def test_a_controller_deciding_in_python_is_fed_after_each_span(monkeypatch):
    """A registered controller that decides in Python cannot run inside the compiled loop: the loop stops at each
    arrival and hands it the frame rows after each call, with the same trace as step by step."""
    from metronome import admission as adm
    from metronome.sim.scenario import make_scenario

    class Halver(adm.AdmissionController):
        name = spec = "halver"

        def __init__(self, **kw):
            super().__init__(**kw)
            self.n = 40

        @classmethod
        def from_spec(cls, arg, deadline_s, params):
            return cls()

        @property
        def limit(self):
            return self.n

        def _decide(self, in_flight, p_latency_s, frames, silent):
            if p_latency_s is not None and p_latency_s > 0.015 and self.n > 4:
                self.n //= 2
                return "decrease"
            self.n += 1
            return "increase"

    monkeypatch.setattr(adm, "CONTROLLERS", dict(adm.CONTROLLERS))
    adm.register(Halver)
    c = calibration.load("moshi-7b-h200")
    c = replace(c, engine=replace(c.engine, num_blocks=900))
    sc = make_scenario(c, kv="sinks", sinks=16, window=240, arrival_rate=2.0, session_duration="exp:40",
                       horizon=60.0, seed=5, deadline=0.04, admission="halver", phases="independent")
    slow = run(sc, fast_forward=False, check_invariants=True)
    fast = run(sc, fast_forward=True, check_invariants=True)
    _tables_equal(slow, fast)
    assert slow.controller_trace == fast.controller_trace
    assert {r["decision"] for r in fast.controller_trace} == {"increase", "decrease"}
    assert fast.loop_arrivals == 0 and fast.fast_steps > 0.5 * fast.summary["steps"]
    assert fast.summary["sessions_refused"] > 0


@pytest.mark.parametrize("phases", ["independent", "aligned"])
def test_frames_due_together_for_a_session_without_a_place_are_each_ticked(monkeypatch, phases):
    """Past the cliff an engine step outlasts several frame periods, so a waiting or re-prefilling session has
    several frames come due at one turn. Each turn's frames due are checked against the frame clock counted here,
    frame by frame: each session's clock moves past every tick up to now; a running session queues the frames from
    its place on, and every other frame is owed silent, its input joining what the session owes the engine. In
    lockstep those answers wait for their tick's running frames, and leave the rows owed only by being
    answered."""
    from metronome.front_end import RUNNING, WAITING
    from metronome.sim.engine import SimEngine

    names = ("state", "next_frame", "backlog", "pending_in", "running_since")
    real = SimEngine._tick_due
    seen = {"calls": 0, "frames": 0, "quiet": 0}

    def owed(eng):  # frames owed and not yet answered, and those answered at the current moment
        return len(eng.silent_pending) + eng.n_answers

    def checked(eng, now, live):
        before = {k: getattr(eng, k).copy() for k in names}
        n_owed = owed(eng)
        real(eng, now, live)
        quiet = 0
        for i in np.flatnonzero((before["state"] >= WAITING) & (before["state"] <= RUNNING)).tolist():
            P, ph, f = float(eng.P_of[i]), float(eng.phase[i]), int(before["next_frame"][i])
            due = []
            while f * P + ph <= now + 1e-12:
                due.append(f)
                f += 1
            queued = [g for g in due if before["state"][i] == RUNNING
                      and g * P + ph >= before["running_since"][i] - 1e-12]
            assert eng.next_frame[i] == f, (i, eng.next_frame[i], f)
            assert eng.backlog[i] - before["backlog"][i] == len(queued), i
            silent = len(due) - len(queued)
            assert eng.pending_in[i] - before["pending_in"][i] == silent * eng.n_in_of[i], i
            quiet += silent
            if len(due) > 1:  # several at once
                seen["calls"] += 1
                seen["frames"] += len(due)
        assert owed(eng) - n_owed == quiet
        seen["quiet"] += quiet

    answer_silent = SimEngine._answer_silent

    def kept(eng, now):  # frames owed in lockstep leave the list only by being answered
        owed0, answered0 = len(eng.silent_pending), int(eng.s_frames.sum())
        answer_silent(eng, now)
        answered = int(eng.s_frames.sum()) - answered0
        assert owed0 - len(eng.silent_pending) == answered, (owed0, len(eng.silent_pending), answered)
        seen["answered_later"] += answered

    seen["answered_later"] = 0
    monkeypatch.setattr(SimEngine, "_tick_due", checked)
    monkeypatch.setattr(SimEngine, "_answer_silent", kept)
    c = calibration.load("moshi-7b-h200")  # past N* (122): steps outlast frames; a small pool runs dry early
    c = replace(c, engine=replace(c.engine, num_blocks=3_000))
    sc = Scenario(c, KVPolicy.unbounded(16), Arrivals("ramp", sessions=300, ramp_s=1.0), 30.0, phases=phases)
    res = run(sc, fast_forward=False)
    assert res.summary["preemptions"] > 0
    # sessions had several frames due at once, and some frames went unheard (answers owed)
    assert seen["calls"] > 0 and seen["quiet"] > 0, seen
    assert (seen["answered_later"] > 0) == (phases == "aligned"), seen  # (only lockstep owes them for later)


class _PeakComputed(serving.EngineModel):
    """The engine model, noting the most tokens any request has had computed after a step."""

    peak = 0

    def step(self):
        rec = super().step()
        _PeakComputed.peak = max(_PeakComputed.peak, int(self.computed_a.max()))
        return rec


def test_a_bound_whose_rebase_cannot_hold_a_frame_is_refused():
    """The front end rebases a frame that would reach max_model_len (256 here) before the engine sees it. A sinks
    policy keeping S + W = 16 + 236 = 252 tokens, with 4 tokens in and 8 out a frame, cannot hold one frame after a
    rebase (252 + 1 re-fed + 4 + 8 = 265 >= 256): vLLM would stop the request part-way through every such frame.
    It is refused before the run, naming the most that fits, 256 - 1 - 13 = 242 tokens. With W = 200 (216 kept,
    216 + 13 < 256) the run goes on, rebases, and no request ever has max_model_len tokens computed."""
    c = fast_moshi()
    c = replace(c, model=replace(c.model, max_model_len_tokens=256), stream=calibration.TokenStream(0.1, 4, 8, 0))
    with pytest.raises(MetronomeError, match="keeps 252 tokens.*keep at most 242 tokens"):
        run(Scenario(c, KVPolicy.sinks(16, 16, 236), Arrivals("all", sessions=2), 6.0, seed=1), fast_forward=False)
    _PeakComputed.peak = 0
    sc = Scenario(c, KVPolicy.sinks(16, 16, 200), Arrivals("all", sessions=2), 6.0, seed=1)
    res = run(sc, fast_forward=False, check_invariants=True, engine_model=_PeakComputed)
    assert res.summary["rebases"] > 0
    assert res.rules_reached["length_limit"] == 0, res.rules_reached  # the front end's rebase came first
    assert 200 < _PeakComputed.peak < 256



def test_frames_owed_behind_an_engine_slower_than_the_clock_stay_in_the_loop():
    """Lockstep, an engine ten times slower than the preset (so behind the frame clock) and 100 sessions in a pool
    that holds a few of their windows: steps preempt, and every tick owes each preempted session a silent frame
    until the tick's running frames are done. Those owed frames pile up for as long as the engine stays behind
    (thousands here; a preempted session's own frames come out of frame order). The compiled loop takes those steps
    as the step-by-step path does, bit for bit, and nearly all of them (it keeps the owed frames in frame order and
    reads only those due); it used to hand them back once more than four per session were owed."""
    c = calibration.load("moshi-7b-h200")
    c = replace(c, engine=replace(c.engine, num_blocks=400), step_latency=c.step_latency.scaled(10.0))
    sc = Scenario(c, KVPolicy.sinks(16, 64, 2048), Arrivals("all", sessions=100), 40.0, seed=3, phases="aligned")
    slow = run(sc, fast_forward=False, check_invariants=True)
    fast = run(sc, fast_forward=True, check_invariants=True)
    _tables_equal(slow, fast)
    steps = len(fast.steps)
    assert steps > 100 and fast.steps.preemptions.sum() > 0 and fast.frames.silent.sum() > 4 * 100
    late = fast.frames.done_s - fast.frames.tick_s
    assert late.max() > 40 * c.stream.frame_period_s  # (the engine fell that far behind the clock)
    assert fast.fast_steps >= 0.95 * steps, (fast.fast_steps, steps)


@pytest.mark.parametrize("fast", [False, True], ids=["step-by-step", "compiled"])
def test_what_follows_a_step_is_recorded_with_it_in_its_order(fast):
    """What follows a step, in front_rules.after_step's order: its tokens, its preemptions, the lockstep silence
    they release, then the records. 150 sessions in lockstep on a 300-block pool outgrow it and are preempted;
    each of their silent frames is answered once its tick's running frames are done, by the step that finishes
    them: every frame answered as a step ends is in that step's row (frames and silent frames: recorded after the
    silence), and the run's peak of blocks used is the most any step's row holds (taken with the step's tokens,
    before its preemptions)."""
    c = calibration.load("moshi-7b-h200")
    c = replace(c, engine=replace(c.engine, num_blocks=300))
    sc = Scenario(c, KVPolicy.sinks(16, 16, 256), Arrivals("all", sessions=150), 10.0, seed=3, phases="aligned")
    res = run(sc, fast_forward=fast)
    st, fr = res.steps, res.frames
    at_end = fr.groupby("done_s")[["frames", "silent"]].sum().reindex(st.t_s + st.step_s).fillna(0)
    assert res.summary["silent_preempted_fraction"] > 0.2  # (the run has the silent frames this is about)
    assert st.frames_done.tolist() == at_end.frames.astype(int).tolist()
    assert st.silent_frames.tolist() == at_end.silent.astype(int).tolist()
    assert res.summary["peak_used_blocks"] == st.resident_blocks.max() == 300
