"""The quality ablation (StreamingLLM's): perplexity of a real model over a long offline text through vLLM,
under full attention, a sliding window only, and sinks + window, each checked against the masked
PyTorch reference with the same semantics.

    metronome-probe quality --model smollm2 [--text pydoc|gpl3|PATH] [--tokens 1024] [--window 64]
                            [--sinks 4] [--block-size 32] [--out runs/quality]

Each bounded run is vLLM with the sink+window plugin (``METRONOME_KV_SINKS``): block-granular semantics
(``plugin/semantics.py``), so the S sinks are whole blocks (S* = ceil(S/bs)·bs) and a query sees its last W
to W+bs−1 positions. "window only" is the same bound with S = 0. vLLM scores the text with prompt
logprobs (chunked prefill, so the window slides across chunks and blocks are freed mid-prompt); the
reference is one masked forward pass of the same fp32 weights in transformers.

Prints the table and writes ``quality.json`` and ``quality.md`` under ``--out``.
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
from pathlib import Path

from metronome.errors import MetronomeError
from metronome.outputs import atomic_dir, check_out

TEXTS = ("pydoc", "gpl3")


def load_text(name: str) -> tuple[str, str]:
    """(text, description) of an offline corpus: CPython's pydoc topics, Debian's GPL-3, or a file."""
    if name == "pydoc":
        import pydoc_data.topics as t

        return ("\n\n".join(t.topics[k] for k in sorted(t.topics)),
                "CPython pydoc_data.topics (PSF license, ships with Python)")
    if name == "gpl3":
        p = Path("/usr/share/common-licenses/GPL-3")
        if not p.is_file():
            raise MetronomeError("--text gpl3 needs /usr/share/common-licenses/GPL-3 (Debian base-files); "
                                 "use --text pydoc")
        return p.read_text(), str(p)
    p = Path(name).expanduser()
    if not p.is_file():
        raise MetronomeError(f"--text {name!r} is neither one of {', '.join(TEXTS)} nor a file")
    return p.read_text(errors="replace"), str(p)


def _resolve(model: str):
    from metronome.probe import models

    return models.resolve(model, dtype="float32")


def tokenize(path: str, text: str, n: int) -> list[int]:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise MetronomeError(f"the model at {path} has no tokenizer ({type(exc).__name__}); quality needs one") from None
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        raise MetronomeError(f"the text has {len(ids)} tokens, fewer than --tokens {n}")
    return ids[:n]


def vllm_prompt_logprobs(model_path: str, ids: list[int], bound, block_size: int, chunk: int) -> tuple[list[float], float]:
    """Per-token log p(ids[i+1] | ids[..i]) from vLLM's prompt logprobs; bound None = unbounded vLLM."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from metronome.probe import plugin

    if bound is not None:
        plugin.activate(bound.sink_tokens, bound.window_tokens)
    else:
        plugin.deactivate()
    t0 = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams, TokensPrompt

        llm = LLM(model=model_path, dtype="float32", skip_tokenizer_init=True, block_size=block_size,
                  enable_prefix_caching=False, enforce_eager=True, max_model_len=len(ids) + block_size,
                  max_num_batched_tokens=chunk, max_num_seqs=1, kv_cache_memory_bytes=2**30, seed=0)
    finally:
        plugin.deactivate()
    try:
        spec = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        if (bound is not None) != (type(spec).__name__ == "SinkWindowSpec"):
            raise RuntimeError(f"engine built with {type(spec).__name__}, expected the bound {bound}")
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                           SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False),
                           use_tqdm=False)[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])], time.perf_counter() - t0


def _semantics(bound, bs: int) -> str:
    if bound is None:
        return "causal"
    window = f"k >= {bs}*floor(max(q-{bound.window_tokens}+1,0)/{bs})"
    if bound.sink_tokens:
        return f"causal & (k < {bound.effective_sinks(bs)} | {window})"
    return f"causal & {window}"


def run_ablation(model: str = "smollm2", text: str = "pydoc", tokens: int = 1024, window: int = 64,
                 sinks: int = 4, block_size: int = 32, chunk: int = 256, reference: bool = True,
                 log=print) -> dict:
    """Run the three configurations through vLLM (and the reference); return the table as a dict."""
    from metronome.probe.plugin import SinkWindow, versions

    versions.check()
    if tokens < 4 * window:
        raise MetronomeError(f"--tokens {tokens} should be several times the window ({window})")
    r = _resolve(model)
    body, text_desc = load_text(text)
    ids = tokenize(r.path, body, tokens)
    sw = SinkWindow(sinks, window)
    sw.check_block_size(block_size)
    configs = [("full attention", None), ("window only", SinkWindow(0, window)), ("sinks + window", sw)]
    ref_model = None
    if reference:
        from metronome.probe import reference as ref

        ref_model = ref.load(r.path)
    rows = []
    for name, bound in configs:
        log(f"[quality] {name}: vLLM ...")
        lp, wall = vllm_prompt_logprobs(r.path, ids, bound, block_size, chunk)
        nll = -sum(lp) / len(lp)
        row = dict(run=name, sink_tokens=(bound.effective_sinks(block_size) if bound else None),
                   window_tokens=(bound.window_tokens if bound else None),
                   semantics=_semantics(bound, block_size),
                   vllm_ppl=math.exp(nll), vllm_wall_s=round(wall, 1))
        if ref_model is not None:
            import torch

            from metronome.probe import reference as ref

            scored = ref.score(ref_model, ids, bound, block_size)
            d = (torch.tensor(lp, dtype=torch.float64) - scored.target_logprobs).abs()
            row.update(reference_ppl=scored.perplexity,
                       rel_diff=math.exp(nll) / scored.perplexity - 1, max_abs_dnll=float(d.max()))
        rows.append(row)
        log(f"[quality] {name}: ppl {row['vllm_ppl']:.3f}" +
            (f" (reference {row['reference_ppl']:.3f}, max |dNLL| {row['max_abs_dnll']:.1e})" if reference else ""))
    dist, version, _ = versions.check()
    return dict(model=r.name, weights=r.weights, text=text_desc, tokens=tokens, window_tokens=window,
                sink_tokens=sinks, effective_sink_tokens=sw.effective_sinks(block_size), block_size=block_size,
                prefill_chunk=chunk, dtype="float32", vllm=f"{dist} {version}", rows=rows)


def to_markdown(t: dict) -> str:
    ref = "reference_ppl" in t["rows"][0]
    head = "| run | vLLM ppl |" + (" reference ppl | rel. diff | max \\|dNLL\\| |" if ref else "")
    sep = "|---|---:|" + ("---:|---:|---:|" if ref else "")
    lines = [f"Perplexity of {t['model']} over the first {t['tokens']} tokens of {t['text']}; "
             f"W = {t['window_tokens']}, S = {t['sink_tokens']} (sinks are whole blocks: "
             f"{t['effective_sink_tokens']} tokens), block size {t['block_size']}, {t['dtype']}, {t['vllm']}, "
             f"prefill in {t['prefill_chunk']}-token chunks.", "", head, sep]
    for r in t["rows"]:
        line = f"| {r['run']} | {r['vllm_ppl']:.3f} |"
        if ref:
            line += f" {r['reference_ppl']:.3f} | {r['rel_diff']:+.1e} | {r['max_abs_dnll']:.1e} |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def add_parser(subparsers):
    p = subparsers.add_parser("quality", help="perplexity: full vs window-only vs sinks+window, through vLLM",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="a model with a tokenizer (default smollm2)")
    p.add_argument("--text", default="pydoc", help=f"offline text: {', '.join(TEXTS)} or a file path")
    p.add_argument("--tokens", type=int, default=1024, help="tokens of the text to score")
    p.add_argument("--window", type=int, default=64, help="window W in tokens")
    p.add_argument("--sinks", type=int, default=4, help="sink tokens S (rounded up to whole blocks)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (max_num_batched_tokens)")
    p.add_argument("--no-reference", action="store_true", help="skip the PyTorch reference")
    p.add_argument("--out", default="runs/quality",
                   help="directory for quality.json and quality.md (default runs/quality); refused if it already "
                        "holds results")
    p.add_argument("--replace", action="store_true", help="replace what --out holds, once the new results are complete")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    out = check_out(args.out, args.replace)
    t = run_ablation(args.model, args.text, args.tokens, args.window, args.sinks, args.block_size,
                     args.chunk, reference=not args.no_reference)
    md = to_markdown(t)
    print(md)
    with atomic_dir(out, args.replace) as tmp:
        (tmp / "quality.json").write_text(json.dumps(t, indent=2))
        (tmp / "quality.md").write_text(md)
    print(f"wrote {out / 'quality.json'} and {out / 'quality.md'}")
    return 0


def main(argv=None) -> int:  # python -m metronome.probe.quality
    import argparse

    parser = argparse.ArgumentParser(prog="metronome-probe")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except MetronomeError as exc:
        print(f"error: {exc}")
        return exc.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
