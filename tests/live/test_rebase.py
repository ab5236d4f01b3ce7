"""Near max_model_len the driver rebases a bounded session: a new request of its S sinks + last W tokens.

vLLM caches keys after RoPE at absolute positions, so a session cannot outgrow ``max_model_len``; under
the bound the driver restarts it with the conversation's own sink tokens and its last W tokens, and the
frame that carries that prefill records its cost (the simulator charges the same S+W prefill,
``KVPolicy.rebase_tokens``). Pool facts and token counts are asserted, not latencies. The run lasts until each
session has rebased twice (``DriverConfig.until``), however slow the host: a 5 s horizon delivered 26 of ~100
frames at load 2.7 and saw no rebase.
"""

import pytest

from metronome.calibration import TokenStream

S, W, BS = 32, 64, 32
MAX_LEN = 320  # 20 frames of 16 tokens: a session rebases every ~1.5 s on a quiet host
STREAM = TokenStream(0.1, 14, 2)
CAP_S = 600.0  # only a cap: the run ends at the rebases it waits for (a quiet host: ~3 s)


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    from metronome.probe.driver import SessionPlan, events_seen, run_live
    from metronome.probe.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(tiny_model, num_blocks=64, max_model_len=MAX_LEN, sinks=S, sliding_window=W))
    try:
        plans = [SessionPlan("a"), SessionPlan("b")]
        res = run_live(engine, STREAM, plans, horizon_s=CAP_S, out_dir=tmp_path_factory.mktemp("rebase"),
                       run="rebase", cap="rebase", until=lambda d: events_seen(d, "rebase", 2, sessions=["a", "b"]))
        policy = engine.policy
    finally:
        engine.close()
    return res, policy


def test_bounded_sessions_rebase_with_their_sinks_and_last_window(run):
    res, policy = run
    assert res.until_met, f"no two rebases each in {CAP_S:g} s: {res.summary['frames']} frames answered"
    assert policy.kind == "sinks" and policy.rebase_tokens() == S + W
    rebases = [e for e in res.events if e["event"] == "rebase"]
    assert len(rebases) >= 2 and {e["session"] for e in rebases} == {"a", "b"}
    # each rebase keeps exactly S + W tokens of history, then the frame's own chunk
    assert all(e["kept_tokens"] == S + W for e in rebases)
    assert all(e["prompt_tokens"] > S + W for e in rebases)
    assert res.summary["rebases"] == len(rebases)


def test_rebased_sessions_keep_talking_and_the_cost_is_recorded(run):
    res, _ = run
    s = res.summary
    assert s["silent_frame_fraction"] == 0 and s["preemptions"] == 0
    # (the run ends at the second rebases, whose frames may still be in the engine: censored, left out)
    rebased = [f for f in res.frames if f.get("rebased") and not f["censored"]]
    assert rebased and all(f["tokens_delivered"] == STREAM.output_tokens_per_frame for f in rebased)
    assert s["p50_rebase_frame_latency_s"] is not None and s["p50_rebase_frame_latency_s"] > 0
    # the bound held throughout: never more than the policy's blocks per session
    assert max(st["used_blocks"] for st in res.steps) <= 2 * (1 + 2 + 1)
