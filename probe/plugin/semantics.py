"""The sink+window bound's exact semantics, in one place (no vLLM import).

**Block-granular sink+window.** With ``bs`` tokens per KV block, ``S`` sink tokens and a window of ``W``
positions, define ``S* = ceil(S/bs)·bs`` (the sinks are whole blocks) and, for a query at absolute
position ``q``, the first window block ``ws(q) = floor(max(q − W + 1, 0) / bs)``. The query attends to
key ``k`` iff::

    k <= q   and   ( k < S*   or   k >= bs · ws(q) )

So a query sees every token of the sink blocks plus every token of the blocks that hold its last ``W``
positions: between ``W`` and ``W + bs − 1`` recent keys, itself included. This is exactly the set of
tokens the KV manager keeps resident (``metronome.kv_policy.KVPolicy.sinks(bs, S, W).resident_blocks``)
plus the query itself, so **the attention reads every resident token and nothing else**:
``attended(q) = resident_tokens(q) + 1``. ``S = 0`` gives the block-granular window-only bound.

Why block-granular: vLLM's CPU attention kernel (CPU_ATTN) takes a paged block table, returns no
log-sum-exp (so two partial passes cannot be merged), and measures its own sliding window from the query
(so it would mask the sinks too). Handing it a compacted block table ``[sink blocks] + [window blocks]``
with plain causal attention is exact for this definition and costs ~0.2 ms of Python per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from metronome.errors import MetronomeError
from metronome.kv_policy import KVPolicy, cdiv

ENV_VAR = "METRONOME_KV_SINKS"



@dataclass(frozen=True)
class SinkWindow:
    sink_tokens: int  # S as asked for; the bound pins ceil(S/bs) whole blocks
    window_tokens: int  # W: positions the query sees back from itself, itself included

    def __post_init__(self):
        if self.sink_tokens < 0:
            raise MetronomeError(f"sink tokens must be >= 0, got {self.sink_tokens}")
        if self.window_tokens < 1:
            raise MetronomeError(f"window must be at least 1 token, got {self.window_tokens}")

    def policy(self, block_size: int) -> KVPolicy:
        """The simulator's KV policy for this bound: the one definition of residency and attention."""
        if self.sink_tokens:
            return KVPolicy.sinks(block_size, self.sink_tokens, self.window_tokens)
        return KVPolicy.window(block_size, self.window_tokens)

    def check_block_size(self, block_size: int) -> None:
        self.policy(block_size)  # raises the same one-line errors as the simulator's --kv options

    def sink_blocks(self, block_size: int) -> int:
        return cdiv(self.sink_tokens, block_size)

    def effective_sinks(self, block_size: int) -> int:
        """S* = ceil(S/bs)·bs: the sink tokens a query actually sees."""
        return self.sink_blocks(block_size) * block_size

    def window_start_block(self, q: int, block_size: int) -> int:
        return max(q - self.window_tokens + 1, 0) // block_size

    def visible(self, q: int, k: int, block_size: int) -> bool:
        return k <= q and (k < self.effective_sinks(block_size)
                           or k >= block_size * self.window_start_block(q, block_size))

    def attended(self, q: int, block_size: int) -> int:
        """Keys the query at position q sees, itself included (``KVPolicy.attended_tokens``)."""
        return int(self.policy(block_size).attended_tokens(q))

    def admission_blocks(self, block_size: int, max_in_flight_tokens: int, max_model_len: int) -> int:
        """Most blocks one request holds at any time, in-flight chunk included (the admission cap):
        :meth:`KVPolicy.admission_cap_blocks` of this bound, never more than a max_model_len request."""
        cap = self.policy(block_size).admission_cap_blocks(max_in_flight_tokens, max_model_len)
        return min(cap, cdiv(max_model_len, block_size))

    def to_env(self) -> str:
        return f"{self.sink_tokens},{self.window_tokens}"

    @classmethod
    def parse(cls, text: str) -> "SinkWindow":
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise MetronomeError(f"{ENV_VAR} must be 'S,W' (sink tokens, window tokens), got {text!r}")
        return cls(int(parts[0]), int(parts[1]))


def mask(n: int, sw: SinkWindow | None, block_size: int, *, window_start_shift_blocks: int = 0):
    """Boolean [n, n] attention mask (True = attend) for positions 0..n−1; None means plain causal.

    ``window_start_shift_blocks`` moves every window start by that many blocks: a deliberately wrong
    mask (off by one block) for the tests that show the exactness check can fail."""
    import torch

    q = torch.arange(n).unsqueeze(1)
    k = torch.arange(n).unsqueeze(0)
    causal = k <= q
    if sw is None:
        return causal
    ws = (torch.clamp(q - sw.window_tokens + 1, min=0) // block_size + window_start_shift_blocks).clamp(min=0)
    return causal & ((k < sw.effective_sinks(block_size)) | (k >= ws * block_size))
