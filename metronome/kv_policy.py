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

A policy is a class (:class:`KVPolicy` and its subclasses) that declares its parameters and how they set that
residency; :func:`register` makes it known to every command's ``--kv`` and parameter flags, the options records,
the summaries and the report, which ask the policy rather than branch on its name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, ClassVar

import numpy as np

from metronome.errors import MetronomeError

def cdiv(a, b):
    """Ceiling division for ints and numpy integer arrays (vLLM's ``cdiv``)."""
    return -(-a // b)


def blocks_in(n, bs):
    """``floor(n / bs)``: the whole blocks of ``bs`` tokens in ``n`` tokens (ints or numpy integer arrays, ``n``
    negative too). Compiled code divides by a shift where ``bs`` is a power of two (its compiled form, in
    :mod:`metronome.serving`): the block size is known only at run time, and the simulator's loop divides by it
    several times for each request of each step."""
    return n // bs


NO_WINDOW = 1 << 62
"""The window of a policy that keeps everything: residency's formula with this window and no sinks is plain
``cdiv(n, bs)`` (no block ever leaves), so one formula serves every policy."""


def resident_blocks_of(n, bs, sink_blocks, window):
    """Blocks resident after ``n`` computed tokens under residency ``(bs, sink_blocks, window)``
    (:meth:`KVPolicy.residency`): the sink blocks below the first window block, and the window's.

    The one statement of residency: :meth:`KVPolicy.resident_blocks` calls it on ints and numpy arrays, and the
    engine step (:func:`metronome.serving.engine_step`) compiles it, so it is written in what numba compiles."""
    lo = blocks_in(np.maximum(n - window + 1, 0), bs)  # the first window block (vLLM: computed − sliding_window + 1)
    return np.minimum(lo, sink_blocks) + blocks_in(n + bs - 1, bs) - lo


def resident_tokens_of(n, bs, sink_blocks, window):
    """Tokens stored in the blocks :func:`resident_blocks_of` keeps (a partly filled last block counts its filled
    slots)."""
    lo = blocks_in(np.maximum(n - window + 1, 0), bs)
    return np.minimum(lo, sink_blocks) * bs + (n - lo * bs)


@dataclass(frozen=True)
class PolicyParam:
    """A parameter a KV policy declares: ``--NAME`` on every command that takes a policy, ``NAME`` in the options
    records and summaries, held in the policy's field ``attr`` (tokens)."""

    name: str
    attr: str
    help: str
    required: bool = True
    sizes: bool = True  # it sets how much a session keeps (a report sizes it when not given)


WINDOW = PolicyParam("window", "window_tokens", "window W in tokens: the last W tokens stay resident")
SINKS = PolicyParam("sinks", "sink_tokens", "sink tokens S: the first S tokens stay resident (whole blocks)",
                    sizes=False)

_POLICIES: dict[str, type["KVPolicy"]] = {}


def register(cls: type["KVPolicy"]) -> type["KVPolicy"]:
    """Make a policy class known by its ``kind``: every command's ``--kv`` and its parameters' flags, the options
    records, the simulator and the report take it from here."""
    _POLICIES[cls.kind] = cls
    return cls


def policy_kinds() -> tuple[str, ...]:
    return tuple(_POLICIES)


def bounded_kinds() -> tuple[str, ...]:
    """The policies that keep a session's KV under a fixed size."""
    return tuple(k for k, c in _POLICIES.items() if c.bounded)


def policy_params() -> dict[str, PolicyParam]:
    """Every parameter some registered policy declares, by name, in registration order."""
    out: dict[str, PolicyParam] = {}
    for c in _POLICIES.values():
        for p in c.params:
            out.setdefault(p.name, p)
    return out


def policy_class(kind: str) -> type["KVPolicy"]:
    if kind not in _POLICIES:
        raise MetronomeError(f"unknown KV policy {kind!r} (one of {', '.join(_POLICIES)})")
    return _POLICIES[kind]


@dataclass(frozen=True)
class KVPolicy:
    """A KV policy over a paged pool of ``block_size`` tokens. Every policy keeps the same shape of residency, its
    first ``sink_tokens`` (whole blocks) and its last ``window_tokens`` (:func:`resident_blocks_of`), which the
    compiled engine step, the fill model and the plugin read through :meth:`residency`; a policy class declares
    its own parameters (``params``) and how they set that residency. ``window_tokens == 0`` keeps everything.

    The built-in ones: :class:`UnboundedKV`, :class:`WindowKV`, :class:`SinksKV`, and :class:`BudgetKV`."""

    block_size: int
    window_tokens: int = 0
    sink_tokens: int = 0

    kind: ClassVar[str] = ""
    params: ClassVar[tuple[PolicyParam, ...]] = ()
    bounded: ClassVar[bool] = True

    def __post_init__(self):
        if self.block_size <= 0:
            raise MetronomeError(f"block size must be positive, got {self.block_size}")
        if not self.bounded:
            return
        if self.window_tokens < self.block_size:
            raise MetronomeError(
                f"window of {self.window_tokens} tokens is under one block ({self.block_size} tokens)")
        if self.sink_tokens < 0:
            raise MetronomeError(f"sinks must be 0 or more, got {self.sink_tokens}")
        if self.sink_tokens >= self.window_tokens:
            raise MetronomeError(
                f"sinks ({self.sink_tokens}) must be fewer than the window ({self.window_tokens} tokens)")

    # -- constructors -------------------------------------------------------------------------------
    @classmethod
    def unbounded(cls, block_size: int) -> "KVPolicy":
        return UnboundedKV(block_size)

    @classmethod
    def window(cls, block_size: int, window_tokens: int) -> "KVPolicy":
        return WindowKV(block_size, window_tokens=window_tokens)

    @classmethod
    def sinks(cls, block_size: int, sink_tokens: int, window_tokens: int) -> "KVPolicy":
        return SinksKV(block_size, window_tokens=window_tokens, sink_tokens=sink_tokens)

    @classmethod
    def from_params(cls, block_size: int, values: dict) -> "KVPolicy":
        """The policy from its parameters' values (None: not given; a required one missing is an error)."""
        kw = {}
        for p in cls.params:
            v = values.get(p.name)
            if v is None:
                if p.required:
                    raise MetronomeError(f"--kv {cls.kind} needs --{p.name} ({p.help})")
                continue
            kw[p.attr] = int(v)
        return cls(block_size, **kw)

    @classmethod
    def sized(cls, block_size: int, given: dict, kept_for: Callable[[int], int]) -> "KVPolicy":
        """The policy a report recommends: the parameters the user ``given`` as they are, the others sized so that
        the session keeps ``kept_for(sink_tokens)`` tokens in all (the report's choice of S + W)."""
        raise NotImplementedError

    # -- the answers ---------------------------------------------------------------------------------
    @property
    def runs_plugin(self) -> bool:
        """Whether a vLLM engine serves this policy through Metronome's sink+window plugin: a bound that keeps
        sinks. vLLM's own sliding window serves a bound without them as it serves any model (CUDA graphs, no extra
        host work); the plugin serves sinks in eager mode and copies each step's block table to the host, which a
        GPU calibration prices as :attr:`metronome.calibration.StepLatencyModel.plugin_terms`."""
        return self.bounded and self.sink_tokens > 0

    @property
    def sink_blocks(self) -> int:
        return cdiv(self.sink_tokens, self.block_size) if self.bounded else 0

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
        for its own window; the sink+window plugin adds the sink blocks and caps at ``cdiv(max_model_len, bs)``."""
        if not self.bounded:
            return None
        window = int(cdiv(min(self.window_tokens - 1 + max_in_flight_tokens, max_model_len), self.block_size)) + 1
        if not self.runs_plugin:
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

    def _values(self, named: bool = False) -> list[tuple[str, int]]:
        """The parameters' values; ``named``: as text names them, an optional one left out at 0."""
        return [(p.name, getattr(self, p.attr)) for p in self.params
                if not (named and not p.required and not getattr(self, p.attr))]

    def describe(self) -> str:
        """``sinks(S=16, W=368)``: the kind and its parameters."""
        words = ", ".join(f"{_LETTER.get(k, k)}={v}" for k, v in self._values(named=True))
        return f"{self.kind}({words})" if words else self.kind

    def short_words(self) -> str:
        """How a sentence names the bound: ``sinks S=16, W=368``, ``window W=368`` or ``unbounded``."""
        return " ".join([self.kind, ", ".join(f"{_LETTER.get(k, k)}={v}" for k, v in self._values(named=True))]).strip()

    def serving_words(self) -> str:
        """What serves the policy in a vLLM engine."""
        if self.runs_plugin:
            return "the metronome sink+window vLLM plugin"
        return "vLLM's own sliding window" if self.bounded else "vLLM, unbounded"

    def options(self) -> dict:
        """The policy as command-line style options: ``kv`` and the policy's own parameters, which
        :func:`make_policy` reads back."""
        return {"kv": self.kind, **dict(self._values())}

    def cli_args(self) -> list[str]:
        """The flags that select this policy on any command (``--kv`` and its parameters)."""
        return [x for k, v in self.options().items() if v is not None for x in (f"--{k}", str(v))]

    def engine_settings(self) -> dict:
        """How a live engine runs the policy (``metronome.probe.engine.EngineConfig`` fields): a sliding window
        for a bounded policy, plus sinks when the plugin serves it."""
        return {"sliding_window": self.window_tokens if self.bounded else None,
                "sinks": self.sink_tokens if self.runs_plugin else None}

    def slug(self) -> str:
        """A file-name part: ``""``, ``-window368`` or ``-sinks16-window368`` (the parameters by name)."""
        return "".join(f"-{k}{v}" for k, v in sorted(self._values(named=True)))


_LETTER = {"window": "W", "sinks": "S", "budget": "B"}  # how the text names the built-in parameters


@register
@dataclass(frozen=True)
class UnboundedKV(KVPolicy):
    """Every token stays resident (vLLM's default): the pool fills at the sessions' token rate."""

    kind: ClassVar[str] = "unbounded"
    bounded: ClassVar[bool] = False

    def __post_init__(self):
        if self.window_tokens or self.sink_tokens:
            raise MetronomeError("--window/--sinks only apply to a bounded --kv")
        super().__post_init__()


@register
@dataclass(frozen=True)
class WindowKV(KVPolicy):
    """The last W tokens (vLLM's own sliding window)."""

    kind: ClassVar[str] = "window"
    params: ClassVar[tuple[PolicyParam, ...]] = (WINDOW,)

    def __post_init__(self):
        if self.sink_tokens:
            raise MetronomeError("--sinks needs a policy that keeps sinks (the window policy keeps none)")
        super().__post_init__()

    @classmethod
    def sized(cls, block_size, given, kept_for):
        return cls(block_size, window_tokens=int(given.get("window") or kept_for(0)))


@register
@dataclass(frozen=True)
class SinksKV(KVPolicy):
    """The first S and the last W tokens (StreamingLLM; the sink+window plugin)."""

    kind: ClassVar[str] = "sinks"
    params: ClassVar[tuple[PolicyParam, ...]] = (SINKS, WINDOW)
    DEFAULT_SINKS: ClassVar[int] = 16  # what a report recommends unless told

    def __post_init__(self):
        if self.sink_tokens <= 0:
            raise MetronomeError(f"--kv sinks needs --sinks > 0, got {self.sink_tokens}")
        super().__post_init__()

    @classmethod
    def sized(cls, block_size, given, kept_for):
        s = int(given["sinks"]) if given.get("sinks") is not None else cls.DEFAULT_SINKS
        w = int(given["window"]) if given.get("window") is not None else kept_for(s) - s
        return cls(block_size, window_tokens=w, sink_tokens=s)


BUDGET = PolicyParam("budget", "budget_tokens", "KV budget B in tokens per session: its sinks and its last B - S "
                     "tokens stay resident")


@register
@dataclass(frozen=True)
class BudgetKV(KVPolicy):
    """A per-session KV budget of B tokens: the first S (``--sinks``, none unless given) and the last B − S. The
    same residency as ``sinks``/``window``, sized by what a session may hold in all rather than by its window."""

    budget_tokens: int = 0

    kind: ClassVar[str] = "budget"
    params: ClassVar[tuple[PolicyParam, ...]] = (BUDGET, replace(SINKS, required=False))

    def __post_init__(self):
        if self.budget_tokens - self.sink_tokens < self.block_size:
            raise MetronomeError(f"--budget {self.budget_tokens} leaves {self.budget_tokens - self.sink_tokens} "
                                 f"tokens past the {self.sink_tokens} sinks, under one block ({self.block_size})")
        object.__setattr__(self, "window_tokens", self.budget_tokens - self.sink_tokens)
        super().__post_init__()

    @classmethod
    def sized(cls, block_size, given, kept_for):
        s = int(given.get("sinks") or 0)
        return cls(block_size, sink_tokens=s, budget_tokens=int(given.get("budget") or kept_for(s)))


def _given(params: dict) -> dict:
    unknown = set(params) - set(policy_params())
    if unknown:
        raise MetronomeError(f"no KV policy takes {', '.join(sorted(unknown))} "
                             f"(the policies' parameters: {', '.join(policy_params())})")
    return {k: v for k, v in params.items() if v is not None}


def check_policy_options(kind, params: dict, default: bool = False) -> None:
    """A parameter given where no policy of ``kind`` (one kind, or the kinds of a what-if grid) takes it is an error:
    it would change nothing. The policies' declared ``params`` say which takes what; ``default``: ``kind`` is the
    command's default, not the user's choice (the message says so)."""
    kinds = [kind] if isinstance(kind, str) else list(kind)
    taken = {p.name for k in kinds for p in policy_class(k).params}
    extra = [name for name in _given(params) if name not in taken]
    if not extra:
        return
    name = extra[0]
    takers = [k for k, c in _POLICIES.items() if any(p.name == name for p in c.params)]
    bounded = all(policy_class(k).bounded for k in takers)
    needs = f"a bounded --kv ({' or '.join(takers)})" if bounded else f"--kv {' or '.join(takers)}"
    own = sorted({p.name for k in kinds for p in policy_class(k).params})
    raise MetronomeError(f"--{name} does not apply to --kv {','.join(kinds)}{' (the default)' if default else ''}: "
                         f"it would change nothing; --{name} needs {needs}"
                         + (f" (--kv {','.join(kinds)} takes {', '.join('--' + n for n in own)})" if own else ""))


def make_policy(kind: str, block_size: int, **params) -> KVPolicy:
    """Build a policy from CLI-style options (``window=368, sinks=16``; None: not given), with one-line errors for
    bad combinations.

    Options a policy has no use for are ignored (``--window`` under ``unbounded``, ``--sinks`` under
    ``window``), so one what-if grid can compare policies; :func:`check_policy_options` refuses them where a
    command takes one policy."""
    return policy_class(kind).from_params(block_size, _given(params))


def policy_from_options(options: dict, block_size: int) -> KVPolicy:
    """The policy of an options record or summary (``{"kv": ..., "window": ..., ...}``, other keys ignored)."""
    names = policy_params()
    return make_policy(options.get("kv"), block_size,
                       **{k: v for k, v in options.items() if k in names})


def policy_option_values(source) -> dict:
    """The policy parameters' values of an argparse namespace or a mapping (None: not given)."""
    get = source.get if isinstance(source, dict) else (lambda k: getattr(source, k, None))
    return {k: get(k) for k in policy_params()}


def given_params(source) -> tuple[tuple[str, int], ...]:
    """The policy parameters given (not None) in an argparse namespace or a mapping, as an options record holds
    them (hashable, in declaration order)."""
    return tuple((k, v) for k, v in policy_option_values(source).items() if v is not None)
