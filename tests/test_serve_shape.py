"""``session.update`` in ``metronome-serve``'s handler (serve/app.py), no engine: what a session may ask for (never a
stream that costs more than the server's: a period no shorter, no more tokens a frame), what it may not set at all,
and input held to the shape it asked for. The gateway's side (the shape applied at a frame boundary, the clock
running on) is tests/test_serve_gateway.py's; the live one, tests/live/test_serve.py's."""

from __future__ import annotations

import asyncio
import json

from test_serve_text import N_IN, _events, _state

from metronome.serve.app import _handle
from metronome.serve.gateway import Client

P = 0.1  # the harness's server: 0.1 s frames, N_IN tokens in, 2 out, deadline 0.1 s


def _update(asked: dict, then=()) -> tuple[list, Client, list]:
    async def main():
        state = _state(None)
        posted = []
        state.gateway.update_shape = posted.append
        c = Client("c", asyncio.get_running_loop())
        _handle(state, c, json.dumps({"type": "session.update", "session": asked}))
        for ev in then:
            _handle(state, c, json.dumps(ev))
        return _events(c), c, posted

    return asyncio.run(main())


def test_a_shape_within_the_limits_waits_in_the_input_queue_for_the_gateway():
    events, c, posted = _update({"frame_period_s": 0.25, "input_tokens_per_frame": 2, "output_tokens_per_frame": 1,
                                 "deadline_s": 0.5})
    assert events == [] and posted == [c]  # session.updated comes from the gateway, once it applied the shape
    kind, shape, message = c.inputs.get_nowait()
    assert kind == "shape" and shape == {"frame_period_s": 0.25, "input_tokens_per_frame": 2,
                                         "output_tokens_per_frame": 1, "deadline_s": 0.5}
    assert message["type"] == "session.updated" and message["session"]["frame_period_s"] == 0.25
    assert message["session"]["limits"]["frame_period_s"] == [P, 10 * P]


def test_asking_for_the_shape_one_has_is_answered_at_once():
    events, c, posted = _update({"frame_period_s": P, "input_tokens_per_frame": N_IN})
    assert [e["type"] for e in events] == ["session.updated"] and posted == [] and c.inputs.empty()


def test_a_shape_outside_the_limits_or_of_the_wrong_type_is_an_error_and_changes_nothing():
    for asked, says in [({"frame_period_s": P / 2}, "frame_period_s must be a number in [0.1, 1]"),
                        ({"frame_period_s": 10 * P + 0.01}, "frame_period_s must be a number in [0.1, 1]"),
                        ({"input_tokens_per_frame": N_IN + 1},
                         f"input_tokens_per_frame must be an integer in [1, {N_IN}]"),
                        ({"input_tokens_per_frame": 0}, "input_tokens_per_frame must be an integer in"),
                        ({"output_tokens_per_frame": 1.5}, "output_tokens_per_frame must be an integer in [1, 2]"),
                        ({"output_tokens_per_frame": True}, "output_tokens_per_frame must be an integer"),
                        ({"deadline_s": 0}, "deadline_s must be a number in [0.001, 1]"),
                        ({"deadline_s": "fast"}, "deadline_s must be a number"),
                        ({"vocab_size": 10}, "cannot set vocab_size"),
                        ({"frame_period_s": 0.2, "server": {}}, "cannot set server")]:
        events, c, posted = _update(asked)
        assert [e["type"] for e in events] == ["error"], asked
        assert says in events[0]["error"]["message"], (asked, events[0]["error"]["message"])
        assert posted == [] and c.inputs.empty() and c.shape == {}


def test_input_after_a_shape_is_held_to_it():
    """Frames sent after the update queue behind it at the new size: longer is refused, shorter padded."""
    events, c, _ = _update({"input_tokens_per_frame": 2}, then=[
        {"type": "input_tokens.append", "token_ids": [5, 6, 7]},
        {"type": "input_tokens.append", "token_ids": [5]}])
    assert [e["error"]["code"] for e in events] == ["frame_too_long"]
    assert "at most 2 tokens" in events[0]["error"]["message"]
    items = list(c.inputs.queue)
    assert items[0][0] == "shape" and items[1] == (0, [5, 1])  # (1: the harness's silence token)
