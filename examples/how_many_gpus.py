"""How many GPUs (user story: fleet planning): a day of Qwen3-Omni traffic, H200 vs B200.

    python examples/how_many_gpus.py [--load examples/day_of_traffic.csv] [--h200-price 3.5] [--b200-price 5.5]
                                     [--out examples-out/how-many-gpus]

The day is `examples/day_of_traffic.csv`: 96 quarter-hours of offered conversations per second, quiet at night,
a midday shoulder and an evening peak of ~10 new conversations a second; each conversation lasts 5 minutes on
average (exponential). For each GPU, with the sink+window bound (S=16, W=1760: about two minutes of this model's
audio):

1. `capacity`: the sessions one GPU carries at the model's 1 s frame deadline (N*, memory or deadline);
2. the closed form: each GPU a loss system with N* places, Erlang B at the peak for at most 1% refused;
3. the fleet simulation over the day (least-loaded router): a static fleet sized for the peak against an
   autoscaled one, GPU-hours, refusals and silent frames per hour, and the cost per 1,000 session-hours at the
   given prices (the defaults are placeholders: pass what you pay).

The same answer from the command line:
    metronome-sim fleet --calibration qwen3-omni-30b-a3b-h200 --calibration qwen3-omni-30b-a3b-b200 \\
        --kv sinks --sinks 16 --window 1760 --load-csv examples/day_of_traffic.csv --autoscale \\
        --gpu-price qwen3-omni-30b-a3b-h200=3.5 --gpu-price qwen3-omni-30b-a3b-b200=5.5
"""

import argparse
import json
import sys
from pathlib import Path

from metronome import calibration
from metronome.errors import run_command
from metronome.kv_policy import KVPolicy
from metronome.report.answer import fleet_rows, peak_words
from metronome.sim.capacity import capacity
from metronome.sim.fleet_config import AutoscalePolicy, EngineType
from metronome.sim.fleet_plan import PlanOptions, plan
from metronome.workload import Arrivals, Durations

PRESETS = ("qwen3-omni-30b-a3b-h200", "qwen3-omni-30b-a3b-b200")
SESSIONS = Durations.parse("exp:300")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--load", default=str(Path(__file__).resolve().parent / "day_of_traffic.csv"))
    ap.add_argument("--h200-price", type=float, default=3.5, help="USD per GPU-hour (placeholder)")
    ap.add_argument("--b200-price", type=float, default=5.5, help="USD per GPU-hour (placeholder)")
    ap.add_argument("--out", default="examples-out/how-many-gpus")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    day = Arrivals.from_csv(a.load)
    types = []
    for name in PRESETS:
        cal = calibration.load(name)
        policy = KVPolicy.sinks(cal.engine.block_size_tokens, 16, 1760)
        cap = capacity(cal, policy, duration_s=SESSIONS.mean_s)
        print(f"{name}: N* = {cap['n_star']} sessions per GPU ({cap['binding']} binds; memory ceiling "
              f"{cap['memory_ceiling']}, deadline-bound {cap['deadline_n_star']})")
        types.append(EngineType.from_capacity(cal, policy, cap))

    prices = {PRESETS[0]: a.h200_price, PRESETS[1]: a.b200_price}
    summary, tables = plan(types, day, SESSIONS, day.pattern_s,
                           PlanOptions(max_refusal=0.01, autoscale=AutoscalePolicy(), prices=prices))
    print(f"\noffered: {day.describe()}; peak {peak_words(summary)}; at most 1% refused")
    for c in summary["calibrations"]:
        print(f"\n{c['calibration']} (N* = {c['n_star']})")
        for label, text in fleet_rows(c, summary["horizon_s"]):
            print(f"  {label:<28} {text}")
    cost = {c["calibration"]: c["routers"]["least-loaded"]["autoscaled"]["cost_per_1000_session_hours"]
            for c in summary["calibrations"]}
    cheaper = min(cost, key=cost.get)
    print(f"\ncheaper per conversation-hour, autoscaled, at these prices: {cheaper} "
          + " vs ".join(f"${v:,.0f}" for v in cost.values()) + " per 1,000 session-hours")
    print(f"fleet simulation: {summary['simulated_engine_seconds_per_wall_s']:,.0f} simulated GPU-seconds per wall "
          f"second ({summary['wall_s']:.1f} s)")
    (out / "fleet.json").write_text(json.dumps(summary, indent=2, default=float))
    tables["bins"].to_csv(out / "bins.csv", index=False)
    print(f"wrote {out}/fleet.json and {out}/bins.csv")


if __name__ == "__main__":
    sys.exit(run_command("examples/how_many_gpus.py", main))
