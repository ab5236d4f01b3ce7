"""Text in and out of ``metronome-serve`` (serve/app.py), with a real Hugging Face tokenizer built in memory (a
word-level vocabulary: no download), no engine: an ``input_text.append`` is its text's token ids as one input frame,
held to a frame's tokens and padded with silence like ``input_tokens.append``; each ``response.frame`` carries its
tokens' text; a server whose model has no tokenizer refuses text and says so in ``session.created``."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from metronome.calibration import TokenStream
from metronome.serve.app import ServeState, _handle, _send
from metronome.serve.gateway import Client

VOCAB = {"[UNK]": 0, "hello": 5, "world": 6, "again": 7, "and": 8}
N_IN = 4
SILENCE = 1


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]")


def _state(tokenizer) -> ServeState:
    gw = SimpleNamespace(cfg=SimpleNamespace(stream=TokenStream(0.1, N_IN, 2), deadline=0.1), silence_token=SILENCE)
    return ServeState(vocab_size=len(VOCAB) + 10, gateway=gw, tokenizer=tokenizer)


def _events(client: Client) -> list:
    out = []
    while not client.out.empty():
        out.append(client.out.get_nowait())
    return out


def test_text_is_one_input_frame_of_its_tokens_padded_and_held_to_a_frame():
    async def main():
        state = _state(_tokenizer())
        c = Client("c", asyncio.get_running_loop())
        assert state.session_info()["text"] is True
        _handle(state, c, json.dumps({"type": "input_text.append", "text": "hello world"}))
        _handle(state, c, json.dumps({"type": "input_text.append", "text": "hello world again and hello"}))
        _handle(state, c, json.dumps({"type": "input_text.append", "text": 42}))
        _handle(state, c, json.dumps({"type": "input_tokens.append", "token_ids": [7, 8]}))
        frames = [c.inputs.get_nowait() for _ in range(c.inputs.qsize())]
        assert frames == [(0, [5, 6, SILENCE, SILENCE]), (1, [7, 8, SILENCE, SILENCE])]  # numbered as sent
        assert [e["error"]["code"] for e in _events(c)] == ["frame_too_long", "invalid_value"]
        assert c.sent_in == 2  # (a frame refused for its content was never sent as a frame)

    asyncio.run(main())


def test_each_frame_carries_its_tokens_text_and_a_model_without_a_tokenizer_refuses_text():
    class Socket:
        def __init__(self):
            self.sent = []

        async def send_text(self, text):
            self.sent.append(json.loads(text))

        async def close(self, code):
            self.sent.append(("close", code))

    async def main(tokenizer):
        c = Client("c", asyncio.get_running_loop())
        for ids in ([5, 6], []):
            c.out.put_nowait({"type": "response.frame", "frame": 0, "input": 0, "token_ids": ids, "text": None,
                              "silent": not ids, "late": False, "latency_ms": 1.0})
        c.out.put_nowait(("close", 1000))
        ws = Socket()
        await _send(ws, c, tokenizer)
        return [m["text"] for m in ws.sent[:2]]

    assert asyncio.run(main(_tokenizer())) == ["hello world", None]  # (a silent frame has no text)
    assert asyncio.run(main(None)) == [None, None]

    async def refused():
        state = _state(None)
        c = Client("c", asyncio.get_running_loop())
        _handle(state, c, json.dumps({"type": "input_text.append", "text": "hello"}))
        return state.session_info()["text"], [e["error"]["code"] for e in _events(c)], c.inputs.qsize()

    assert asyncio.run(refused()) == (False, ["unsupported"], 0)


def test_the_server_finds_a_checkpoints_tokenizer_and_none_where_there_is_none(tmp_path):
    from metronome.cli.serve_cli import _tokenizer as load

    assert load(str(tmp_path)) is None  # (tiny: a config and weights, no tokenizer)
    _tokenizer().save_pretrained(tmp_path / "ckpt")
    tok = load(str(tmp_path / "ckpt"))
    assert tok is not None and tok.encode("world hello", add_special_tokens=False) == [6, 5]


def test_what_the_server_runs_cannot_be_updated_even_to_what_it_is():
    """``session.update`` may set the stream within limits; the vocabulary is the model's (even asked as it is)."""
    async def main():
        state = _state(_tokenizer())
        c = Client("c", asyncio.get_running_loop())
        _handle(state, c, json.dumps({"type": "session.update", "session": {"vocab_size": state.vocab_size}}))
        _handle(state, c, json.dumps({"type": "session.update", "session": {"frame_period_s": 0.1}}))
        return [e.get("type") for e in _events(c)]

    assert asyncio.run(main()) == ["error", "session.updated"]
