"""Published per-step and per-tick figures for the models Metronome prices, and what the presets predict for them.

Each :class:`PublicFigure` is one number someone measured and published: the model, what was timed, the setup, the
value and its unit, where it was published (``source``: repository and issue or pull request, or a file), the GPU it
most likely ran on and why (``gpu_assumed``: an assumption wherever the source does not name the GPU) and notes.
A figure a preset can price carries a :class:`Step`: the preset, the serving stack that matches the server that
was measured, and the step's inputs (batch, context per sequence, tokens computed per sequence).
:func:`predict_s` prices that step with the preset as shipped.

Nothing here sets, scales or fits a term: the figures test the presets, they are not their source. Where the
measured setup differs from the preset in a way the setup itself states (a model's own shape, a precision), a
:class:`Variant` prices the difference separately, by the preset's own terms, and says so. A figure no preset can
price (another GPU, a metric the step model does not produce) has no step and says why in ``note``.
``python benchmarks/bench_anchors.py`` prints the comparison (:func:`report_lines`); docs/gpu-pricing.md shows it
with every source.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from metronome import calibration
from metronome.calibration import Calibration, StepLatencyModel

Loader = Callable[[str], Calibration]

# The presets' serving stacks the figures' servers match (metronome.models STACKS)
BATCHED = "batched-graphs"  # every stage batched across a step's sessions, CUDA graphs
LOCKSTEP = "vllm-omni-duplex"  # depformer and Mimi once per session, eager

# PersonaPlex's servers attend over their whole ring KV cache every tick: moshi's RingKVCache.complete() hands the
# attention all `capacity` slots, the unwritten ones masked but read all the same. So a tick reads 3,000 positions
# a session whatever the call's length: the temporal transformer's `context` (moshi_7b_202409.json).
PERSONAPLEX_RING_TOKENS = 3000

# (predicted − published) / published within this is "predicted" (the bar for PersonaPlex's ticks)
WITHIN = 0.20


@dataclass(frozen=True)
class Step:
    """The step of the step-latency model a figure times: ``preset`` priced for ``stack`` (None: the backbone's
    terms alone, the rest of the pipeline having run on another GPU), less the stages named in ``exclude`` (a figure
    that timed only part of the pipeline), for ``batch`` sequences each attending over ``context_tokens`` and
    computing ``new_tokens``; a share ``prefill_share`` of the steps also computes an arriving request's
    ``prefill_tokens`` (a figure that is a mean over steps)."""

    preset: str
    stack: str | None
    batch: float
    context_tokens: int
    new_tokens: int = 1
    exclude: tuple[str, ...] = ()
    prefill_tokens: int = 0
    prefill_share: float = 0.0


@dataclass(frozen=True)
class PublicFigure:
    key: str  # short id, unique
    model: str  # as published
    what: str  # what was timed
    setup: str  # how: server, batch or concurrency, context, precision
    value: float
    unit: str  # "ms" for a time; "" for a ratio (a real-time factor)
    source: str  # repository and issue or pull request (and commit), or a repository's file
    gpu_assumed: str  # the GPU it most likely ran on, then why in brackets
    note: str = ""
    step: Step | None = None  # None: no preset prices it (``note`` says why)
    group: str = ""  # figures of one server at several batch sizes, judged together (GROUPS)


@dataclass(frozen=True)
class Variant:
    """A difference between a figure's setup and the preset that the setup itself states, priced by the preset's
    own terms (``apply``: the preset → the preset as the figure's server ran the model)."""

    label: str
    apply: Callable[[Calibration], Calibration]


@dataclass(frozen=True)
class Group:
    title: str
    unpriced: str  # what the server pays that the preset does not price, with the evidence for it
    variants: tuple[Variant, ...] = ()


def thinker_batch(request_rate: float, ttft_s: float, itl_s: float, output_tokens: int) -> float:
    """The mean number of requests a thinker decodes at once, by Little's law on a serving benchmark's own row:
    requests a second times the time each spends in the thinker (its first token, then ``output_tokens − 1``
    inter-token gaps). At least 1: a gap is timed only while the thinker decodes."""
    return max(1.0, request_rate * (ttft_s + (output_tokens - 1) * itl_s))


# --------------------------------------------------------------------------------------------------------------
# The figures

_PERSONAPLEX = "PersonaPlex 7B (Moshi 7B fine-tune)"
_PP_SOURCE = ("vllm-project/vllm-omni issue #7389 (RFC: PersonaPlex multi-session serving), quoting the standalone "
              "lockstep server of PR #4771 at commit 2544c8f2")
_PP_GPU = ("H100 80GB (assumed: the RFC names no GPU; PR #6604 timed the same experimental PersonaPlex server on an "
           "H100 80GB, 30.2 ms a frame for one session with CUDA graphs, in line with 28.0 ms for two here, and "
           "vLLM-Omni's CI runs on H100s)")
_PP_SETUP = ("PersonaPlex's lockstep server: moshi's LMGen with elastic batching (vllm_omni/experimental/fullduplex/"
             "personaplex/elastic.py), every session's frame in one tick; the temporal transformer and the depformer "
             "batched and replayed from CUDA graphs (moshi's CUDAGraphed); the depformer runs 16 steps a frame "
             "(dep_q=16, configuration_personaplex.py); attention over the whole 3,000-slot ring KV; one Mimi encode "
             "and two Mimi decodes a tick, batched; bf16")
_PR6604 = "vllm-project/vllm-omni PR #6604 ([Perf][PersonaPlex] capture the per-frame steps into CUDA graphs)"
_PR6604_SETUP = ("vLLM-Omni's native PersonaPlex lockstep engine, one session; the per-frame model step alone: one "
                 "temporal-transformer step over the 3,000-slot ring KV, then the 16-step depformer (Mimi and serving "
                 "not in it); bf16")

# vLLM-Omni's CI perf baselines for Qwen3-Omni (PR #3695): concurrency → request rate (req/s), mean TTFT (s),
# mean inter-token latency (s), as the PR's table gives them (avg_request_throughput, avg_mean_ttft_ms,
# avg_mean_itl_ms), random 2,500 tokens in and 900 text tokens out per request
_QWEN3_CI = {1: (0.0318, 0.36255, 6.9674e-3), 4: (0.1059, 0.25799, 8.3357e-3), 16: (0.2355, 0.50604, 12.3200e-3),
             32: (0.3150, 0.81368, 15.8696e-3)}
_QWEN3_OUT = 900
_QWEN3_CONTEXT = 2500 + _QWEN3_OUT // 2  # the prompt plus, on average, half the answer
_QWEN3_SETUP = ("vLLM-Omni CI perf case test_qwen3_omni (tests/dfx/perf/stage_configs/qwen3_omni.yaml): the thinker "
                "alone on one H100 under vLLM with CUDA graphs, the talker and Code2Wav on a second; random 2,500 "
                "tokens in, 900 text tokens out, audio out; bf16. Most requests in flight wait for their audio, so "
                "the thinker decodes fewer at once: the batch is its mean by Little's law on the same row (requests "
                "a second x (TTFT + 899 inter-token gaps)); each arrival's 2,500-token prefill runs in one step "
                "(max_num_batched_tokens 32,768), a share requests a second x inter-token latency of the steps")

FIGURES: tuple[PublicFigure, ...] = (
    *(PublicFigure(
        key=f"personaplex-tick-{n}", model=_PERSONAPLEX, what=f"lockstep tick, {n} sessions", setup=_PP_SETUP,
        value=v, unit="ms", source=_PP_SOURCE, gpu_assumed=_PP_GPU,
        note="a tick is one 80 ms frame for every session",
        step=Step("moshi-7b-h100", BATCHED, n, PERSONAPLEX_RING_TOKENS), group="vllm-omni-duplex")
      for n, v in ((2, 28.0), (8, 32.6), (16, 45.0), (32, 70.2))),
    PublicFigure(
        key="personaplex-frame-graphs", model=_PERSONAPLEX, what="per-frame model step, 1 session, CUDA graphs",
        setup=_PR6604_SETUP + "; temporal step and depformer captured into CUDA graphs", value=30.2, unit="ms",
        source=_PR6604, gpu_assumed="H100 80GB (stated in the PR)",
        step=Step("moshi-7b-h100", BATCHED, 1, PERSONAPLEX_RING_TOKENS, exclude=("Mimi",)),
        group="personaplex-frame"),
    PublicFigure(
        key="personaplex-frame-eager", model=_PERSONAPLEX, what="per-frame model step, 1 session, eager",
        setup=_PR6604_SETUP + "; eager: about 100 small kernels a frame launched one by one", value=77.5, unit="ms",
        source=_PR6604, gpu_assumed="H100 80GB (stated in the PR)",
        note=("the lockstep stack runs the depformer eagerly but prices the backbone as vLLM runs it, with CUDA "
              "graphs; here the temporal step ran eagerly too"),
        step=Step("moshi-7b-h100", LOCKSTEP, 1, PERSONAPLEX_RING_TOKENS, exclude=("Mimi",)),
        group="personaplex-frame"),
    *(PublicFigure(
        key=f"qwen3-omni-itl-c{c}", model="Qwen3-Omni-30B-A3B (thinker)",
        what=f"text inter-token latency, {c} concurrent request{'s' if c > 1 else ''}", setup=_QWEN3_SETUP,
        value=round(itl * 1e3, 4), unit="ms",
        source="vllm-project/vllm-omni PR #3695 (CI perf JSON baselines: avg_mean_itl_ms, avg_request_throughput, "
               "avg_mean_ttft_ms)",
        gpu_assumed="H100 80GB (the CI case is marked cuda: H100, 2 cards)",
        note="the mean gap between streamed text tokens: the thinker's mean step",
        step=Step("qwen3-omni-30b-a3b-h100", None, thinker_batch(rate, ttft, itl, _QWEN3_OUT), _QWEN3_CONTEXT,
                  prefill_tokens=2500, prefill_share=rate * itl),
        group="qwen3-omni-thinker")
      for c, (rate, ttft, itl) in _QWEN3_CI.items()),
    # --- found, and not compared: no preset prices them ---------------------------------------------------------
    PublicFigure(
        key="personaplex-h20-tick", model=_PERSONAPLEX, what="mean tick, 2 sessions, vLLM-Omni's unified duplex path",
        setup=("main branch, max_sessions 2, under the PyTorch profiler: 4,073 kernel launches a tick and the GPU "
               "idle 88.9% of the trace; each session's Mimi encode and depformer run alone, eagerly"),
        value=88.39, unit="ms", source="vllm-project/vllm-omni issue #7389 (comment by HankBO, 100-tick trace)",
        gpu_assumed="H20 (stated)", note="no H20 preset, and the profiler's own cost is in the figure"),
    PublicFigure(
        key="qwen3-omni-rtf", model="Qwen3-Omni-30B-A3B", what="mean audio real-time factor, 16 / 32 concurrent",
        setup="the inter-token rows' runs; speech generated on the second H100",
        value=0.4000, unit="",
        source="vllm-project/vllm-omni PR #3695 (avg_mean_audio_rtf: 0.4000 at 16, 0.5777 at 32)",
        gpu_assumed="H100 80GB (the CI case is marked cuda: H100, 2 cards)",
        note=("the presets' speech term is set from these two figures (anchored), so agreeing with them would show "
              "nothing, and the speech stages ran on the second GPU, not beside the thinker")),
    PublicFigure(
        key="minicpm-o-rtf-c8", model="MiniCPM-o 4.5", what="mean audio real-time factor, 8 concurrent requests",
        setup=("vLLM-Omni nightly CI, Thinker, Talker and Code2Wav on one H100, max_num_seqs 4: half the requests "
               "queue inside the figure"),
        value=1.0324, unit="", source="vllm-project/vllm-omni issue #7865 (nightly regression table, baseline)",
        gpu_assumed="H100 (stated)",
        note="a turn-based request's real-time factor, queueing included: the step model prices a step, not that"),
    PublicFigure(
        key="moshi-l4-latency", model="Moshi 7B", what="practical end-to-end latency, one conversation",
        setup="Kyutai's own stack", value=200.0, unit="ms", source="kyutai-labs/moshi README.md",
        gpu_assumed="L4 (stated)",
        note=("a latency (an 80 ms frame, 80 ms of acoustic delay, then compute), not a step, on a GPU no preset "
              "prices")),
)


def _scale_terms(cal: Calibration, prefix: str, factor: float) -> Calibration:
    """``cal`` with every term whose name starts with ``prefix`` (the backbone's and every stack's) ``factor`` times
    its value."""
    terms = {t.name: t.value for t in cal.step_latency.terms}
    terms.update((t.name, t.value) for s in cal.stack_options for t in s.terms)
    for name, value in terms.items():
        if name.startswith(prefix):
            cal = cal.with_term(name, value * factor)
    return cal


GROUPS: dict[str, Group] = {
    "vllm-omni-duplex": Group(
        "PersonaPlex's lockstep ticks",
        unpriced=("host work per tick: the server's Python between its graphed steps (staging-ring updates "
                  "and per-codebook loops, sampling, every session's audio and text copied to the host), which "
                  "the presets price only as vLLM's own per-step cost. Evidence: one session's frame alone takes 30.2 "
                  "ms with CUDA graphs (PR #6604; its row above), and the unified path's trace finds the GPU idle 89% "
                  "of each tick, 4,073 launches a tick (issue #7389). Mimi, too: the server runs three codec passes "
                  "a tick (one encode, two decodes), their convolutions eager (moshi graphs only Mimi's "
                  "transformers)"),
        variants=(Variant("with PersonaPlex's 16-step depformer (dep_q=16; the preset's depformer terms are "
                          "Moshi's 8 steps)", lambda cal: _scale_terms(cal, "depformer", 2.0)),)),
    "personaplex-frame": Group(
        "PersonaPlex's single-session frame",
        unpriced=("host work per frame (Python, launches and syncs outside the captured graphs), and, eager, the "
                  "temporal step's own launches: the presets price the backbone's eager launches only for the "
                  "sink+window plugin"),
        variants=(Variant("with PersonaPlex's 16-step depformer", lambda cal: _scale_terms(cal, "depformer", 2.0)),)),
    "qwen3-omni-thinker": Group(
        "Qwen3-Omni's thinker steps",
        unpriced=("the MoE layers' fixed cost per step: the preset prices the bytes a step reads, but at small "
                  "batches a Qwen3-Omni step is latency-bound: 7.2 ms at batch 1 measured on the H200 in plain "
                  "PyTorch with CUDA graphs (docs/measured/decode_step-h200-run1.json), close to the 7.0 ms published "
                  "here: 48 MoE layers each pay routing, top-k and the expert kernels' latency whatever the bytes"),
        variants=(Variant("with the thinker's weights in bf16, as the CI ran them (the H100 preset serves them in "
                          "FP8)", lambda cal: _scale_terms(_scale_terms(cal, "weights streamed", 2.0), "routed experts",
                                                           2.0)),)),
}


# --------------------------------------------------------------------------------------------------------------
# Pricing

def by_key(key: str) -> PublicFigure:
    for f in FIGURES:
        if f.key == key:
            return f
    raise KeyError(key)


def compared() -> tuple[PublicFigure, ...]:
    """The figures a preset prices."""
    return tuple(f for f in FIGURES if f.step is not None)


def step_model(cal: Calibration, step: Step) -> StepLatencyModel:
    """The step-latency model ``step`` is priced with: ``cal`` for the step's stack (or its backbone's terms alone),
    less the terms of the stages the step excludes."""
    if step.stack is None:
        terms = cal.backbone_terms
    else:
        cal = cal.with_stack(step.stack)
        terms = cal.step_latency.terms
    terms = tuple(t for t in terms if not t.name.startswith(step.exclude))
    return cal.step_latency.with_terms(terms)


def predict_s(fig: PublicFigure, load: Loader = calibration.load, stack: str | None = ...) -> float:
    """Seconds the preset gives for the figure's step (``stack``: another of the preset's stacks instead of the one
    matching the figure's server). ``load`` maps a preset's name to its calibration: the shipped presets."""
    if fig.step is None:
        raise ValueError(f"{fig.key}: no preset prices this figure ({fig.note})")
    s = fig.step if stack is ... else replace(fig.step, stack=stack)
    model = step_model(load(s.preset), s)
    context, new = s.batch * s.context_tokens, s.batch * s.new_tokens
    plain = model.step_s(s.batch, context, new)
    if not s.prefill_share:
        return float(plain)
    with_prefill = model.step_s(s.batch, context, new + s.prefill_tokens)
    return float((1 - s.prefill_share) * plain + s.prefill_share * with_prefill)


def published_s(fig: PublicFigure) -> float:
    if fig.unit != "ms":
        raise ValueError(f"{fig.key}: {fig.unit or 'a ratio'} is not a time")
    return fig.value / 1e3


def error(fig: PublicFigure, load: Loader = calibration.load) -> float:
    """(predicted − published) / published."""
    return predict_s(fig, load) / published_s(fig) - 1


# --------------------------------------------------------------------------------------------------------------
# The report

def _value(f: PublicFigure) -> str:
    """The figure with the digits its source gives (28.0 ms, 6.9674 ms, 0.4)."""
    return f"{f.value!r} {f.unit}" if f.unit else repr(f.value)


def _gpu(f: PublicFigure) -> str:
    return f.gpu_assumed.split(" (")[0]


def _batch(b: float) -> str:
    return f"{b:g}" if b == int(b) else f"{b:.2f}"


def _table(rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if k in right else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def report_lines(load: Loader = calibration.load) -> list[str]:
    """The comparison as ``python benchmarks/bench_anchors.py`` prints it: every figure a preset prices beside the
    prediction for the same setup and the error; each group's verdict, what its server pays that the preset does
    not price when it misses by more than :data:`WITHIN`, its setup variants and the preset's other stacks; the
    figures no preset prices and why; every figure's setup and source."""
    index = {f.key: i for i, f in enumerate(FIGURES, 1)}
    rows = [("#", "figure", "batch", "published", "GPU", "preset · stack", "predicted", "error")]
    for f in compared():
        p = predict_s(f, load)
        rows.append((str(index[f.key]), f"{f.model.split(' (')[0]}: {f.what}", _batch(f.step.batch), _value(f),
                     _gpu(f), f"{f.step.preset} · {f.step.stack or 'backbone only'}", f"{p * 1e3:.1f} ms",
                     f"{(p / published_s(f) - 1) * 100:+.0f}%"))
    out = ["Public figures beside the presets: each figure's step priced by the preset and stack that match its "
           "setup (terms as shipped; none is fitted to a figure)", ""]
    out += _table(rows, right={0, 2, 3, 6, 7})
    for key, g in GROUPS.items():
        members = [f for f in compared() if f.group == key]
        if not members:
            continue
        errs = [error(f, load) for f in members]
        inside = sum(abs(e) <= WITHIN for e in errs)
        out += ["", f"{g.title}: within {WITHIN:.0%} at {inside} of {len(members)} "
                    f"(errors {', '.join(f'{e * 100:+.0f}%' for e in errs)})"]
        if inside < len(members):
            gap = ", ".join(f"{(published_s(f) - predict_s(f, load)) * 1e3:+.1f} ms" for f in members)
            out.append(f"  published − predicted: {gap}")
            out.append(f"  not priced: {g.unpriced}")
        for v in g.variants:
            got = ", ".join(f"{predict_s(f, lambda n: v.apply(load(n))) * 1e3:.1f}" for f in members)
            out.append(f"  {v.label}: {got} ms")
        stacks = {f.step.stack for f in members}
        for s in load(members[0].step.preset).stacks:
            if s not in stacks:
                got = ", ".join(f"{predict_s(f, load, stack=s) * 1e3:.1f}" for f in members)
                out.append(f"  under the {s} stack instead: {got} ms")
    out += ["", "Found, not compared (no preset prices them):"]
    out += [f"  [{index[f.key]}] {f.model}: {f.what}: {_value(f)} on {_gpu(f)}: {f.note}"
            for f in FIGURES if f.step is None]
    out += ["", "Setups and sources:"]
    seen: dict[tuple[str, str, str, str], list[int]] = {}
    for f in FIGURES:
        seen.setdefault((f.setup, f.source, f.gpu_assumed, f.note if f.step else ""), []).append(index[f.key])
    for (setup, source, gpu, note), ids in seen.items():
        label = f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])
        out.append(f"  [{label}] {setup}. GPU: {gpu}. Source: {source}." + (f" Note: {note}." if note else ""))
    return out
