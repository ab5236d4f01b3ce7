"""Public figures beside the presets: every published per-step or per-tick figure found for the models Metronome
prices (metronome/anchors.py, each with its source), what the matching preset and serving stack predict for the
same setup, and the error.

    python benchmarks/bench_anchors.py

No GPU and no measurement: it prices each figure's step with the shipped presets (seconds). docs/gpu-pricing.md
shows its output with the sources.
"""

from __future__ import annotations

import argparse

from metronome import anchors


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    print("\n".join(anchors.report_lines()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
