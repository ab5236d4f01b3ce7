"""Fleet planning: Erlang B, the offered-load CSV, and the multi-engine simulation against them."""

import math
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pandas as pd
import pytest

from metronome import calibration as calmod
from metronome.erlang import batch_means_interval, engines_needed, erlang_b, refusal_probability
from metronome.errors import MetronomeError
from metronome.fill_model import FillModel
from metronome.kv_policy import make_policy
from metronome.workload import Arrivals, Durations
from metronome.sim.executors import LocalExecutor
from metronome.sim.fleet import simulate
from metronome.sim.fleet_bins import level_max_by_bin, overlap_by_bin  # the tables' arithmetic, checked by hand
from metronome.sim.fleet_config import ROUTERS, AutoscalePolicy, EngineType, FleetConfig
from metronome.sim.fleet_plan import grid, size_by_simulation, sweep


# --------------------------------------------------------------------------------------------- Erlang B
def exact_erlang_b(c: int, a) -> Fraction:
    """Erlang's formula in exact rationals, term by term: (A^c/c!) / sum_k A^k/k!."""
    a = Fraction(a)
    terms = [a ** k / math.factorial(k) for k in range(c + 1)]
    return terms[-1] / sum(terms)


def exact_erlang_b_integer_load(c: int, a: int) -> Fraction:
    """The same for an integer load, in integers: each term times c! is A^k·c!/k!, summed from k = c down."""
    total, power, prod = 0, a ** c, 1  # power = A^k, prod = c!/k!
    for k in range(c, -1, -1):
        total += power * prod
        power //= a
        prod *= k
    return Fraction(a ** c, total)


@pytest.mark.parametrize("c,a", [(0, 3), (1, "1/2"), (2, 2), (5, "7/2"), (10, 5), (12, "45/4"), (30, 25), (40, 36)])
def test_erlang_b_matches_the_exact_formula(c, a):
    # the recursion rounds once per place: relative error about c·1e-16, far inside 1e-12
    assert erlang_b(c, float(Fraction(a))) == pytest.approx(float(exact_erlang_b(c, a)), rel=1e-12)


def test_erlang_b_is_stable_for_thousands_of_places():
    c, a = 3000, 2900
    with pytest.raises(OverflowError):  # the textbook form's A^c does not fit in a float
        float(a) ** c
    expected = float(exact_erlang_b_integer_load(c, a))
    # 3000 rounding steps of about 1e-16 each: 1e-10 relative leaves a wide margin
    assert erlang_b(c, a) == pytest.approx(expected, rel=1e-10)
    assert 0 < expected < 0.05


def test_erlang_b_against_published_table_values():
    # Erlang B tables: 1% blocking at 10 lines carries 4.461 Erlangs, at 100 lines 84.06. The tables round A to
    # four digits, which moves B by at most 6e-6 (10 lines) and 1e-5 (100 lines) around 1%.
    assert erlang_b(10, 4.461) == pytest.approx(0.01, abs=1e-5)
    assert erlang_b(100, 84.06) == pytest.approx(0.01, abs=1.5e-5)


def test_engines_needed_from_the_table_values():
    # pooled: 10 engines of 10 places are 100 lines, which carry 84.06 Erlangs at 1%
    assert engines_needed(84.0, 10, 0.01, "pooled") == 10
    assert engines_needed(84.1, 10, 0.01, "pooled") == 11
    # random: each engine of 10 places carries 4.461 Erlangs at 1%, so 44 Erlangs need 10 (4.4 each), 45 need 11
    assert engines_needed(44.0, 10, 0.01, "random") == 10
    assert engines_needed(45.0, 10, 0.01, "random") == 11
    assert engines_needed(0.0, 10, 0.01) == 0
    assert refusal_probability(44.0, 10, 10, "random") == pytest.approx(float(exact_erlang_b(10, "22/5")), rel=1e-12)


@pytest.mark.parametrize("call,needle", [
    (lambda: engines_needed(10, 5, 0.0), "refusal target must be in (0, 1)"),
    (lambda: engines_needed(10, 5, 1.0), "refusal target must be in (0, 1)"),
    (lambda: engines_needed(-1, 5, 0.01), "offered load must be"),
    (lambda: engines_needed(10, 0, 0.01), "places per engine must be an integer >= 1"),
    (lambda: engines_needed(10, 5, 0.01, "sticky"), "unknown routing"),
    (lambda: batch_means_interval([1], [10]), "at least 2 batches"),
])
def test_erlang_bad_input(call, needle):
    with pytest.raises(MetronomeError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        call()


def test_batch_means_interval_by_hand():
    # refused 2, 4, 3, 5 of 100 each: p = 14/400; deviations from p·100 are -1.5, .5, -.5, 1.5, so s = sqrt(5/3);
    # the t table gives t(0.975, 3 df) = 3.182, so the half-width is 3.182·s/(100·2). The table's three decimals
    # move it by under 4e-6.
    p, lo, hi = batch_means_interval([2, 4, 3, 5], [100, 100, 100, 100])
    half = 3.182 * math.sqrt(5 / 3) / 200
    assert p == pytest.approx(0.035, abs=1e-15)
    assert lo == pytest.approx(0.035 - half, abs=4e-6) and hi == pytest.approx(0.035 + half, abs=4e-6)


def test_take_trace_hands_over_each_row_once():
    # a fleet takes its controllers' traces as it goes (a day is 86,400 rows per engine); taken in pieces, the
    # rows are those of an identical controller's whole trace, none twice and none lost
    from metronome.admission import make_controller

    kept, taken = make_controller("aimd", 0.08), make_controller("aimd", 0.08)
    pieces = []
    for k in range(40):
        for c in (kept, taken):
            c.advance(k * 0.5, 3)
            c.observe(k * 0.5, 0.05 if k % 7 else 0.2, 6, 1 if k == 20 else 0)
        if k % 9 == 0:
            pieces += taken.take_trace()
    pieces += taken.take_trace()
    assert pieces == kept.trace() and len(pieces) == 19
    assert taken.trace() == [] and taken.take_trace() == []


# ------------------------------------------------------------------------------------------ load CSV
def test_the_example_day_is_96_quarter_hours_with_an_evening_peak():
    a = Arrivals.from_csv("examples/day_of_traffic.csv")
    rows = [line for line in open("examples/day_of_traffic.csv")
            if line.strip() and not line.startswith("#") and not line.startswith("time")]
    assert len(a.segments) == len(rows) == 96
    assert all(d == 900 for d, _ in a.segments) and a.pattern_s == 86400
    rates = [r for _, r in a.segments]
    assert a.peak_rate_per_s == max(rates) == max(float(line.split(",")[1]) for line in rows)
    assert 17 <= rates.index(max(rates)) / 4 < 23  # the peak is in the evening
    assert a.rate_at(3 * 3600) == float(rows[12].split(",")[1])
    assert a.describe() == f"Poisson arrivals, rate pattern of 96 segments over 86400 s, peak {max(rates):g}/s"


def test_csv_times_in_seconds_or_clock_are_the_same(tmp_path):
    f1, f2 = tmp_path / "a.csv", tmp_path / "b.csv"
    f1.write_text("time,rate\n0,1\n1800,2.5\n3600,0\n")
    f2.write_text("# clock times\n00:00,1\n00:30,2.5\n01:00:00,0\n")
    assert Arrivals.from_csv(f1) == Arrivals.from_csv(f2) == Arrivals("pattern", segments=((1800, 1), (1800, 2.5),
                                                                                          (1800, 0)))


@pytest.mark.parametrize("text,needle", [
    ("0,1\n900,-2\n1800,1\n", "line 2: the rate must be a finite number of sessions/s >= 0, got -2"),
    ("0,1\n900,1\n2700,1\n", "line 3: time 2700 s is 1800 s after the row before, but rows are 900 s apart"),
    ("0,1\n900,1\n600,1\n", "line 3: time 600 s comes before the row before"),
    ("0,1\n900,1\n900,2\n", "line 3: time 900 s repeats the row before"),
    ("0,1\nnoon,1\n", "line 2: cannot read 'noon' as a time"),
    ("0,1\n900,lots\n", "line 2: cannot read 'lots' as a rate"),
    ("0,1\n00:75,1\n", "line 2: cannot read '00:75' as a time"),
    ("time,rate\n", "needs two or more time,rate rows"),
    ("", "needs two or more time,rate rows"),
    ("0,1\n", "needs two or more time,rate rows"),
    ("900,1\n1800,1\n", "line 1: the first row must be at time 0"),
    ("0,1,3\n900,1\n", "line 1: want TIME,RATE"),
    ("0,inf\n900,1\n", "line 1: the rate must be a finite number"),
])
def test_bad_load_csv_is_one_line(tmp_path, text, needle):
    f = tmp_path / "load.csv"
    f.write_text(text)
    with pytest.raises(MetronomeError) as exc:
        Arrivals.from_csv(f)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_a_rate_pattern_and_a_csv_share_the_segment_check(tmp_path):
    f = tmp_path / "load.csv"
    f.write_text("0,1\n60,-1\n")
    with pytest.raises(MetronomeError) as from_csv:
        Arrivals.from_csv(f)
    with pytest.raises(MetronomeError) as from_pattern:
        Arrivals.parse_pattern("60:1,60:-1")
    assert str(from_csv.value).split(": ", 1)[1] == str(from_pattern.value).split(": ", 1)[1]
    with pytest.raises(MetronomeError, match="no such load CSV file"):
        Arrivals.from_csv(tmp_path / "missing.csv")


# ------------------------------------------------------------------------------------------ the fleet
CAL = calmod.load("moshi-7b-h200")
SINKS = make_policy("sinks", CAL.engine.block_size_tokens, window=1760, sinks=4)
UNBOUNDED = make_policy("unbounded", CAL.engine.block_size_tokens)


def small_engine(n: int = 10, curve=()) -> EngineType:
    """Moshi on an H200 under a bound, capped at n sessions (far under its memory ceiling): a loss system of n places."""
    return EngineType(CAL, SINKS, n, 0.08, tuple(curve))


def loss_run(router: str, seeds=range(8), durations=Durations("lognormal", 60.0, 1.2), engines=4, offered=36.0,
             horizon=20_000.0, warmup=600.0):
    """G = 4 engines of 10 places offered 36 Erlangs; one batch per seed (independent runs)."""
    cfg = FleetConfig(engine=small_engine(), engines=engines, arrivals=Arrivals("poisson", rate_per_s=offered / 60),
                      durations=durations, horizon_s=horizon, router=router, warmup_s=warmup, bin_s=horizon)
    tot = [simulate(replace(cfg, seed=s)).totals for s in seeds]
    return batch_means_interval([t["refused"] for t in tot], [t["offered"] for t in tot], confidence=0.99)


@pytest.fixture(scope="module")
def by_router():
    return {r: loss_run(r) for r in ROUTERS}


def test_least_loaded_refuses_as_erlang_b_pooled(by_router):
    # lognormal sessions (sigma 1.2): Erlang B depends on their mean only. The 99% interval is the simulation's
    # sampling error over 8 independent seeds; it is narrow enough (under 2 points around 6.5%) that random
    # routing (16.8%) or one engine fewer (B(30, 36) = 24%) would fall outside it.
    p, lo, hi = by_router["least-loaded"]
    assert lo <= erlang_b(40, 36.0) <= hi
    assert hi - lo < 0.02


def test_random_routing_refuses_as_erlang_b_per_engine(by_router):
    p, lo, hi = by_router["random"]
    assert lo <= erlang_b(10, 36.0 / 4) <= hi
    assert hi - lo < 0.025  # under 2.5 points around 16.8%: pooled routing's 6.5% would fall outside


def test_routers_ranked_least_loaded_fewest_random_most(by_router):
    # same offered load and seeds: the margin is the 99% intervals not overlapping (each is the seeds' spread)
    ll, rnd = by_router["least-loaded"], by_router["random"]
    for r in ("round-robin", "power-of-two"):
        assert ll[2] < by_router[r][1], (r, ll, by_router[r])
        assert by_router[r][2] < rnd[1], (r, by_router[r], rnd)


def test_same_seed_same_result_on_every_path():
    et = EngineType(CAL, UNBOUNDED, 20, 0.08, ((1, 0.01), (30, 0.05), (60, 0.09)))
    cfg = FleetConfig(engine=et, engines=3, arrivals=Arrivals("pattern", segments=((600, 0.1), (600, 0.4))),
                      durations=Durations("exponential", 200.0), horizon_s=1800.0, router="power-of-two", seed=7,
                      controller="aimd", autoscale=AutoscalePolicy(start_delay_s=60, check_s=5, scale_in_after_s=120),
                      bin_s=600.0)
    a, b = simulate(cfg), simulate(cfg)
    pd.testing.assert_frame_equal(a.bins, b.bins)
    pd.testing.assert_frame_equal(a.engines, b.engines)
    drop = {"wall_s", "engine_seconds_per_wall_s"}
    assert {k: v for k, v in a.totals.items() if k not in drop} == {k: v for k, v in b.totals.items() if k not in drop}
    c = simulate(replace(cfg, seed=8))
    assert not c.bins[["offered", "admitted"]].equals(a.bins[["offered", "admitted"]])


def test_memory_silences_the_newest_sessions_as_the_block_arithmetic_says():
    # 60 unbounded sessions start together on one engine and last the whole 600 s. At the tick t the engine holds
    # K = usable // ceil(floor(12.5 t)/16) of them (Moshi: 12.5 tokens/s, 16-token blocks); the rest are silent.
    n, horizon, grid = 60, 600.0, 5.0
    et = EngineType(CAL, UNBOUNDED, n, 0.08)
    cfg = FleetConfig(engine=et, engines=1, arrivals=Arrivals("all", sessions=n), durations=Durations("fixed", 1e6),
                      horizon_s=horizon, memory_grid_s=grid, bin_s=horizon)
    got = simulate(cfg).bins.silent_frame_fraction.iloc[0]
    usable = CAL.engine.usable_blocks - CAL.engine.watermark_blocks
    silent = 0
    ticks = [(k + 0.5) * grid for k in range(int(horizon / grid))]
    for t in ticks:
        blocks = -(-int(12.5 * t) // 16)
        silent += max(0, n - min(usable // max(blocks, 1), CAL.engine.max_num_seqs))
    assert CAL.stream.kv_tokens_per_s == 12.5 and CAL.engine.block_size_tokens == 16
    assert silent > 0
    assert got == pytest.approx(silent / (n * len(ticks)), abs=1e-12)


def test_unbounded_fleet_collapses_where_the_router_cannot_see_it():
    # 8 unbounded engines capped at their memory ceiling for a 300 s session, offered 90% of their places:
    # sessions that happen to run long fill one engine's pool while least-loaded keeps its in-flight count level
    ceiling = FillModel(CAL, UNBOUNDED).memory_ceiling(300.0)
    et = EngineType(CAL, UNBOUNDED, ceiling, 0.08)
    cfg = FleetConfig(engine=et, engines=8, arrivals=Arrivals("poisson", rate_per_s=0.9 * 8 * ceiling / 300),
                      durations=Durations("exponential", 300.0), horizon_s=4 * 3600.0, warmup_s=3600.0)
    res = simulate(cfg)
    e = res.engines[res.engines.bin >= 1]
    worst = e.loc[e.silent_frame_fraction.idxmax()]
    same_hour = e[(e.bin == worst.bin) & (e.engine != worst.engine)]
    assert worst.silent_frame_fraction > 0.1            # collapsed: over a tenth of its frames silent
    assert same_hour.silent_frame_fraction.min() < worst.silent_frame_fraction / 2
    # the router's view: its in-flight count is within one session of the others' (least-loaded levels them)
    assert abs(worst.in_flight_mean - same_hour.in_flight_mean.mean()) < 1.0
    assert worst.in_flight_max <= same_hour.in_flight_max.max()
    assert res.totals["silent_frame_fraction"] < worst.silent_frame_fraction


def test_in_flight_peaks_per_bin_by_hand():
    # engine 0: [0, 10) then [10, 20) (the second arrives as the first leaves: never two at once, as the run
    # processes a departure before an arrival at the same instant), and [5, 4000) across the bin edge at 3600;
    # engine 1: three overlapping from 100 to 200
    start = np.array([0.0, 10.0, 5.0, 100.0, 120.0, 150.0])
    stop = np.array([10.0, 20.0, 4000.0, 200.0, 200.0, 200.0])
    group = np.array([0, 0, 0, 1, 1, 1])
    edges = np.array([0.0, 3600.0, 7200.0])
    peaks = level_max_by_bin(start, stop, group, 2, edges)
    assert peaks.tolist() == [[2, 1], [3, 0]]
    seconds = overlap_by_bin(start, stop, group, 2, edges)
    assert seconds.tolist() == [[10 + 10 + 3595, 400], [100 + 80 + 50, 0]]


def test_aimd_engines_settle_at_the_latency_bound():
    # p99 reaches the 64 ms target (0.8 x 80 ms) at 54 sessions on this curve, far under the memory ceiling (114),
    # and 70 Erlangs are offered per engine: fed the latency, each AIMD controller holds its engine's sessions at
    # about 54. It acts once per 1 s interval, after the interval, so a few sessions over the bound get in
    # (max <= 54 + 3); the limit itself saws above the count (it grows +1/s faster than sessions arrive).
    et = small_engine(54, ((1, 0.01), (50, 0.06), (60, 0.07), (200, 1.0)))
    cfg = FleetConfig(engine=et, engines=3, arrivals=Arrivals("poisson", rate_per_s=3 * 70 / 300),
                      durations=Durations("exponential", 300.0), horizon_s=2 * 3600.0, controller="aimd",
                      warmup_s=3600.0)
    res = simulate(cfg)
    last = res.engines[res.engines.bin == 1]
    assert ((last.in_flight_mean > 0.9 * 54) & (last.in_flight_mean <= 54)).all(), last.in_flight_mean.tolist()
    assert (last.in_flight_max <= 54 + 3).all() and (last.limit_decreases > 0).all()
    assert res.totals["refused_fraction"] > 0.1 and res.totals["silent_frame_fraction"] == 0


def test_autoscaling_saves_gpu_hours_and_keeps_refusals_near_target():
    # 2 h quiet (8 Erlangs), 1 h rise, 2 h peak (80 Erlangs), 1 h fall, 2 h quiet; engines of 10 places, a 60 s
    # start. A static fleet sized for the peak (Erlang B) runs 10 engines all day; the quiet hours need 2 or 3.
    pattern = Arrivals("pattern", segments=((7200, 8 / 60), (3600, 30 / 60), (7200, 80 / 60), (3600, 30 / 60),
                                            (7200, 8 / 60)))
    g = engines_needed(80.0, 10, 0.01)
    base = FleetConfig(engine=small_engine(), engines=g, arrivals=pattern, durations=Durations("exponential", 60.0),
                       horizon_s=pattern.pattern_s)
    policy = AutoscalePolicy(min_engines=1, max_engines=2 * g, start_delay_s=60, scale_out_after_s=10,
                             scale_in_after_s=300, scale_out_utilization=0.75, scale_in_utilization=0.5)
    for seed in (0, 1):
        static = simulate(replace(base, seed=seed)).totals
        run = simulate(replace(base, seed=seed, engines=2, autoscale=policy))
        auto = run.totals
        # a perfect autoscaler would need about half the static GPU-hours here; 80% leaves room for start
        # delays, draining and the headroom of the utilisation thresholds
        assert auto["gpu_hours"] < 0.8 * static["gpu_hours"], (auto, static)
        assert auto["refused_fraction"] <= 0.01, auto
        assert auto["engines_max"] > 2 and static["gpu_hours"] == g * pattern.pattern_s / 3600
        assert run.bins.offered_rate_per_s.tolist() == pytest.approx([8 / 60] * 2 + [30 / 60] + [80 / 60] * 2
                                                                     + [30 / 60] + [8 / 60] * 2, rel=1e-12)
        # engines started later serve 60 s after they were provisioned, and those 60 s are paid for
        life = run.lifecycle
        late = life[life.provisioned_s > 0]
        assert len(late) and ((late.serving_s - late.provisioned_s) == 60).all()
        paid = (np.minimum(life.released_s, pattern.pattern_s) - life.provisioned_s).sum() / 3600
        assert auto["gpu_hours"] == pytest.approx(paid, rel=1e-12)
        assert (life.released_s[np.isfinite(life.released_s)] > life.serving_s[np.isfinite(life.released_s)]).all()


def test_aimd_backs_off_on_silent_frames_when_memory_binds():
    # latency allows ~270 sessions but the pool holds 30 steady ones (a pool cut to 30 sessions' worth of blocks):
    # the AIMD controller only learns of the pool from silent frames (any silent frame is congestion at its
    # defaults).
    peak = FillModel(CAL, SINKS).peak_resident_blocks
    cal = replace(CAL, engine=replace(CAL.engine, num_blocks=30 * peak + CAL.engine.watermark_blocks))
    et = EngineType(cal, SINKS, 30, 0.08, ((1, 0.01), (200, 0.05), (400, 1.0)))
    assert et.fill.memory_ceiling() == 30
    cfg = FleetConfig(engine=et, engines=3, arrivals=Arrivals("poisson", rate_per_s=3 * 45 / 300),
                      durations=Durations("exponential", 300.0), horizon_s=2 * 3600.0, controller="aimd",
                      warmup_s=3600.0)
    res = simulate(cfg)
    last = res.engines[res.engines.bin == 1]
    # Unfed, nothing stops the count short of the 45 Erlangs offered per engine and about a quarter of the frames
    # go silent. Fed, each silent interval cuts the limit: a few percent at most stay silent (young sessions hold
    # fewer blocks, so an engine carries some 35 sessions, over the steady ceiling, before its pool runs dry).
    assert (last.in_flight_mean < 40).all(), last.in_flight_mean.tolist()
    assert res.totals["silent_frame_fraction"] < 0.03, res.totals
    assert (last.limit_decreases > 0).all()


def test_size_by_simulation_is_the_fewest_engines_meeting_the_target():
    cfg = FleetConfig(engine=small_engine(), engines=1, arrivals=Arrivals("poisson", rate_per_s=36.0 / 60),
                      durations=Durations("exponential", 60.0), horizon_s=10_000.0, warmup_s=1000.0,
                      bin_s=2250.0, router="random")
    out = size_by_simulation(cfg, 0.05, [0, 1], start=engines_needed(36.0, 10, 0.05, "pooled"))
    g = out["engines"]
    from_above = size_by_simulation(cfg, 0.05, [0, 1], start=engines_needed(36.0, 10, 0.05, "random") + 3)
    assert from_above["engines"] == g  # searched down from above, the same answer

    seeds = out["seeds"]  # the seeds given, then the next ones: at least eight independent runs
    assert seeds[:2] == [0, 1] and seeds == list(range(len(seeds))) and len(seeds) >= 8

    def refused(k):
        tot = [simulate(replace(cfg, engines=k, seed=s)).totals for s in seeds]
        return sum(t["refused"] for t in tot) / sum(t["offered"] for t in tot)

    assert refused(g) <= 0.05 < refused(g - 1)
    assert out["refused_fraction"] == refused(g)
    assert g > engines_needed(36.0, 10, 0.05, "pooled")  # random routing needs more than the pooled form


def test_sweep_returns_rows_in_input_order():
    cfgs = grid([small_engine(10), small_engine(6)], [3, 5], ["random", "least-loaded"], [0, 1],
                arrivals=Arrivals("poisson", rate_per_s=0.5), durations=Durations("exponential", 60.0),
                horizon_s=3000.0)
    expected = [(n, g, r, s) for n in (10, 6) for g in (3, 5) for r in ("random", "least-loaded") for s in (0, 1)]
    assert [(c.engine.n_star, c.engines, c.router, c.seed) for c in cfgs] == expected  # the last axis fastest
    table = sweep(cfgs, executor=LocalExecutor(2))  # two worker processes: rows arrive in any order
    assert list(zip(table.n_star, table.engines_initial, table.router, table.seed)) == expected
    assert table.refused.tolist() == [simulate(c).totals["refused"] for c in cfgs]


@pytest.mark.parametrize("make,needle", [
    (lambda: FleetConfig(engine=small_engine(), engines=0, arrivals=Arrivals("poisson", rate_per_s=1),
                         durations=Durations("fixed", 60), horizon_s=100), "--engines must be an integer >= 1, got 0"),
    (lambda: EngineType(CAL, SINKS, 0, 0.08), "N* is 0"),
    (lambda: FleetConfig(engine=small_engine(), engines=2, arrivals=Arrivals("poisson", rate_per_s=1),
                         durations=Durations("fixed", 60), horizon_s=100, router="sticky"), "unknown router"),
    (lambda: FleetConfig(engine=small_engine(), engines=2, arrivals=Arrivals("poisson", rate_per_s=1),
                         durations=Durations("fixed", 60), horizon_s=100, controller="aimd"), "latency curve"),
    (lambda: AutoscalePolicy(scale_in_utilization=0.9, scale_out_utilization=0.8), "0 < --scale-in-utilization"),
    (lambda: AutoscalePolicy(min_engines=3, max_engines=2), "--max-engines must be"),
])
def test_fleet_bad_input(make, needle):
    with pytest.raises(MetronomeError, match=needle):
        make()


def test_size_by_simulation_draws_runs_until_its_interval_leaves_the_target():
    # 4 engines of 10 places, random routing, 36 Erlangs: each engine refuses B(10, 9) = 16.8%. Against a 16.8%
    # target the interval cannot leave it (every run allowed is drawn); against 5% it does at once (the first
    # eight runs); each interval is the batch-means one over the runs' own totals (one batch per seed).
    cfg = FleetConfig(engine=small_engine(), engines=1, arrivals=Arrivals("poisson", rate_per_s=36.0 / 60),
                      durations=Durations("exponential", 60.0), horizon_s=4000.0, warmup_s=400.0,
                      bin_s=900.0, router="random")
    near = size_by_simulation(cfg, erlang_b(10, 9.0), [0], start=4, max_runs=16)
    (at4,) = [t for t in near["tried"] if t[0] == 4]
    assert at4[2] == 16  # at 4 engines the share is the target itself: every run allowed was drawn
    far = size_by_simulation(cfg, 0.30, [0], start=4)
    assert far["engines"] == 4 and far["runs"] == 8 and far["decided"] and far["refused_fraction_ci"][1] < 0.30
    tot = [simulate(replace(cfg, engines=4, seed=s)).totals for s in range(8)]
    p, lo, hi = batch_means_interval([t["refused"] for t in tot], [t["offered"] for t in tot])
    assert far["refused_fraction_ci"] == [lo, hi] and far["refused_fraction"] == pytest.approx(p, rel=1e-12)
