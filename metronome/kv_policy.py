"""KV policies: how many tokens and blocks a session holds after it has computed ``n`` tokens.

This is the one place that answers "blocks held by a session after n tokens"; the simulator, the
fill model, the live probe and the vLLM plugin all call it.

Semantics (the same in the simulator, the reference mask and the vLLM plugin, which imports nothing
but this definition). Memory is paged in blocks of ``bs`` tokens, and a paged engine frees a block
only once *every* token in it has left the window, so the bound is **block-granular**. After ``n``
tokens, the next query sits at position ``n``; with ``S* = ceil(S/bs)·bs`` (the sinks are whole blocks)
and the first window block ``ws(n) = floor(max(n − W + 1, 0) / bs)`` (vLLM's own rule,
``num_skipped_tokens = num_computed_tokens − sliding_window + 1``), the cache keeps:

* sink blocks ``0 .. ceil(S/bs) − 1``, never freed;
* window blocks ``ws(n) .. ceil(n/bs) − 1``;
* so a bounded session never holds more than ``ceil(S/bs) + ceil(W/bs) + 1`` blocks.

The query attends to key ``k`` iff ``k <= n and (k < S* or k >= bs·ws(n))``: every resident token and
itself, nothing else (``attended_tokens(n) == resident_tokens(n) + 1``). That is between ``W`` and
``W + bs − 1`` recent keys plus the sink blocks. With ``bs = 1`` it is exactly StreamingLLM's
``k < S or n − k < W``.

Resident *tokens* are the tokens stored in resident blocks (a partly filled last block counts only
its filled slots). Every function accepts an integer or a numpy integer array for ``n``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from metronome.errors import MetronomeError

POLICY_KINDS = ("unbounded", "window", "sinks")
BOUNDED_KINDS = ("window", "sinks")  # the policies that keep a session's KV under a fixed size


def cdiv(a, b):
    """Ceiling division for ints and numpy integer arrays (vLLM's ``cdiv``)."""
    return -(-a // b)


NO_WINDOW = 1 << 62
"""The window of a policy that keeps everything: residency's formula with this window and no sinks is plain
``cdiv(n, bs)`` (no block ever leaves), so one formula serves every policy."""


def resident_blocks_of(n, bs, sink_blocks, window):
    """Blocks resident after ``n`` computed tokens under residency ``(bs, sink_blocks, window)``
    (:meth:`KVPolicy.residency`): the sink blocks below the first window block, and the window's.

    The one statement of residency: :meth:`KVPolicy.resident_blocks` calls it on ints and numpy arrays, and the
    engine step (:func:`metronome.serving.engine_step`) compiles it, so it is written in what numba compiles."""
    lo = np.maximum(n - window + 1, 0) // bs  # the first window block (vLLM: computed − sliding_window + 1)
    return np.minimum(lo, sink_blocks) + (n + bs - 1) // bs - lo


def resident_tokens_of(n, bs, sink_blocks, window):
    """Tokens stored in the blocks :func:`resident_blocks_of` keeps (a partly filled last block counts its filled
    slots)."""
    lo = np.maximum(n - window + 1, 0) // bs
    return np.minimum(lo, sink_blocks) * bs + (n - lo * bs)


@dataclass(frozen=True)
class KVPolicy:
    """``unbounded``, ``window(W)`` or ``sinks(S, W)`` over a paged pool of ``block_size`` tokens."""

    kind: str
    block_size: int
    window_tokens: int = 0
    sink_tokens: int = 0

    def __post_init__(self):
        if self.kind not in POLICY_KINDS:
            raise MetronomeError(f"unknown KV policy {self.kind!r} (one of {', '.join(POLICY_KINDS)})")
        if self.block_size <= 0:
            raise MetronomeError(f"block size must be positive, got {self.block_size}")
        if self.kind == "unbounded":
            if self.window_tokens or self.sink_tokens:
                raise MetronomeError("--window/--sinks only apply to --kv window or --kv sinks")
            return
        if self.window_tokens < self.block_size:
            raise MetronomeError(
                f"window of {self.window_tokens} tokens is under one block ({self.block_size} tokens)")
        if self.kind == "window" and self.sink_tokens:
            raise MetronomeError("--sinks needs --kv sinks (the window policy keeps no sinks)")
        if self.kind == "sinks":
            if self.sink_tokens <= 0:
                raise MetronomeError(f"--kv sinks needs --sinks > 0, got {self.sink_tokens}")
            if self.sink_tokens >= self.window_tokens:
                raise MetronomeError(
                    f"sinks ({self.sink_tokens}) must be fewer than the window ({self.window_tokens} tokens)")

    # -- constructors -------------------------------------------------------------------------------
    @classmethod
    def unbounded(cls, block_size: int) -> "KVPolicy":
        return cls("unbounded", block_size)

    @classmethod
    def window(cls, block_size: int, window_tokens: int) -> "KVPolicy":
        return cls("window", block_size, window_tokens=window_tokens)

    @classmethod
    def sinks(cls, block_size: int, sink_tokens: int, window_tokens: int) -> "KVPolicy":
        return cls("sinks", block_size, window_tokens=window_tokens, sink_tokens=sink_tokens)

    # -- the answers ---------------------------------------------------------------------------------
    @property
    def bounded(self) -> bool:
        return self.kind != "unbounded"

    @property
    def runs_plugin(self) -> bool:
        """Whether a vLLM engine serves this policy through Metronome's sink+window plugin. vLLM's own sliding
        window serves ``window`` as it serves any model (CUDA graphs, no extra host work); the plugin serves
        ``sinks`` in eager mode and copies each step's block table to the host, which a GPU calibration prices
        as :attr:`metronome.calibration.StepLatencyModel.plugin_terms`."""
        return self.kind == "sinks"

    @property
    def sink_blocks(self) -> int:
        return cdiv(self.sink_tokens, self.block_size) if self.kind == "sinks" else 0

    @property
    def window_blocks(self) -> int:
        return cdiv(self.window_tokens, self.block_size) if self.bounded else 0

    @property
    def max_resident_blocks(self) -> int | None:
        """The most blocks one session can ever hold (None when unbounded)."""
        if not self.bounded:
            return None
        return self.sink_blocks + self.window_blocks + 1

    def residency(self) -> tuple[int, int, int]:
        """``(block_size, sink_blocks, window)``: what :func:`resident_blocks_of` and :func:`resident_tokens_of`
        (and the compiled engine step) need to know of the policy. A policy that keeps everything has no
        sinks and a window no session reaches (:data:`NO_WINDOW`)."""
        return self.block_size, self.sink_blocks, self.window_tokens if self.bounded else NO_WINDOW

    def resident_blocks(self, n):
        """Blocks held after ``n`` computed tokens."""
        return resident_blocks_of(np.asarray(n, dtype=np.int64), *self.residency())

    def step_blocks(self, n, k):
        """Blocks held while a step computes ``k`` tokens after ``n``: vLLM frees out-of-window blocks at the
        count *before* the step and then takes the chunk's new blocks, so ``resident_blocks(n) + cdiv(n + k) −
        cdiv(n)``, one or more blocks above ``resident_blocks(n + k)`` when the chunk crosses a block."""
        n = np.asarray(n, dtype=np.int64)
        return self.resident_blocks(n) + cdiv(n + k, self.block_size) - cdiv(n, self.block_size)

    def resident_tokens(self, n):
        """Tokens stored in the resident blocks after ``n`` computed tokens."""
        return resident_tokens_of(np.asarray(n, dtype=np.int64), *self.residency())

    def attended_tokens(self, n):
        """Keys the query at position ``n`` attends to, itself included: every resident token plus itself
        (block-granular; see the module docstring)."""
        return self.resident_tokens(n) + 1

    def canonical(self, n):
        """Fold ``n`` onto a small representative: ``(n_c, block_offset, token_offset)`` such that for
        every ``d >= 0``::

            resident_blocks(n + d) == resident_blocks(n_c + d) + block_offset
            resident_tokens(n + d) == resident_tokens(n_c + d) + token_offset

        Residency is periodic in ``n`` with period ``block_size`` (unbounded: up to a whole-block offset;
        bounded: once the window has passed the sink blocks), so sessions that grow in lockstep can be
        counted per residue class instead of one by one."""
        n = np.asarray(n, dtype=np.int64)
        bs = self.block_size
        if not self.bounded:
            n_c = n % bs
            return n_c, n // bs, n - n_c
        steady = self.sink_blocks * bs + self.window_tokens - 1
        n_c = np.where(n >= steady, steady + (n - steady) % bs, n)
        zero = np.zeros_like(n)
        return n_c, zero, zero

    def admission_cap_blocks(self, max_in_flight_tokens: int, max_model_len: int) -> int | None:
        """The KV spec's per-request admission cap in blocks (None: full attention, no cap).

        Blocks are freed on the computed-token basis before each chunk is allocated, so a request holds at
        most the blocks of its last ``W − 1`` computed tokens plus the tokens in flight, +1 because the
        window need not start on a block boundary: vLLM's ``SlidingWindowSpec.max_admission_blocks_per_request``
        for ``window``; the sink+window plugin adds the sink blocks and caps at ``cdiv(max_model_len, bs)``."""
        if not self.bounded:
            return None
        window = int(cdiv(min(self.window_tokens - 1 + max_in_flight_tokens, max_model_len), self.block_size)) + 1
        if self.kind == "window":
            return window
        return min(self.sink_blocks + window, int(cdiv(max_model_len, self.block_size)))

    @property
    def kept_tokens(self) -> int:
        """The tokens the bound keeps, S + W (0 when unbounded): how long a session takes to reach its steady
        state is this many tokens (plus up to a block) at its token rate."""
        return self.sink_tokens + self.window_tokens if self.bounded else 0

    def rebase_tokens(self) -> int | None:
        """Prompt length of a session rebased near ``max_model_len``: S sinks plus the last W tokens."""
        return self.kept_tokens if self.bounded else None

    def describe(self) -> str:
        if self.kind == "unbounded":
            return "unbounded"
        if self.kind == "window":
            return f"window(W={self.window_tokens})"
        return f"sinks(S={self.sink_tokens}, W={self.window_tokens})"

    def short_words(self) -> str:
        """How a sentence names the bound: ``sinks S=16, W=368``, ``window W=368`` or ``unbounded``."""
        if self.kind == "sinks":
            return f"sinks S={self.sink_tokens}, W={self.window_tokens}"
        return f"window W={self.window_tokens}" if self.bounded else "unbounded"

    def serving_words(self) -> str:
        """What serves the policy in a vLLM engine."""
        if self.runs_plugin:
            return "the metronome sink+window vLLM plugin"
        return "vLLM's own sliding window" if self.bounded else "vLLM, unbounded"

    def options(self) -> dict:
        """The policy as command-line style options (``kv``, ``window``, ``sinks``; None where it has none), which
        :func:`make_policy` reads back."""
        return {"kv": self.kind, "window": self.window_tokens if self.bounded else None,
                "sinks": self.sink_tokens if self.kind == "sinks" else None}

    def cli_args(self) -> list[str]:
        """The flags that select this policy on any command (``--kv``, ``--window``, ``--sinks``)."""
        return [x for k, v in self.options().items() if v is not None for x in (f"--{k}", str(v))]

    def engine_settings(self) -> dict:
        """How a live engine runs the policy (``metronome.probe.engine.EngineConfig`` fields): a sliding window
        for a bounded policy, plus sinks when the plugin serves it."""
        return {"sliding_window": self.window_tokens if self.bounded else None,
                "sinks": self.sink_tokens if self.runs_plugin else None}

    def slug(self) -> str:
        """A file-name part: ``""``, ``-window368`` or ``-sinks16-window368``."""
        o = self.options()
        return "".join(f"-{k}{o[k]}" for k in ("sinks", "window") if o[k] is not None)


def takes_sinks(kind: str) -> bool:
    """Whether the policy ``kind`` keeps sink tokens (``--sinks`` applies to it)."""
    return kind == "sinks"


def check_sinks_option(kind: str, sink_tokens: int | None, required: bool = False) -> None:
    """``--sinks`` given to a policy that keeps none is an error (a command that takes one policy); with
    ``required``, a sinks policy must be given its S."""
    if sink_tokens and not takes_sinks(kind):
        raise MetronomeError(f"--sinks needs --kv sinks (the {kind} policy keeps no sinks)")
    if required and takes_sinks(kind) and not sink_tokens:
        raise MetronomeError("--kv sinks needs --sinks S (sink tokens) and --window W")


def make_policy(kind: str, block_size: int, window_tokens: int | None = None, sink_tokens: int | None = None) -> KVPolicy:
    """Build a policy from CLI-style options, with one-line errors for bad combinations.

    Options a policy has no use for are ignored (``--window`` under ``unbounded``, ``--sinks`` under
    ``window``), so one what-if grid can compare policies."""
    if kind == "unbounded":
        return KVPolicy("unbounded", block_size)
    if kind in ("window", "sinks") and window_tokens is None:
        raise MetronomeError(f"--kv {kind} needs --window TOKENS")
    if kind == "window":
        return KVPolicy("window", block_size, window_tokens=int(window_tokens))
    return KVPolicy(kind, block_size, window_tokens=int(window_tokens or 0), sink_tokens=int(sink_tokens or 0))
