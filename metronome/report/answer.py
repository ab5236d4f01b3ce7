"""The report's words and numbers, formatted once: both report.md and report.html print these strings,
so the two can never disagree."""

from __future__ import annotations

from metronome.calibration import COEFFICIENT_UNITS, ESTIMATE_FACTOR
from metronome.erlang import DEFAULT_MAX_REFUSAL
from metronome.report.plan import OVERLOAD, REGIME_GAP, TARGET_FRACTION
from metronome.results import COLLAPSE_SILENT_FRACTION

REGIMES = {"independent": "independent phases (each client's frames on its own clock, vLLM stepping while any "
                          "has work: how vLLM serves real clients)",
           "aligned": "aligned phases (every session's frames on one clock, served in lockstep: a fixed-batch "
                      "server such as Moshi's own)"}


# ------------------------------------------------------------------------------------------ formats
def secs(x: float | None) -> str:
    if x is None:
        return "never"
    return f"{x:.0f} s" if x >= 100 else f"{x:.1f} s"


def ms(x: float | None) -> str:
    return "n/a" if x is None else f"{1e3 * x:.1f} ms"


def pct(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{100 * x:.0f}%" if x >= 0.1 else f"{100 * x:.2f}%"


def count(n: int | float | None) -> str:
    return "n/a" if n is None else f"{int(n):,}"


def mib(b: int) -> str:
    return f"{b / 2**20:,.0f} MiB"


def rel(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def deadline_words(c: dict) -> str:
    return f"{1e3 * c['deadline_s']:g} ms"


def bound_words(c: dict) -> str:
    return c["policy"]["words"]


def admission_words(c: dict) -> str:
    t = c["tuning"]
    n = c["capacity"]["n_star"]
    if t["params"] is None:
        return f"static:{n} (no AIMD setting in the small grid met the budget)"
    p = t["params"]
    plural = "" if p["additive_increase"] == 1 else "s"
    return (f"AIMD +{p['additive_increase']:g} session{plural} per {p['interval_s']:g} s, ×{p['decrease_factor']:g} on "
            f"congestion, p{p['percentile']:g} target {p['target_fraction']:g} × deadline, start at "
            f"{p['initial_limit']}, max_limit {p['max_limit']} (or static:{n})")


# ------------------------------------------------------------------------------------------ the answer
def never_ending_t_sat(c: dict) -> float | None:
    """When N* unbounded sessions that never end run the pool dry (the pool-fill section's curve at N*)."""
    n = c["capacity"]["n_star"]
    return next((k["t_sat_predicted_s"] for k in c["fill"]["curves"]
                 if k["policy"] == "unbounded" and k["sessions"] == n), None)


def mix_words(c: dict) -> str:
    """The workload of the answer's unbounded verdict: N* sessions of the report's mix, which end."""
    return f"{count(c['capacity']['n_star'])} sessions of {c['session_duration']} started together"


def never_ending_words(c: dict) -> str:
    """What sessions that never end do at N* (the pool-fill section), said beside a verdict on the mix."""
    t = never_ending_t_sat(c)
    return ("" if t is None else
            f"; the same number of sessions that never end run it dry after {secs(t)} (the pool-fill section)")


def collapse_words(c: dict) -> str:
    u = c["unbounded_at_n_star"]
    mix = mix_words(c)
    if u["collapsed"]:
        return (f"{mix}: collapses: the pool runs dry after {secs(u['t_sat_predicted_s'])} (fill model; simulated "
                f"{secs(u['t_sat_observed_s'])}), then {pct(u['silent_frame_fraction'])} of frames are silent "
                f"while deadline misses stay at {pct(u['deadline_miss_fraction'])}")
    if u["t_sat_observed_s"] is not None:
        return (f"{mix}: saturate after {secs(u['t_sat_observed_s'])} but do not collapse "
                f"({pct(u['silent_frame_fraction'])} silent frames)")
    return (f"{mix}: no collapse in {secs(u['horizon_s'])} (the pool never ran dry: enough of them end first)"
            + never_ending_words(c))


def regime_words(c: dict) -> str:
    """Which regime the answer assumes, and N* under the other one when it differs by more than REGIME_GAP."""
    cap = c["capacity"]
    alt = cap.get("other_regime")
    words = f"The answer assumes {REGIMES[cap['phases']]}."
    if alt and regimes_differ(c):
        words += (f" Under {alt['phases']} phases N* would be {count(alt['n_star'])} ({alt['binding']} binds; "
                  f"deadline-bound {count(alt['deadline_n_star'])}), {regime_gap_words(c)}.")
    return words


def regimes_differ(c: dict) -> bool:
    cap, alt = c["capacity"], c["capacity"].get("other_regime")
    return bool(alt) and abs(alt["n_star"] - cap["n_star"]) > REGIME_GAP * max(cap["n_star"], 1)


def regime_gap_words(c: dict) -> str:
    cap, alt = c["capacity"], c["capacity"]["other_regime"]
    gap = (alt["n_star"] - cap["n_star"]) / max(cap["n_star"], 1)
    return f"{abs(gap):.0%} {'more' if gap > 0 else 'fewer'} than under {cap['phases']} phases"


def span(pair: list[int]) -> str:
    """An interval of sessions: ``64–219``, one number when its ends meet."""
    lo, hi = pair
    return count(lo) if lo == hi else f"{count(lo)}–{count(hi)}"


def stack_words(c: dict) -> str:
    """The serving stack the answer prices, named (empty for a calibration that names none)."""
    rows = c.get("stacks") or []
    s = next((r for r in rows if r["answer"]), None)
    if s is None:
        return ""
    return f", served by the {s['stack']} stack" + (" (the default)," if s["default"] else ",")


def dominant_bar(r: dict) -> dict | None:
    return next((b for b in r["tornado"] if b["term"] == r["dominant_term"]), None)


def bar_span(b: dict) -> str:
    """A tornado bar's N* with its term at its high and at its low, as an interval."""
    return span(sorted([b["deadline_n_star_at_high_sessions"], b["deadline_n_star_at_low_sessions"]]))


def range_sentence(c: dict) -> str:
    """N*'s interval over the step terms' ranges and the term that moves it most, in a sentence (see
    :mod:`metronome.sim.capacity`: every ranged term at its slow end, then at its fast end, at once)."""
    cap = c["capacity"]
    r = cap.get("ranges")
    if not r:
        return ""
    if not r["ranged_terms"]:
        return "No step term of this calibration states a range, so N* has no interval here."
    b = dominant_bar(r)
    most = (f"\"{b['term']}\" moves it most ({bar_span(b)} with it alone at its high and its low)" if b
            else "no single term moves it")
    dl = r["deadline_n_star_interval_sessions"]
    if cap["binding"] == "deadline":
        words = (f"Over the step terms' ranges N* lies in {span(r['n_star_interval_sessions'])} (every term at its "
                 f"slow end, then at its fast end); {most}")
        if r["n_star_interval_sessions"][1] < dl[1]:
            words += f"; at the fast end memory caps it"
        return words + "."
    words = (f"The step terms' ranges move only the deadline-bound N*, {count(cap['deadline_n_star'])}: it lies in "
             f"{span(dl)} (every term at its slow end, then at its fast end); {most}")
    if r["n_star_interval_sessions"][0] < cap["n_star"]:
        words += f"; at the slow end the deadline binds first and N* is {count(r['n_star_interval_sessions'][0])}"
    else:
        words += f"; {cap['binding']} binds across them"
    return words + "."


def headline(c: dict) -> str:
    """The answer in plain words, one paragraph per calibration."""
    cap, u = c["capacity"], c["unbounded_at_n_star"]
    n = cap["n_star"]
    if cap["binding"] == "memory":
        why = (f"memory binds: the pool holds {count(cap['memory_ceiling'])} bounded sessions, while latency "
               f"would allow {count(cap['deadline_n_star'])}")
    elif cap["binding"] == "max_num_seqs":
        why = (f"vLLM's request limit binds: max_num_seqs lets it hold {count(cap['memory_ceiling'])} sessions, "
               f"paused ones included, while latency would allow {count(cap['deadline_n_star'])}; the pool "
               f"would hold more, so raise --max-num-seqs")
    else:
        why = (f"the deadline binds: past {count(cap['deadline_n_star'])} sessions p99 frame latency exceeds "
               f"{ms(cap['target_latency_s'])}, {TARGET_FRACTION:g} × the deadline; "
               + (f"max_num_seqs would allow {count(cap['memory_ceiling'])} and memory {count(c['pool_ceiling'])}"
                  if c["seqs_bind"] else f"memory would hold {count(cap['memory_ceiling'])}"))
    first = (f"One {c['hardware']} carries {count(n)} concurrent {c['model']} sessions{stack_words(c)} at a frame "
             f"deadline of {deadline_words(c)} with {bound_words(c)} ({why}).")
    if range_sentence(c):
        first += " " + range_sentence(c)
    if u["collapsed"]:
        second = (f"Without the bound, {count(n)} sessions run the pool dry after {secs(u['t_sat_predicted_s'])} "
                  f"and {pct(u['silent_frame_fraction'])} of frames go silent, while deadline misses stay at "
                  f"{pct(u['deadline_miss_fraction'])} and p99 latency at {ms(u['p99_frame_latency_s'])}: "
                  f"conversations go quiet while latency looks fine.")
    else:
        if u["t_sat_observed_s"] is not None:
            fate = (f"fill the pool after {secs(u['t_sat_observed_s'])} but do not collapse "
                    f"({pct(u['silent_frame_fraction'])} silent frames)")
        else:
            fate = (f"never run the pool dry in {secs(u['horizon_s'])}: enough of them end first"
                    + never_ending_words(c))
        second = (f"Without the bound, {count(n)} sessions of this mix {fate}; unbounded, the pool holds "
                  f"only {count(c['memory_ceiling_unbounded'])} sessions of {secs(c['session_duration_mean_s'])}.")
    return f"{first} {second} {regime_words(c)}"


INTERVAL_ROW = "N* over the terms' ranges"


def interval_row(c: dict) -> str:
    """The answer table's interval: N* with every ranged step term at its slow end · at its fast end, and the term
    that moves it most."""
    cap, r = c["capacity"], c["capacity"]["ranges"]
    if not r["ranged_terms"]:
        return f"{count(cap['n_star'])} sessions: no step term states a range"
    b = dominant_bar(r)
    most = f"moved most by \"{b['term']}\" ({bar_span(b)} alone)" if b else "no single term moves it"
    if cap["binding"] == "deadline":
        return (f"{span(r['n_star_interval_sessions'])} sessions (every ranged step term at its slow end · at its "
                f"fast end); {most}")
    return (f"{span(r['n_star_interval_sessions'])} sessions ({cap['binding']} binds; the ranges move the "
            f"deadline-bound N* over {span(r['deadline_n_star_interval_sessions'])}); {most}")


def stack_rows(c: dict) -> list[tuple[str, str]]:
    """One row per serving stack the calibration ships: its N* with its interval, the default named and the
    answer's marked."""
    rows = []
    for s in c.get("stacks") or []:
        r = s["ranges"]
        b = dominant_bar(r)
        words = f"N* = {count(s['n_star'])} sessions"
        if r["ranged_terms"] and r["n_star_interval_sessions"] != [s["n_star"]] * 2:
            words += f" ({span(r['n_star_interval_sessions'])})"
        words += f", {s['binding']} binds"
        if b:
            words += f"; moved most by \"{b['term']}\""
        if s["answer"]:
            words += "; the answer above"
        rows.append((f"stack {s['stack']}" + (" (default)" if s["default"] else ""),
                     f"{words} — {s['description']}"))
    return rows


def answer_rows(c: dict) -> list[tuple[str, str]]:
    """(question, answer) rows of one calibration's answer table."""
    cap, t, pol = c["capacity"], c["tuning"], c["policy"]
    fig = t["figures"]
    if fig is not None:
        goodput = (f"{fig['goodput_sessions']:,.0f} healthy sessions ({fig['goodput_frames_per_s']:,.0f} frames/s) "
                   f"with {t['offered_rate_per_s']:.2f} sessions/s offered"
                   + (f" ({OVERLOAD:g}× N*)" if t["offered_is_overload"] else "")
                   + f"; deadline misses ≤ {pct(fig['worst_deadline_miss_fraction'])}, "
                   f"silent ≤ {pct(fig['worst_silent_frame_fraction'])}")
    else:
        goodput = "n/a: no AIMD setting met the deadline-miss budget without collapse"
    window_note = f", about the last {c['policy']['window_context_s']:g} s of conversation" if pol["window_defaulted"] else ""
    return [
        ("hardware · model", f"{c['hardware']} · {c['model']}"),
        ("calibration", f"{c['name']} ({c['provenance']['kind']})"),
        ("workload", f"{deadline_words(c)} frame deadline · session length {c['session_duration']}"),
        ("memory ceiling", f"{count(c['pool_ceiling'])} sessions ({pol['describe']}: ≤ "
                           f"{pol['peak_blocks_per_session']} blocks = {mib(pol['bytes_per_session'])} each)"),
        *([("max_num_seqs", f"{count(c['max_num_seqs'])} sessions: vLLM's request limit caps sessions before "
                            f"memory does")] if c["seqs_bind"] else []),
        ("deadline-bound N*", f"{count(cap['deadline_n_star'])} sessions (p{cap['percentile']:g} ≤ "
                              f"{ms(cap['target_latency_s'])} = {TARGET_FRACTION:g} × deadline)"),
        ("which binds", f"{cap['binding']} → N* = {count(cap['n_star'])} sessions"),
        *([(INTERVAL_ROW, interval_row(c))] if cap.get("ranges") else []),
        *stack_rows(c),
        ("phase regime", f"{cap['phases']}" + (f"; under {cap['other_regime']['phases']}: N* = "
                                                f"{count(cap['other_regime']['n_star'])} "
                                                f"({cap['other_regime']['binding']} binds, {regime_gap_words(c)})"
                                                if regimes_differ(c) else
                                                (f"; under {cap['other_regime']['phases']} within "
                                                 f"{REGIME_GAP:.0%} ({count(cap['other_regime']['n_star'])})"
                                                 if cap.get("other_regime") else ""))),
        ("recommended S, W", f"{bound_words(c)}{window_note}"),
        ("recommended admission", admission_words(c)),
        ("expected goodput", goodput),
        ("unbounded at N*", collapse_words(c)),
        ("unbounded memory ceiling", f"{count(c['memory_ceiling_unbounded'])} sessions of "
                                     f"{secs(c['session_duration_mean_s'])}"),
    ]


def answer_table(data: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows, calibrations side by side (the first column is the question; a row only some calibrations
    have, such as a stack another model does not ship, sits after the row it follows there, blank elsewhere)."""
    cals = data["calibrations"]
    per = [dict(answer_rows(c)) for c in cals]
    labels: list[str] = []
    for p in per:
        for k, label in enumerate(p):
            if label not in labels:
                labels.insert(labels.index(list(p)[k - 1]) + 1 if k else 0, label)
    header = [""] + [c["name"] for c in cals]
    return header, [[label] + [p.get(label, "") for p in per] for label in labels]


# ------------------------------------------------------------------------------------------ how sure N* is
TORNADO_HEADER = ["term", "basis", "value", "range (low–high)", "N* at its low", "N* at its high", "swing"]


def tornado_tables(data: dict) -> list[tuple[str, Table]]:
    """One table per calibration with ranged terms (the answer's stack): each ranged step term, its range, and the
    deadline-bound N* with it alone at its low and at its high, widest swing first (the sensitivity chart's
    numbers)."""
    out = []
    for c in data["calibrations"]:
        r = c["capacity"].get("ranges")
        if not r or not r["tornado"]:
            continue
        rows = [[b["term"], b["basis"], f"{duration(b['value_s'])} {b['unit'][2:]}",
                 f"{duration(b['low_s'])}–{duration(b['high_s'])}", count(b["deadline_n_star_at_low_sessions"]),
                 count(b["deadline_n_star_at_high_sessions"]), count(b["swing_sessions"])] for b in r["tornado"]]
        out.append((f"{c['name']} · deadline-bound N* {count(r['deadline_n_star_sessions'])} with one term moved; "
                    f"every term at once: {span(r['deadline_n_star_interval_sessions'])}", (TORNADO_HEADER, rows)))
    return out


def tornado_note(data: dict) -> str:
    parts = [f"How sure is N*? Every step term carries a range: a measured term the spread between its runs, a "
             f"datasheet or anchored term what its source supports, an estimated term its value ÷ or × "
             f"{ESTIMATE_FACTOR:g}. The chart moves one term at a time to its low and to its high, the others at their "
             f"values, and shows the deadline-bound N* (widest swing on top); the shaded band is the interval: every "
             f"term at its slow end at once, then at its fast end. That is a worst and a best case over the ranges, "
             f"not a confidence interval: the terms' errors are not known to be independent, so they are not let to "
             f"cancel. The memory ceiling does not depend on step time: when memory binds, the ranges move the "
             f"deadline-bound N* alone."]
    for c in data["calibrations"]:
        if c["capacity"].get("ranges"):
            parts.append(f"{c['name']}: {range_sentence(c)}")
    return " ".join(parts)


# ------------------------------------------------------------------------------------------ GPUs for a load
OFFERED_LOAD_HINT = "--offered-load RATE|PATTERN|CSV"


def gpus_table(data: dict) -> Table:
    """GPUs for a few offered loads (concurrent sessions), calibrations side by side: Erlang B on each N*."""
    cals = data["calibrations"]
    g0 = cals[0]["gpus_for_loads"]
    header = ["concurrent sessions offered", f"arrivals (sessions/s, mean {secs(g0['mean_session_s'])})"]
    header += [f"{c['name']}: GPUs" for c in cals]
    rows = []
    for i, load in enumerate(g0["loads"]):
        row = [count(load["sessions"]), f"{load['arrival_rate_per_s']:,.3g}"]
        for c in cals:
            e = c["gpus_for_loads"]["loads"][i]["engines"]
            row.append(f"{e['pooled']:,} · {e['random']:,} with random routing")
        rows.append(row)
    return header, rows


def gpus_note(data: dict) -> str:
    cals = data["calibrations"]
    g0 = cals[0]["gpus_for_loads"]
    places = ", ".join(f"{count(c['gpus_for_loads']['n_star'])} ({c['name']})" for c in cals) if len(cals) > 1 \
        else count(g0["n_star"])
    where = ("the \"How many GPUs\" section sizes it" if data.get("fleet") else
             f"add {OFFERED_LOAD_HINT} (a rate in sessions/s, a pattern of rates or a day's CSV) for a \"How many "
             "GPUs\" section that simulates the fleet, its routers and an autoscaler, or run metronome-sim fleet")
    return (f"GPUs for an offered load of concurrent sessions (arrival rate × mean session length, "
            f"{secs(g0['mean_session_s'])}) with at most {pct(g0['max_refusal'])} of conversations refused at the "
            f"door: each GPU a loss system of N* = {places} places (the answer's, with its bound), sized by Erlang B; "
            f"the first figure for a router that finds any free GPU, the second for random routing. For your own "
            f"load, {where}.")


def gpus_words(c: dict) -> str:
    """One line for the CLI: a calibration's GPUs for the answer's loads, and the flag for the planner's own."""
    g = c["gpus_for_loads"]
    loads = ", ".join(f"{count(x['sessions'])} → {x['engines']['pooled']:,}" for x in g["loads"])
    return (f"GPUs at ≤ {pct(g['max_refusal'])} refused (Erlang B on N* = {count(g['n_star'])}), concurrent "
            f"sessions → GPUs: {loads}; for your own load add {OFFERED_LOAD_HINT}")


# ------------------------------------------------------------------------------------------ fidelity
LIVE_HINT = ("pass --live DIR (the --out folder of metronome-probe validate or run, or of "
             "benchmarks/bench_live_aimd.py)")


def sessions(x: float | None) -> str:
    """A (mean) number of sessions."""
    return "n/a" if x is None else f"{x:,.1f}"


def fidelity(c: dict) -> tuple[str, list[list[str]] | None]:
    """A sentence and, with live results, rows: policy, metric, measured, predicted, error."""
    kind = c["provenance"]["kind"]
    live = c.get("live")
    if live is None:
        if kind == "estimated":
            return (f"{c['name']} is estimated: its pool size and step latency were computed by "
                    f"{c['provenance']['source']}, not measured on the target. The shape of every curve "
                    "(the cliff, the bound, the race) follows from the KV arithmetic and holds; the absolute N*, "
                    "t_sat and latencies are as good as the estimate. " + terms_words(c) + " Measure the target "
                    f"with metronome-probe and {LIVE_HINT} to see predicted against measured here.", None)
        return (f"{c['name']} is measured ({c['provenance']['source']}, {c['provenance']['date']}) but no live "
                f"results were given: {LIVE_HINT} to compare.", None)
    if live.get("kind") == "runs":
        return runs_fidelity(c, live)
    rows = []
    for name, p in live["policies"].items():
        rows.append([name, "t_sat", secs(p["t_sat_observed_s"]), secs(p["t_sat_predicted_s"]),
                     rel(p["t_sat_relative_error"])])
        for metric, label in (("p50_frame_latency_s", "p50 frame latency"), ("p99_frame_latency_s", "p99 frame latency")):
            m = p[metric]
            rows.append([name, label, ms(m["live"]), ms(m["simulated"]), rel(m["relative_error"])])
        s = p.get("silent_frame_fraction")
        if s:
            rows.append([name, "silent frames", pct(s["live"]), pct(s["simulated"]), rel(s["relative_error"])])
    meta = ", ".join(f"{k} {v}" for k, v in live.get("meta", {}).items())
    return (f"Live validation from {live['source']}{' (' + meta + ')' if meta else ''}: the engine measured, the "
            f"simulator predicted from the calibration just measured. Errors are (predicted − measured) / measured.",
            rows)


def run_rows(run: dict) -> list[list[str]]:
    """One live admission run's fidelity rows: live (measured) beside simulated (predicted)."""
    f, lab = run["figures"], run["label"]

    def row(figure: str, key: str, fmt) -> list[str]:
        return [lab, figure, fmt(f[key]["live"]), fmt(f[key]["simulated"]), rel(f[key]["relative_error"])]

    rows = [row("settled concurrency (mean admitted, 2nd half)", "settled_sessions", sessions)]
    if f["settled_limit"]["live"] is not None or f["settled_limit"]["simulated"] is not None:
        ctl = run.get("controller") or "admission"
        rows.append(row(f"settled {ctl.upper() if ctl in ('aimd', 'static') else ctl} limit", "settled_limit",
                        sessions))
    if run.get("n_star") is not None:
        on = f": {run['n_star_policy']}" if run.get("n_star_policy") else ""
        rows.append([lab, f"N* (simulator{on})", "n/a", count(run["n_star"]), "n/a"])
    off = f["sessions_offered"]
    adm = f["sessions_admitted"]
    rows.append([lab, "sessions admitted", f"{count(adm['live'])} of {count(off['live'])}",
                 f"{count(adm['simulated'])} of {count(off['simulated'])}", rel(adm["relative_error"])])
    rows.append(row("silent frames", "silent_frame_fraction", pct))
    rows.append(row("preemptions", "preemptions", count))
    rows.append(row("p50 frame latency", "p50_frame_latency_s", ms))
    rows.append(row("p99 frame latency", "p99_frame_latency_s", ms))
    return rows


def run_meta_words(meta: dict) -> str:
    """A live run's workload in words: deadline, pool, arrivals, session durations, controller, seed."""
    words = {"model": lambda v: f"model {v}", "deadline_s": lambda v: f"{1e3 * v:g} ms deadline",
             "num_blocks": lambda v: f"{v:,} blocks", "window": lambda v: f"window {v}",
             "arrival_rate": lambda v: f"Poisson {v:g}/s", "rate_pattern": lambda v: f"rate pattern {v}",
             "durations": lambda v: f"durations {v}", "session_duration": lambda v: f"durations {v}",
             "admission": lambda v: f"admission {v}", "seed": lambda v: f"seed {v}"}
    return ", ".join(words[k](v) if k in words else f"{k} {v}" for k, v in meta.items())


def live_plan_words(c: dict, from_live: bool = False) -> str:
    """With ``--live``: which calibration the plan used (the folder's own when none was given) and every setting the
    live run and the plan do not share (empty when there is no live folder)."""
    live = c.get("live")
    if not live:
        return ""
    parts = []
    if from_live:
        parts.append(f"Planned with the calibration the live folder {live['source']} records: {c['name']} "
                     f"({c['provenance']['kind']}, {c['provenance']['path'] or c['spec']}).")
    diff = c.get("live_differences") or []
    if diff:
        parts.append(f"The live run and this plan differ in: " + "; ".join(
            f"{d['parameter']} (run {d['run']}, plan {d['plan']}; {d['flag']} plans at the run's)" for d in diff)
            + ". Figures that depend on them are not comparable between the two.")
    elif not from_live:
        parts.append(f"The live run in {live['source']} and this plan share their deadline, frame period, bound and "
                     f"pool where the folder records them.")
    return " ".join(parts)


def runs_fidelity(c: dict, live: dict) -> tuple[str, list[list[str]]]:
    """The sentence and rows for live admission runs (a metronome-probe run folder or the benchmark's)."""
    runs = list(live["runs"].values())
    meta = run_meta_words(live.get("meta", {}))
    what = ("Live AIMD runs of benchmarks/bench_live_aimd.py" if live["origin"] == "benchmark"
            else "A live admission run (metronome-probe run)")
    parts = [f"{what} from {live['source']}{' (' + meta + ')' if meta else ''}, beside the simulator."]
    here = [r for r in runs if r.get("simulated_by") == "report"]
    folder = [r for r in runs if r.get("simulated_by") == "sim/"]
    if here:
        where = c["provenance"]["path"] or c["spec"]
        parts.append(f"{', '.join(r['label'] for r in here)}: re-simulated here with this report's calibration "
                     f"{c['name']} ({c['provenance']['kind']}, {where}) on the run's own workload: the same seed, "
                     "arrivals and session durations, the same controller and settings, KV policy, pool and "
                     "deadline; N* is the simulator's for that policy, pool and deadline.")
    if folder:
        cals = sorted({r.get("simulated_with") or "an unnamed calibration" for r in folder})
        same = cals == [c["name"]]
        parts.append(f"{', '.join(r['label'] for r in folder)}: simulated by the "
                     f"{'benchmark' if live['origin'] == 'benchmark' else 'run'} itself (its sim/ folder) with the "
                     f"calibration {', '.join(cals)}"
                     + ("." if same else f", not with this report's {c['name']}."))
    for r in runs:
        f = r["figures"]["settled_sessions"]
        s = f"{r['label']}: live settled at {sessions(f['live'])} sessions, simulated {sessions(f['simulated'])}"
        n = r.get("n_star")
        if n:
            vs = [f"{who} {rel(None if x is None else (x - n) / n)}" for who, x in
                  (("live", f["live"]), ("simulated", f["simulated"]))]
            s += f" (N* = {count(n)}: {', '.join(vs)})"
        parts.append(s + ".")
    parts.append("Settled concurrency is the mean of the admitted sessions over the second half of the run; "
                 "errors are (simulated − live) / live. The figure in report.html shows admitted sessions and the "
                 "controller's limit over time, live beside simulated.")
    rows = [row for r in runs for row in run_rows(r)]
    return " ".join(parts), rows


FIDELITY_HEADER = ["policy", "figure", "measured", "predicted", "error"]


# ------------------------------------------------------------------------------------------ provenance
def provenance_rows(c: dict) -> list[tuple[str, str]]:
    p = c["provenance"]
    rows = [("calibration", f"{c['name']} ({p['kind']}) from {p['path'] or c['spec']}"),
            ("source", p["source"]), ("hardware", p["hardware"]), ("date", p["date"])]
    if p["engine"]:
        rows.append(("engine", p["engine"]))
    if p["weights"]:
        rows.append(("weights", p["weights"]))
    stack = next((s for s in c.get("stacks") or [] if s["answer"]), None)
    if stack:
        rows.append(("serving stack", f"{stack['stack']}" + (" (the default)" if stack["default"] else "")
                     + f": {stack['about']}"))
    rows.append(("pool", f"{c['pool']['num_blocks']:,} blocks × {c['pool']['block_size_tokens']} tokens "
                         f"({c['pool']['pool_bytes'] / 1e9:.1f} GB)"))
    rows.append(("stream", f"a frame every {1e3 * c['stream']['frame_period_s']:g} ms, "
                           f"{c['stream']['kv_tokens_per_s']:g} KV tokens/s per session"))
    return rows


TERMS_HEADER = ["coefficient", "term", "value", "basis", "source"]


def duration(x: float) -> str:
    """A short duration at a readable scale."""
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x / 1e-9:.3g} ns"


def term_rows(c: dict) -> list[list[str]]:
    """What the step-latency model is made of (an estimated calibration lists it), the plugin's own terms
    marked."""
    return [[t["coefficient"], t["name"] + (" (sink+window plugin only)" if t["plugin"] else ""),
             f"{duration(t['value'])} {COEFFICIENT_UNITS[t['coefficient']]}", t["basis"], t["source"]]
            for t in c["provenance"].get("terms", [])]


def terms_words(c: dict) -> str:
    """How the step model's terms were obtained, counted by basis, and whether the plugin's are priced in."""
    terms = c["provenance"].get("terms", [])
    if not terms:
        return ""
    by = {}
    for t in terms:
        by[t["basis"]] = by.get(t["basis"], 0) + 1
    counts = ", ".join(f"{n} {b}" for b, n in sorted(by.items(), key=lambda kv: -kv[1]))
    plugin = [t for t in terms if t["plugin"]]
    cost = sum(t["value"] for t in plugin if t["coefficient"] == "base_s")
    applied = ("the answer's policy runs through it, so they are priced in" if c["provenance"].get("plugin_priced")
               else "the answer's policy does not run through it")
    return (f"Its step model is {len(terms)} named terms ({counts}; section 7 lists each with its source); "
            f"{len(plugin)} of them are the sink+window plugin's own costs on a GPU (eager mode without CUDA graphs, "
            f"the block table copied to the host every step: {duration(cost)} a step), and {applied}.")


# ------------------------------------------------------------------------------------------ how many GPUs
SECTION_TITLES = {"answer": "The answer", "gpus": "How many GPUs", "fill": "Pool fill", "metastability": "Metastability",
                  "signal": "The signal", "admission": "Admission", "fidelity": "Fidelity", "provenance": "Provenance"}


def sections(data: dict) -> list[tuple[str, str]]:
    """(id, numbered title) of the report's sections in page order; "How many GPUs" only with an offered load."""
    keys = [k for k in SECTION_TITLES if k != "gpus" or data.get("fleet")]
    return [(k, f"{i}. {SECTION_TITLES[k]}") for i, k in enumerate(keys, 1)]


def section_title(data: dict, key: str) -> str:
    return dict(sections(data))[key]


def sizing_words(sim: dict) -> str:
    """The simulated size's refused share at the peak and how sure it is: its 95% interval over the runs drawn, or,
    when nobody was refused, the count (a zero spread is no interval)."""
    h = sim.get("hours_per_run")
    runs = (f"{sim['runs']} runs of {h:g} h at the peak" if h else f"{sim.get('runs', 1)} runs at the peak")
    ci = sim["refused_fraction_ci"]
    if ci:
        words = f"refused {pct(sim['refused_fraction'])}, 95% CI {pct(ci[0])}-{pct(ci[1])} over {runs}"
        if sim.get("decided") is False:
            words += "; the interval still holds the target"
        return words
    if sim.get("offered") is not None and not sim.get("refused"):
        return f"none of {sim['offered']:,} sessions refused over {runs}"
    return f"refused {pct(sim['refused_fraction'])} over {runs}"


def fleet_rows(c: dict, horizon_s: float, max_refusal: float = DEFAULT_MAX_REFUSAL) -> list[tuple[str, str]]:
    """One calibration's fleet answer (an entry of :func:`metronome.sim.fleet_plan.plan`'s summary) as labelled lines:
    the closed form and the simulated size at the peak, the run's GPU-hours static and autoscaled, the refusals
    and silent frames achieved, the worst hour against the target, the cost when priced. ``metronome-sim fleet``
    prints the same lines."""
    cf = c["closed_form_engines"]
    rows = [("GPUs at peak, closed form", f"{cf['pooled']} with a router that finds any free GPU · "
                                          f"{cf['random']} with random routing (Erlang B)")]
    for r, rr in c["routers"].items():
        sim = rr["simulated"]
        rows.append(("GPUs at peak, simulated", f"{sim['engines']} with {r} ({sizing_words(sim)})"))
    for r, rr in c["routers"].items():
        st, au = rr["static"], rr.get("autoscaled")
        text = f"[{r}] static {st['gpu_hours']:,.0f} ({st['engines']} GPUs)"
        if au:
            change = au["gpu_hours"] / st["gpu_hours"] - 1 if st["gpu_hours"] else 0.0
            text += (f" · autoscaled {au['gpu_hours']:,.0f} (mean {au['engines_mean']:.1f}, max "
                     f"{au['engines_max']} GPUs; {100 * change:+.0f}% vs static)")
        rows.append((f"GPU-hours ({horizon_s / 3600:g} h)", text))
        text = (f"[{r}] static {pct(st['refused_fraction'])} · {pct(st['silent_frame_fraction'])} (worst hour "
                f"{pct(st['worst_bin_refused_fraction'])} · {pct(st['worst_bin_silent_frame_fraction'])})")
        if au:
            text += (f"; autoscaled {pct(au['refused_fraction'])} · {pct(au['silent_frame_fraction'])} "
                     f"(worst hour {pct(au['worst_bin_refused_fraction'])} · "
                     f"{pct(au['worst_bin_silent_frame_fraction'])})")
        rows.append(("refused · silent frames", text))
        modes = [(mode, x) for mode, x in (("static", st), ("autoscaled", au)) if x and "bins" in x]
        over = any(x["bins_over_target"] for _, x in modes)
        rows.append((f"hours over the {pct(max_refusal)} target", f"[{r}] " + "; ".join(
            f"{mode} {x['bins_over_target']} of {x['bins']} (worst {pct(x['worst_bin_refused_fraction'])})"
            for mode, x in modes)
            + (": the fleet is sized for the peak's mean refusal, and one hour's refusals scatter around that mean"
               if over else "")))
        worst = max(x["worst_bin_silent_frame_fraction"] for x in (st, au) if x)
        if worst >= COLLAPSE_SILENT_FRACTION:
            rows.append(("", f"[{r}] an hour with {pct(worst)} of frames silent: sessions that run long overflow an "
                             f"engine's pool, which neither the router (in-flight counts) nor the refusals see; a "
                             f"bounded KV policy keeps N* inside memory"))
        if c["gpu_price_per_hour"] is not None:
            text = f"[{r}] static ${st['cost_per_1000_session_hours']:,.0f}"
            if au:
                text += f" · autoscaled ${au['cost_per_1000_session_hours']:,.0f}"
            rows.append(("cost per 1,000 session-h", text + f" (at ${c['gpu_price_per_hour']:g} per GPU-hour)"))
    unb = c.get("unbounded")
    if unb:
        ucf = unb["closed_form_engines"]
        gpus = ("no number of GPUs: not one session fits" if ucf["pooled"] is None else
                f"{ucf['pooled']} GPUs at peak by Erlang B ({ucf['random']} with random routing)")
        rows.append(("unbounded KV, for comparison", f"N* = {unb['n_star']:,} sessions per GPU ({unb['binding']} "
                                                     f"binds) → {gpus}, against {cf['pooled']} with {c['policy']}"))
    return rows


def peak_words(summary: dict) -> str:
    """The offered load at the peak of a fleet plan's summary: the rate × the mean session length, in Erlangs."""
    return (f"{summary['peak_rate_per_s']:g}/s × {summary['mean_session_s']:g} s = "
            f"{summary['peak_offered_erlangs']:,.0f} Erlangs")


def fleet_note(data: dict) -> str:
    f = data["fleet"]
    s = f["summary"]
    parts = [f"Offered load: {f['offered_load']}; sessions {data['calibrations'][0]['session_duration']}. At the peak "
             f"({peak_words(s)}) "
             f"with at most {pct(s['max_refusal'])} of conversations refused at the door:"]
    for c in s["calibrations"]:
        rr = c["routers"]["least-loaded"]
        st, au = rr["static"], rr.get("autoscaled")
        text = (f"{c['calibration']} needs {c['closed_form_engines']['pooled']} GPUs by Erlang B (N* = {c['n_star']} "
                f"places each, a router that finds any free GPU; {c['closed_form_engines']['random']} with random "
                f"routing) and {rr['simulated']['engines']} simulated with least-loaded routing; over the "
                f"{s['horizon_s'] / 3600:g} h run a static fleet of {st['engines']} uses {st['gpu_hours']:,.0f} GPU-hours")
        if au:
            text += f", autoscaling {au['gpu_hours']:,.0f} (max {au['engines_max']} at once)"
        if c["gpu_price_per_hour"] is not None:
            best = au or st
            text += f", ${best['cost_per_1000_session_hours']:,.0f} per 1,000 session-hours"
        parts.append(text + ".")
    parts.append("Each GPU is a loss system with N* places (the answer's N*, with its bound), so Erlang B needs only "
                 "the mean session length; the simulation routes every session of the run and adds the autoscaler "
                 "(scale out on sustained pressure with an engine start delay, scale in by draining).")
    return " ".join(parts)


def fleet_table(data: dict) -> Table:
    """The fleet answer side by side, one column per calibration."""
    f = data["fleet"]
    cols = f["summary"]["calibrations"]
    h, target = f["summary"]["horizon_s"], f["summary"]["max_refusal"]
    per = [dict(fleet_rows(c, h, target)) for c in cols]
    labels = [label for label, _ in fleet_rows(cols[0], h, target) if label]
    for p in per[1:]:
        labels += [label for label in p if label and label not in labels]
    return [""] + [c["calibration"] for c in cols], [[label] + [p.get(label, "") for p in per] for label in labels]


def fleet_hours_table(series: dict[str, dict]) -> Table:
    """Per hour of the run, calibrations side by side: the offered rate, then each calibration's GPUs (static,
    autoscaled mean), refused and silent frames, static · autoscaled (static alone without the autoscaler); columns
    carry the calibration's name when there are several. ``series``: :func:`metronome.sim.fleet_plan.hour_series` by calibration name. The report's per-hour table and
    ``metronome-sim fleet``'s are these rows."""
    header = ["hour", "offered/s"]
    for name, sr in series.items():
        modes = "static · autoscaled" if sr["autoscaled_engines_mean"] else "static"
        named = f"{name}: " if len(series) > 1 else ""  # one calibration: the table's title names it
        header += [f"{named}GPUs {modes}", f"{named}refused {modes}", f"{named}silent frames {modes}"]
    first = next(iter(series.values()))
    rows = []
    for k, t in enumerate(first["start_s"]):
        row = [f"{t / 3600:g}", f"{first['offered_rate_per_s'][k]:.2f}"]
        for sr in series.values():
            au = bool(sr["autoscaled_engines_mean"])
            row += [f"{sr['static_engines'][k]:.0f}" + (f" · {sr['autoscaled_engines_mean'][k]:.1f}" if au else ""),
                    pct(sr["static_refused_fraction"][k])
                    + (f" · {pct(sr['autoscaled_refused_fraction'][k])}" if au else ""),
                    pct(sr["static_silent_frame_fraction"][k])
                    + (f" · {pct(sr['autoscaled_silent_frame_fraction'][k])}" if au else "")]
        rows.append(row)
    return header, rows


def seeds_words(data: dict) -> str:
    o = data["options"]
    return (f"scenario seed {o['seed']}; Monte Carlo seeds {o['seed']}…{o['seed'] + o['mc_runs'] - 1} per cell, "
            f"{o['seed']}…{o['seed'] + o['mc_edge_runs'] - 1} on the collapse band's edge; "
            f"AIMD tuning seed {o['seed']} (one seed per setting)")



# ------------------------------------------------------------------------------------------ sections
Table = tuple[list[str], list[list[str]]]


def fill_table(data: dict) -> Table:
    rows = []
    for c in data["calibrations"]:
        for k in c["fill"]["curves"]:
            rows.append([c["name"], k["label"], count(k["sessions"]), secs(k["t_sat_predicted_s"]),
                         secs(k["t_sat_observed_s"]), pct(max(k["occupancy_simulated"] or [0.0])),
                         "yes" if k["collapsed"] else "no"])
    return ["calibration", "policy", "N (never ending)", "t_sat predicted", "t_sat simulated", "peak occupancy",
            "collapsed"], rows


def fill_note(data: dict) -> str:
    c0 = data["calibrations"][0]
    parts = [f"Here N sessions start together and never end, each growing until the horizon: the pool's worst "
             f"case. The answer's \"unbounded at N*\" is another workload: N* sessions of {c0['session_duration']}, "
             f"which end and free their blocks, so the same N can collapse here and not there."]
    for c in data["calibrations"]:
        u = [k for k in c["fill"]["curves"] if k["policy"] == "unbounded"]
        b = [k for k in c["fill"]["curves"] if k["policy"] == "bounded"]
        fast, slow = u[-1], u[0]
        below = [k for k in b if k["t_sat_observed_s"] is None]
        parts.append(
            f"{c['name']}: unbounded, {count(slow['sessions'])} sessions run the pool dry after "
            f"{secs(slow['t_sat_predicted_s'])} (simulated {secs(slow['t_sat_observed_s'])}) and "
            f"{count(fast['sessions'])} after {secs(fast['t_sat_predicted_s'])}; with {bound_words(c)} every session "
            f"stops growing at {c['policy']['peak_blocks_per_session']} blocks, so up to "
            f"{count(max([k['sessions'] for k in below] or [0]))} sessions the pool levels off below 100%.")
    return (" ".join(parts) + " Lines are the fill model ρ(t) (N sessions started together, block by block); points "
            "are the simulator; dotted verticals mark the predicted t_sat, crosses the simulated one.")


PAST_N_STAR = "†"  # marks a session count past the deadline-bound N* (compute-overloaded)


def mc_sessions_labels(m: dict) -> list[str]:
    """The metastability grid's N labels, those past the deadline-bound N* marked (tables and heatmaps)."""
    return [count(n) + (f" {PAST_N_STAR}" if past else "") for n, past in zip(m["sessions"], m["past_n_star"])]


def mc_cell_words(p: dict, i: int, j: int) -> str:
    """One cell: predicted / simulated collapse, the simulated share's 95% Wilson interval and its runs."""
    lo, hi = p["collapse_interval"][i][j]
    return (f"{pct(p['predicted'][i][j])} / {pct(p['simulated_collapse'][i][j])} "
            f"[{pct(lo)}–{pct(hi)}, {p['runs'][i][j]} runs]")


def metastability_tables(data: dict) -> list[tuple[str, Table]]:
    """One grid per calibration and policy: predicted / simulated collapse per (mean duration, N), with the
    simulated share's Wilson interval."""
    out = []
    for c in data["calibrations"]:
        m = c["metastability"]
        for key in ("unbounded", "bounded"):
            p = m["policies"][key]
            header = ["mean length ↓  N →"] + mc_sessions_labels(m)
            rows = [[f"{d:g} s"] + [mc_cell_words(p, i, j) for j in range(len(m["sessions"]))]
                    for i, d in enumerate(m["mean_duration_s"])]
            out.append((f"{c['name']} · {p['label']} (predicted / simulated [95% interval, runs])", (header, rows)))
    return out


def metastability_note(data: dict) -> str:
    c0 = data["calibrations"][0]
    m = c0["metastability"]
    return (f"N sessions start together with exponentially distributed lengths of the given mean and run for "
            f"{m['horizon_factor']:g} mean lengths. Predicted: the fill model's probability of collapse: that the pool "
            f"runs dry (exact; a race between fill and sessions ending) and that the survivors it cannot hold then "
            f"silence at least 1% of the frames. Simulated: the share of seeded runs per cell that collapsed (the "
            f"pool ran dry and at least 1% of the frames after that were silent frames of sessions that had lost "
            f"their place), {m['runs_per_cell']} runs per cell, {m['edge_runs']} where the cell is on the band's "
            f"edge (some runs collapsed and some not, or a neighbour's outcome differs), with its 95% Wilson "
            f"interval; a run stops once its outcome is decided. N is in units of N* = {count(m['n_star'])}; "
            f"{PAST_N_STAR} marks N past the deadline-bound N* (compute-overloaded: frames miss their deadline "
            f"whatever the pool does). The mean lengths are multiples of the unbounded t_sat at N*. "
            f"Without the bound, collapse is metastable: the same N can survive or collapse depending on how long "
            f"conversations happen to last. With it, collapse needs more sessions than the memory ceiling.")


def signal_table(data: dict) -> Table:
    rows = []
    for c in data["calibrations"]:
        for key in ("unbounded", "bounded"):
            s = c["signal"][key]
            for i, n in enumerate(s["sessions"]):
                rows.append([c["name"], s["label"], count(n), ms(s["p50_frame_latency_s"][i]),
                             ms(s["p99_frame_latency_s"][i]), pct(s["silent_frame_fraction"][i]),
                             pct(s["deadline_miss_fraction"][i])])
    return ["calibration", "policy", "N", "p50 latency", "p99 latency", "silent frames", "deadline misses"], rows


def signal_note(data: dict) -> str:
    parts = []
    for c in data["calibrations"]:
        u, b = c["signal"]["unbounded"], c["signal"]["bounded"]
        lo, hi = 0, len(u["sessions"]) - 1
        ceiling = c["capacity"]["memory_ceiling"]
        at = max((i for i, n in enumerate(b["sessions"]) if n <= ceiling), default=lo)
        above = (f", and past the ceiling it jumps to {ms(b['p99_frame_latency_s'][hi])} at "
                 f"{count(b['sessions'][hi])}" if b["sessions"][hi] > ceiling else "")
        parts.append(
            f"{c['name']}: from {count(u['sessions'][lo])} to {count(u['sessions'][hi])} sessions, unbounded p99 "
            f"moves from {ms(u['p99_frame_latency_s'][lo])} to {ms(u['p99_frame_latency_s'][hi])} while silent frames "
            f"climb to {pct(u['silent_frame_fraction'][hi])}; bounded p99 ramps from {ms(b['p99_frame_latency_s'][lo])} "
            f"to {ms(b['p99_frame_latency_s'][at])} at {count(b['sessions'][at])} sessions with no silent frames"
            f"{above}.")
    d = data["calibrations"][0]["session_duration_mean_s"]
    return (f"N sessions run together for one mean session length ({secs(d)}). " + " ".join(parts) +
            " Unbounded, p50 stays flat (the full pool caps the context a step attends to) while silent frames "
            "climb: the wall shows up as silence, which a latency dashboard does not see. Bounded, latency rises "
            "smoothly with load up to the memory ceiling (blue dotted) with no silent frames: a signal an admission "
            "controller can hold at N* (green).")


def admission_table(data: dict) -> Table:
    rows = []
    for c in data["calibrations"]:
        for key in ("unbounded", "bounded"):
            p = c["admission"]["policies"][key]
            s = p["summary"]
            rows.append([c["name"], p["label"], count(s["sessions_offered"]), count(s["sessions_admitted"]),
                         count(s["sessions_refused"]), f"{s['goodput_sessions']:,.0f}", ms(s["p99_frame_latency_s"]),
                         pct(s["silent_frame_fraction"]), pct(s["deadline_miss_fraction"]),
                         "yes" if s["collapsed"] else "no"])
    return ["calibration", "policy", "offered", "admitted", "refused", "goodput (sessions)", "p99 latency",
            "silent frames", "deadline misses", "collapsed"], rows


def admission_note(data: dict) -> str:
    c0 = data["calibrations"][0]
    steps = ", ".join(f"{r * c0['admission']['mean_duration_s']:,.0f}" for _, r in c0["admission"]["pattern"])
    parts = []
    for c in data["calibrations"]:
        u = c["admission"]["policies"]["unbounded"]["summary"]
        b = c["admission"]["policies"]["bounded"]["summary"]
        parts.append(f"{c['name']}: with {bound_words(c)} the controller keeps {b['goodput_sessions']:,.0f} healthy "
                     f"sessions on average with {pct(b['silent_frame_fraction'])} silent frames; unbounded, the same "
                     f"controller admits sessions that later lose their place in the pool, and "
                     f"{pct(u['silent_frame_fraction'])} of frames go silent while only "
                     f"{pct(u['deadline_miss_fraction'])} miss the deadline ({u['goodput_sessions']:,.0f} healthy "
                     f"sessions).")
    return (f"Poisson arrivals whose rate rises and falls, one mean session length per step (for {c0['name']}, an "
            f"offered load of {steps} sessions), with the tuned AIMD controller in front of the engine. The "
            f"controller sees only frame latency and silent frames. " + " ".join(parts) +
            " The plotted latency and silence are per controller interval (the worst interval in each bucket).")
