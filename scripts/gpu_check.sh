#!/usr/bin/env bash
# The prepared GPU check (issue 16): on one GPU with PyTorch but no vLLM and no network, in well under 8 min:
#   1. the sink+window compaction on CUDA tensors (metronome.probe.plugin.compaction_check: paged attention over
#      the compacted block tables against the dense masked reference, freed blocks poisoned with NaN);
#   2. a decode step of each preset's backbone shape (metronome.probe.decode_step: attention over the KV plus the
#      MLP or MoE, random bf16 weights, batch x context grid), fitted to base + per-seq + per-context-token terms
#      the presets can cite; written to $OUT/decode_step.json.
# Usage: bash scripts/gpu_check.sh            (CUDA; OUT defaults to ./gpu_check, PYTHON to python)
#        bash scripts/gpu_check.sh --cpu      (a small shape on CPU: what CI runs, so the script keeps working)
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
echo "gpu_check: done in $(( $(date +%s) - start )) s; $out/decode_step.json"
