"""The no-model vLLM scheduler harness (``vllm_scheduler_harness.py``): one test per fact of its docstring.

Each test drives vLLM 0.32's real Scheduler + KV cache manager (no engine, no model) with concrete numbers,
so a change in vLLM's scheduling, or a broken harness, fails here. Block counts exclude vLLM's null block:
``num_blocks=13`` means 12 usable blocks.
"""

import pytest

pytest.importorskip("vllm")

from vllm_scheduler_harness import SchedulerHarness  # noqa: E402

pytestmark = pytest.mark.live
BS = 16


def make(num_blocks, **kw):
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_num_batched_tokens", 256)
    kw.setdefault("max_model_len", 2048)
    return SchedulerHarness(num_blocks=num_blocks, block_size=BS, **kw)


def run(h, n):
    recs = []
    for _ in range(n):
        recs.append(h.step())
        h.check()
    return recs


def test_two_sessions_fill_the_pool_and_the_third_waits():
    h = make(33, max_num_batched_tokens=1024)  # 32 usable
    assert h.usable_blocks == 32 and h.free_blocks() == 32 and h.admission_cap is None
    h.add("a", 256, 1)
    h.add("b", 256, 1)
    h.add("c", 16, 1)
    rec = h.step()
    assert rec.scheduled == {"a": 256, "b": 256} and rec.admitted == ["a", "b"]
    assert rec.admitted_as == {"a": "new", "b": "new"} and rec.sampled == ["a", "b"]
    assert rec.paused == ["a", "b"]  # max_tokens reached: paused, holding 16 blocks each
    assert rec.used_blocks == rec.used_blocks_end == 32 and h.free_blocks() == 0
    assert h.blocks_of("a") == h.blocks_of("b") == 16
    assert h.status("a") == "WAITING_FOR_STREAMING_REQ" and h.computed("a") == 256
    for rec in run(h, 3):  # c waits for good: nothing frees a block
        assert rec.ran and rec.scheduled == {} and rec.admitted == []
    assert h.status("c") == "WAITING" and h.queue() == ["a", "b", "c"]


def test_fact1_victim_is_the_last_running_request_and_goes_to_the_head_of_waiting():
    h = make(9)  # 8 usable: four 30-token requests take 2 blocks each
    for r in "abcd":
        h.add(r, 30, 10)
    run(h, 3)  # prefill, then decode to 32 computed tokens
    assert h.used_blocks() == 8 and all(h.computed(r) == 32 for r in "abcd")
    rec = h.step()  # every request now needs a third block
    assert rec.preempted == ["d", "c"]  # a takes d's blocks; c is then its own victim
    assert rec.scheduled == {"a": 1, "b": 1} and rec.admitted == []
    for r in "cd":
        assert h.status(r) == "PREEMPTED" and h.computed(r) == 0 and h.blocks_of(r) == 0
        assert rec.requests[r].preemptions == 1
    assert h.running() == ["a", "b"] and h.queue() == ["c", "d"]
    assert rec.used_blocks == 6


def test_fact1_no_admission_in_a_step_with_a_preemption():
    h = make(9)
    h.add("s", 10, 1)
    run(h, 1)  # paused session, 1 block
    h.add("a", 30, 10)
    h.add("b", 60, 10)
    run(h, 1)
    while h.computed("b") < 64:
        run(h, 1)
    h.append("s", 1, 1)  # needs no new block (11 tokens in its 1 block)
    assert h.free_blocks() == 0
    rec = h.step()
    assert rec.preempted == ["b"] and rec.admitted == [] and "s" not in rec.scheduled
    rec = h.step()
    assert rec.admitted == ["s"] and rec.admitted_as == {"s": "continued"} and rec.scheduled["s"] == 1


def test_fact2_full_attention_running_request_needs_ceil_c_plus_k_over_bs_minus_held():
    h = make(64, max_num_batched_tokens=64)
    h.add("a", 200, 2)
    held = [r.requests["a"].blocks for r in run(h, 4)]
    assert held == [4, 8, 12, 13]  # ceil(64/16), ceil(128/16), ceil(192/16), ceil(200/16)


def test_fact2_sink_window_frees_before_allocating_on_the_processed_count():
    S, W = 16, 64
    h = make(64, max_num_batched_tokens=64, sinks=(S, W))
    assert type(h.manager).__name__ == "SinkWindowManager" and h.kv_spec.admission_blocks == 10
    assert h.admission_cap == 10  # 1 sink block + cdiv(63 + 64, 16) + 1
    h.add("a", 200, 3)
    recs = run(h, 4)
    assert [r.requests["a"].blocks for r in recs] == [4, 8, 9, 6]
    assert [r.requests["a"].table_len for r in recs] == [4, 8, 12, 13]
    # the same rule over a long streaming run: held = ceil(c_after/bs) - max(0, ws - sink_blocks),
    # ws = floor(max(c_before - W + 1, 0)/bs), and never above the admission cap
    run(h, 2)
    for i in range(30):
        h.append("a", 17 + 13 * (i % 5), 2)
        for _ in range(2):
            before = h.computed("a")
            rec = h.step()
            h.check()
            after = rec.after_schedule["a"]
            ws = max(before - W + 1, 0) // BS
            assert after.blocks == -(-after.computed // BS) - max(0, ws - 1), (i, before, after)
            assert after.blocks <= h.admission_cap


def test_fact3_whole_sequence_must_be_free_to_admit():
    h = make(13, max_num_batched_tokens=64)  # 12 usable; a 200-token prompt needs 13
    h.add("a", 200, 2)
    assert all(r.scheduled == {} for r in run(h, 3)) and h.status("a") == "WAITING"
    h = make(13, max_num_batched_tokens=64, scheduler_reserve_full_isl=False)
    h.add("a", 200, 2)
    recs = run(h, 5)
    assert [r.scheduled.get("a", 0) for r in recs] == [64, 64, 64, 0, 64]
    assert recs[3].preempted == ["a"] and recs[4].admitted_as == {"a": "resumed"}


def test_fact3_the_full_sequence_gate_is_not_a_reservation():
    h = make(13, long_prefill_token_threshold=32)  # 12 usable; two 160-token prompts need 10 each
    h.add("a", 160, 2)
    h.add("b", 160, 2)
    recs = run(h, 4)
    assert recs[0].admitted == ["a", "b"] and recs[0].scheduled == {"a": 32, "b": 32}
    assert [r.used_blocks for r in recs[:3]] == [4, 8, 12]
    assert recs[3].preempted == ["b"] and recs[3].scheduled == {"a": 32}


def test_fact3_head_of_line_blocking():
    h = make(13)
    h.add("a", 128, 1)
    run(h, 1)  # a paused with 8 blocks: 4 free
    h.add("big", 80, 1)  # needs 5
    h.add("small", 10, 1)  # needs 1, but is behind big
    for rec in run(h, 2):
        assert rec.scheduled == {}
    assert h.queue() == ["a", "big", "small"]


def test_fact3_first_chunk_is_the_budget_left_after_running_requests():
    h = make(200, max_num_batched_tokens=64)
    for r in "xyz":
        h.add(r, 10, 50)
    run(h, 2)
    h.add("p", 300, 1)
    rec = h.step()
    assert rec.scheduled == {"x": 1, "y": 1, "z": 1, "p": 61} and rec.admitted == ["p"]


def test_fact3_paused_sessions_take_a_max_num_seqs_slot():
    h = make(200, max_num_seqs=2)
    h.add("a", 10, 1)
    h.add("b", 10, 1)
    run(h, 1)
    h.add("c", 10, 1)
    assert run(h, 1)[0].scheduled == {}  # 2 paused sessions fill max_num_seqs=2
    h.abort("a")
    assert h.status("a") == "FINISHED_ABORTED" and h.used_blocks() == 1
    assert run(h, 1)[0].admitted == ["c"]


def test_fact3_watermark_applies_only_with_running_requests():
    h = make(13, watermark=0.25)  # int(0.25 * 13) = 3 blocks
    h.add("a", 150, 100)  # 10 blocks, admitted with nothing running (no watermark)
    assert run(h, 1)[0].admitted == ["a"]
    h.add("b", 10, 5)  # 1 + 3 > 2 free
    assert all(r.admitted == [] for r in run(h, 2))
    h = make(13, watermark=0.25)
    h.add("a", 120, 100)
    run(h, 1)
    h.add("b", 10, 5)  # 1 + 3 <= 4 free
    assert run(h, 1)[0].admitted == ["b"]


def test_fact3_sink_window_preempted_session_resumes_under_the_admission_cap():
    h = make(13, max_num_batched_tokens=64, max_model_len=4096, sinks=(16, 64))
    h.add("a", 60, 1)
    h.step()
    for _ in range(8):
        h.append("a", 60, 1)
        h.step()
    h.step()
    assert h.computed("a") == 540 and h.blocks_of("a") == 9 and h.table_len("a") == 34
    h.add("x", 30, 12, resumable=False)
    run(h, 1)
    h.append("a", 200, 1)
    recs = run(h, 3)
    assert recs[0].admitted_as == {"a": "continued"} and recs[2].preempted == ["a"]
    assert h.num_tokens("a") == 740  # 47 blocks uncapped; the gate asks min(47, cap 10)
    stalled = run(h, 8)  # x holds 3 blocks: 9 free < 10
    assert all(r.admitted == [] for r in stalled) and stalled[-1].finished == ["x"]
    rec = h.step()  # x finished: 12 free >= 10
    assert rec.admitted_as == {"a": "resumed"} and rec.scheduled == {"a": 64}


def test_fact4_paused_sessions_are_never_preempted_and_a_full_pool_deadlocks():
    h = make(13)
    h.add("a", 64, 1)
    h.add("b", 64, 1)
    run(h, 1)
    h.add("c", 60, 40)
    recs = run(h, 6)
    assert recs[-1].preempted == ["c"]  # c needs a 5th block; its own only victim
    assert h.status("a") == h.status("b") == "WAITING_FOR_STREAMING_REQ" and h.blocks_of("a") == 4
    assert run(h, 1)[0].scheduled == {}  # c waits for 5 blocks, 4 are free
    # the deadlock: two paused 96-token sessions fill 12 blocks, both get a chunk
    h = make(13)
    h.add("a", 96, 1)
    h.add("b", 96, 1)
    run(h, 1)
    h.append("a", 16, 1)
    h.append("b", 16, 1)
    for rec in run(h, 4):
        assert rec.ran and rec.scheduled == {} and rec.used_blocks == 12
    assert h.scheduler.has_requests() and h.queue() == ["a", "b"]
    h.abort("b")
    rec = h.step()
    assert rec.scheduled == {"a": 16} and rec.used_blocks == 7


def test_fact4_session_queue_order_and_chunks_queued_while_running():
    h = make(100)
    h.add("a", 10, 1)
    run(h, 1)
    h.add("b", 10, 1)
    run(h, 1)
    h.add("n", 10, 1)
    h.append("b", 5, 1)
    h.append("a", 5, 1)
    assert h.queue() == ["a", "b", "n"]  # appending does not move a session
    rec = h.step()
    assert rec.admitted == ["a", "b", "n"] and rec.admitted_as["a"] == "continued"
    assert h.computed("a") == 15 and h.num_tokens("a") == 16  # the chunk's sample: computed + 1
    h.add("r", 10, 3)
    run(h, 1)
    h.append("r", 4, 1)  # r is running: the chunk is queued
    assert len(h.scheduler.requests["r"].streaming_queue) == 1
    recs = run(h, 3)
    assert recs[1].requests["r"].status == "WAITING" and recs[1].requests["r"].num_tokens == 16
    assert recs[2].admitted_as == {"r": "continued"} and recs[2].scheduled == {"r": 4}
    assert h.queue() == ["a", "b", "n", "r"]  # a session re-enters at the tail when it pauses
    h.close("r")
    assert h.status("r") == "FINISHED_ABORTED" and h.blocks_of("r") == 0


def test_fact5_a_session_at_max_model_len_pauses_and_is_pushed_past_it():
    h = make(100, max_model_len=128)
    h.add("a", 120, 20)
    recs = run(h, 8)
    assert recs[-1].paused == ["a"] and h.computed("a") == 127 and h.num_tokens("a") == 128
    assert not h.has_work()
    h.append("a", 30, 3)
    rec = h.step()
    assert rec.scheduled == {"a": 30} and h.computed("a") == 157 > 128  # past max_model_len
    assert rec.used_blocks == 8 and h.status("a") == "WAITING_FOR_STREAMING_REQ"  # no new blocks
    # a chunk longer than the budget leaves the session RUNNING past max_model_len, never scheduled again
    h = make(100, max_model_len=128, max_num_batched_tokens=64)
    h.add("a", 120, 20)
    run(h, 8)  # 64 + 56 prompt tokens, then 6 decodes: 126 computed
    h.append("a", 100, 3)  # queued while a runs; applied when a stops at max_model_len
    rec = run(h, 1)[0]
    assert rec.scheduled == {"a": 1} and rec.requests["a"].status == "WAITING" and h.num_tokens("a") == 227
    assert run(h, 1)[0].scheduled == {"a": 64} and h.computed("a") == 191
    for rec in run(h, 3):
        assert rec.ran and rec.scheduled == {} and h.status("a") == "RUNNING"
    # a plain request finishes instead
    h = make(100, max_model_len=128)
    h.add("p", 120, 20, resumable=False)
    recs = run(h, 8)
    assert recs[-1].finished == ["p"] and h.status("p") == "FINISHED_LENGTH_CAPPED"
    assert recs[-1].used_blocks_end == 0


def test_fact6_budget_goes_to_running_requests_first_and_frames_wait_behind_a_prefill():
    h = make(200, max_num_batched_tokens=64)
    h.add("d", 10, 50)
    h.add("s", 10, 1)
    run(h, 1)
    h.add("p", 300, 2)
    run(h, 1)
    h.append("s", 5, 1)
    recs = run(h, 4)
    for rec in recs[:3]:
        assert rec.scheduled == {"d": 1, "p": 63}  # d first (list order), p takes the rest, s waits
    assert recs[3].scheduled == {"d": 1, "p": 48, "s": 5}


def test_fact6_long_prefill_threshold_is_off_for_a_lone_request_but_paused_sessions_count():
    h = make(200, max_num_batched_tokens=64, long_prefill_token_threshold=16)
    h.add("p", 100, 2)
    assert run(h, 1)[0].scheduled == {"p": 64}  # the only eligible request: no cap
    h.abort("p")
    h.add("s", 10, 1)
    run(h, 1)  # s paused in kv_holding_waiting
    h.add("q", 100, 2)
    assert [r.scheduled for r in run(h, 2)] == [{"q": 16}, {"q": 16}]
