"""The plain-PyTorch reference for the sink+window bound: the same model and weights in HF transformers,
one forward pass with an explicit attention mask.

The mask is ``causal ∧ (k < S* ∨ k ≥ bs·floor(max(q − W + 1, 0)/bs))`` (``plugin.semantics.mask``; with
``S = 0`` it is the block-granular window only, with no bound it is plain causal). Positions stay absolute
(``position_ids = 0..n−1``), as in vLLM, which caches keys after RoPE. One masked forward pass over the whole
sequence equals token-by-token decoding with eviction, because a masked key contributes nothing.

No vLLM import here: this is what the vLLM results are checked against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from metronome.probe.plugin.semantics import SinkWindow, mask


@dataclass
class Scored:
    target_logprobs: "object"  # [n-1] float64 tensor: log p(token[i+1] | tokens[..i])
    argmax: "object"  # [n-1] long tensor: the greedy next token at each position

    @property
    def nll(self) -> float:
        return float(-self.target_logprobs.mean())

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


def load(path: str, dtype: str = "float32"):
    """The HF model at ``path`` (a directory with config.json and safetensors), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    model.eval()
    return model


def score(model, token_ids: list[int], bound: SinkWindow | None, block_size: int, *,
          window_start_shift_blocks: int = 0) -> Scored:
    """Teacher-forced log-probabilities of ``token_ids`` under the bound (None: full causal attention)."""
    import torch

    n = len(token_ids)
    allowed = mask(n, bound, block_size, window_start_shift_blocks=window_start_shift_blocks)
    dtype = next(model.parameters()).dtype
    additive = torch.zeros((1, 1, n, n), dtype=dtype)
    additive.masked_fill_(~allowed, torch.finfo(dtype).min)
    ids = torch.tensor([token_ids])
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=additive, position_ids=torch.arange(n).unsqueeze(0)).logits[0]
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    target = torch.tensor(token_ids[1:])
    return Scored(logp.gather(1, target.unsqueeze(1)).squeeze(1), logp.argmax(dim=-1))
