"""How fast a session's KV really grows: the stream's rate while the engine keeps up, its throughput past that.

A running session has one frame in flight at a time (:mod:`metronome.sim.engine`: due frames wait in its
``backlog`` and the front end submits the oldest when the last is answered). A frame that starts with ``c``
computed tokens is ``output_tokens_per_frame`` engine steps: the first computes ``input_tokens_per_frame + 1``
tokens (the token sampled last, re-fed, and the frame's input) over ``c`` computed tokens, each later one 1
token over ``c + input + j`` (sub-step ``j``). The step's ``context_tokens`` are the scheduled requests' resident
tokens at their computed counts before the step (:meth:`KVPolicy.resident_tokens`), and its cost is the
calibration's step model (:meth:`Calibration.step_latency_for`) times the mean of its jitter
(:func:`metronome.jitter.mean_ratio`).

With ``N`` sessions in flight the engine serves one frame of each in ``T(N, c)`` seconds when every one of them
has work in every step:

* **aligned** phases: the ``N`` frames go through the same sub-step together, so a frame is the sum over its
  sub-steps of one step of ``N`` sequences computing ``N·k_j`` tokens;
* **independent** phases: every session has work in every step (a backlog), but each sits at its own sub-step,
  so a step batches the ``N`` sessions spread evenly over the ``n_out`` sub-steps (``N/n_out`` at each): it
  computes ``N·(in + out)/n_out`` tokens over the mean context, and a frame is ``n_out`` such steps.

Either way the session adds ``kv_tokens_per_frame`` tokens per frame served, so its KV grows at
``kv_tokens_per_frame / max(P, T(N, c))``: the stream rate while ``T ≤ P`` (the engine keeps up and each frame
waits for its tick), the engine's throughput past it (frames come due faster than they are served, the backlog
grows, every frame is answered late). The first-step term (``frame_first_s``) is left out: it is paid only by a
step after the engine waited, which an engine behind the clock never does, and an engine that keeps up on
average (``T ≤ P``) catches up after each such step, so it never sets the rate.

A step whose new tokens pass ``max_num_batched_tokens`` is split into as many steps as the budget needs, each
taking an equal share of the sequences, context and tokens.

Sessions the front end cannot place (waiting for blocks, preempted) are not in the batch: their frames are
answered silent at the tick and only their input joins their history (``pending_in``), ``input_tokens_per_frame``
a period. The fill model counts them as the ``N`` that the engine does not serve.
"""

from __future__ import annotations

import numpy as np

from metronome.calibration import Calibration, TokenStream
from metronome.jitter import mean_ratio
from metronome.kv_policy import KVPolicy
from metronome.serving import check_phases


def frame_steps(stream: TokenStream) -> tuple[np.ndarray, np.ndarray]:
    """A frame's engine steps: (tokens step ``j`` computes, tokens the frame has computed before it). The first
    computes the re-fed token and the input, each later one the token sampled last."""
    j = np.arange(stream.output_tokens_per_frame)
    new = np.where(j == 0, stream.input_tokens_per_frame + 1, 1)
    return new, np.where(j == 0, 0, stream.input_tokens_per_frame + j)


class FrameService:
    """``T(N, c)`` of one engine serving one policy under one phase regime (:func:`frame_service_s`), with what
    does not depend on ``N`` and ``c`` worked out once: the mean-field clocks of the fill model call it hundreds
    of times a run."""

    def __init__(self, calibration: Calibration, policy: KVPolicy, phases: str):
        check_phases(phases)
        self.policy, self.aligned = policy, phases == "aligned"
        self.lat = calibration.step_latency_for(policy)
        self.ratio = mean_ratio(self.lat)
        self.budget = calibration.engine.max_num_batched_tokens
        self.new, self.before = frame_steps(calibration.stream)

    def steps_s(self, batch, context_tokens, new_tokens):
        """Seconds of the engine's steps over ``batch`` sequences, ``context_tokens`` and ``new_tokens`` (split into
        steps the token budget allows), at the step model's mean."""
        m = np.maximum(np.ceil(new_tokens / self.budget), 1.0)
        return m * self.lat.step_s(batch / m, context_tokens / m, new_tokens / m) * self.ratio

    def __call__(self, sessions, computed_tokens):
        n = np.asarray(sessions, dtype=float)[..., None]
        # per sub-step j of a frame that starts after computed_tokens: the tokens it computes, the resident tokens
        # it attends over (the last axis is j)
        ctx = self.policy.resident_tokens(np.asarray(computed_tokens, dtype=np.int64)[..., None] + self.before)
        ctx = ctx.astype(float)
        if self.aligned:
            t = self.steps_s(n, n * ctx, n * self.new).sum(axis=-1)
        else:
            t = self.new.size * self.steps_s(n[..., 0], n[..., 0] * ctx.mean(axis=-1), n[..., 0] * self.new.mean())
        return np.where(np.asarray(sessions) > 0, t, 0.0)


def frame_service_s(calibration: Calibration, policy: KVPolicy, phases: str, sessions, computed_tokens):
    """``T(N, c)``: seconds the engine takes to serve one frame of each of ``sessions`` sessions, each of which has
    ``computed_tokens`` tokens at the frame's start and work in every step (module docstring). Vectorised:
    ``sessions`` and ``computed_tokens`` broadcast; 0 for no sessions."""
    return FrameService(calibration, policy, phases)(sessions, computed_tokens)


def frame_time_s(calibration: Calibration, policy: KVPolicy, phases: str, sessions, computed_tokens):
    """Seconds between a session's served frames: ``max(P, T(N, c))``."""
    return np.maximum(calibration.stream.frame_period_s,
                      frame_service_s(calibration, policy, phases, sessions, computed_tokens))


def kv_tokens_per_s(calibration: Calibration, policy: KVPolicy, phases: str, sessions, computed_tokens):
    """How fast one of ``sessions`` sessions' KV grows at ``computed_tokens``: ``kv_tokens_per_frame / max(P, T)``."""
    return calibration.stream.kv_tokens_per_frame / frame_time_s(calibration, policy, phases, sessions,
                                                                 computed_tokens)
