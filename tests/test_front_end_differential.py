"""The front end, twice: the live driver (:class:`metronome.probe.driver.Driver`) against the simulator's
(:class:`metronome.sim.engine.SimEngine`), step by step, on the same engine model.

Both front ends claim the same serving rules (frame clock, admission gate and FCFS queue, first frame, silence,
preemption by recompute and the deadlock rule, readmission with the history, rebase or finish at the length
limit). Here the driver runs on virtual time over ``tests/fake_engine.py``, whose every scheduling decision is
:class:`metronome.serving.EngineModel`'s (the model proven against vLLM's own ``Scheduler``), and whose step takes
what the simulator's step model says of that very step; the simulator runs the same workload (arrivals, durations,
phase slots, drawn by the same functions) on the same calibration, step by step and through its compiled loop.
What each records must then be the same: every step (its start, batch, new and context tokens, preemptions), every
frame (its tick, when it was answered, its tokens, silent or late) and every session (admitted when, preempted and
rebased how often, ended when and why).

What is left out, and why: the step model's first-step term and jitter (the driver measures a real engine's time,
it does not model it: here the fake's step time stands for it, the simulator's model without those two terms), and
the last ``2·P`` before the horizon (SimPy stops the simulation mid-step at the horizon, the driver finishes the step
it is in; what is recorded about that step and the frames it answers differs by construction).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from fake_engine import FakeEngine, rebased_readmissions, token_id_errors
from fixed_engine import fast_moshi

from metronome import serving
from metronome.calibration import TokenStream
from metronome.errors import MetronomeError
from metronome.probe.driver import Driver, DriverConfig, SessionPlan
from metronome.sim import scenario as sc_mod
from metronome.workload import draw_phases

BS = 16
TIME_TOL = 1e-9  # both sides sum the same step times, in the same order; the driver subtracts its start (0.0)


def calibration(*, period, n_in, n_out, prompt, blocks, maxlen, budget, seqs, watermark, slow):
    """A small engine: the fixed Moshi step model scaled by ``slow`` (so a few sessions reach the deadline), its
    pool, limits and stream as given, and no first-step term or jitter (see the module's docstring)."""
    c = fast_moshi()
    sl = c.step_latency
    step = replace(sl, base_s=sl.base_s * slow, per_seq_s=sl.per_seq_s * slow,
                   per_context_token_s=sl.per_context_token_s * slow * 64,
                   per_new_token_s=sl.per_new_token_s * slow * 64, frame_first_s=0.0, jitter=(), plugin_terms=())
    eng = replace(c.engine, block_size_tokens=BS, num_blocks=blocks + 1, reserved_blocks=1,
                  max_num_batched_tokens=budget, max_num_seqs=seqs, watermark_blocks=watermark)
    return replace(c, name="differential", model=replace(c.model, max_model_len_tokens=maxlen),
                   stream=TokenStream(period, n_in, n_out, prompt), engine=eng, step_latency=step)


def simulate(sc, fast_forward: bool):
    return sc_mod.run(sc, fast_forward=fast_forward, check_invariants=not fast_forward)


def drive(sc):
    """The driver on the fake engine, over the scenario's own workload."""
    cal, policy = sc.calibration, sc.policy
    arrival, duration = sc_mod.workload(sc)
    slots = draw_phases(arrival.size, sc.phases, sc.seed)
    lat = cal.step_latency_for(policy)
    eng = FakeEngine(num_blocks=cal.engine.usable_blocks + 1, block_size=BS,
                     max_model_len=cal.model.max_model_len_tokens, policy=policy,
                     max_num_batched_tokens=cal.engine.max_num_batched_tokens, max_num_seqs=cal.engine.max_num_seqs,
                     watermark_blocks=cal.engine.watermark_blocks, sleep_min_s=0.0, own_loop=sc.loop == "vllm",
                     latency=lambda rec: lat.step_s(int(rec.slots.size), rec.context_tokens, rec.new_tokens))
    roster = sc_mod.roster(sc, arrival, duration)  # (each session's stream and clock, when the scenario mixes them)
    own, clocks = roster.input_tokens is not None, roster.period_s is not None
    plans = [SessionPlan(str(i), float(arrival[i]), float(duration[i]), max(cal.stream.prompt_tokens, 1),
                         int(slots[i]), input_tokens=int(roster.input_tokens[i]) if own else None,
                         output_tokens=int(roster.output_tokens[i]) if own else None,
                         period_s=float(roster.period_s[i]) if clocks else None,
                         deadline_s=float(roster.deadline_s[i]) if clocks else None) for i in range(arrival.size)]
    cfg = DriverConfig(stream=cal.stream, horizon_s=sc.horizon_s, deadline_s=sc.deadline, policy=policy,
                       phases=sc.phases)
    admission = sc.admission() if callable(sc.admission) else None
    kw = {"admission": admission} if admission is not None else {}
    res = Driver(eng, cfg, clock=eng.clock, sleep=eng.sleep, **kw).run(plans)
    # the ids it handed the engine, as vLLM holds them (the counts are what the comparison below checks)
    errors, res.token_checks = token_id_errors(eng, policy.sink_tokens, rebased_readmissions(res.events))
    assert not errors, errors[:3]
    return res


def _t(x):
    return np.round(np.asarray(x, dtype=float), 7)


def sim_steps(res, until):
    s = res.steps
    s = s[s.t_s + s.step_s < until]
    return pd.DataFrame({"t_s": _t(s.t_s), "batch": s.batch.values, "new_tokens": s.new_tokens.values,
                         "context_tokens": s.context_tokens.values, "preemptions": s.preemptions.values})


def live_steps(res, until):
    s = pd.DataFrame(res.steps)
    s = s[s.t_end_s < until]
    return pd.DataFrame({"t_s": _t(s.t_s), "batch": s.batch.values, "new_tokens": s.new_tokens.values,
                         "context_tokens": s.context_tokens.values, "preemptions": s.preemptions.values})


SILENT_CAUSES = ("silent_preempted", "silent_waiting", "silent_departed")  # what each silent frame is (results)


def sim_frames(res, until):
    f = res.frames
    f = f[f.tick_s + f.latency_s < until]
    g = pd.DataFrame({"tick_s": _t(f.tick_s), "done_s": _t(f.tick_s + f.latency_s), "frames": f.frames.values,
                      "silent": f.silent.values, **{c: f[c].values for c in SILENT_CAUSES}, "late": f.late.values,
                      "tokens": f.tokens.values})
    return g.groupby(["tick_s", "done_s"], as_index=False).sum().sort_values(["tick_s", "done_s"], ignore_index=True)


def live_frames(res, until, deadline):
    f = pd.DataFrame(res.frames)
    f = f[~f.censored]
    done = f.tick_s + f.latency_s.astype(float)  # (a frame its session left before it was done: done_s null)
    f, done = f[done < until], done[done < until]
    g = pd.DataFrame({"tick_s": _t(f.tick_s), "done_s": _t(done), "frames": 1,
                      "silent": f.silent.astype(int).values, **{c: f[c].astype(int).values for c in SILENT_CAUSES},
                      "late": (~f.met_deadline).astype(int).values, "tokens": f.tokens_delivered.values})
    return g.groupby(["tick_s", "done_s"], as_index=False).sum().sort_values(["tick_s", "done_s"], ignore_index=True)


def sim_sessions(res, until):
    s = res.sessions
    s = s[(s.arrival_s < until) & (s.end_reason != "")]  # (not offered: it came during the step past the horizon)
    return pd.DataFrame({"session": s.session.astype(str), "admitted": s.admitted_s.notna(), "end_s": _t(s.ended_s),
                         "reason": s.end_reason.astype(str), "frames": s.frames, "silent_frames": s.silent_frames,
                         "preemptions": s.preemptions, "rebases": s.rebases})


def live_sessions(res, until):
    s = pd.DataFrame(res.sessions)
    s = s[s.arrival_s < until].copy()
    for c in ("frames", "silent_frames", "preemptions", "rebases"):  # (a refused session's row has none)
        s[c] = s[c].fillna(0).astype(int) if c in s else 0
    return pd.DataFrame({"session": s.session.astype(str), "admitted": s.admitted.astype(bool),
                         "end_s": _t(s.end_s), "reason": s.reason.astype(str), "frames": s.frames,
                         "silent_frames": s.silent_frames,
                         "preemptions": s.preemptions, "rebases": s.rebases})


def compare(sc):
    """Drive the scenario and simulate it step by step and through the compiled loop; assert that the three
    agree on every step, frame and session up to ``2·P`` before the horizon. Returns (the driver's result, the
    step-by-step simulation's)."""
    until = sc.horizon_s - 2 * sc.calibration.stream.frame_period_s
    live = drive(sc)
    ls, lf = live_steps(live, until), live_frames(live, until, sc.deadline)
    lss = live_sessions(live, until).sort_values("session", ignore_index=True)
    out = None
    for ff in (False, True):
        sim = simulate(sc, ff)
        what = f"{sc.phases}, {sc.loop} loop, fast_forward={ff}"
        pd.testing.assert_frame_equal(sim_steps(sim, until).reset_index(drop=True), ls.reset_index(drop=True),
                                      check_dtype=False, obj=f"steps ({what})")
        pd.testing.assert_frame_equal(sim_frames(sim, until), lf, check_dtype=False, obj=f"frames ({what})")
        ss = sim_sessions(sim, until).sort_values("session", ignore_index=True)
        assert ss.session.tolist() == lss.session.tolist()
        assert ss.admitted.tolist() == lss.admitted.tolist(), f"sessions admitted ({what})"
        # sessions that ended before the cut: how and when, and what befell them on the way
        gone = (ss.end_s < until).values & (ss.reason != "horizon").values
        pd.testing.assert_frame_equal(ss[gone].reset_index(drop=True), lss[gone].reset_index(drop=True),
                                      check_dtype=False, obj=f"sessions ended before the cut ({what})")
        out = out or sim
    return live, out


def random_scenario(k: int):
    """Scenario ``k`` of the random family: every knob the front ends read, drawn so that between them the
    scenarios reach preemption, readmission, the deadlock rule, the length limit, the token budget,
    ``max_num_seqs``, the watermark, overload, departures and the admission controller. Every third scenario is
    drawn under pressure (:data:`PRESSURE`): a pool a few sessions run dry, so that the rules of a dry pool
    (preemption, the deadlock rule, readmission, the full-sequence gate, the watermark) decide in many scenarios,
    not a handful."""
    r = np.random.default_rng([k, 26])
    period = float(r.choice([0.08, 0.1, 0.2]))
    n_in, n_out, prompt = int(r.integers(1, 20)), int(r.integers(1, 8)), int(r.integers(0, 40))
    kv = str(r.choice(["unbounded", "sinks", "window"]))
    params = {}
    if kv == "sinks":
        params = {"sinks": int(r.integers(1, 40)), "window": int(r.integers(16, 100))}
    elif kv == "window":
        params = {"window": int(r.integers(16, 100))}
    engine = dict(blocks=int(r.integers(12, 80)), maxlen=int(r.choice([160, 256, 512, 4096])),
                  budget=int(r.choice([16, 32, 64, 128, 512])), seqs=int(r.choice([3, 6, 64])),
                  watermark=int(r.choice([0, 0, 1, 3])), slow=float(r.choice([0.3, 1.0, 3.0, 10.0])))
    arrivals = r.integers(3)
    work = ({"sessions": int(r.integers(1, 10))} if arrivals == 0 else
            {"sessions": int(r.integers(1, 10)), "session_duration": f"exp:{r.uniform(0.5, 4):.2f}"} if arrivals == 1
            else {"arrival_rate": float(r.uniform(1, 6)), "session_duration": f"exp:{r.uniform(0.5, 4):.2f}"})
    admission = str(r.choice(["none", "none", "static:3", "aimd", "aimd", "gradient"]))
    # half the AIMD ones hold a refused session in the gate's queue (until it times out) instead of refusing it
    queue = admission == "aimd" and r.random() < 0.5
    aimd = {"on_refuse": "queue", "queue_timeout_s": float(r.uniform(0.2, 2.0)), "interval_s": 0.5} if queue else None
    horizon, phases, loop = float(r.uniform(2, 5)), str(r.choice(serving.PHASES)), str(r.choice(serving.LOOPS))
    deadline = float(period * r.choice([0.5, 1.0]))
    if k % 3 == 0:
        p = np.random.default_rng([k, 45])
        engine.update(blocks=int(p.integers(*PRESSURE["blocks"])), budget=int(p.choice(PRESSURE["budget"])),
                      watermark=int(p.choice(PRESSURE["watermark"])))
        n_in, n_out = int(p.integers(*PRESSURE["n_in"])), int(p.integers(*PRESSURE["n_out"]))
        work = {"sessions": int(p.integers(*PRESSURE["sessions"])), "session_duration": f"exp:{p.uniform(1, 4):.2f}"}
        if kv != "unbounded" and p.random() < 0.5:
            kv, params = "unbounded", {}
        if p.random() < 0.5:  # a front end that steps vLLM itself takes the engine's own preemptions
            loop = "driver"
    cal = calibration(period=period, n_in=n_in, n_out=n_out, prompt=prompt, **engine)
    return sc_mod.make_scenario(
        calibration=cal, kv=kv, horizon=horizon, seed=k, phases=phases, loop=loop, deadline=deadline,
        admission=admission, aimd_params=aimd, **work, **params)


# the pressured third of the family (random_scenario): a small pool, several sessions with several tokens a frame
PRESSURE = {"blocks": (10, 26), "budget": (16, 16, 32, 64, 128), "watermark": (0, 1, 2), "n_in": (1, 8),
            "n_out": (4, 9), "sessions": (5, 13)}


def random_scenarios(n: int):
    """The first ``n`` scenarios of the random family, as (k, scenario)."""
    k = found = 0
    while found < n:
        k += 1
        try:
            sc = random_scenario(k)
        except MetronomeError:  # a pool too small for one session's first frame: not a scenario
            continue
        found += 1
        yield k, sc


N_SCENARIOS = 240
# what the random family must reach between its scenarios, each in at least REACH of them (counted by scenario): a
# rule that decides in a handful of scenarios is a rule whose change the comparison may never meet; in ten or more,
# each with its own pool, stream, policy and loop, a change that alters what it decides shows in one of them. The
# pressured third (PRESSURE) is what gets the rules of a dry pool there.
MUST_REACH = ("preempt:engine", "preempt:pool_dry", "preempt:stall", "readmit", "rebase", "end:departed",
              "end:refused", "end:length", "rule:preemption", "rule:window_free", "rule:token_budget",
              "rule:max_num_seqs", "rule:full_sequence_gate", "rule:watermark", "frames:silent", "frames:late",
              *(f"frames:{c}" for c in SILENT_CAUSES),
              "kv:unbounded", "kv:sinks", "kv:window", "admission:aimd", "admission:static", "admission:gradient",
              "gate:queue", "end:queue_timeout")
REACH = 10
# ... but for these, which only a dry pool under a small budget (the gate) or a front end stepping vLLM itself when
# the engine preempts mid-frame reaches (both worked by hand in tests/test_engine_rules.py and
# tests/test_driver_rules.py as well)
RARE = {"rule:full_sequence_gate": 6, "preempt:engine": 8}
ID_CHECKS = 100  # frames whose token ids were checked, per kind (refeed, readmit, rebase)


def reached(sc, live, sim) -> set[str]:
    """What scenario ``sc`` made the two front ends do (the driver's events and sessions, the engine model's
    rules as the simulation counted them)."""
    out = {f"{e['event']}:{e['reason']}" if e["event"] == "preempt" else e["event"] for e in live.events}
    out |= {f"end:{s['reason']}" for s in live.sessions}
    out |= {f"rule:{r}" for r, n in (sim.rules_reached or {}).items() if n}
    f = pd.DataFrame(live.frames)
    if len(f):
        f = f[~f.censored]
        out |= {"frames:silent"} if f.silent.any() else set()
        out |= {f"frames:{c}" for c in SILENT_CAUSES if f[c].any()}
        out |= {"frames:late"} if (~f.met_deadline).any() else set()
    queued = getattr(sc.admission() if callable(sc.admission) else None, "on_refuse", "") == "queue"
    return out | {f"kv:{sc.policy.kind}", f"admission:{sc.admission_label.split(':')[0]}"} | (
        {"gate:queue"} if queued else set())


def test_the_driver_and_the_simulator_serve_alike_on_random_scenarios():
    seen, regimes, ids = Counter(), Counter(), Counter()
    for _, sc in random_scenarios(N_SCENARIOS):
        live, sim = compare(sc)
        regimes[sc.phases, sc.loop] += 1
        seen.update(reached(sc, live, sim))
        ids.update(live.token_checks)
    print(dict(regimes), dict(seen), dict(ids))
    assert len(regimes) == 4 and min(regimes.values()) >= N_SCENARIOS // 8, regimes  # both phases, both loops
    short = {w: seen[w] for w in MUST_REACH if seen[w] < RARE.get(w, REACH)}
    assert not short, short
    assert min(ids[c] for c in ("refeed", "readmit", "rebase")) >= ID_CHECKS, ids  # the token ids were checked


def test_sessions_the_engine_preempts_in_one_step_are_requeued_alike():
    """Six unbounded sessions (11 tokens in, 6 out a frame) on 19 blocks, stepped by the driver: at 0.27 s the engine
    preempts two sessions in one step (running[-1] first: the newer, then the older). The simulator's front end
    requeues them in that order, each at the head of its queue, so the older ends first in line; the live driver
    got them from ``probe/engine.py`` as ``sorted(preempted_req_ids)`` (vLLM hands it a set) and requeued them in
    the order of their ids, so at 0.4 s it readmitted the newer first and the steps parted from 0.448 s on. The live
    engine now reports them in vLLM's order (``probe.engine.preemption_order``), as the fake engine here does."""
    cal = calibration(period=0.2, n_in=11, n_out=6, prompt=16, blocks=19, maxlen=512, budget=64, seqs=64, watermark=1,
                      slow=0.3)
    compare(sc_mod.make_scenario(calibration=cal, kv="unbounded", horizon=4.728653817189326, seed=114,
                                 phases="aligned", loop="driver", deadline=0.2, admission="none", sessions=6,
                                 session_duration="exp:2.76"))


def test_sessions_that_stream_their_own_token_counts_are_served_alike():
    """A mix of streams: each session its own input and output tokens a frame (at most the stream's), under both
    phase regimes and both loops. The driver gives each session its own counts, the simulator's front end and its
    compiled loop read them per session: every step, frame and session must agree as in the family above, and the
    compiled loop must have taken part of each run (its steps are the per-session reads under test)."""
    regimes, fast = Counter(), []
    for k, sc in random_scenarios(36):
        st = sc.calibration.stream
        r = np.random.default_rng([k, 49])
        mix = tuple((int(r.integers(1, st.input_tokens_per_frame + 1)), int(r.integers(1, st.output_tokens_per_frame
                                                                                         + 1))) for _ in range(3))
        if len(set(mix)) < 2:
            continue
        sc = replace(sc, token_mix=mix)
        live, _ = compare(sc)
        # each session was served its own stream: the frames the driver expected of it are its own output tokens
        arrival, duration = sc_mod.workload(sc)
        want = sc_mod.roster(sc, arrival, duration).output_tokens
        f = pd.DataFrame(live.frames)
        if len(f):
            got = f.groupby("session").tokens_expected.agg(set)
            assert all(got[sid] == {int(want[int(sid)])} for sid in got.index), (mix, got)
        regimes[sc.phases, sc.loop] += 1
        fast.append(simulate(sc, True).fast_steps)
    assert len(regimes) == 4, regimes
    assert sum(f > 0 for f in fast) >= len(fast) // 2, fast


def test_sessions_on_clocks_of_their_own_are_served_alike():
    """A mix of clocks and streams: each session its own frame period, deadline and tokens a frame, under
    independent phases and both loops. The driver ticks each session on its own clock; the simulator's front end
    and its compiled loop read each session's clock (the wheel's slot of sessions on clocks of their own, each
    row's tick the session's own): every step, frame and session must agree as in the family above, the sessions
    must have been served on their own clocks (each frame's tick on its session's grid), and the compiled loop
    must have taken part of each run."""
    loops, fast, n = Counter(), [], 0
    for k, sc in random_scenarios(90):
        if sc.phases != "independent":
            continue
        st = sc.calibration.stream
        r = np.random.default_rng([k, 53])
        P = st.frame_period_s
        # periods a half to twice the stream's (a shorter one ticks twice between two of the run's), on and off
        # the run's grid; deadlines a half to one of each period
        clocks = tuple((p, float(p * r.choice([0.5, 1.0]))) for p in
                       (float(P * r.choice([0.5, 0.75, 1.0, 1.5, 2.0])), float(r.uniform(0.5, 2.0) * P)))
        tokens = tuple((int(r.integers(1, st.input_tokens_per_frame + 1)),
                        int(r.integers(1, st.output_tokens_per_frame + 1))) for _ in range(3))
        sc = replace(sc, period_mix=clocks, token_mix=tokens)
        live, _ = compare(sc)
        arrival, duration = sc_mod.workload(sc)
        roster = sc_mod.roster(sc, arrival, duration)
        f = pd.DataFrame(live.frames)
        if len(f):
            sid = f.session.astype(int).values
            per, ph = roster.period_s[sid], serving.phase_offset_s(roster.phase_slot[sid], roster.period_s[sid])
            on_grid = np.abs((f.tick_s.values - ph) / per - np.round((f.tick_s.values - ph) / per))
            assert on_grid.max() < 1e-6, on_grid.max()  # (every tick f·P_i + φ_i, to rounding)
        loops[sc.loop] += 1
        fast.append(simulate(sc, True).fast_steps)
        n += 1
    assert len(loops) == 2 and n >= 30, (loops, n)
    assert sum(f > 0 for f in fast) >= len(fast) // 2, fast
    # and a busy one: 60 sessions on three periods (one the run's), two deadlines on two of them, so that sessions
    # of one clock tick together (one frame row for several, some on time and some late) and some frames miss their
    # session's deadline, in a run the loop takes whole
    cal = calibration(period=0.08, n_in=4, n_out=2, prompt=8, blocks=400, maxlen=4096, budget=512, seqs=64,
                      watermark=0, slow=0.1)
    for loop in serving.LOOPS:
        sc = replace(sc_mod.make_scenario(calibration=cal, kv="sinks", sinks=4, window=64, horizon=4.0, seed=7,
                                          phases="independent", loop=loop, deadline=0.08, sessions=60),
                     period_mix=((0.08, 0.08), (0.16, 0.08), (0.056, 0.056), (0.08, 0.03), (0.16, 0.16)),
                     token_mix=((4, 2), (2, 1)))
        compare(sc)
        sim = simulate(sc, True)
        f = sim.frames
        assert (f.frames > 1).sum() > 100 and 0 < f.late.sum() < 0.1 * f.frames.sum(), f.describe()
        assert sim.fast_steps > 1000, sim.fast_steps


@pytest.mark.parametrize("mix", [((0, 1),), ((1, 0),), ((21, 1),), ((1, 9),)])
def test_a_mix_beyond_the_stream_is_refused_before_the_run(mix):
    """A stream of the mix streams 1 to the calibration stream's tokens a frame (here 20 in, 8 out): one line,
    before any work; the front end refuses the same rosters."""
    from metronome.front_end import FrontEnd, Roster

    cal = calibration(period=0.08, n_in=20, n_out=8, prompt=0, blocks=64, maxlen=4096, budget=512, seqs=64,
                      watermark=0, slow=1.0)
    sc = sc_mod.make_scenario(calibration=cal, kv="unbounded", sessions=2, horizon=1.0)
    assert replace(sc, token_mix=((20, 8), (1, 1))).token_mix  # the stream's own bounds are within it
    with pytest.raises(MetronomeError, match="a stream of the mix has 1 to 20 input and 1 to 8 output"):
        replace(sc, token_mix=mix)
    (n_in, n_out), = mix
    limits = serving.EngineLimits(num_blocks=64, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=4096)
    with pytest.raises(ValueError, match="tokens per frame are 1 to the stream's"):
        FrontEnd(serving.EngineModel(sc.policy, limits), sc.policy, limits, cal.stream,
                 Roster(np.zeros(1), np.ones(1), input_tokens=[n_in], output_tokens=[n_out]), 1.0, 0.08)


def test_a_mix_goes_to_the_sessions_in_the_order_they_arrive():
    """Session k in arrival order streams clock k % len of the mix and tokens k % len of the token mix, whatever
    order the roster lists them in (here the second listed arrives first)."""
    cal = calibration(period=0.08, n_in=20, n_out=8, prompt=0, blocks=64, maxlen=4096, budget=512, seqs=64,
                      watermark=0, slow=1.0)
    sc = replace(sc_mod.make_scenario(calibration=cal, kv="unbounded", sessions=2, horizon=1.0),
                 period_mix=((0.08, 0.04), (0.16, 0.1), (0.12, 0.12)), token_mix=((3, 1), (5, 2)))
    roster = sc_mod.roster(sc, np.array([0.3, 0.1, 0.2]), np.ones(3))
    assert roster.period_s.tolist() == [0.12, 0.08, 0.16]  # (their places in arrival order: 2, 0, 1)
    assert roster.deadline_s.tolist() == [0.12, 0.04, 0.1]
    assert roster.input_tokens.tolist() == [3, 3, 5] and roster.output_tokens.tolist() == [1, 1, 2]


@pytest.mark.parametrize("clocks, phases, message", [
    (((0.0, 0.08),), "independent", "a clock of the mix has a positive period and deadline"),
    (((0.08, -1.0),), "independent", "a clock of the mix has a positive period and deadline"),
    (((float("inf"), 0.08),), "independent", "a clock of the mix has a positive period and deadline"),
    (((0.16, 0.08),), "aligned", "a mix of clocks needs independent phases")])
def test_a_mix_of_clocks_that_cannot_be_served_is_refused_before_the_run(clocks, phases, message):
    """A clock of the mix is a positive period and deadline, in seconds, and sessions on clocks of their own
    cannot tick in lockstep: one line, before any work; the front end refuses the same rosters."""
    from metronome.front_end import FrontEnd, FrontEndOptions, Roster

    cal = calibration(period=0.08, n_in=20, n_out=8, prompt=0, blocks=64, maxlen=4096, budget=512, seqs=64,
                      watermark=0, slow=1.0)
    sc = sc_mod.make_scenario(calibration=cal, kv="unbounded", sessions=2, horizon=1.0, phases=phases)
    with pytest.raises(MetronomeError, match=message):
        replace(sc, period_mix=clocks)
    (period, deadline), = clocks
    limits = serving.EngineLimits(num_blocks=64, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=4096)
    with pytest.raises(ValueError, match="positive seconds" if phases == "independent" else "aligned phases"):
        FrontEnd(serving.EngineModel(sc.policy, limits), sc.policy, limits, cal.stream,
                 Roster(np.zeros(1), np.ones(1), period_s=[period], deadline_s=[deadline]), 1.0, 0.08,
                 options=FrontEndOptions(phases=phases))
