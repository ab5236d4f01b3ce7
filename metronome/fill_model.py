"""The first-order model of pool occupancy, and what it predicts.

With N sessions started together, each adding ``r_tok`` tokens per second (the calibration's
``kv_tokens_per_s``), the pool fills as::

    ρ(t) = ρ0 + N·r·t          (blocks; r = r_tok / block_size per session, ρ0 = N·prompt/block_size)

while the engine keeps up with the frame clock. Past its throughput a session still adds its tokens a frame,
but one frame per frame *served* (:mod:`metronome.throughput`: ``max(P, T(N, c))`` apart, ``T`` the engine's
time for one frame of each of the N sessions at ``c`` tokens, under the :data:`~metronome.serving.PHASES`
regime in ``phases``), so ``tokens(t)`` bends below the line and every figure here is taken on that clock:
t_sat, the occupancy curves, the unbounded memory ceiling, and the races with session length, where the clock
depends on how many sessions are still alive (:meth:`FillModel._p_saturate_overloaded`). Below the
throughput nothing changes.

until a bounded policy caps each session at its peak resident blocks. The pool *saturates* when a
running session needs a block and none is free. At block granularity the N sessions (which grow in
lockstep) all need block ``b+1`` when they pass ``b·block_size`` tokens, so the pool of ``B`` usable
blocks saturates once ``N·blocks(n) > B``:

    n_sat = the smallest n with N·resident_blocks(n) > B,      t_sat = (n_sat − prompt) / r_tok

For unbounded KV, ``n_sat = floor(B/N)·block_size + 1``, which is the linear law up to one block. Under a
bounded policy ``t_sat`` exists only if ``N·peak_resident_blocks > B``; the most sessions the pool can
ever hold, ``floor(B / peak_resident_blocks)``, is the **memory ceiling**.

When sessions also *end*, saturation is a race between fill and session length (why collapse is
metastable): the count alive at age ``t`` falls as the durations run out while the blocks each one holds
rise. :meth:`FillModel.p_saturate_fixed` computes the probability exactly for N sessions started
together with i.i.d. durations; :meth:`FillModel.p_saturate_poisson` approximates it for Poisson
arrivals (M/G/∞ shot noise, normal approximation).

Saturating is not collapsing. After the pool first runs dry the survivors keep growing while some of
them leave; the pool holds at most ``K(t) = floor(B / blocks(t))`` of them, and the others are silent
(preempted, waiting for blocks). A run *collapses* (the rule of :mod:`metronome.results`) when those frames,
silent after a preemption, are at least 1% of the frames answered from ``t_sat`` to the horizon (frames an
engine behind the frame clock flushes silent as their session departs are answered, not silenced): a pool that runs
dry once and recovers after a few departures does not. :meth:`FillModel.silenced_fraction` gives that
fraction for given durations, :meth:`FillModel.p_collapse_fixed` the probability that it reaches the
threshold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import integrate, stats

from metronome import compiled, throughput
from metronome.calibration import Calibration
from metronome.kv_policy import KVPolicy, cdiv
from metronome.serving import RESIDENCY_PARTS, check_phases, resident_tokens_jit
from metronome.workload import Durations


# FillModel.p_saturate_fixed by its inputs: a Monte Carlo asks it once per run of the same scenario (each seed), and
# it took a fifth of a report's time; kept per process
_P_SAT: dict = {}


@dataclass(frozen=True)
class FillModel:
    calibration: Calibration
    policy: KVPolicy
    phases: str = "independent"  # serving.PHASES: how the engine batches the sessions' frames (throughput)

    def __post_init__(self):
        check_phases(self.phases)
        # T(N, c)'s constants, once (the mean-field clocks call it hundreds of times; not a field: no part of eq)
        object.__setattr__(self, "_service", throughput.FrameService(self.calibration, self.policy, self.phases))

    # -- basic quantities ------------------------------------------------------------------------------
    @property
    def usable_blocks(self) -> int:
        """Blocks a waiting or running session can get: the pool less the admission watermark."""
        e = self.calibration.engine
        return e.usable_blocks - e.watermark_blocks

    @property
    def tokens_per_s(self) -> float:
        return self.calibration.stream.kv_tokens_per_s

    @property
    def fill_rate_blocks_per_s(self) -> float:
        """r: blocks per second one unbounded session adds to the pool."""
        return self.tokens_per_s / self.policy.block_size

    @property
    def max_tokens(self) -> int:
        """Tokens a session may reach before the engine's max_model_len stops (or rebases) it."""
        return self.calibration.model.max_model_len_tokens

    # -- the engine's clock: how fast N sessions in flight really grow (metronome.throughput) -------------
    def frame_service_s(self, n_sessions, tokens):
        """The engine's time for one frame of each of ``n_sessions`` running sessions at ``tokens`` computed tokens
        (:func:`metronome.throughput.frame_service_s`). The engine never attends over more than its pool, so the
        context each session brings is capped at its share of it (past saturation the sessions it cannot hold
        are silent, not in the batch)."""
        n = np.asarray(n_sessions)
        share = (self.usable_blocks * self.policy.block_size) // np.maximum(n, 1)
        tokens = np.minimum(np.asarray(tokens, dtype=np.int64), share)
        return self._service(n, tokens)

    def frame_time_s(self, n_sessions, tokens):
        """Seconds between one session's served frames with ``n_sessions`` in flight at ``tokens`` computed
        tokens: the frame period while the engine keeps up, its frame service time past that."""
        return np.maximum(self.calibration.stream.frame_period_s, self.frame_service_s(n_sessions, tokens))

    def _clock(self, n_sessions: int, n_end: float):
        """``(tokens, seconds)`` at each frame start of N sessions started together, from the prompt up to
        ``n_end`` tokens: frame ``k`` starts after ``prompt + k·tokens_per_frame`` tokens and lasts
        :meth:`frame_time_s`. Between frame starts tokens are taken to grow linearly."""
        st = self.calibration.stream
        n_frames = max(1, int(math.ceil((min(n_end, self.max_tokens) - st.prompt_tokens) / st.kv_tokens_per_frame)) + 1)
        n = st.prompt_tokens + st.kv_tokens_per_frame * np.arange(n_frames + 1)
        t = np.concatenate([[0.0], np.cumsum(self.frame_time_s(n_sessions, n[:-1]))])
        return n, t

    def overloaded(self, n_sessions: int, tokens) -> bool:
        """True when N sessions at ``tokens`` computed tokens (any of them, an array) outrun the engine."""
        return bool(np.any(self.frame_service_s(n_sessions, tokens) > self.calibration.stream.frame_period_s))

    def _keeps_up(self, n_sessions: int | None, n_end: float) -> bool:
        """True when the engine serves N sessions on the stream's clock up to ``n_end`` tokens. The frame service
        time grows with the context, so checking the last frame start is enough."""
        if n_sessions is None or n_sessions <= 0:
            return True
        st = self.calibration.stream
        last = st.prompt_tokens + st.kv_tokens_per_frame * max(
            0, int(math.ceil((min(n_end, self.max_tokens) - st.prompt_tokens) / st.kv_tokens_per_frame)))
        return not self.overloaded(n_sessions, last)

    def seconds_to_tokens(self, n, n_sessions: int | None = None):
        """Seconds after N sessions started together until each has computed ``n`` tokens (continuous); with
        ``n_sessions`` None, on the stream's clock (the engine keeping up)."""
        n = np.asarray(n, dtype=float)
        prompt = self.calibration.stream.prompt_tokens
        n_end = float(np.max(n)) if n.size else prompt
        if self._keeps_up(n_sessions, n_end):
            return (n - prompt) / self.tokens_per_s
        tok, t = self._clock(n_sessions, n_end)
        return np.interp(n, tok, t)

    def tokens_at(self, t_s, n_sessions: int | None = None):
        """Tokens a session has computed ``t_s`` seconds after N sessions started together (continuous); with
        ``n_sessions`` None, on the stream's clock. Past ``max_model_len`` tokens grow on at the last rate."""
        t_s = np.asarray(t_s, dtype=float)
        stream = self.calibration.stream.prompt_tokens + self.tokens_per_s * t_s
        if n_sessions is None or n_sessions <= 0:
            return stream
        n_end = float(np.max(stream)) if stream.size else 0.0
        if self._keeps_up(n_sessions, n_end):
            return stream
        tok, t = self._clock(n_sessions, n_end)
        rate = (tok[-1] - tok[-2]) / (t[-1] - t[-2])
        return np.where(t_s <= t[-1], np.interp(t_s, t, tok), tok[-1] + rate * (t_s - t[-1]))

    def rho_linear(self, t_s, n_sessions: int):
        """ρ(t) = ρ0 + N·(tokens(t) − prompt)/block_size in blocks, the first-order law (no cap, no block
        rounding): ``ρ0 + N·r·t`` while the engine keeps up, slower once it is overloaded."""
        return n_sessions * self.tokens_at(t_s, n_sessions) / self.policy.block_size

    def occupancy_blocks(self, t_s, n_sessions: int):
        """Blocks held by N sessions of age ``t_s`` under the policy, at block granularity."""
        n = np.floor(self.tokens_at(t_s, n_sessions)).astype(np.int64)
        return n_sessions * self.policy.resident_blocks(n)

    def frame_blocks(self, n_start):
        """Blocks one session holds at the busiest step of a frame that starts after ``n_start`` tokens: the
        frame's first step computes ``in + 1`` tokens, each later one 1 (:meth:`KVPolicy.step_blocks`)."""
        n = np.asarray(n_start, dtype=np.int64)
        new, before = throughput.frame_steps(self.calibration.stream)
        peak = self.policy.step_blocks(n, int(new[0]))
        for k, b in zip(new[1:].tolist(), before[1:].tolist()):
            peak = np.maximum(peak, self.policy.step_blocks(n + b, k))
        return peak

    def _frame_starts(self) -> np.ndarray:
        """Token counts at the start of a session's frames, long enough to pass its steady state."""
        st, p = self.calibration.stream, self.policy
        n_frames = (p.kept_tokens + 3 * p.block_size) // max(st.kv_tokens_per_frame, 1) + p.block_size
        return st.prompt_tokens + st.kv_tokens_per_frame * np.arange(n_frames + 1)

    @property
    def peak_resident_blocks(self) -> int | None:
        """The most blocks one session ever holds under a bounded policy, inside a step included (None when
        unbounded): a chunk that crosses a block takes its new block before the out-of-window ones go."""
        if not self.policy.bounded:
            return None
        return int(self.frame_blocks(self._frame_starts()).max())

    def memory_ceiling(self, duration_s: float | None = None) -> int | None:
        """The most sessions the engine can hold: ``floor(B / peak blocks per session)``, and never more than
        vLLM's ``max_num_seqs`` (a session paused between frames still holds its request slot).

        Unbounded KV has a ceiling only for a given session length (``duration_s``): the most sessions whose
        history after ``duration_s`` fits, each grown on the engine's clock for that many sessions (past the
        engine's throughput more sessions grow more slowly, so more of them fit than on the stream's clock)."""
        peak = self.peak_resident_blocks
        seqs = self.calibration.engine.max_num_seqs
        if peak is not None:
            return min(self.usable_blocks // max(peak, 1), seqs)
        if duration_s is None or not math.isfinite(duration_s):
            return None

        def fits(n_sessions: int) -> bool:
            n = min(int(self.tokens_at(duration_s, n_sessions)), self.max_tokens)
            return n_sessions * int(self.policy.resident_blocks(max(n, 1))) <= self.usable_blocks

        # on the stream's clock (the most tokens a session can reach): the classic ceiling, a lower bound
        n = min(int(self.tokens_at(duration_s)), self.max_tokens)
        lo = min(self.usable_blocks // max(int(self.policy.resident_blocks(max(n, 1))), 1), seqs)
        if lo >= seqs or fits(seqs):
            return seqs
        # N·blocks(tokens after D with N in flight) rises with N (each added session adds its history and
        # slows the others by less than its share), so the largest N that fits is found by bisection
        hi = seqs  # fits(lo) holds (or lo is 0), fits(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    @property
    def seqs_bind(self) -> bool:
        """True when ``max_num_seqs``, not the pool, sets the bounded ceiling."""
        peak = self.peak_resident_blocks
        return peak is not None and self.usable_blocks // max(peak, 1) > self.calibration.engine.max_num_seqs

    # -- saturation with N sessions started together ---------------------------------------------------
    def saturation_tokens(self, n_sessions: int) -> int | None:
        """n_sat: the smallest per-session token count at which N lockstep sessions overflow the pool."""
        if n_sessions <= 0:
            return None
        budget = self.usable_blocks
        p = self.policy
        if not p.bounded:
            n_sat = (budget // n_sessions) * p.block_size + 1
            return n_sat if n_sat <= self.max_tokens else None
        n = self._frame_starts()  # lockstep sessions are alike: the first frame whose busiest step overflows
        over = np.nonzero(n_sessions * self.frame_blocks(n) > budget)[0]
        return int(n[over[0]]) if over.size else None

    def t_sat(self, n_sessions: int) -> float | None:
        """Seconds until N sessions started together saturate the pool (None: never)."""
        n_sat = self.saturation_tokens(n_sessions)
        if n_sat is None:
            return None
        return max(0.0, float(self.seconds_to_tokens(n_sat, n_sessions)))

    # -- the race between fill and session length -----------------------------------------------------
    def _level_tokens(self, horizon_s: float):
        """Token counts at which the per-session block count steps up before ``horizon_s`` (the stream's clock is
        the fastest a session grows), with the count after each step."""
        prompt = self.calibration.stream.prompt_tokens
        n_end = min(int(self.tokens_at(horizon_s)), self.max_tokens)
        if n_end < prompt:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        n = np.arange(prompt, n_end + 1)
        b = self.policy.resident_blocks(n)
        # the block count held right after computing n tokens; a rise happens at the first n of each level
        up = np.nonzero(np.diff(b) > 0)[0] + 1
        idx = np.concatenate([[0], up])
        return n[idx], b[idx]

    def _levels(self, horizon_s: float, n_sessions: int | None = None):
        """Times at which the per-session block count of N sessions started together (all alive) steps up, with
        the count after each step (``n_sessions`` None: the stream's clock)."""
        n, b = self._level_tokens(horizon_s)
        if n.size == 0:
            return np.zeros(0), b
        t = self.seconds_to_tokens(n, n_sessions)
        keep = t <= horizon_s + 1e-9
        return t[keep], b[keep]

    def p_saturate_fixed(self, n_sessions: int, durations: Durations, horizon_s: float) -> float:
        """P(the pool saturates before ``horizon_s``) for N sessions started at t=0 with i.i.d. durations.

        Exact for the block-granular fill law: with ``A(t)`` sessions alive at age t and ``K(t) =
        floor(B / blocks(t))`` the most that fit, saturation happens iff ``A(t_j) > K_j`` at some step
        time ``t_j`` of the block count. ``A`` is a pure-death Markov chain (binomial thinning between
        step times), so a forward pass over the distribution of ``A`` gives the answer.
        """
        if n_sessions <= 0:
            return 0.0
        key = (self.calibration.to_json(), self.policy, self.phases, n_sessions, durations, float(horizon_s))
        if key not in _P_SAT:
            if len(_P_SAT) >= 256:
                _P_SAT.clear()
            _P_SAT[key] = self._p_saturate_fixed(n_sessions, durations, horizon_s)
        return _P_SAT[key]

    def _p_saturate_fixed(self, n_sessions: int, durations: Durations, horizon_s: float) -> float:
        if not self._keeps_up(n_sessions, float(self.tokens_at(horizon_s))):
            return self._p_saturate_overloaded(n_sessions, durations, horizon_s)
        times, blocks = self._levels(horizon_s)
        if times.size == 0:
            return 0.0
        budget = self.usable_blocks
        K = budget // np.maximum(blocks, 1)
        # only the times at which K reaches a new minimum matter (A(t) is non-increasing)
        keep, best = [], n_sessions
        for j, k in enumerate(K):
            if k < best:
                keep.append(j)
                best = k
        if not keep:
            return 0.0
        pi = np.zeros(n_sessions + 1)  # distribution of the number of sessions still alive
        pi[n_sessions] = 1.0
        s_prev, absorbed = 1.0, 0.0
        for j in keep:
            t = float(times[j])
            s_now = float(durations.survival(t)) if t > 0 else 1.0
            q = 0.0 if s_prev <= 0 else min(1.0, s_now / s_prev)
            if q < 1.0:
                support = np.nonzero(pi > 1e-16)[0]
                if support.size == 0:
                    break
                hi = int(support.max())
                pmf = stats.binom.pmf(np.arange(hi + 1)[None, :], support[:, None], q)
                thinned = pi[support] @ pmf
                pi = np.zeros_like(pi)
                pi[: hi + 1] = thinned
            s_prev = s_now
            k = int(K[j])
            absorbed += float(pi[k + 1:].sum())
            pi[k + 1:] = 0.0
        return min(1.0, absorbed)

    def _p_saturate_overloaded(self, n_sessions: int, durations: Durations, horizon_s: float) -> float:
        """:meth:`p_saturate_fixed` when N sessions outrun the engine: the clock depends on how many are alive.

        A session's frame ``k`` ticks at ``k·P``; it starts when it is due and the session's last frame is done,
        and takes the engine's frame service time with ``A`` alive (:func:`metronome.throughput.frame_service_s`):
        ``s_k = max(k·P, s_(k−1) + T(A, n_(k−1)))``. So the sessions fall behind the clock while ``A`` is past the
        throughput and catch up (frames back to back) once departures bring it under: when a block level is
        reached depends on the whole path of ``A``, not on ``A`` now. A run that kept more sessions is at the
        same level later, so a mean-field clock (the expected alive count) would overstate how often such a run
        overflows. The forward pass is over the block levels with the state ``A`` and, for each ``A``, the mean
        start time of the frame that reaches the level among the runs in that state: from one level to the next
        the clock above runs at ``A`` alive and the sessions survive with ``S(t')/S(t)``, binomially. For
        exponential durations that survival depends only on ``t' − t`` (memoryless); what is left out is the
        spread of the time within a state and ``A`` changing inside one block level. A level reached after the
        horizon counts for nothing."""
        n_lv, b_lv = self._level_tokens(horizon_s)
        if n_lv.size == 0:
            return 0.0
        st = self.calibration.stream
        P, tpf = st.frame_period_s, st.kv_tokens_per_frame
        K = self.usable_blocks // np.maximum(b_lv, 1)
        if not (K < n_sessions).any():
            return 0.0
        last = int(np.nonzero(K < n_sessions)[0][-1])  # no level past this one can overflow
        n_lv, K = n_lv[:last + 1], K[:last + 1]
        # the frame that computes a level's first token: its start is when the level's block is taken
        f_lv = np.maximum(np.ceil((n_lv - st.prompt_tokens) / tpf).astype(np.int64) - 1, 0)
        f_lv[0] = 0
        A = np.arange(n_sessions + 1)
        # the frame service time with A alive over each level's frames, at the level's middle frame: the
        # context moves by under a block a session inside one level
        mid = st.prompt_tokens + tpf * ((np.concatenate([[0], f_lv[:-1]]) + f_lv) // 2)
        serve = self.frame_service_s(A[:, None], mid[None, :])
        lgam = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n_sessions + 1)))])  # log k!
        pi = np.zeros(n_sessions + 1)
        pi[n_sessions] = 1.0
        tau = np.zeros(n_sessions + 1)  # mean start of the level's frame among the runs with A alive
        absorbed = 0.0
        for j in range(n_lv.size):
            if j:
                src = np.nonzero(pi > 1e-16)[0]
                if src.size == 0:
                    break
                s_old = durations.survival(tau[src])

                def step(alive):  # the level's frames with `alive` sessions: (start of the last, survival)
                    t = tau[src].copy()
                    f0, f1 = int(f_lv[j - 1]), int(f_lv[j])
                    frame = serve[alive, j]
                    for f in range(f0 + 1, f1 + 1):
                        t = np.maximum(f * P, t + frame)
                    q = np.where(s_old > 0, durations.survival(t) / np.where(s_old > 0, s_old, 1.0), 0.0)
                    return t, np.clip(q, 1e-300, 1.0 - 1e-16)

                # the sessions leave during the level and the rest speed up: the clock runs at the alive count
                # expected halfway through it (a predictor-corrector step), not at the count it started with
                _, q = step(src)
                t_new, q = step(np.rint(src * np.sqrt(q)).astype(np.int64))
                hi = int(src.max())
                a = np.arange(hi + 1)[None, :]
                n_ = src[:, None]
                # (a > n: no such outcome. Its formula's (n − a)·log(1 − q) is large and positive, and exp of it
                # overflowed: it is masked to log 0 first, not exponentiated and thrown away)
                logp = np.where(a <= n_, lgam[n_] - lgam[np.minimum(a, n_)] - lgam[np.maximum(n_ - a, 0)]
                                + a * np.log(q[:, None]) + (n_ - a) * np.log1p(-q[:, None]), -np.inf)
                w = pi[src][:, None] * np.exp(logp)
                mass = w.sum(axis=0)
                pi = np.zeros_like(pi)
                pi[:hi + 1] = mass
                tau = np.zeros_like(tau)
                tau[:hi + 1] = (w * t_new[:, None]).sum(axis=0) / np.where(mass > 0, mass, 1.0)
            pi[tau > horizon_s + 1e-9] = 0.0  # these runs reach the level after the horizon
            k = int(K[j])
            absorbed += float(pi[k + 1:].sum())
            pi[k + 1:] = 0.0
        return min(1.0, absorbed)

    # -- Poisson arrivals -------------------------------------------------------------------------------
    def blocks_at_age(self, age_s):
        """Blocks one session holds ``age_s`` seconds after it started (vectorised; tokens stop growing at
        ``max_model_len``)."""
        n = np.minimum(np.floor(self.tokens_at(age_s)), self.max_tokens).astype(np.int64)
        return self.policy.resident_blocks(np.maximum(n, 0)).astype(float)

    def occupancy_poisson(self, rate_per_s: float, durations: Durations, t_s: float,
                          clock=None) -> tuple[float, float]:
        """Mean and variance of occupied blocks at time ``t_s`` for Poisson arrivals from t=0.

        M/G/∞ shot noise: sessions alive at t are a Poisson process over their ages ``a`` with intensity
        ``λ·P(D > a)``, so ``E[ρ] = λ∫₀ᵗ P(D>a)·b(a) da`` and ``Var[ρ] = λ∫₀ᵗ P(D>a)·b(a)² da``."""
        if t_s <= 0:
            return 0.0, 0.0
        # a fine grid (block counts are step functions) integrated with the trapezoid rule
        grid = np.linspace(0.0, t_s, 4001)
        sf = durations.survival(grid)
        b = self.blocks_at_age(grid)
        if not self._poisson_keeps_up(rate_per_s, durations, grid, sf, b):
            b = self._poisson_blocks_at_age(rate_per_s, durations, grid, clock)
        mean = rate_per_s * integrate.trapezoid(sf * b, grid)
        var = rate_per_s * integrate.trapezoid(sf * b * b, grid)
        return float(mean), float(var)

    POISSON_CLOCK_POINTS = 801  # the mean-field engine clock of Poisson arrivals is stepped on this many points

    def _poisson_keeps_up(self, rate_per_s: float, durations: Durations, grid, sf, b) -> bool:
        """True when the engine keeps up with Poisson arrivals up to ``grid[-1]``: the expected sessions alive
        ``λ∫S``, each with the mean context of the stream's clock (the most a session can hold), never outrun it."""
        ages = grid
        alive = rate_per_s * integrate.cumulative_trapezoid(sf, ages, initial=0.0)
        n = np.minimum(np.floor(self.tokens_at(ages)), self.max_tokens)
        ctx = rate_per_s * integrate.cumulative_trapezoid(sf * self.policy.resident_tokens(n.astype(np.int64)), ages,
                                                         initial=0.0)
        if alive.max() < 1:
            return True
        mean_ctx = ctx / np.maximum(alive, 1e-300)
        return not self.overloaded(np.maximum(np.rint(alive), 1).astype(np.int64), np.floor(mean_ctx).astype(np.int64))

    def _poisson_clock(self, rate_per_s: float, durations: Durations, until_s: float):
        """The mean-field engine clock of Poisson arrivals from 0 to ``until_s`` (:meth:`_poisson_blocks_at_age`):
        the grid and ``V`` on it, the engine's frames served per session. Computed once for a horizon and read at
        every window of :meth:`p_saturate_poisson` (the clock up to ``t`` does not depend on what comes after).

        Here a cohort that arrived at ``s`` has been served :meth:`_poisson_blocks_at_age`'s frames, and at most
        ``V(t) − s/P``: frames are served in the order of their ticks, so one that arrives while the engine is
        behind the stream's clock waits for it to catch up (``M`` starts at 0). The cap is the clock's only:
        without it the clock predicts the bounded Moshi hour at 4.25 sessions/s, exp(160 s), to saturate in 17 %
        of runs and 10 simulated runs saturated 4 times; with it 49 %. (:meth:`_poisson_blocks_at_age` with the
        cap predicts 0 %.)"""
        st = self.calibration.stream
        P, tpf, prompt = st.frame_period_s, st.kv_tokens_per_frame, st.prompt_tokens
        grid = np.linspace(0.0, float(until_s), self.POISSON_CLOCK_POINTS)  # the clock is smooth
        G = grid.size
        dt = np.diff(grid, prepend=0.0)
        V = np.zeros(G)
        M = np.zeros(G)  # min of r/P − V(r) from each cohort's arrival to now, and 0 (the docstring)
        # a cohort's survival at each age on the grid (the grid is even: an age is a grid point)
        surv = rate_per_s * durations.survival(grid)
        # T at each (sessions, context) met: once the alive count and the contexts settle (a bounded policy's
        # window is full), the same pair comes back at nearly every point, and T costs a call into the step model
        service: dict[tuple[int, int], float] = {}
        shape, residency = (float(P), int(prompt), int(tpf), int(self.max_tokens)), self.policy.residency()
        for i in range(1, G):
            alive, held = _cohorts(i, V, M, grid, dt, surv, shape, residency)
            T = 0.0
            if alive >= 1.0:
                key = (int(round(alive)), int(held / alive))
                T = service.get(key)
                if T is None:
                    T = service[key] = float(self.frame_service_s(*key))
            V[i] = V[i - 1] + dt[i] / max(T, 1e-12)
        return grid, V

    def _poisson_blocks_at_age(self, rate_per_s: float, durations: Durations, ages, clock=None) -> np.ndarray:
        """Blocks a session of age ``grid[-1] − grid[j]`` holds at ``grid[-1]`` (so: ``b`` over ages, reversed
        back to age order) when Poisson arrivals outrun the engine: a mean-field clock.

        The engine serves one frame of each alive session per :meth:`frame_service_s` with the expected alive count
        ``m(s) = λ∫₀ˢ S`` and their mean context; a session that arrived at ``s_j`` has been handed a frame a
        period since, and is served at most as fast as the engine serves frames, so (one queue per session, the
        min-plus form of ``s_k = max(k·P, s_(k−1) + T)``) its frames served by ``t`` are
        ``min over r in [s_j, t] of (r − s_j)/P + V(t) − V(r)``, ``V`` the engine's frames served per session
        (``∫ ds/T``): behind the clock while overloaded, catching up once not. The alive count's own noise is left
        to the shot-noise variance; each cohort's context is its resident tokens at the mean-field count.

        ``ages`` runs from 0 to the time ``t`` asked about; ``clock`` is :meth:`_poisson_clock` to ``t`` or past it
        (default: to ``t``). A clock computed past ``t`` is read at its last point at or before ``t``: a cohort
        that arrived after that point has been served nothing, an error of at most one of its steps."""
        st = self.calibration.stream
        P, tpf, prompt = st.frame_period_s, st.kv_tokens_per_frame, st.prompt_tokens
        t = float(ages[-1])
        grid, V = clock if clock is not None else self._poisson_clock(rate_per_s, durations, t)
        i = int(np.searchsorted(grid, t + 1e-9, side="right")) - 1
        W = grid[:i + 1] / P - V[:i + 1]
        M = np.minimum.accumulate(W[::-1])[::-1]  # min of W over [grid[j], grid[i]]
        served = np.maximum(V[i] - grid[:i + 1] / P + M, 0.0)
        # by age: the cohort of age a arrived at t − a (after grid[i]: none served yet)
        arrived = t - np.asarray(ages, dtype=float)
        got = np.where(arrived <= grid[i], np.interp(arrived, grid[:i + 1], served), 0.0)
        n = np.minimum(np.floor(prompt + tpf * got + WHOLE_TOKENS_EPS), self.max_tokens).astype(np.int64)
        return self.policy.resident_blocks(n).astype(float)

    def p_saturate_poisson(self, rate_per_s: float, durations: Durations, horizon_s: float) -> float:
        """Approximate P(the pool saturates before ``horizon_s``) under Poisson arrivals.

        At each time the occupancy is near-normal (many sessions), so ``p(t) = P(ρ(t) > B)``. Windows one
        mean duration apart are treated as independent (the occupancy forgets its past after about one
        session lifetime): ``P ≈ 1 − Π_j (1 − p(t_j))``. An approximation: the Monte Carlo in
        ``metronome-sim metastability`` reports how far it is from the simulated fraction."""
        if horizon_s <= 0:
            return 0.0
        step = min(durations.mean_s, horizon_s)
        ts = np.arange(step, horizon_s + 1e-9, step)
        if ts.size == 0 or ts[-1] < horizon_s:
            ts = np.append(ts, horizon_s)
        budget = self.usable_blocks
        p_none = 1.0
        clock = _LazyClock(self, rate_per_s, durations, float(ts[-1]))
        for t in ts:
            mean, var = self.occupancy_poisson(rate_per_s, durations, float(t), clock)
            if var <= 0:
                p = float(mean > budget)
            else:
                p = float(stats.norm.sf(budget + 0.5, loc=mean, scale=math.sqrt(var)))
            p_none *= 1.0 - p
        return 1.0 - p_none

    # -- collapse with N sessions started together ----------------------------------------------------
    MAX_CELLS = 4000  # the frame grid of silenced_fraction is coarsened to at most this many cells

    OVERLOADED_CELLS = 1000  # the overloaded path steps each run's own clock cell by cell: coarser cells

    def _frame_cells(self, horizon_s: float, max_cells: int | None = None):
        """The frame clock over ``[0, horizon_s)`` in cells of ``g`` whole frames (g = 1 up to MAX_CELLS frames).

        Returns ``(g, frames per cell, K per cell, frames a session can live)``: ``K`` is the fewest
        sessions of the common age the pool holds in any frame of the cell (``floor(B / blocks)``, blocks
        after that frame's tokens ``prompt + (f+1)·tokens_per_frame``). Unbounded sessions end at
        ``max_model_len`` (the engine finishes them); a bounded one is rebased onto its plateau, so its
        block count stays the policy's."""
        st = self.calibration.stream
        n_frames = max(0, int(math.ceil(horizon_s / st.frame_period_s - 1e-9)))
        g = max(1, cdiv(n_frames, max_cells or self.MAX_CELLS))
        n_cells = cdiv(n_frames, g)
        f = np.arange(n_cells * g)
        n = st.prompt_tokens + (f + 1) * st.kv_tokens_per_frame
        life = n_frames
        if not self.policy.bounded:
            past = np.nonzero(n > self.max_tokens)[0]
            if past.size:
                life = min(life, int(past[0]))
            n = np.minimum(n, self.max_tokens)
        k = self.usable_blocks // np.maximum(self.policy.resident_blocks(n), 1)
        k = np.where(f < n_frames, k, np.iinfo(np.int64).max)  # frames past the horizon do not count
        per_cell = np.minimum(g, n_frames - np.arange(n_cells) * g)
        return g, per_cell, k.reshape(n_cells, g).min(axis=1), life

    def silenced_fraction(self, durations_s, horizon_s: float) -> tuple[np.ndarray, np.ndarray]:
        """For runs of N sessions started together: when the pool first runs dry, and the share silenced after.

        ``durations_s`` is one run's N durations, or an (R, N) array of R runs. With the frame ticks
        ``t_f = f·P < H``, the sessions alive ``A_f = #{i : D_i > t_f}`` and the most the pool holds
        ``K_f = floor(B / blocks(prompt + (f+1)·tokens_per_frame))``::

            f_sat = min{f : A_f > K_f}                       (t_sat = f_sat·P; none: never saturated)
            φ     = Σ_{f ≥ f_sat} (A_f − K_f)⁺  /  Σ_{f ≥ f_sat} A_f

        ``φ`` is the share of the frames answered from ``t_sat`` on that are silent after a preemption: the
        sessions past the pool's ceiling are preempted and wait. It is the fraction the collapse rule of
        :mod:`metronome.results` measures (frames silent after a preemption over all frames ticked from the first
        preemption to the horizon), with the simulator's engine detail left out: a preempted
        session's history does not grow while it is silent, so it comes back holding fewer blocks and the
        engine fits slightly more than ``K_f`` — ``φ`` runs a few percent (relative) above the simulated
        fraction. The model also assumes the N sessions all fit at their first frame (admitted at t=0).
        Frames are grouped into cells of ``g`` frames when the horizon has more than ``MAX_CELLS`` (``A``
        at a cell's first frame, the cell's smallest ``K``).

        Past the engine's throughput each run's own clock is stepped instead (:meth:`_silenced_overloaded`).

        Returns ``(t_sat_s, φ)`` arrays of length R (``nan`` and 0 for runs that never saturate)."""
        d = np.atleast_2d(np.asarray(durations_s, dtype=float))
        runs, n = d.shape
        if not self._keeps_up(n, float(self.tokens_at(horizon_s))):
            return self._silenced_overloaded(d, horizon_s)
        P = self.calibration.stream.frame_period_s
        g, per_cell, k, life = self._frame_cells(horizon_s)
        n_cells = per_cell.size
        t_sat = np.full(runs, np.nan)
        phi = np.zeros(runs)
        if n_cells == 0 or n == 0:
            return t_sat, phi
        # frames a session is answered in: f = 0 .. ceil(D/P) − 1 (and none past max_model_len)
        m = np.minimum(np.ceil(d / P - 1e-9), life).astype(np.int64)
        q = np.minimum(cdiv(m, g), n_cells)  # cells whose first frame the session is alive in
        chunk = max(1, 2_000_000 // (n_cells + 1))
        cells = np.arange(n_cells)
        for lo in range(0, runs, chunk):
            qq = q[lo:lo + chunk]
            r = qq.shape[0]
            dead = np.bincount((qq + (n_cells + 1) * np.arange(r)[:, None]).ravel(), minlength=r * (n_cells + 1))
            alive = n - np.cumsum(dead.reshape(r, n_cells + 1), axis=1)[:, :n_cells]
            over = alive > k
            sat = over.any(axis=1)
            first = np.where(sat, over.argmax(axis=1), n_cells)
            after = cells[None, :] >= first[:, None]
            excess = (np.maximum(alive - np.minimum(k, n), 0) * per_cell * after).sum(axis=1)
            frames = (alive * per_cell * after).sum(axis=1)
            t_sat[lo:lo + r] = np.where(sat, first * g * P, np.nan)
            phi[lo:lo + r] = np.where(frames > 0, excess / np.maximum(frames, 1), 0.0)
        return t_sat, phi

    def _silenced_overloaded(self, d: np.ndarray, horizon_s: float) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`silenced_fraction` when the sessions outrun the engine: each run on its own clock.

        The sessions are served in lockstep on frames (cells of ``g``) whose start is ``s_c = max(c·g·P, s_(c−1)
        + g·T(running, n))`` (:meth:`_p_saturate_overloaded`), with ``A`` the run's sessions alive at ``s_c``
        and ``K_c`` the most the pool holds at the cell's token count. The pool runs dry at the first cell with
        ``A > K`` (``t_sat = s_c``); from then ``min(A, K)`` run and the rest are silent. The collapse rule
        counts the frames whose *tick* is at or after ``t_sat`` and that are answered before the horizon; past
        the throughput a running session answers frames of old ticks (its backlog), so they are:

        * frames served with their tick at or after ``t_sat``;
        * the silent sessions' frames, answered at their ticks, ``(A − K)⁺`` a period: silent after a preemption;
        * the backlog of a running session that is preempted: the front end answers its due frames silent at once
          (``FrontEnd._preempt``), those ticked from ``t_sat`` to now: silent after a preemption;
        * the backlog of a running session that leaves, answered silent as it departs (``FrontEnd._end``): frames,
          but flushed at departure, not silent after a preemption, so not in the share's numerator.

        A backlog is that of a session running since t=0. One readmitted after a preemption queues its frames anew
        from its readmission, and it is the first victim when the pool runs dry again (vLLM preempts the most
        recently admitted): its backlog is left out, and so, when the ceiling drops, the backlog of as many of the
        pushed out as there are readmitted sessions running.

        A frame still in a backlog at the horizon is never answered and not counted."""
        st = self.calibration.stream
        P, tpf = st.frame_period_s, st.kv_tokens_per_frame
        runs, n = d.shape
        g, per_cell, k, life = self._frame_cells(horizon_s, self.OVERLOADED_CELLS)
        n_cells = per_cell.size
        t_sat = np.full(runs, np.nan)
        phi = np.zeros(runs)
        if n_cells == 0 or n == 0:
            return t_sat, phi
        H = float(horizon_s)
        ds = np.concatenate([np.sort(d, axis=1), np.full((runs, 1), np.inf)], axis=1)  # each run's departures
        rows = np.arange(runs)
        gone = np.zeros(runs, dtype=np.int64)  # departures so far (the clock only moves forward)
        life_cells = cdiv(life, g)
        # the frame service time with A running at each cell's token count, for every A at once
        serve = self.frame_service_s(np.arange(n + 1)[:, None],
                                     st.prompt_tokens + tpf * g * np.arange(n_cells)[None, :])

        def alive(t):
            while True:
                step = ds[rows, gone] <= t
                if not step.any():
                    return n - gone
                gone[step] += 1

        s = np.zeros(runs)
        sat = np.zeros(runs, dtype=bool)
        frames = np.zeros(runs)
        silent = np.zeros(runs)
        a_prev = np.full(runs, n)
        run_prev = np.full(runs, n)
        first = np.full(runs, float(n))  # running sessions never preempted (the rest running were readmitted)
        k_prev = int(k[0])
        for c in range(n_cells):
            active = s < H
            if not active.any():
                break
            a = alive(s) if c < life_cells else np.zeros(runs, dtype=np.int64)
            kc = int(k[c])
            new = ~sat & active & (a > kc)
            t_sat[new] = s[new]
            sat |= new
            run = np.where(sat, np.minimum(a, kc), a)
            tick0 = c * g * P
            s_next = np.maximum((c + 1) * g * P, s + per_cell[c] * serve[run, c])
            on = sat & active
            if on.any():
                # running sessions that left or were pushed out since the last cell, with their backlog: those
                # running since t=0 owe every frame ticked since t_sat; a readmitted one's queue started anew at
                # its readmission and is left out. The departures are spread over both kinds; the victims are the
                # most recently admitted (vLLM's order): the readmitted ones first
                left = np.where(a_prev > 0, (a_prev - a) * run_prev / np.maximum(a_prev, 1), 0.0)
                left_first = np.where(run_prev > 0, left * first / np.maximum(run_prev, 1), 0.0)
                readmitted = np.maximum(run_prev - left - (first - left_first), 0.0)
                pushed = np.where(a > kc, max(k_prev - kc, 0), 0)
                pushed_first = np.maximum(pushed - readmitted, 0.0)
                owed = np.maximum(s - np.maximum(t_sat, tick0), 0.0) / P
                excess = np.maximum(a - kc, 0) * (np.minimum(s_next, H) - s) / P
                served = np.where(tick0 >= t_sat, run * per_cell[c], 0)
                # the pushed out's backlog is silent after a preemption; the departed's is answered, flushed silent
                silent += np.where(on, pushed_first * owed + excess, 0.0)
                frames += np.where(on, (left_first + pushed_first) * owed + excess + served, 0.0)
                first = np.where(on, np.clip(first - left_first - pushed_first, 0.0, run), run)
            else:
                first = run.astype(float)
            a_prev, run_prev, k_prev = a, run, kc
            s = np.where(active, s_next, s)
        phi = np.where(frames > 0, silent / np.maximum(frames, 1e-300), 0.0)
        return t_sat, np.where(sat, phi, 0.0)

    def p_collapse_fixed(self, n_sessions: int, durations: Durations, horizon_s: float,
                         silent_fraction: float = 0.01, runs: int = 4000, seed: int = 0) -> float:
        """P(collapse before ``horizon_s``) for N sessions started at t=0 with i.i.d. durations.

        Collapse = the pool saturates and then ``φ ≥ silent_fraction`` (see :meth:`silenced_fraction`;
        the simulator's rule uses 1%). Computed as::

            P(collapse) = P(saturate) · P(φ ≥ silent_fraction | saturated)

        with ``P(saturate)`` exact (:meth:`p_saturate_fixed`) and the conditional share estimated over
        ``runs`` draws of the N durations alone (no engine), from ``numpy.random.default_rng(seed)``:
        deterministic for a seed, well under a second for hundreds of sessions. Invariants:
        ``0 ≤ P(collapse) ≤ P(saturate)``; 0 when the pool cannot saturate (a bounded policy under its
        memory ceiling, a horizon shorter than t_sat), and also when none of the draws saturated (then
        P(saturate) is itself of the order of 1/runs or less); P(saturate) when every saturated draw collapses; the
        Monte Carlo's standard error is at most ``P(saturate)·0.5/sqrt(saturated draws)``, under 0.01 at
        the default 4000 draws."""
        if n_sessions <= 0 or horizon_s <= 0:
            return 0.0
        p_sat = self.p_saturate_fixed(n_sessions, durations, horizon_s)
        if p_sat <= 0.0:
            return 0.0
        rng = np.random.default_rng(seed)
        per_draw = max(1, min(runs, 4_000_000 // n_sessions))  # durations drawn per batch
        saturated = collapsed = 0
        for lo in range(0, runs, per_draw):
            r = min(per_draw, runs - lo)
            t_sat, phi = self.silenced_fraction(durations.sample(rng, r * n_sessions).reshape(r, n_sessions),
                                                horizon_s)
            sat = ~np.isnan(t_sat)
            saturated += int(sat.sum())
            collapsed += int((sat & (phi >= silent_fraction)).sum())
        if saturated == 0:
            return 0.0
        return min(p_sat, p_sat * collapsed / saturated)


# A cohort's served frames are a difference of clock readings (its age over the period, less the engine's lag), whole
# numbers that float arithmetic lands a hair either side of (30 s / 0.08 s is 374.9999999999999): counted as the
# whole number they are before the tokens are floored, so the sum's order cannot move a token.
WHOLE_TOKENS_EPS = 1e-9


@compiled.counted
def _cohorts(i, V, M, grid, dt, surv, stream, residency):
    """One point of :meth:`FillModel._poisson_clock`: first ``M`` brought up to point ``i − 1`` (the min of
    ``r/P − V(r)`` from each cohort's arrival to it, and 0), then, over the cohorts that arrived at points
    ``0..i−1``, at point ``i − 1``: the sessions expected alive (``surv``: the arrival rate times the survival at
    each age on the grid), and their resident tokens summed by that weight, each cohort holding what the frames it
    has been served put there (``stream``: the frame period, the first frame's tokens, a frame's KV tokens and
    the most a session holds; ``residency``: the policy's, KVPolicy.residency). Compiled: the clock takes hundreds
    of points, each over every cohort before it."""
    P, prompt, tpf, max_tokens = stream
    bs, sink_blocks, window = residency
    u = grid[i - 1] / P - V[i - 1]
    for j in range(i):
        M[j] = min(M[j], u)
    alive = 0.0
    held = 0.0
    for j in range(i):
        served = max(V[i - 1] - grid[j] / P + M[j], 0.0)
        n = min(math.floor(prompt + tpf * served + WHOLE_TOKENS_EPS), max_tokens)
        w = surv[i - 1 - j] * dt[j + 1]
        alive += w
        held += w * resident_tokens_jit(n, bs, sink_blocks, window)
    return alive, held


class _LazyClock:
    """:meth:`FillModel._poisson_clock` to a horizon, computed the first time a window needs it (windows where the
    engine keeps up never do), then shared by every later window. Unpacks as ``(grid, V)``."""

    def __init__(self, fm: FillModel, rate_per_s: float, durations: Durations, until_s: float):
        self._args, self._fm, self._clock = (rate_per_s, durations, until_s), fm, None

    def __iter__(self):
        if self._clock is None:
            self._clock = self._fm._poisson_clock(*self._args)
        return iter(self._clock)


# (before any clock runs: the cohorts compile the policy's residency in from another module)
CLOCK_FORM = compiled.guard(_cohorts, RESIDENCY_PARTS)
