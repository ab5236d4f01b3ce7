"""Find N* and tune AIMD (user story 2): how many sessions can one GPU carry, and where should the limit sit?

    python examples/find_n_star_and_tune_aimd.py [--out examples-out/tune]

Moshi on one H200 (estimated preset) with sinks+window KV and a 40 ms per-frame compute budget:
1. `capacity`: the memory ceiling, the deadline-bound N*, and which binds;
2. `tune-aimd`: a small grid over the AIMD parameters, scored by goodput under a deadline-miss budget
   and no collapse;
3. the tuned controller in the loop under overload, bounded and unbounded: with the bound it settles at
   N*, without it the same controller admits into the wall.
"""

import argparse
import json
import sys
from pathlib import Path

from metronome import calibration
from metronome.errors import run_command
from metronome.kv_policy import KVPolicy
from metronome.sim.capacity import capacity
from metronome.sim.scenario import make_scenario, run
from metronome.sim.tuning import tune_aimd

SCENARIO = dict(calibration="moshi-7b-h200", kv="sinks", sinks=16, window=368, deadline=0.04,
                arrival_rate=10.0, session_duration="exp:300", horizon=600.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="examples-out/tune")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    cap = capacity(calibration.load("moshi-7b-h200"), KVPolicy.sinks(16, 16, 368), deadline_s=0.04)
    print(f"memory ceiling {cap['memory_ceiling']} sessions, deadline-bound N* {cap['deadline_n_star']}: "
          f"{cap['binding']} binds, N* = {cap['n_star']}")

    grid = {"additive_increase": [1.0, 4.0], "decrease_factor": [0.75, 0.9], "target_fraction": [0.8, 0.9],
            "interval_s": [1.0]}
    # the limit never needs to pass N*: past the memory ceiling only silence would tell the controller (with
    # independent phases, the default, latency at 40 ms stays under target up to the ceiling); start at N*/2
    base = {"max_limit": cap["n_star"], "initial_limit": max(1, cap["n_star"] // 2)}
    best, table = tune_aimd({k: v for k, v in SCENARIO.items()}, grid=grid, seeds=1, base_params=base)
    (out / "best_aimd.json").write_text(json.dumps(best, indent=2, default=str))
    table.to_csv(out / "tradeoff.csv", index=False)
    print(f"best AIMD: {best['params']['additive_increase']:g} per {best['params']['interval_s']:g} s, "
          f"x{best['params']['decrease_factor']:g}, target {best['params']['target_fraction']:g} x deadline "
          f"-> {best['figures']['goodput_sessions']:.0f} healthy sessions of goodput")

    # N* at the tuned controller's own target (the tuner may trade margin for goodput)
    tuned = capacity(calibration.load("moshi-7b-h200"), KVPolicy.sinks(16, 16, 368), deadline_s=0.04,
                     target_fraction=best["params"]["target_fraction"])
    print(f"N* at the tuned target ({best['params']['target_fraction']:g} x deadline): {tuned['n_star']}")
    cap = tuned
    for kv in ("sinks", "unbounded"):
        res = run(make_scenario(**{**SCENARIO, "kv": kv}, admission="aimd", aimd_params=best["params"]))
        st = res.steps
        n = (st.running + st.waiting)[st.t_s > 300]
        s = res.summary
        print(f"{kv:<9} admitted concurrency after 300 s: mean {n.mean():.0f} (N* {cap['n_star']}), "
              f"silent {100 * s['silent_frame_fraction']:.1f}%, deadline misses {100 * s['deadline_miss_fraction']:.2f}%, "
              f"collapsed {s['collapsed']}")
    print(f"wrote {out}/best_aimd.json and {out}/tradeoff.csv "
          f"(metronome-sim run --admission aimd --aimd-params {out}/best_aimd.json ...)")


if __name__ == "__main__":
    sys.exit(run_command("examples/find_n_star_and_tune_aimd.py", main))
