"""The engine model is vLLM's scheduler: the simulator run on :class:`metronome.serving.EngineModel` and the same
simulator run on vLLM 0.32's own ``Scheduler`` + KV cache manager (``vllm_scheduler_harness``, no model) must
take the same steps.

Each scenario is simulated twice, step by step (no fast-forward: it writes EngineModel's state directly), once
per scheduler. The front end (frame clock, admission, the length limit, the deadlock rule) is the simulator's
own in both runs, so any difference is a difference between the two schedulers. Compared exactly, for every
step: who is scheduled and with how many tokens, in which order; who is preempted; who is admitted; blocks in
use after scheduling. Then the simulator's tables (steps, frames, sessions) and summary, which follow from them.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("vllm")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fixed_engine import fast_moshi  # noqa: E402
from metronome import serving  # noqa: E402
from metronome.errors import MetronomeError  # noqa: E402
from metronome.kv_policy import KVPolicy  # noqa: E402
from metronome.serving import EngineModel  # noqa: E402
from metronome.sim.scenario import Scenario, run  # noqa: E402
from metronome.workload import Arrivals, Durations  # noqa: E402

from vllm_scheduler_harness import SchedulerHarness  # noqa: E402

pytestmark = pytest.mark.live

_STATUS = {"RUNNING": serving.RUNNING, "WAITING": serving.WAITING, "PREEMPTED": serving.PREEMPTED,
           "WAITING_FOR_STREAMING_REQ": serving.PAUSED}


class Recorded:
    """Mixin: keep every step's (scheduled, preempted, admitted, used) for the comparison."""

    def _record(self, rec):
        self.log.append((tuple(rec.scheduled.items()), tuple(rec.preempted), tuple(rec.admitted), rec.used_blocks))
        return rec


class ModelBackend(EngineModel, Recorded):
    def __init__(self, policy, limits):
        super().__init__(policy, limits)
        self.log = []

    def step(self):
        rec = super().step()
        self.check()
        return self._record(rec)


class VllmBackend(Recorded):
    """vLLM's scheduler behind EngineModel's interface: request slots handed out in order of ``add``, the
    model's status names, a StepRecord of slots."""

    def __init__(self, policy: KVPolicy, limits: serving.EngineLimits):
        sinks = (policy.sink_tokens, policy.window_tokens) if policy.kind == "sinks" else None
        assert policy.kind != "window", "the harness runs the sink+window plugin or full attention"
        assert limits.watermark_blocks == 0
        self.h = SchedulerHarness(num_blocks=limits.num_blocks + 1, block_size=policy.block_size,
                                  max_num_seqs=limits.max_num_seqs,
                                  max_num_batched_tokens=limits.max_num_batched_tokens,
                                  max_model_len=limits.max_model_len, sinks=sinks)
        assert self.h.admission_cap == policy.admission_cap_blocks(limits.in_flight_tokens, limits.max_model_len)
        self.policy = policy
        self.log = []
        self.steps = 0
        self.rid_of: list = []
        self.slot_of: dict = {}

    def _slots(self, rids) -> np.ndarray:
        return np.array([self.slot_of[r] for r in rids], dtype=np.int64)

    def add(self, rid, prompt_tokens, max_tokens):
        self.h.add(str(rid), prompt_tokens, max_tokens)
        self.slot_of[rid] = len(self.rid_of)
        self.rid_of.append(rid)
        return self.slot_of[rid]

    def append(self, rid, chunk_tokens, max_tokens):
        assert self.h.status(str(rid)) == "WAITING_FOR_STREAMING_REQ", "the front end appends to paused sessions only"
        self.h.append(str(rid), chunk_tokens, max_tokens)

    def append_many(self, slots, chunk_tokens, max_tokens):
        for s, k in zip(slots.tolist(), np.broadcast_to(chunk_tokens, slots.shape).tolist()):
            self.append(self.rid_of[s], k, max_tokens)

    def abort(self, rid):
        self.h.abort(str(rid))

    def status(self, rid):
        r = self.h.scheduler.requests.get(str(rid))
        return _STATUS[r.status.name] if r is not None else None

    def computed(self, rid):
        return self.h.computed(str(rid))

    def tokens_of(self, rid):
        return self.h.num_tokens(str(rid))

    def blocks_of(self, rid):
        return self.h.blocks_of(str(rid))

    def computed_of(self, slots):
        return np.array([self.h.computed(str(self.rid_of[s])) for s in slots.tolist()], dtype=np.int64)

    def held_of(self, slots):
        return np.array([self.h.blocks_of(str(self.rid_of[s])) for s in slots.tolist()], dtype=np.int64)

    def waiting_of(self, slots):
        return np.array([self.status(self.rid_of[s]) in (serving.WAITING, serving.PREEMPTED) for s in slots.tolist()],
                        dtype=bool)

    def free_blocks(self):
        return self.h.free_blocks()

    @property
    def used(self):
        return self.h.used_blocks()

    def has_work(self):
        return self.h.has_work()

    def check(self):
        self.h.check()

    def step(self):
        rec = self.h.step()
        self.steps += 1
        ids = [int(k) for k in rec.scheduled]
        out = serving.StepRecord(self._slots(ids), np.array(list(rec.scheduled.values()), dtype=np.int64),
                                 preempted=[int(r) for r in rec.preempted], admitted=[int(r) for r in rec.admitted],
                                 used_blocks=rec.used_blocks, sampled_slots=self._slots(int(r) for r in rec.sampled),
                                 paused_slots=self._slots(int(r) for r in rec.paused), rid_of=self.rid_of)
        # the context the step model prices: what the policy keeps of each scheduled request after the step
        out.context_tokens = int(self.policy.resident_tokens(self.computed_of(out.slots)).sum())
        assert not rec.finished, f"vLLM finished {rec.finished} on its own: the front end must prevent it"
        return self._record(out)


def _cal(block=16, blocks=60, budget=256, seqs=64, maxlen=4096, n_in=4, n_out=3, period=0.08, prompt=8):
    # the fixed engine: the named scenarios (some found by random search) are pinned to its step times
    c = fast_moshi()
    return replace(c, model=replace(c.model, max_model_len_tokens=maxlen),
                   stream=replace(c.stream, frame_period_s=period, input_tokens_per_frame=n_in,
                                  output_tokens_per_frame=n_out, prompt_tokens=prompt),
                   engine=replace(c.engine, block_size_tokens=block, num_blocks=blocks, reserved_blocks=0,
                                  max_num_batched_tokens=budget, max_num_seqs=seqs, watermark_blocks=0))


def _both(sc: Scenario):
    """Run ``sc`` on both schedulers; assert every step and every table agree; return the model's result."""
    made = {}

    def factory(kind):
        def make(policy, limits):
            made[kind] = (ModelBackend if kind == "model" else VllmBackend)(policy, limits)
            return made[kind]
        return make

    a = run(sc, fast_forward=False, check_invariants=True, engine_model=factory("model"))
    b = run(sc, fast_forward=False, check_invariants=True, engine_model=factory("vllm"))
    la, lb = made["model"].log, made["vllm"].log
    for k, (x, y) in enumerate(zip(la, lb)):
        assert x == y, f"step {k}: model {x} != vLLM {y}"
    assert len(la) == len(lb), f"model took {len(la)} steps, vLLM {len(lb)}"
    import pandas as pd

    for name in ("steps", "frames", "sessions"):
        pd.testing.assert_frame_equal(getattr(a, name), getattr(b, name), check_exact=True)
    return a, la


def _first_preemption(log):
    return next((k for k, (_, pre, _, _) in enumerate(log) if pre), None)


# --------------------------------------------------------------------------------------- named scenarios
def test_lockstep_sessions_filling_the_pool_stall_on_paused_sessions_and_the_front_end_breaks_it():
    # 12 unbounded sessions of 7 tokens a frame on 60 blocks of 16: the pool runs dry after ~11 frames; at
    # a frame boundary every session is paused, vLLM never preempts a paused one, so the front end must
    sc = Scenario(_cal(), KVPolicy.unbounded(16), Arrivals("all", sessions=12), 3.0, seed=1, phases="aligned")
    res, log = _both(sc)
    assert res.summary["preemptions"] > 0 and res.summary["t_sat_observed_s"] is not None
    assert any(not sched for sched, _, _, _ in log), "a step where vLLM scheduled nothing (the stall) must occur"


def test_paused_sessions_the_waiting_pass_skips_keep_their_place_in_the_queue():
    # clients on their own clocks: paused and resumed sessions interleave in the kv-holding queue, and when a
    # resumed one does not fit, the paused ones the pass skipped before it go back in front of it, in order
    # (vLLM's skipped_waiting_requests). Putting them at the back instead changes who is admitted at step 245
    # (found by a random search; the aligned-phase scenarios never tell the two apart)
    cal = _cal(block=16, blocks=48, budget=64, seqs=40, maxlen=4096, n_in=2, n_out=3, prompt=1)
    sc = Scenario(cal, KVPolicy.sinks(16, 8, 32), Arrivals("poisson", rate_per_s=9.400537616867787), 3.0,
                  durations=Durations("exponential", 3.6386579533676775), seed=1765, phases="independent")
    res, log = _both(sc)
    assert len(log) > 245 and res.summary["sessions_admitted"] > 10


def test_running_requests_that_cross_a_block_are_preempted_newest_first_by_the_engine():
    # sessions joined at different ticks cross block boundaries in different decode steps: with the pool
    # full a running request needs a block mid-frame and vLLM preempts running[-1]
    sc = Scenario(_cal(blocks=40, n_in=3, n_out=6), KVPolicy.unbounded(16), Arrivals("ramp", sessions=10, ramp_s=1.0),
                  3.0, seed=2)
    res, log = _both(sc)
    engine_preempted = [pre for _, pre, _, _ in log if pre]
    assert engine_preempted, "vLLM itself must have preempted a running request"
    assert _first_preemption(log) is not None


def test_arrivals_while_the_pool_is_full_wait_and_are_admitted_as_sessions_leave():
    sc = Scenario(_cal(blocks=50), KVPolicy.unbounded(16), Arrivals("poisson", rate_per_s=8.0), 4.0,
                  durations=Durations("exponential", 1.0), seed=3)
    res, log = _both(sc)
    assert res.summary["sessions_admitted"] > 10
    assert res.steps.waiting.max() > 0, "some arrival must have waited for blocks"


def test_preempted_sessions_are_readmitted_with_their_whole_history():
    sc = Scenario(_cal(blocks=45, budget=64), KVPolicy.unbounded(16), Arrivals("all", sessions=10), 4.0,
                  durations=Durations("list", values_s=(1.5, 100.0)), seed=4)
    res, log = _both(sc)
    readmitted = res.sessions[(res.sessions.preemptions > 0) & (res.sessions.tokens > 0)]
    assert len(readmitted) > 0
    # a readmission is a prefill longer than any frame: chunked by the 64-token budget
    assert res.steps.new_tokens.max() == 64


def test_sessions_reaching_max_model_len_are_rebased_under_the_bound_and_finished_without_it():
    b, _ = _both(Scenario(_cal(maxlen=160, blocks=80), KVPolicy.sinks(16, 16, 64), Arrivals("all", sessions=4), 4.0,
                          seed=5))
    assert b.summary["rebases"] >= 4 and b.summary["length_capped"] == 0
    u, _ = _both(Scenario(_cal(maxlen=160, blocks=80), KVPolicy.unbounded(16), Arrivals("all", sessions=4), 4.0,
                          seed=5))
    assert u.summary["length_capped"] == 4 and u.summary["rebases"] == 0


def test_the_sink_window_bound_frees_blocks_inside_vllm_as_the_model_says():
    # 20 sessions under S=16, W=64 rest on at most 1 + 4 + 1 = 6 blocks each on a pool of 200: never dry. vLLM
    # frees out-of-window blocks at the count *before* a step, so a 5-token chunk that crosses a block boundary
    # holds one block more for that step: the in-step peak passes 20 × 6 but never 20 × 7
    res, log = _both(Scenario(_cal(blocks=200), KVPolicy.sinks(16, 16, 64), Arrivals("ramp", sessions=20, ramp_s=0.5),
                              5.0, seed=6))
    assert res.summary["preemptions"] == 0
    peak = max(used for *_, used in log)
    assert 20 * KVPolicy.sinks(16, 16, 64).max_resident_blocks < peak <= 20 * 7


def test_sink_window_sessions_past_the_ceiling_are_preempted_and_readmitted_under_the_cap():
    # the full-sequence gate reserves the admission cap for a readmitted session, not its (long) history
    res, log = _both(Scenario(_cal(blocks=40, budget=128), KVPolicy.sinks(16, 16, 64),
                              Arrivals("ramp", sessions=16, ramp_s=2.0), 6.0, seed=7))
    assert res.summary["preemptions"] > 0


def test_a_step_that_preempts_admits_nobody_even_when_the_freed_blocks_would_fit():
    # 15 sink+window sessions whose frames (8 tokens) the 32-token budget takes four at a time: frames wait
    # for budget, not blocks, while the running ones cross blocks and preempt; vLLM's waiting pass is skipped
    # in that step although the victim's blocks would fit a waiting frame (found by mutating that rule)
    res, log = _both(Scenario(_cal(blocks=36, budget=32, seqs=32, n_in=7, n_out=3, prompt=1), KVPolicy.sinks(16, 8, 32),
                              Arrivals("all", sessions=15), 3.0, durations=Durations("exponential", 2.0), seed=26))
    assert any(pre for _, pre, _, _ in log)


# ---------------------------------------------------------------------------------------- random scenarios
@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(kind=st.sampled_from(["unbounded", "sinks"]), block=st.sampled_from([16, 32]),
       blocks=st.integers(12, 80), budget=st.sampled_from([32, 64, 256]), seqs=st.integers(4, 40),
       n_in=st.integers(1, 12), n_out=st.integers(1, 5), prompt=st.integers(1, 40),
       arrivals=st.sampled_from(["all", "ramp", "poisson"]), n=st.integers(1, 14), rate=st.floats(1.0, 10.0),
       mean=st.floats(0.3, 4.0), short=st.booleans(), seed=st.integers(0, 10_000),
       phases=st.sampled_from(["independent", "aligned"]))
def test_random_streaming_workloads_agree_step_by_step(kind, block, blocks, budget, seqs, n_in, n_out, prompt, arrivals,
                                                       n, rate, mean, short, seed, phases):
    maxlen = 6 * block + 48 if short else 4096
    pol = KVPolicy.unbounded(block) if kind == "unbounded" else KVPolicy.sinks(block, block // 2, 2 * block)
    budget = max(budget, n_in + 1 + prompt)
    cal = _cal(block=block, blocks=blocks, budget=budget, seqs=min(seqs, budget), maxlen=maxlen,  # vLLM: seqs <= budget
               n_in=n_in, n_out=n_out, prompt=prompt)
    arr = {"all": Arrivals("all", sessions=n), "ramp": Arrivals("ramp", sessions=n, ramp_s=1.0),
           "poisson": Arrivals("poisson", rate_per_s=rate)}[arrivals]
    try:
        sc = Scenario(cal, pol, arr, 3.0, durations=Durations("exponential", mean), seed=seed, phases=phases)
    except MetronomeError as exc:  # a pool too small for one session is refused up front, as for a user
        assert "too small" in str(exc)
        event("refused: pool too small")
        return
    res, log = _both(sc)
    event(f"steps: {'>100' if len(log) > 100 else '<=100'}")
    event(f"phases: {phases}")
    event("preempted" if res.summary["preemptions"] else "no preemption")
    event("rebased" if res.summary["rebases"] else ("length-capped" if res.summary["length_capped"] else "no length limit"))


def _interpreted(monkeypatch, **mutants):
    """Run the engine step as Python (each compiled part's own source, :attr:`py_func`), with ``mutants`` in place
    of parts of it, so a broken rule reaches every request."""
    for name in ("engine_step", "_running_pass", "_waiting_pass", "_alloc", "_chunk", "_preempt", "_kv_order",
                 "_model_run"):
        monkeypatch.setattr(serving, name, getattr(serving, name).py_func)
    for name, f in mutants.items():
        monkeypatch.setattr(serving, name, f)
    monkeypatch.setattr(EngineModel, "_kernel", staticmethod(serving.engine_step))


def test_the_comparison_fails_when_the_model_frees_window_blocks_ahead_of_the_chunk(monkeypatch):
    """The old simulator's assumption (blocks leaving the window freed before the chunk's new blocks are
    taken, at the count *after* the step) is not vLLM's: the sink+window run must then disagree."""
    alloc = serving._alloc.py_func

    def frees_ahead(s, k, admitting, lim, cnt, computed, ntok, slots, held, reached):
        if slots[s]:  # free at the count after the step, before the allocation
            keep = serving._res_blocks(computed[s] + k, lim[serving.L_BS], lim[serving.L_SINKB], lim[serving.L_WINDOW])
            if keep < held[s]:
                cnt[serving.E_USED] -= held[s] - keep
                held[s] = keep
        return alloc(s, k, admitting, lim, cnt, computed, ntok, slots, held, reached)

    _interpreted(monkeypatch, _alloc=frees_ahead)
    with pytest.raises(AssertionError, match="step"):
        _both(Scenario(_cal(blocks=200), KVPolicy.sinks(16, 16, 64), Arrivals("ramp", sessions=20, ramp_s=0.5), 5.0,
                       seed=6))


def _long_prompts():
    # 100-token prompts, prefilled 64 tokens a step: vLLM admits one only when all 7 of its blocks are free,
    # though its first chunk needs 4
    return Scenario(_cal(blocks=40, budget=64, prompt=100), KVPolicy.unbounded(16),
                    Arrivals("poisson", rate_per_s=6.0), 4.0, durations=Durations("exponential", 1.0), seed=8)


def test_a_long_prompt_is_admitted_only_when_the_whole_of_it_fits():
    res, _ = _both(_long_prompts())
    assert res.summary["sessions_admitted"] > 5


def test_the_comparison_fails_without_vllms_full_sequence_gate(monkeypatch):
    """Charging a new request only its first chunk (no full-sequence gate) admits it earlier than vLLM."""
    alloc = serving._alloc.py_func
    _interpreted(monkeypatch, _alloc=lambda s, k, admitting, *state: alloc(s, k, False, *state))
    with pytest.raises(AssertionError, match="step"):
        _both(_long_prompts())
