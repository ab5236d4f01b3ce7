"""The public figures (metronome/anchors.py) and `python benchmarks/bench_anchors.py`, which sets them beside the
presets: every figure is cited, every prediction is the shipped preset's (a preset term that moves moves it), the
script prints every figure, and docs/gpu-pricing.md shows what the script prints today."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from doc_commands import ROOT, fenced_blocks, mismatches
from metronome import anchors, calibration

BENCH = ROOT / "benchmarks" / "bench_anchors.py"
COMMAND = "python benchmarks/bench_anchors.py"

# A citation a reader can follow: owner/repo with an issue or pull request number, or owner/repo and a file in it.
CITED = re.compile(r"\b[\w.-]+/[\w.-]+ (?:issue|PR) #\d+|\b[\w.-]+/[\w.-]+ [\w./-]+\.(?:md|json|py|yaml)\b")

# PersonaPlex's ticks as vllm-project/vllm-omni issue #7389 publishes them: sessions → ms
PERSONAPLEX_TICKS = {2: 28.0, 8: 32.6, 16: 45.0, 32: 70.2}


@pytest.fixture(scope="module")
def printed() -> str:
    p = subprocess.run([sys.executable, str(BENCH)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


# --- the figures ------------------------------------------------------------------------------------------------

def test_at_least_four_figures_are_compared_and_keys_are_unique():
    assert len(anchors.compared()) >= 4
    keys = [f.key for f in anchors.FIGURES]
    assert len(keys) == len(set(keys)), keys


def test_personaplex_ticks_are_the_published_four():
    ticks = {f.step.batch: f.value for f in anchors.FIGURES if f.group == "vllm-omni-duplex"}
    assert ticks == PERSONAPLEX_TICKS


@pytest.mark.parametrize("fig", anchors.FIGURES, ids=lambda f: f.key)
def test_every_figure_has_a_source_a_setup_and_a_gpu(fig):
    assert CITED.search(fig.source), f"{fig.key}: {fig.source!r} names no repository and issue, PR or file"
    assert fig.setup.strip() and fig.what.strip() and fig.model.strip()
    assert fig.value > 0 and fig.unit in ("ms", "")
    # the GPU, then why in brackets: stated by the source, or the assumption and its reason
    assert re.fullmatch(r"[\w ]+ \((?:stated.*|assumed: .+|the CI .+)\)", fig.gpu_assumed), fig.gpu_assumed
    if fig.step is None:
        assert fig.note.strip(), f"{fig.key}: a figure no preset prices must say why"


@pytest.mark.parametrize("fig", anchors.compared(), ids=lambda f: f.key)
def test_every_compared_figure_names_a_shipped_preset_and_its_stack(fig):
    cal = calibration.load(fig.step.preset)
    assert fig.step.stack is None or fig.step.stack in cal.stacks, (fig.step.stack, cal.stacks)
    assert fig.group in anchors.GROUPS


def test_personaplex_ticks_are_judged_under_the_stack_of_their_server():
    # the server batched every session's frame with CUDA graphs (moshi's LMGen, elastic batching): the stack that
    # batches every stage with graphs, on the H100 the figures most likely ran on
    for f in anchors.FIGURES:
        if f.group == "vllm-omni-duplex":
            assert (f.step.preset, f.step.stack) == ("moshi-7b-h100", anchors.BATCHED)
            assert f.step.context_tokens == anchors.PERSONAPLEX_RING_TOKENS == 3000


def test_thinker_batch_is_littles_law():
    # 0.3 requests a second, each 0.5 s to its first token then 99 gaps of 10 ms: 0.3 × 1.49 = 0.447 → at least 1
    assert anchors.thinker_batch(0.3, 0.5, 0.01, 100) == 1.0
    assert anchors.thinker_batch(2.0, 0.5, 0.01, 100) == pytest.approx(2.0 * 1.49)


def test_the_cited_measurement_of_the_moe_step_is_in_docs_measured():
    # the Qwen3-Omni group's explanation quotes 7.2 ms at batch 1 from this file
    points = json.loads((ROOT / "docs/measured/decode_step-h200-run1.json").read_text())["models"]["qwen3-omni"]
    first = next(p for p in points["points"] if p["batch"] == 1 and p["context"] == 512)
    assert round(first["step_s"] * 1e3, 1) == 7.2
    assert "7.2 ms at batch 1" in anchors.GROUPS["qwen3-omni-thinker"].unpriced


# --- the predictions come from the presets ----------------------------------------------------------------------

@pytest.mark.parametrize("fig", anchors.compared(), ids=lambda f: f.key)
def test_prediction_moves_with_a_backbone_term(fig):
    cal = calibration.load(fig.step.preset)
    term = next(t for t in cal.backbone_terms if t.coefficient == "base_s")
    before = anchors.predict_s(fig)
    after = anchors.predict_s(fig, load=lambda name: calibration.load(name).with_term(term.name, term.value + 1e-3))
    assert after - before == pytest.approx(1e-3, rel=1e-6)  # a per-step term: once a step, whatever the batch


@pytest.mark.parametrize("fig", [f for f in anchors.compared() if f.step.stack], ids=lambda f: f.key)
def test_prediction_moves_with_its_stacks_per_session_terms(fig):
    stack = calibration.load(fig.step.preset).with_stack(fig.step.stack)
    mine = [t for t in stack.stack_pricing(fig.step.stack).terms if t.coefficient == "per_seq_s"
            and not any(t.name.startswith(x) for x in fig.step.exclude)]
    assert mine, f"{fig.key}: its stack prices no per-session stage work"

    def bumped(name):
        cal = calibration.load(name)
        for t in mine:
            cal = cal.with_term(t.name, t.value + 1e-4)
        return cal

    moved = anchors.predict_s(fig, load=bumped) - anchors.predict_s(fig)
    assert moved == pytest.approx(fig.step.batch * len(mine) * 1e-4, rel=1e-6)


@pytest.mark.parametrize("fig", [f for f in anchors.compared() if f.step.exclude], ids=lambda f: f.key)
def test_excluded_stages_are_left_out(fig):
    # the figure timed part of the pipeline: a term of a stage it excludes does not move it
    cal = calibration.load(fig.step.preset).with_stack(fig.step.stack)
    left_out = [t for t in cal.step_latency.terms if t.name.startswith(fig.step.exclude)]
    assert left_out
    before = anchors.predict_s(fig)
    for t in left_out:
        assert anchors.predict_s(fig, load=lambda n, t=t: calibration.load(n).with_term(t.name, 1.0)) == before


def test_backbone_only_figures_leave_the_stack_out():
    # Qwen3-Omni's CI ran the speech stages on a second GPU: the thinker's step is the backbone's terms alone
    fig = anchors.by_key("qwen3-omni-itl-c1")
    cal = calibration.load(fig.step.preset)
    stage = cal.with_stack(cal.stacks[0]).stack_pricing(cal.stacks[0]).terms[0]
    assert anchors.predict_s(fig, load=lambda n: calibration.load(n).with_term(stage.name, 1.0)) == \
        anchors.predict_s(fig)


@pytest.mark.parametrize("fig", [f for f in anchors.compared() if f.step.prefill_share], ids=lambda f: f.key)
def test_a_mean_step_carries_its_share_of_the_arrivals_prefill(fig):
    # one arrival every 1/rate seconds, one step every ITL: a share rate × ITL of the steps also prefills 2,500 tokens,
    # so a per-token term moves the mean step by its change × (batch + share × 2,500)
    rate, _, itl = anchors._QWEN3_CI[int(fig.key.rsplit("-c", 1)[1])]
    assert fig.step.prefill_share == pytest.approx(rate * itl) and fig.step.prefill_tokens == 2500
    term = next(t for t in calibration.load(fig.step.preset).backbone_terms if t.coefficient == "per_new_token_s")
    moved = anchors.predict_s(fig, load=lambda n: calibration.load(n).with_term(term.name, term.value + 1e-6)) - \
        anchors.predict_s(fig)
    assert moved == pytest.approx(1e-6 * (fig.step.batch + rate * itl * 2500), rel=1e-6)


@pytest.mark.parametrize("key", sorted(anchors.GROUPS))
def test_every_setup_variant_changes_the_prediction(key):
    # a variant prices a stated setup difference by the preset's own terms: renaming those terms must not make it
    # a silent no-op
    members = [f for f in anchors.compared() if f.group == key]
    for v in anchors.GROUPS[key].variants:
        assert all(anchors.predict_s(f, lambda n: v.apply(calibration.load(n))) > anchors.predict_s(f)
                   for f in members), v.label


# --- the script -------------------------------------------------------------------------------------------------

def test_bench_prints_every_figure_with_its_source(printed):
    for f in anchors.FIGURES:
        assert anchors._value(f) in printed, f"{f.key}: {anchors._value(f)} not printed"
        assert f.source in printed, f"{f.key}: its source is not printed"


def test_bench_prints_each_prediction_and_error(printed):
    for f in anchors.compared():
        i, p = anchors.FIGURES.index(f) + 1, anchors.predict_s(f)
        row = next(line for line in printed.splitlines() if re.match(rf"\s*{i}\s", line))
        assert f"{p * 1e3:.1f} ms" in row and f"{(p / anchors.published_s(f) - 1) * 100:+.0f}%" in row, row


def test_bench_names_what_is_not_priced_when_personaplex_misses(printed):
    # the bar: PersonaPlex's four ticks within 20% by the stack of its server, or the missing term named
    errs = [anchors.error(f) for f in anchors.FIGURES if f.group == "vllm-omni-duplex"]
    line = next(s for s in printed.splitlines() if s.startswith("PersonaPlex's lockstep ticks: within"))
    assert f"at {sum(abs(e) <= anchors.WITHIN for e in errs)} of 4" in line
    if any(abs(e) > anchors.WITHIN for e in errs):
        assert "not priced: host work per tick" in printed


def test_docs_show_what_the_bench_prints(printed):
    # docs/gpu-pricing.md shows the command, then (after a line of prose) an excerpt of its output
    text = (ROOT / "docs" / "gpu-pricing.md").read_text()
    blocks = fenced_blocks(text)
    at = next(k for k, (lang, body, _) in enumerate(blocks) if lang == "bash" and body.strip() == COMMAND)
    lang, shown, line = next(b for b in blocks[at + 1:] if b[0] == "text")
    bad = mismatches(shown, printed)
    assert not bad, f"docs/gpu-pricing.md line {line}: no longer what the bench prints: {bad}"
    for f in anchors.FIGURES:
        assert f.source.split(" (")[0] in text, f"docs/gpu-pricing.md does not cite {f.key}'s source"
