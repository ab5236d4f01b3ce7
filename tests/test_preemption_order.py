"""The live engine reports a step's preempted requests in the order vLLM preempted them (newest running first),
although vLLM hands them over as a set: the front end requeues each at the head of its queue in that order, as the
simulator's engine model does, so the two readmit the same session first."""

from metronome.probe.engine import preemption_order


def test_victims_come_back_in_the_order_vllm_preempted_them():
    # running was [a, b, c, d]; a dry pool preempted d, then c (running.pop() each time), each prepended to
    # waiting, which held [w1, w2]: waiting is now [c, d, w1, w2]. The order of preemption is d, then c.
    assert preemption_order({"c", "d"}, ["c", "d", "w1", "w2"]) == ["d", "c"]
    # three victims, ids that sort the other way round: z preempted first, then m, then a
    assert preemption_order({"a", "m", "z"}, ["a", "m", "z", "q"]) == ["z", "m", "a"]


def test_a_victim_that_left_the_queue_in_the_same_step_comes_last():
    # b was preempted first, then a; x was preempted and finished (aborted) before the queue was read
    assert preemption_order({"a", "b", "x"}, ["a", "b"]) == ["b", "a", "x"]
