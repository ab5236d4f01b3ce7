"""A live session's token ids: what its engine request holds, what it has not sent yet, what it sampled last.

The simulator moves counts; a live session has to hand vLLM the ids themselves, and vLLM's streaming request
keeps them in a way the front end must mirror: a chunk appended to a paused request **drops the last token it
sampled** (never computed, so never in the KV), and the caller re-feeds it at the head of the next chunk. Every
move of the front end that touches tokens is one of five (docs/front-end.md, "Token ids"), and each is one
method here:

1. a silent frame: its input waits (:meth:`TokenBook.silent`);
2. a frame submitted: ``last + pending + input``, or a first frame's ``prompt + pending + input``
   (:meth:`TokenBook.chunk`, then :meth:`TokenBook.sent`);
3. a frame's tokens: all but the last join the history, the last is re-fed (:meth:`TokenBook.sampled`);
4. a preemption: what the request held joins the history (:meth:`TokenBook.preempted`);
5. a readmission or a rebase: a new request whose prompt is the history and the waiting input
   (:meth:`TokenBook.take_prompt`), or what the policy keeps of it (``serving.rebase_ids``), which becomes the
   new history (:meth:`TokenBook.restarted`).

Which move happens when is the front end's rule (:mod:`metronome.probe.driver`); the book only keeps the ids
consistent with what vLLM holds, so that a readmitted session re-prefills exactly what it had.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class TokenBook:
    history: list[int] = field(default_factory=list)  # ids the session's request holds or was given
    pending: list[int] = field(default_factory=list)  # input of silent frames, not yet in the engine
    last: int | None = None  # sampled last, not in the engine's history: re-fed with the next chunk

    @property
    def new(self) -> bool:
        """Nothing of the session reached an engine yet: its first frame carries the prompt."""
        return not self.history and self.last is None

    def __len__(self) -> int:
        """Tokens a request restarting the session now would carry (before any rebase)."""
        return len(self.history) + len(self.pending) + (self.last is not None)

    def silent(self, ids: list[int]) -> None:
        """1. A frame answered silent: its input joins the session when it next sends."""
        self.pending.extend(ids)

    def chunk(self, prompt_tokens: int, input_tokens: int, draw: Callable[[int], list[int]]) -> list[int]:
        """2. The ids a frame appends: the re-fed last token (or, for the first frame, a prompt of
        ``prompt_tokens`` drawn ids), the waiting input, and ``input_tokens`` drawn ids of its own. Drawn in
        that order, so one seed gives one run. Nothing changes until :meth:`sent`."""
        head = draw(max(prompt_tokens, 1)) if self.last is None else [self.last]
        return head + self.pending + draw(input_tokens)

    def sent(self, chunk: list[int]) -> None:
        """2. The engine took ``chunk`` on the session's request."""
        self.history.extend(chunk)
        self.pending = []

    def sampled(self, tokens: list[int]) -> None:
        """3. A frame's tokens are all in: vLLM keeps all but the last in the history; the last is re-fed."""
        self.history.extend(tokens[:-1])
        self.last = tokens[-1]

    def prefilled(self, token: int) -> None:
        """3. A restarted request's prefill sampled ``token``: it starts the next chunk."""
        self.last = token

    def preempted(self, inflight: list[int] | None) -> None:
        """4. The request is gone (preempted, or lost with the engine). With a frame in flight its chunk is
        already in the history and the tokens it got join it; otherwise the token sampled last does."""
        if inflight is not None:
            self.history.extend(inflight)
        elif self.last is not None:
            self.history.append(self.last)
        self.last = None

    def take_prompt(self) -> list[int]:
        """5. A restart's prompt before any rebase: the history and the waiting input (which it consumes)."""
        prompt, self.pending = self.history + self.pending, []
        return prompt

    def restarted(self, tokens: list[int]) -> None:
        """5. A new request holds ``tokens`` (a readmission's prompt, or a rebase's prompt and chunk)."""
        self.history = list(tokens)
        self.pending = []
