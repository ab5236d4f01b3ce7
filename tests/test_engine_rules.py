"""The engine step's rules (metronome/serving.py's ``engine_step``), each on a scenario small enough to work by hand.

No vLLM here: every expected step below (who is scheduled with how many tokens, who is admitted or preempted, the
blocks each request holds, the order of the queues) is written out from vLLM 0.32's own algorithm
(``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``, and ``kv_cache_manager.py``, ``allocate_slots``), as
the docstrings work it, never computed by the engine model. What each scenario leans on of that algorithm:

* one step: the RUNNING requests first, in running order, each ``min(tokens left, long-prefill threshold, budget,
  max_model_len - computed - 1)`` tokens; ``allocate_slots`` failing preempts ``running[-1]`` (all its blocks
  freed, nothing computed, to the head of ``waiting``) and retries, and a request that preempts itself ends the
  pass. Then, only if nothing was preempted, the kv-holding queue (sessions resumed between streaming chunks, in
  the order they paused) and after it the waiting queue, head first, while ``len(running) + paused <
  max_num_seqs`` and the budget lasts; the first request that does not fit ends the pass;
* ``allocate_slots`` for a waiting request: the full-sequence gate first (``min(cdiv(tokens, bs), admission cap)
  - slots`` blocks, plus the watermark when a request is already running, must be free); then the blocks that left
  the window at the *computed* count go back (``remove_skipped_blocks``); then ``cdiv(computed + k, bs) - slots``
  new blocks (``slots`` counts the freed ones: vLLM keeps a null block in their place);
* after the step, each request whose tokens are all computed samples one; one that has sampled its
  ``max_tokens`` pauses holding its blocks (``WAITING_FOR_STREAMING_REQ``: never a preemption candidate); its next
  chunk drops the token it sampled last (the caller re-feeds it).

Block size 4 throughout; ``pool`` is the blocks requests can hold.
"""

from __future__ import annotations

import pytest

from metronome.errors import MetronomeError
from metronome.kv_policy import KVPolicy
from metronome.serving import EngineLimits, EngineModel

BS = 4


class Named:
    """The engine model, its requests called by the names these tests give them (the model names a request by the
    slot ``add`` returns)."""

    def __init__(self, m: EngineModel):
        self.m, self.slot, self.name = m, {}, []

    def __getattr__(self, attr):
        return getattr(self.m, attr)

    def add(self, rid: str, prompt_tokens: int, max_tokens: int) -> None:
        self.slot[rid] = self.m.add(prompt_tokens, max_tokens)
        self.name.append(rid)

    def append(self, rid: str, chunk_tokens: int, max_tokens: int) -> None:
        self.m.append(self.slot[rid], chunk_tokens, max_tokens)

    def abort(self, rid: str) -> None:
        self.m.abort(self.slot[rid])

    def status(self, rid: str):
        return self.m.status(self.slot[rid])

    def computed(self, rid: str) -> int:
        return self.m.computed(self.slot[rid])

    def tokens_of(self, rid: str) -> int:
        return self.m.tokens_of(self.slot[rid])

    def blocks_of(self, rid: str) -> int:
        return self.m.blocks_of(self.slot[rid])


def engine(pool: int, *, seqs: int = 16, budget: int = 64, maxlen: int = 256, watermark: int = 0,
           threshold: int = 0, policy: KVPolicy | None = None) -> Named:
    return Named(EngineModel(policy or KVPolicy.unbounded(BS),
                             EngineLimits(num_blocks=pool, max_num_seqs=seqs, max_num_batched_tokens=budget,
                                          max_model_len=maxlen, watermark_blocks=watermark,
                                          long_prefill_token_threshold=threshold)))


def step(m: Named) -> tuple[list, list, list]:
    """One step: (scheduled as [(request, tokens)] in schedule order, preempted, admitted), by name."""
    rec = m.step()
    m.check()
    name = m.name
    return ([(name[s], k) for s, k in rec.scheduled.items()], [name[s] for s in rec.preempted],
            [name[s] for s in rec.admitted])


def state(m: EngineModel, rid) -> tuple:
    """(status, computed tokens, tokens, blocks held)."""
    return m.status(rid), m.computed(rid), m.tokens_of(rid), m.blocks_of(rid)


# -- a request's name ----------------------------------------------------------------------------------------------
def test_a_request_is_named_by_its_slot_which_no_later_request_takes():
    """Slots go in the order of ``add`` and are never reused (the compiled loop's ``add_slot`` counts on it, and the
    front end names its requests by them): a slot aborted holds no request, and asking it for one is an error."""
    m = engine(10).m
    a, b = m.add(3, 1), m.add(3, 1)
    assert (a, b) == (0, 1)
    m.abort(a)
    assert m.status(a) is None and m.status(b) == "waiting" and m.add(3, 1) == 2
    for call in (lambda: m.abort(a), lambda: m.append(a, 1, 1), lambda: m.blocks_of(a), lambda: m.tokens_of(3)):
        with pytest.raises(MetronomeError, match="no request in slot"):
            call()


# -- a request's life ---------------------------------------------------------------------------------------------
def test_a_request_prefills_decodes_pauses_and_resumes_without_its_last_token():
    """a: 6 tokens, 2 to sample, on a 10-block pool.

    1. waiting pass: gate cdiv(6, 4) = 2 <= 10 free; all 6 scheduled, cdiv(6, 4) = 2 blocks; computed 6 = tokens:
       it samples one (7 tokens).
    2. running pass: 7 - 6 = 1 token, cdiv(7, 4) - 2 = 0 new blocks; it samples its 2nd (8 tokens) and pauses.
    3. nothing to run (paused is not running, not waiting).
    Its next chunk of 3 (the re-fed token and 2 new): 7 computed + 3 = 10 tokens (the 8th, sampled last, dropped).
    4. kv-holding queue: gate cdiv(10, 4) - 2 slots = 1 <= 8 free; 3 tokens, cdiv(10, 4) - 2 = 1 new block (3)."""
    m = engine(10)
    m.add("a", 6, 2)
    assert step(m) == ([("a", 6)], [], ["a"]) and state(m, "a") == ("running", 6, 7, 2)
    assert step(m) == ([("a", 1)], [], []) and state(m, "a") == ("paused", 7, 8, 2)
    assert step(m) == ([], [], []) and not m.has_work()
    m.append("a", 3, 1)
    assert state(m, "a") == ("waiting", 7, 10, 2)
    assert step(m) == ([("a", 3)], [], ["a"]) and state(m, "a") == ("paused", 10, 11, 3)
    assert m.free_blocks() == 7


# -- preemption ---------------------------------------------------------------------------------------------------
def test_a_dry_pool_preempts_the_newest_running_request_to_the_head_of_waiting_and_admits_nobody():
    """3 blocks. a (4 tokens) and b (8) are admitted in one step, 1 + 2 blocks: the pool is full; both sample
    (a 5 tokens, b 9). c (1 token, 1 block) arrives after.

    2. running pass: a's 5th token needs cdiv(5, 4) - 1 = 1 block, none free: running[-1] = b is preempted (its 2
       blocks back, 0 computed, its 9 tokens kept, at the head of waiting, before c) and a's allocation retried:
       1 block. A step that preempted has no waiting pass: c, whose 1 block would fit (1 free), waits.
    3. running pass: a 1 token (6 tokens fit its 2 blocks). Waiting pass, head first: b's gate cdiv(9, 4) = 3 > 1
       free ends the pass; c, behind it, waits though it fits (no later request jumps the queue)."""
    m = engine(3)
    m.add("a", 4, 5)
    m.add("b", 8, 5)
    assert step(m) == ([("a", 4), ("b", 8)], [], ["a", "b"]) and m.free_blocks() == 0
    m.add("c", 1, 1)
    assert step(m) == ([("a", 1)], ["b"], [])
    assert state(m, "b") == ("preempted", 0, 9, 0) and state(m, "a") == ("running", 5, 6, 2)
    assert m.status("c") == "waiting" and m.free_blocks() == 1
    assert step(m) == ([("a", 1)], [], []) and m.status("b") == "preempted" and m.status("c") == "waiting"
    assert m.reached["preemption"] == 1


def test_a_request_that_would_preempt_itself_is_preempted_and_ends_the_pass():
    """3 blocks. p (3 tokens, 1 to sample) is admitted, samples and pauses holding 1 block. x (2 tokens) and a (4)
    are admitted next, 1 block each: the pool is full; both sample (x 3 tokens, a 5). w (3 tokens) arrives.

    3. running pass: x 1 token (3 fit its block). a's 5th needs a 2nd block, none free; running[-1] is a itself
       (p is paused: never a candidate): a is preempted (its block back) and the pass ends. No waiting pass: w (1
       block, 1 free) waits.
    4. running pass: x 1 token (4 fit). Waiting, head first: a's gate cdiv(5, 4) = 2 > 1 free: w waits behind it."""
    m = engine(3)
    m.add("p", 3, 1)
    assert step(m) == ([("p", 3)], [], ["p"]) and m.status("p") == "paused"
    m.add("x", 2, 9)
    m.add("a", 4, 9)
    assert step(m) == ([("x", 2), ("a", 4)], [], ["x", "a"]) and m.free_blocks() == 0
    m.add("w", 3, 1)
    assert step(m) == ([("x", 1)], ["a"], [])
    assert state(m, "a") == ("preempted", 0, 5, 0) and state(m, "p") == ("paused", 3, 4, 1)
    assert m.free_blocks() == 1 and m.status("w") == "waiting"
    assert step(m) == ([("x", 1)], [], []) and m.status("a") == "preempted" and m.status("w") == "waiting"


def test_a_step_that_preempted_admits_nobody_even_a_resumed_session_that_needs_no_block():
    """3 blocks. r (3 tokens, 1 to sample) is admitted and pauses (1 block); x and v (4 tokens each) are admitted
    next (1 block each): the pool is full; both sample (5 tokens each). r resumes with 1 token: 3 computed + 1 = 4
    fit its block (gate cdiv(4, 4) - 1 slot = 0).

    3. running: x's 5th token needs a 2nd block: v (running[-1]) is preempted, x takes its block. The step preempted:
       no waiting pass, so r waits though it needs nothing.
    4. running: x 1 (6 tokens fit). Waiting: the kv-holding queue first, r 1 token; then v, at the head of waiting,
       gate cdiv(5, 4) = 2 > 0 free."""
    m = engine(3)
    m.add("r", 3, 1)
    step(m)
    m.add("x", 4, 9)
    m.add("v", 4, 9)
    assert step(m) == ([("x", 4), ("v", 4)], [], ["x", "v"]) and m.free_blocks() == 0
    m.append("r", 1, 1)
    assert step(m) == ([("x", 1)], ["v"], []) and m.status("r") == "waiting"
    assert step(m) == ([("x", 1), ("r", 1)], [], ["r"]) and m.status("v") == "preempted"


def test_a_pool_full_of_paused_sessions_stalls_and_nobody_is_preempted():
    """2 blocks. a and b (3 tokens, 1 to sample) each take 1 block, sample and pause: the pool is full. Each resumes
    with 3 tokens (3 computed + 3 = 6: a 2nd block each). The kv-holding queue: a's gate cdiv(6, 4) - 1 = 1 > 0 free
    ends the pass. Nothing runs, so nothing can be preempted, and paused holders never are: the step schedules
    nothing, every step after it too (the front end's deadlock rule must act)."""
    m = engine(2)
    m.add("a", 3, 1)
    m.add("b", 3, 1)
    step(m)
    m.append("a", 3, 1)
    m.append("b", 3, 1)
    for _ in range(3):
        assert step(m) == ([], [], [])
    assert state(m, "a") == ("waiting", 3, 6, 1) and state(m, "b") == ("waiting", 3, 6, 1) and m.has_work()


# -- the waiting pass's order -------------------------------------------------------------------------------------
def test_resumed_sessions_go_before_new_requests_in_the_order_they_paused():
    """3 blocks. a then b (3 tokens, 1 to sample) are admitted, sample and pause in that order (1 block each, 1
    free). n (2 tokens: 1 block) is added; then b resumes, then a (3 computed + 5 = 8 tokens: 1 more block each).

    The waiting pass takes the kv-holding queue first, in the order its sessions paused (a, b), whatever order
    they resumed in: a's gate cdiv(8, 4) - 1 = 1 <= 1 free, 5 tokens, its 2nd block; b's gate 1 > 0 ends the
    pass; n, whose 1 block would have fitted first, waits."""
    m = engine(3)
    m.add("a", 3, 1)
    m.add("b", 3, 1)
    assert step(m) == ([("a", 3), ("b", 3)], [], ["a", "b"])
    m.add("n", 2, 1)
    m.append("b", 5, 1)
    m.append("a", 5, 1)
    assert step(m) == ([("a", 5)], [], ["a"])
    assert state(m, "a") == ("paused", 8, 9, 2) and m.status("b") == "waiting" and m.status("n") == "waiting"


def test_max_num_seqs_counts_paused_sessions():
    """max_num_seqs 2, 10 blocks. p pauses (1 block); b is admitted (running 0 + paused 1 < 2) and decodes; c
    waits: running 1 + paused 1 = 2, though 8 blocks are free."""
    m = engine(10, seqs=2)
    m.add("p", 3, 1)
    step(m)
    m.add("b", 3, 5)
    assert step(m) == ([("b", 3)], [], ["b"])
    m.add("c", 3, 5)
    assert step(m) == ([("b", 1)], [], []) and m.status("c") == "waiting" and m.free_blocks() == 8
    assert m.reached["max_num_seqs"] >= 1


# -- the token budget and chunked prefill ------------------------------------------------------------------------
def test_the_token_budget_chunks_a_prefill_and_stops_the_waiting_pass():
    """Budget 8, 20 blocks. a (3 tokens) is admitted and decodes. w (20 tokens) and z (2) arrive.

    2. running: a 1 (7 left). Waiting: w's gate cdiv(20, 4) = 5 <= 19 free; min(20, 7) = 7 tokens, cdiv(7, 4) = 2
       blocks. The budget is spent: z is not looked at.
    3. running: a 1; w min(13, 7) = 7 (14 computed: cdiv(14, 4) - 2 = 2 more blocks, 4). Budget spent: z waits.
    4. running: a 1; w 6, its last (20 computed, 5 blocks): it samples. Waiting: z, 2 tokens, 1 block."""
    m = engine(20, budget=8)
    m.add("a", 3, 9)
    step(m)
    m.add("w", 20, 1)
    m.add("z", 2, 1)
    assert step(m) == ([("a", 1), ("w", 7)], [], ["w"]) and state(m, "w") == ("running", 7, 20, 2)
    assert step(m) == ([("a", 1), ("w", 7)], [], []) and state(m, "w") == ("running", 14, 20, 4)
    assert m.status("z") == "waiting"
    assert step(m) == ([("a", 1), ("w", 6), ("z", 1)], [], ["z"]) and state(m, "w") == ("paused", 20, 21, 5)


def test_the_token_budget_leaves_the_last_running_requests_unscheduled_not_preempted():
    """Budget 2, 10 blocks: a, b, c (3 tokens each) wait.

    1. waiting: a min(3, 2) = 2 tokens; the budget is spent.
    2. running: a 1 (3 computed: it samples); waiting: b min(3, 1) = 1.
    3. running: a 1, b 1: the budget is spent in the running pass, and c still waits (nobody is preempted for it)."""
    m = engine(10, budget=2)
    for r in "abc":
        m.add(r, 3, 9)
    assert step(m) == ([("a", 2)], [], ["a"])
    assert step(m) == ([("a", 1), ("b", 1)], [], ["b"])
    assert step(m) == ([("a", 1), ("b", 1)], [], []) and m.status("c") == "waiting"
    assert m.reached["token_budget"] >= 1


@pytest.mark.parametrize("with_paused", [False, True])
def test_the_long_prefill_threshold_caps_a_chunk_only_when_another_request_is_there(with_paused):
    """Threshold 4, budget 64. a (10 tokens) alone is prefilled in one step of 10: the threshold applies only when
    there are more than one request (vLLM: running + waiting, and a paused streaming session counts: it waits for
    its next chunk). With p paused beside it: chunks of 4, 4, 2."""
    m = engine(20, threshold=4)
    if with_paused:
        m.add("p", 3, 1)
        step(m)
    m.add("a", 10, 1)
    if not with_paused:
        assert step(m) == ([("a", 10)], [], ["a"])
        return
    assert step(m) == ([("a", 4)], [], ["a"])
    assert step(m) == ([("a", 4)], [], [])
    assert step(m) == ([("a", 2)], [], []) and state(m, "a") == ("paused", 10, 11, 3)
    assert m.reached["long_prefill"] == 2


# -- the full-sequence gate, the admission cap and the watermark ----------------------------------------------------
def test_a_waiting_request_needs_its_whole_sequence_free_not_just_its_chunk():
    """Budget 4, a 3-block pool less what h holds. w (12 tokens) would take 1 block for its first chunk of 4, but
    vLLM's gate wants cdiv(12, 4) = 3 free: with 2 free it waits; with 3 it is admitted, 4 tokens, 1 block."""
    for pool, admitted in ((3, False), (4, True)):
        m = engine(pool, budget=4)
        m.add("h", 3, 1)  # holds 1 block, paused
        step(m)
        m.add("w", 12, 1)
        got = step(m)
        if admitted:
            assert got == ([("w", 4)], [], ["w"]) and state(m, "w") == ("running", 4, 12, 1)
        else:
            assert got == ([], [], []) and m.status("w") == "waiting" and m.reached["full_sequence_gate"] == 1


def test_a_bounded_request_is_admitted_on_its_capped_need():
    """Sinks S=4, W=8 (bs 4), budget 4: the gate's cap is the sink block plus cdiv(W - 1 + 4, 4) + 1 = 4 window
    blocks, 5 (under cdiv(256, 4)). w (40 tokens: cdiv(40, 4) = 10 blocks uncapped) is admitted with 5 free: its
    first chunk, 4 tokens, 1 block. With 4 free it waits."""
    policy = KVPolicy.sinks(BS, 4, 8)
    for pool, admitted in ((4, False), (5, True)):
        m = engine(pool, budget=4, policy=policy)
        m.add("w", 40, 1)
        got = step(m)
        assert got == (([("w", 4)], [], ["w"]) if admitted else ([], [], [])), (pool, got)


def test_the_watermark_holds_back_an_admission_only_while_something_runs():
    """Watermark 2, 4 blocks. w (3 tokens, 1 block) alone is admitted with 4 free (nothing runs: no watermark).
    Then with a running (1 block) and 3 free, b's 1 block + 2 <= 3 is admitted; c's 1 + 2 > 2 free waits."""
    m = engine(4, watermark=2)
    m.add("a", 3, 9)
    assert step(m) == ([("a", 3)], [], ["a"])
    m.add("b", 3, 9)
    m.add("c", 3, 9)
    assert step(m) == ([("a", 1), ("b", 3)], [], ["b"])
    assert m.status("c") == "waiting" and m.free_blocks() == 2 and m.reached["watermark"] == 1
    m2 = engine(1, watermark=2)
    m2.add("w", 3, 1)
    assert step(m2) == ([("w", 3)], [], ["w"])  # nothing running: the whole pool is there to take


# -- blocks under a window ------------------------------------------------------------------------------------------
def test_blocks_that_left_the_window_go_back_before_the_next_allocation():
    """Window W=8 (bs 4, no sinks), 10 blocks. a (12 tokens, 3 to sample): 3 blocks for its prefill.
    2. before a's 13th token is allocated: at 12 computed the window starts at token 12 - 8 + 1 = 5, block 1, so
       block 0 goes back (2 held); then cdiv(13, 4) - 3 slots (the freed one still counts: vLLM's null block) = 1
       new: 3 held, 4 slots.
    3. at 13 computed the window starts at 6: still block 1, nothing to free; cdiv(14, 4) - 4 = 0 new: 3 held."""
    m = engine(10, policy=KVPolicy.window(BS, 8))
    m.add("a", 12, 3)
    assert step(m) == ([("a", 12)], [], ["a"]) and m.blocks_of("a") == 3
    assert step(m) == ([("a", 1)], [], []) and m.blocks_of("a") == 3 and m.free_blocks() == 7
    assert m.reached["window_free"] == 1
    assert step(m) == ([("a", 1)], [], []) and m.blocks_of("a") == 3 and m.free_blocks() == 7


# -- max_model_len --------------------------------------------------------------------------------------------------
def test_a_running_request_is_never_scheduled_past_max_model_len():
    """max_model_len 12. a (10 tokens, 5 to sample): prefilled (10 computed, 11 tokens), then 1 token: room 12 -
    10 - 1 = 1 (11 computed, 12 tokens). Then room 12 - 11 - 1 = 0: nothing scheduled (vLLM's running pass caps a
    request at max_model_len - computed - 1 and skips it at 0), however many steps: its KV never holds a 12th
    token."""
    m = engine(10, maxlen=12)
    m.add("a", 10, 5)
    assert step(m) == ([("a", 10)], [], ["a"])
    assert step(m) == ([("a", 1)], [], []) and state(m, "a") == ("running", 11, 12, 3)
    for _ in range(3):
        assert step(m) == ([], [], []) and state(m, "a") == ("running", 11, 12, 3)
    assert m.reached["length_limit"] == 3
