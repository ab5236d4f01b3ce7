"""The cliff and the bound, side by side, on a shipped preset.

    python examples/cliff_and_bound.py [--calibration moshi-7b-h200] [--sessions 300] [--out examples-out]

Runs the same fixed-N scenario twice, unbounded KV and sinks+window, prints both summaries and writes
one self-contained plotly page: resident blocks, frame latency and silent frames over time.
"""

import argparse
import sys
from pathlib import Path

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from metronome.errors import run_command
from metronome.sim.scenario import make_scenario, run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calibration", default="moshi-7b-h200")
    ap.add_argument("--sessions", type=int, default=300)
    ap.add_argument("--horizon", type=float, default=300.0)
    ap.add_argument("--sinks", type=int, default=16)
    ap.add_argument("--window", type=int, default=368)
    ap.add_argument("--out", default="examples-out")
    a = ap.parse_args()

    runs = {
        "unbounded": run(make_scenario(a.calibration, "unbounded", sessions=a.sessions, horizon=a.horizon)),
        f"sinks S={a.sinks}, W={a.window}": run(make_scenario(a.calibration, "sinks", window=a.window, sinks=a.sinks,
                                                              sessions=a.sessions, horizon=a.horizon)),
    }
    keys = ("t_sat_predicted_s", "t_sat_observed_s", "silent_frame_fraction", "deadline_miss_fraction",
            "p50_frame_latency_s", "p99_frame_latency_s", "peak_pool_occupancy", "collapsed")
    for label, r in runs.items():
        print(f"{label}:")
        for k in keys:
            print(f"  {k:<24} {r.summary[k]}")

    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=("resident KV blocks (pool size dashed)", "frame latency (ms)",
                                        "silent frames (share of frames answered)"))
    colors = {"unbounded": "#d62728"}
    pool = None
    for label, r in runs.items():
        c = colors.get(label, "#1f77b4")
        st, fr = r.steps, r.frames
        pool = r.scenario.calibration.engine.num_blocks
        fig.add_trace(go.Scatter(x=st.t_s, y=st.resident_blocks, name=label, line=dict(color=c)), 1, 1)
        fig.add_trace(go.Scatter(x=fr.tick_s, y=fr.latency_s * 1e3, name=label, line=dict(color=c), showlegend=False), 2, 1)
        fig.add_trace(go.Scatter(x=fr.tick_s, y=fr.silent / fr.frames, name=label, line=dict(color=c), showlegend=False), 3, 1)
        if r.summary["t_sat_observed_s"] is not None:
            fig.add_vline(x=r.summary["t_sat_observed_s"], line=dict(color=c, dash="dot"))
    fig.add_hline(y=pool, line=dict(dash="dash", color="grey"), row=1, col=1)
    deadline_ms = runs["unbounded"].summary["deadline_s"] * 1e3
    fig.add_hline(y=deadline_ms, line=dict(dash="dash", color="grey"), row=2, col=1)
    fig.update_xaxes(title_text="simulated time (s)", row=3, col=1)
    fig.update_layout(height=900, title=f"{a.calibration}: {a.sessions} sessions, the cliff vs the bound "
                                        f"(dotted: t_sat; latency stays under the {deadline_ms:g} ms deadline while frames go silent)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    page = out / "cliff_and_bound.html"
    fig.write_html(page, include_plotlyjs=True)
    print(f"wrote {page}")


if __name__ == "__main__":
    sys.exit(run_command("examples/cliff_and_bound.py", main))
