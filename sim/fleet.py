"""Fleets: G engines behind a router, simulated at the level of sessions — who is admitted where, for how long,
and which admitted sessions the engine's memory leaves silent.

An engine is a loss system with an admission controller of its own, the project's real controller classes
(:func:`metronome.admission.make_controller`): ``static`` (a cap at the engine's ``N*``) or ``aimd`` (the AIMD
controller, fed every control interval the engine's p99 frame latency at its current number of running
sessions, interpolated from :func:`metronome.sim.capacity.capacity`'s ``evaluations`` curve, and its silent
frames). A router sends each arriving session to one serving engine:

* ``round-robin`` — the next serving engine in turn;
* ``least-loaded`` — the serving engine with the fewest sessions in flight (the lowest-numbered on a tie). With
  equal static caps it finds an engine with room whenever one exists, so the fleet refuses as one loss system
  of ``G·N*`` places (Erlang B pooled, :mod:`metronome.erlang`); under AIMD the limits differ and it need not;
* ``power-of-two`` — two distinct serving engines drawn at random, the one with fewer in flight;
* ``random`` — a serving engine drawn at random (each engine a loss system fed ``A/G``).

A session the chosen engine refuses is refused at the door: it does not try another engine. The router sees
in-flight counts only.

**Memory.** Under a bounded KV policy and a static cap the cap is ``N*``, already inside the memory ceiling, so
memory never silences anyone. Otherwise (unbounded KV, or an AIMD limit that may pass the ceiling) an engine
holds, at every instant, the blocks each of its sessions holds at its age
(:meth:`metronome.fill_model.FillModel.blocks_at_age`); it runs its sessions in admission order while their
blocks fit in its usable blocks (and ``max_num_seqs``), and the rest are silent: vLLM preempts the most recently
admitted, and its waiting queue is first come, first served. A silent session still counts in flight, so the
router keeps sending sessions to an engine whose long-lived sessions have run its pool dry. The silent share is
evaluated on a grid of ``memory_grid_s`` over the whole run (vectorised, after the run, when only the statistics
need it: the grid misses changes shorter than a grid step, an error of about ``memory_grid_s`` over the mean
session length) and, for AIMD, also at each event on the engine (the controller acts on it). It is the fill
model's approximation: a preempted session comes back holding all the blocks of its age (the simulator's engine
lets it back with fewer, so this runs a few percent above it, as :meth:`FillModel.silenced_fraction` notes), and
an unbounded session that reaches ``max_model_len`` keeps its blocks until it ends (vLLM would end it).

**Autoscaling** (:class:`metronome.sim.fleet_config.AutoscalePolicy`): every ``check_s`` the autoscaler looks at
the fleet's utilisation, sessions in flight on serving engines over the places of the serving and starting
engines (a starting engine counts ``N*``). Pressure = utilisation above ``scale_out_utilization`` (engines at
or near their limit), or more than ``max_refusal`` of the arrivals since the last check refused while no engine
is starting (a refusal an engine already starting will answer is not counted twice); after
``scale_out_after_s`` of it, it brings enough engines (draining ones back first, then new ones that serve after
``start_delay_s``) to bring utilisation to the middle of the two thresholds, at least one. Slack = utilisation below
``scale_in_utilization`` and no refusal over the target; after ``scale_in_after_s`` of it, it drains engines
(the least loaded) down to that middle: a draining engine takes no new session and is released when its last
one ends. GPU-hours integrate every engine from its start to its release (starting, serving, draining).

Everything is event-driven on arrivals, departures, engine starts and autoscaler checks; the same
configuration and seed give the same result (the sessions come from :func:`metronome.workload.draw`, the
router's draws from a generator of their own seeded with the same seed).

The run's inputs and result are :mod:`metronome.sim.fleet_config`; the memory's silence
:mod:`metronome.sim.fleet_memory`; the tables' per-bin tallies :mod:`metronome.sim.fleet_bins`; sweeps, sizing and
the plan over many runs :mod:`metronome.sim.fleet_plan`.
"""

from __future__ import annotations

import heapq
import math
import time

import numpy as np
import pandas as pd

from metronome.erlang import batch_means_interval
from metronome.workload import draw

from metronome.sim.fleet_bins import expected_by_bin, level_max_by_bin, overlap_by_bin
from metronome.sim.fleet_config import ROUTERS, FleetConfig, FleetResult
from metronome.sim.fleet_memory import silent_mask, silent_on_grid

_ROUTER_STREAM = 0xF1EE7  # the router's draws: a generator of their own, so sessions do not depend on the router
_STARTING, _SERVING, _DRAINING, _RELEASED = 0, 1, 2, 3
_FREE = 1 << 40  # the load least-loaded sees for an engine that is not serving


# ------------------------------------------------------------------------------------------- the run
class _Run:
    """The state of one fleet run; :func:`simulate` is its interface."""

    def __init__(self, cfg: FleetConfig):
        self.cfg = cfg
        et = cfg.engine
        self.n_star = et.n_star
        self.aimd = cfg.controller == "aimd"
        self.memory = et.needs_memory(cfg.limit_max)
        self.fill = et.fill
        self.max_seqs = et.calibration.engine.max_num_seqs
        self.period = et.calibration.stream.frame_period_s
        self.peak_blocks = self.fill.peak_resident_blocks
        self.lat_cache: dict[int, float] = {}
        self.n_bins = int(math.ceil(cfg.horizon_s / cfg.bin_s - 1e-9))
        # engines, indexed by id (never reused)
        self.state: list[int] = []
        self.inflight: list[int] = []
        self.ctl: list = []
        self.t_prov: list[float] = []
        self.t_serve: list[float] = []
        self.t_rel: list[float] = []
        self.fed: list[float] = []  # AIMD: the time up to which the controller has been fed
        self.active: list[list[int]] = []  # AIMD with memory: each engine's sessions, in admission order
        self.load = np.full(max(16, cfg.engines), _FREE, dtype=np.int64)
        self.serving: list[int] = []
        self.ready: list[tuple[float, int]] = []  # (time an engine starts serving, id)
        self.refused_count = 0
        self.limit_sum: dict[tuple[int, int], float] = {}
        self.limit_n: dict[tuple[int, int], int] = {}
        self.decreases: dict[tuple[int, int], int] = {}
        # the run's sessions (run() draws them): arrival, end, engine that served each (-1: refused) and the
        # engine the router picked
        self.arr = np.zeros(0)
        self.stop = np.zeros(0)
        self.eng_of: list[int] = []
        self.chosen: list[int] = []
        # the autoscaler's view: arrivals and refusals so far and at its last check, and since when the fleet
        # has been under pressure (or slack)
        self.arrived = self.arrived_seen = self.refused_seen = 0
        self.pressure_since: float | None = None
        self.slack_since: float | None = None

    # -- engines ---------------------------------------------------------------------------------------
    def provision(self, t: float, serve_at: float) -> int:
        e = len(self.state)
        if e >= self.load.size:
            self.load = np.concatenate([self.load, np.full(self.load.size, _FREE, dtype=np.int64)])
        self.state.append(_STARTING)
        self.inflight.append(0)
        self.ctl.append(self.cfg.make_controller())
        self.t_prov.append(t)
        self.t_serve.append(math.inf)
        self.t_rel.append(math.inf)
        self.fed.append(serve_at)
        self.active.append([])
        if serve_at <= t:
            self.serve(e, t)
        else:
            heapq.heappush(self.ready, (serve_at, e))
        return e

    def serve(self, e: int, t: float) -> None:
        if self.state[e] == _STARTING:
            self.t_serve[e] = t
            self.fed[e] = t
            self.ctl[e].advance(t, 0)  # the controller's control intervals start when the engine does
        self.state[e] = _SERVING
        self.load[e] = self.inflight[e]
        self.serving = sorted(self.serving + [e])

    def drain(self, e: int, t: float) -> None:
        self.state[e] = _DRAINING
        self.load[e] = _FREE
        self.serving.remove(e)
        if self.inflight[e] == 0:
            self.release(e, t)

    def release(self, e: int, t: float) -> None:
        if self.aimd:
            self.feed(e, t)
        self.state[e] = _RELEASED
        self.t_rel[e] = t

    # -- AIMD's signal ---------------------------------------------------------------------------------
    def may_mute(self, e: int, t: float) -> bool:
        """Whether memory can silence any of engine ``e``'s sessions by ``t`` (a cheap bound: every session
        holding as many blocks as the most any can hold by then)."""
        sess = self.active[e]
        n = len(sess)
        if not self.memory or n == 0:
            return False
        if n > self.max_seqs:
            return True
        if self.peak_blocks is not None:
            most = self.peak_blocks
        else:  # unbounded: the oldest session holds the most
            most = float(self.fill.blocks_at_age(t - self.arr[sess[0]]))
        return n * most > self.fill.usable_blocks

    def silent_counts(self, e: int, times: np.ndarray) -> np.ndarray:
        """Silent sessions on engine ``e`` at each of ``times`` (its sessions as they are now)."""
        sess = self.active[e]
        n = len(sess)
        ages = times[:, None] - self.arr[np.asarray(sess)][None, :]
        blocks = self.fill.blocks_at_age(ages).ravel()
        mute = silent_mask(blocks, np.arange(times.size) * n, self.fill.usable_blocks, self.max_seqs)
        return mute.reshape(times.size, n).sum(axis=1)

    def latency(self, running: int) -> float:
        v = self.lat_cache.get(running)
        if v is None:
            v = self.lat_cache[running] = float(self.cfg.engine.latency_at(running))
        return v

    def feed(self, e: int, t: float) -> None:
        """Hand engine ``e``'s controller what it answered from the last feed up to ``t`` (its in-flight count
        unchanged meanwhile): a row per control interval, the silent count evaluated at the span's start and on
        the memory grid, the frames counted on the sessions' frame clocks (``floor(n·t/period)`` answered by
        ``t``)."""
        t0 = self.fed[e]
        if t <= t0:
            return
        self.fed[e] = t
        ctl = self.ctl[e]
        n = self.inflight[e]
        if n == 0:
            ctl.advance(t, 0)
        else:
            I, anchor = ctl.interval_s, self.t_serve[e]
            k = math.floor((t0 - anchor) / I) + 1
            tau = [t0]
            while anchor + k * I < t:
                if anchor + k * I > t0:
                    tau.append(anchor + k * I)
                k += 1
            tau.append(t)
            rows = len(tau) - 1
            if self.may_mute(e, t):
                g = self.cfg.memory_grid_s
                grid = [g * j for j in range(math.floor(t0 / g) + 1, math.ceil(t / g)) if t0 < g * j < t]
                evals = np.array([t0] + grid)
                counts = self.silent_counts(e, evals)
                s_rows = counts[np.searchsorted(evals, np.array(tau[:-1]), side="right") - 1].tolist()
            else:
                s_rows = [0] * rows
            P = self.period
            for j in range(rows):
                a, b, s = tau[j], tau[j + 1], int(s_rows[j])
                f = math.floor(n * b / P) - math.floor(n * a / P)
                ctl.advance(a, n)
                ctl.observe(a, self.latency(n - s), f, min(f, math.floor(s * b / P) - math.floor(s * a / P)))
        self._take_trace(e)

    def _take_trace(self, e: int) -> None:
        bin_s = self.cfg.bin_s
        for row in self.ctl[e].take_trace():
            key = (e, min(int((row["t_s"] - 1e-9) // bin_s), self.n_bins - 1))
            self.limit_sum[key] = self.limit_sum.get(key, 0.0) + row["limit"]
            self.limit_n[key] = self.limit_n.get(key, 0) + 1
            if row["decision"] == "decrease":
                self.decreases[key] = self.decreases.get(key, 0) + 1

    # -- the autoscaler --------------------------------------------------------------------------------
    def autoscale(self, t: float) -> None:
        pol = self.cfg.autoscale
        starting = [e for e, s in enumerate(self.state) if s == _STARTING]
        draining = [e for e, s in enumerate(self.state) if s == _DRAINING]
        in_s = sum(self.inflight[e] for e in self.serving)
        places = sum(self.ctl[e].limit for e in self.serving) + self.n_star * len(starting)
        u = in_s / places if places else (math.inf if in_s else 0.0)
        refused, arrived = self.refused_count - self.refused_seen, self.arrived - self.arrived_seen
        self.refused_seen, self.arrived_seen = self.refused_count, self.arrived
        refusing = arrived > 0 and refused > pol.max_refusal * arrived
        pressure = u > pol.scale_out_utilization or (refusing and not starting)
        slack = not pressure and not refusing and u < pol.scale_in_utilization
        self.pressure_since = (self.pressure_since if self.pressure_since is not None else t) if pressure else None
        self.slack_since = (self.slack_since if self.slack_since is not None else t) if slack else None
        active = len(self.serving) + len(starting)
        want = math.ceil(in_s / (pol.target_utilization * self.n_star))
        if pressure and t - self.pressure_since >= pol.scale_out_after_s:
            self.pressure_since = None
            k = max(1, want - active)
            for e in sorted(draining, key=lambda x: -self.inflight[x])[:k]:
                self.serve(e, t)
                k -= 1
            room = (pol.max_engines - (active + len(draining))) if pol.max_engines is not None else k
            for _ in range(max(0, min(k, room))):
                self.provision(t, t + pol.start_delay_s)
        elif slack and t - self.slack_since >= pol.scale_in_after_s:
            self.slack_since = None
            k = min(active - max(pol.min_engines, want), len(self.serving))
            for e in sorted(self.serving, key=lambda x: (self.inflight[x], -x))[:max(0, k)]:
                self.drain(e, t)

    # -- the loop --------------------------------------------------------------------------------------
    def run(self) -> None:
        cfg = self.cfg
        arr, dur = draw(cfg.arrivals, cfg.durations, cfg.horizon_s, cfg.seed)
        n = arr.size
        self.arr = arr
        stop = arr + dur
        dep_order = np.argsort(stop, kind="stable")
        dep_t, dep_i = stop[dep_order].tolist(), dep_order.tolist()
        arr_l = arr.tolist()
        u1 = u2 = []
        if cfg.router in ("random", "power-of-two"):  # the draws are the router's own: none for the others
            u = np.random.default_rng([cfg.seed, _ROUTER_STREAM]).random((2, n))
            u1, u2 = u[0].tolist(), u[1].tolist()
        self.eng_of = eng_of = [-1] * n
        self.chosen = chosen = [-1] * n
        for _ in range(cfg.engines):
            self.provision(0.0, 0.0)
        pol = cfg.autoscale
        check_s = pol.check_s if pol else math.inf
        next_check = check_s
        inflight, state, ctl, load, active = self.inflight, self.state, self.ctl, self.load, self.active
        aimd, track = self.aimd, self.aimd and self.memory
        router = ROUTERS.index(cfg.router)
        rr = 0
        dp = 0
        INF = math.inf
        for i in range(n + 1):
            t = arr_l[i] if i < n else cfg.horizon_s
            while True:  # everything due by t, in time order: departures, then engine starts and checks
                td = dep_t[dp] if dp < n else INF
                tt = min(next_check, self.ready[0][0]) if self.ready else next_check
                if td <= tt:
                    if td > t:
                        break
                    j = dep_i[dp]
                    dp += 1
                    e = eng_of[j]
                    if e < 0:
                        continue
                    if aimd:
                        self.feed(e, td)
                    inflight[e] -= 1
                    if track:
                        active[e].remove(j)
                    s = state[e]
                    if s == _SERVING:
                        load[e] -= 1
                    elif s == _DRAINING and inflight[e] == 0:
                        self.release(e, td)
                else:
                    if tt > t:
                        break
                    if self.ready and self.ready[0][0] <= tt:
                        _, e = heapq.heappop(self.ready)
                        self.serve(e, tt)
                    else:
                        self.autoscale(tt)
                        next_check += check_s
            if i == n:
                break
            if pol is not None:
                load = self.load  # provisioning may have grown it
                self.arrived = i + 1
            serving = self.serving
            m = len(serving)
            if m == 0:
                self.refused_count += 1
                continue
            if router == 1:  # least-loaded
                e = int(load.argmin())
            elif router == 0:  # round-robin
                e = serving[rr % m]
                rr += 1
            elif router == 3:  # random
                e = serving[int(u1[i] * m)]
            else:  # power-of-two
                a = int(u1[i] * m)
                e = serving[a]
                if m > 1:
                    b = int(u2[i] * (m - 1))
                    b = serving[b + 1 if b >= a else b]
                    if inflight[b] < inflight[e]:
                        e = b
            chosen[i] = e
            if aimd:
                self.feed(e, t)
            if ctl[e].may_admit(t, inflight[e]):
                inflight[e] += 1
                load[e] += 1
                eng_of[i] = e
                if track:
                    active[e].append(i)
            else:
                self.refused_count += 1
        if aimd:
            for e, s in enumerate(state):
                if s != _RELEASED:
                    self.feed(e, cfg.horizon_s)
        self.stop = np.minimum(stop, cfg.horizon_s)

    # -- the tables ------------------------------------------------------------------------------------
    def tables(self) -> FleetResult:
        cfg = self.cfg
        H, n_bins = cfg.horizon_s, self.n_bins
        edges = np.minimum(np.arange(n_bins + 1) * cfg.bin_s, H)
        width = np.diff(edges)
        n_eng = len(self.state)
        eng_of = np.asarray(self.eng_of, dtype=np.int64)
        chosen = np.asarray(self.chosen, dtype=np.int64)
        arr = self.arr
        adm = eng_of >= 0
        bin_of = np.minimum((arr // cfg.bin_s).astype(np.int64), n_bins - 1)
        offered = np.bincount(bin_of, minlength=n_bins)
        admitted = np.bincount(bin_of[adm], minlength=n_bins)
        refused = offered - admitted
        # per engine: sessions, silent frames, provisioned time
        start, stop, eng = arr[adm], self.stop[adm], eng_of[adm]
        in_flight_s = overlap_by_bin(start, stop, eng, n_eng, edges)
        in_flight_max = level_max_by_bin(start, stop, eng, n_eng, edges)
        if self.memory:
            silent_ticks, flying_ticks = silent_on_grid(start, stop, eng, n_eng, self.fill, self.max_seqs,
                                                         cfg.memory_grid_s, H, cfg.bin_s, n_bins)
        else:
            silent_ticks = flying_ticks = np.zeros((n_eng, n_bins))
        t_prov = np.asarray(self.t_prov)
        t_rel = np.minimum(np.asarray(self.t_rel), H)
        ids = np.arange(n_eng)
        prov_s = overlap_by_bin(t_prov, t_rel, ids, n_eng, edges)
        eng_level = level_max_by_bin(t_prov, t_rel, np.zeros(n_eng, dtype=np.int64), 1, edges)[0]
        e_adm = np.bincount(eng * n_bins + bin_of[adm], minlength=n_eng * n_bins).reshape(n_eng, n_bins)
        ref = (~adm) & (chosen >= 0)
        e_ref = np.bincount(chosen[ref] * n_bins + bin_of[ref], minlength=n_eng * n_bins).reshape(n_eng, n_bins)
        limit = np.full((n_eng, n_bins), float(self.n_star) if not self.aimd else np.nan)
        dec = np.zeros((n_eng, n_bins), dtype=np.int64)
        for (e, b), v in self.limit_sum.items():
            limit[e, b] = v / self.limit_n[(e, b)]
        for (e, b), v in self.decreases.items():
            dec[e, b] = v

        def frac(num, den):
            return np.where(den > 0, num / np.where(den > 0, den, 1), 0.0)

        bins = pd.DataFrame({
            "bin": np.arange(n_bins), "start_s": edges[:-1], "end_s": edges[1:],
            "offered_rate_per_s": expected_by_bin(cfg.arrivals, edges) / width,
            "offered": offered, "admitted": admitted, "refused": refused,
            "refused_fraction": frac(refused, offered),
            "silent_frame_fraction": frac(silent_ticks.sum(axis=0), flying_ticks.sum(axis=0)),
            "in_flight_mean": in_flight_s.sum(axis=0) / width,
            "engines_mean": prov_s.sum(axis=0) / width, "engines_max": eng_level,
            "gpu_hours": prov_s.sum(axis=0) / 3600.0, "session_hours": in_flight_s.sum(axis=0) / 3600.0,
        })
        ee, bb = np.meshgrid(np.arange(n_eng), np.arange(n_bins), indexing="ij")
        engines = pd.DataFrame({
            "engine": ee.ravel(), "bin": bb.ravel(), "provisioned_s": prov_s.ravel(),
            "in_flight_mean": (in_flight_s / width).ravel(), "in_flight_max": in_flight_max.ravel(),
            "admitted": e_adm.ravel(), "refused": e_ref.ravel(),
            "silent_frame_fraction": frac(silent_ticks, flying_ticks).ravel(),
            "limit_mean": limit.ravel(), "limit_decreases": dec.ravel(),
        })
        engines = engines[engines.provisioned_s > 0].reset_index(drop=True)
        # totals over arrivals (and, for silence, instants) after the warm-up
        late = arr >= cfg.warmup_s
        n_off, n_adm = int(late.sum()), int((late & adm).sum())
        first_bin = int(cfg.warmup_s // cfg.bin_s)
        w_edges = np.array([cfg.warmup_s, H])
        silent_s = silent_ticks[:, first_bin:].sum() if self.memory else 0.0
        flying_s = flying_ticks[:, first_bin:].sum() if self.memory else 0.0
        engine_s = float(prov_s.sum())
        ci = None
        whole = bins[(bins.start_s >= cfg.warmup_s) & (bins.offered > 0)]
        if len(whole) >= 2:
            ci = batch_means_interval(whole.refused, whole.offered)[1:]
        totals = {
            "calibration": cfg.engine.name, "policy": cfg.engine.policy.describe(), "n_star": self.n_star,
            "router": cfg.router, "controller": cfg.controller, "autoscaled": cfg.autoscale is not None,
            "engines_initial": cfg.engines, "seed": cfg.seed, "horizon_s": H, "warmup_s": cfg.warmup_s,
            "offered": n_off, "admitted": n_adm, "refused": n_off - n_adm,
            "refused_fraction": (n_off - n_adm) / n_off if n_off else 0.0,
            "refused_fraction_ci": None if ci is None else [round(float(x), 6) for x in ci],
            "silent_frame_fraction": float(silent_s / flying_s) if flying_s else 0.0,
            "session_hours": float(overlap_by_bin(start, stop, np.zeros(start.size, dtype=np.int64), 1,
                                                   w_edges).sum() / 3600.0),
            "gpu_hours": engine_s / 3600.0, "engines_mean": engine_s / H, "engines_max": int(eng_level.max()),
            "engines_provisioned": n_eng,
        }
        lifecycle = pd.DataFrame({"engine": ids, "provisioned_s": t_prov, "serving_s": np.asarray(self.t_serve),
                                  "released_s": np.asarray(self.t_rel)})
        return FleetResult(cfg, bins, engines, lifecycle, totals)


def simulate(cfg: FleetConfig) -> FleetResult:
    """Run one fleet configuration (see the module docstring)."""
    t0 = time.perf_counter()
    r = _Run(cfg)
    r.run()
    res = r.tables()
    wall = time.perf_counter() - t0
    res.totals["wall_s"] = round(wall, 4)
    res.totals["engine_seconds_per_wall_s"] = res.totals["gpu_hours"] * 3600.0 / wall
    return res

