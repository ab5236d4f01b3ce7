"""A live session's token ids (``metronome.probe.token_book``), move by move, with ids written by hand.

The same book is checked in bulk by ``tests/test_front_end_differential.py``: on 240 random scenarios every
id the driver hands the fake engine is replayed against what the engine held (``fake_engine.token_id_errors``).
"""

from metronome.probe.token_book import TokenBook


def draw_from(ids):
    it = iter(ids)
    return lambda n: [next(it) for _ in range(n)]


def test_the_five_moves_keep_the_ids_vllm_holds():
    b = TokenBook()
    assert b.new and len(b) == 0
    draw = draw_from(range(100, 200))
    b.silent([1, 2])  # 1. a frame it waited through (input kept for later)
    first = b.chunk(3, 2, draw)  # 2. its first frame: a prompt of 3, the waiting input, 2 of its own
    assert first == [100, 101, 102, 1, 2, 103, 104] and b.pending == [1, 2]  # nothing moves before it is sent
    b.sent(first)
    assert b.history == first and b.pending == [] and not b.new
    b.sampled([7, 8])  # 3. two tokens out: vLLM keeps 7; 8 was never computed and is re-fed
    assert b.history == first + [7] and b.last == 8 and len(b) == 9
    nxt = b.chunk(3, 2, draw)
    assert nxt == [8, 105, 106]  # the re-fed token, then the input (no prompt after the first frame)
    b.sent(nxt)
    b.preempted([9])  # 4. preempted mid-frame: the one token it got joins the history
    assert b.history == first + [7, 8, 105, 106, 9] and b.last is None
    b.silent([3])
    prompt = b.take_prompt()  # 5. readmitted: the whole history and the waiting input
    assert prompt == first + [7, 8, 105, 106, 9, 3] and b.pending == []
    b.restarted(prompt)
    b.prefilled(11)
    assert b.last == 11 and b.chunk(0, 1, draw) == [11, 107]


def test_a_preemption_between_frames_keeps_the_token_sampled_last():
    b = TokenBook([5, 6], [], 7)  # paused after a frame: 7 sampled, not yet re-fed
    b.preempted(None)
    assert b.history == [5, 6, 7] and b.last is None and len(b) == 3
    b.restarted([6, 7])  # a rebase kept the last two
    assert b.history == [6, 7] and b.pending == []
