#!/usr/bin/env bash
# The prepared GPU check (issues 16, 47): on one GPU with PyTorch but no vLLM and no network, in at most 6 min:
#   1. the sink+window compaction on CUDA tensors (metronome.probe.plugin.compaction_check: paged attention over
#      the compacted block tables against the dense masked reference, freed blocks poisoned with NaN);
#   2. a decode step of each preset's backbone shape (metronome.probe.decode_step: attention over the KV plus the
#      MLP or MoE, random bf16 weights, batch x context grid), fitted to base + per-seq + per-context-token terms
#      the presets can cite; written to $OUT/decode_step.json;
#   3. every stage of every model's frame pipeline besides the backbone (metronome.probe.stage_timers: the depformer,
#      Mimi, the talkers, code predictor, Code2Wav, token2wav, the TTS LM and vocoder, the audio encoders) and the
#      backbone's MoE curve, batched across sessions and one session at a time, from CUDA graphs and eager, at
#      batch 1-256, each mode fitted to per launch + per session; written to $OUT/stages.json (schema:
#      docs/measured/README.md). It prints its H200 plan first and its running time budget after each stage; it
#      starts nothing once the 6 min would be spent.
# Usage: bash scripts/gpu_check.sh            (CUDA; OUT defaults to ./gpu_check, PYTHON to python)
#        bash scripts/gpu_check.sh --cpu      (small shapes on CPU, eager only: what CI runs, so the script keeps
#                                              working; every stage timer included)
# Metronome need not be installed: without it the package is imported from this checkout (numpy and torch are
# the only third-party imports on this path).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$PWD/gpu_check}"
device=cuda; small=(); cases=300
if [[ "${1:-}" == "--cpu" ]]; then device=cpu; small=(--small); cases=40; fi
mkdir -p "$out"
run() {  # python -m MODULE ARGS..., from the installed package or, failing that, from this checkout
  "${PYTHON:-python}" - "$here" "$@" <<'PY'
import runpy, sys
root, module, args = sys.argv[1], sys.argv[2], sys.argv[3:]
try:
    import metronome.probe  # noqa: F401  (installed)
except ImportError:
    sys.path.insert(0, root)
    import metronome
    metronome.__path__.append(root)  # metronome.probe -> probe/, as pyproject.toml's package-dir maps it
sys.argv = [module, *args]
runpy.run_module(module, run_name="__main__")
PY
}
start=$(date +%s)
run metronome.probe.plugin.compaction_check --device "$device" --cases "$cases"
run metronome.probe.decode_step --device "$device" "${small[@]}" --out "$out/decode_step.json"
limit=360  # issue 47: the whole run in <= 6 min on one H200; the stage timers get what is left, less 20 s to finish
budget=$(( limit - 20 - ($(date +%s) - start) ))
run metronome.probe.stage_timers --device "$device" "${small[@]}" --budget-s "$budget" --out "$out/stages.json"
echo "gpu_check: done in $(( $(date +%s) - start )) s; $out/decode_step.json $out/stages.json"
