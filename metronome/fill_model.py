"""The first-order model of pool occupancy, and what it predicts.

With N sessions started together, each adding ``r_tok`` tokens per second (the calibration's
``kv_tokens_per_s``), the pool fills as::

    ρ(t) = ρ0 + N·r·t          (blocks; r = r_tok / block_size per session, ρ0 = N·prompt/block_size)

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
(preempted, waiting for blocks). A run *collapses* (the rule of :mod:`metronome.sim.scenario`) when those
silenced frames are at least 1% of the frames answered from ``t_sat`` to the horizon — a pool that runs
dry once and recovers after a few departures does not. :meth:`FillModel.silenced_fraction` gives that
fraction for given durations, :meth:`FillModel.p_collapse_fixed` the probability that it reaches the
threshold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import integrate, stats

from metronome.calibration import Calibration
from metronome.kv_policy import KVPolicy, cdiv
from metronome.workload import Durations


@dataclass(frozen=True)
class FillModel:
    calibration: Calibration
    policy: KVPolicy

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

    def tokens_at(self, t_s):
        """Tokens a session has computed ``t_s`` seconds after it started (continuous)."""
        return self.calibration.stream.prompt_tokens + self.tokens_per_s * np.asarray(t_s, dtype=float)

    def rho_linear(self, t_s, n_sessions: int):
        """ρ(t) = ρ0 + N·r·t in blocks, the first-order law (no cap, no block rounding)."""
        rho0 = n_sessions * self.calibration.stream.prompt_tokens / self.policy.block_size
        return rho0 + n_sessions * self.fill_rate_blocks_per_s * np.asarray(t_s, dtype=float)

    def occupancy_blocks(self, t_s, n_sessions: int):
        """Blocks held by N sessions of age ``t_s`` under the policy, at block granularity."""
        n = np.floor(self.tokens_at(t_s)).astype(np.int64)
        return n_sessions * self.policy.resident_blocks(n)

    def frame_blocks(self, n_start):
        """Blocks one session holds at the busiest step of a frame that starts after ``n_start`` tokens: the
        frame's first step computes ``in + 1`` tokens, each later one 1 (:meth:`KVPolicy.step_blocks`)."""
        st = self.calibration.stream
        n = np.asarray(n_start, dtype=np.int64)
        k0 = st.input_tokens_per_frame + 1
        peak = self.policy.step_blocks(n, k0)
        n = n + k0
        for _ in range(st.output_tokens_per_frame - 1):
            peak = np.maximum(peak, self.policy.step_blocks(n, 1))
            n = n + 1
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

        Unbounded KV has a ceiling only for a given session length (``duration_s``)."""
        peak = self.peak_resident_blocks
        if peak is None:
            if duration_s is None or not math.isfinite(duration_s):
                return None
            n = min(int(self.tokens_at(duration_s)), self.max_tokens)
            peak = int(self.policy.resident_blocks(max(n, 1)))
        return min(self.usable_blocks // max(peak, 1), self.calibration.engine.max_num_seqs)

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
        return max(0.0, (n_sat - self.calibration.stream.prompt_tokens) / self.tokens_per_s)

    # -- the race between fill and session length -----------------------------------------------------
    def _levels(self, horizon_s: float):
        """Times at which the per-session block count steps up, with the count after each step."""
        prompt = self.calibration.stream.prompt_tokens
        n_end = min(int(self.tokens_at(horizon_s)), self.max_tokens)
        if n_end < prompt:
            return np.zeros(0), np.zeros(0, dtype=np.int64)
        n = np.arange(prompt, n_end + 1)
        b = self.policy.resident_blocks(n)
        # the block count held right after computing n tokens; a rise happens at the first n of each level
        up = np.nonzero(np.diff(b) > 0)[0] + 1
        idx = np.concatenate([[0], up])
        return (n[idx] - prompt) / self.tokens_per_s, b[idx]

    def p_saturate_fixed(self, n_sessions: int, durations: Durations, horizon_s: float) -> float:
        """P(the pool saturates before ``horizon_s``) for N sessions started at t=0 with i.i.d. durations.

        Exact for the block-granular fill law: with ``A(t)`` sessions alive at age t and ``K(t) =
        floor(B / blocks(t))`` the most that fit, saturation happens iff ``A(t_j) > K_j`` at some step
        time ``t_j`` of the block count. ``A`` is a pure-death Markov chain (binomial thinning between
        step times), so a forward pass over the distribution of ``A`` gives the answer.
        """
        times, blocks = self._levels(horizon_s)
        if times.size == 0 or n_sessions <= 0:
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

    # -- Poisson arrivals -------------------------------------------------------------------------------
    def blocks_at_age(self, age_s):
        """Blocks one session holds ``age_s`` seconds after it started (vectorised; tokens stop growing at
        ``max_model_len``)."""
        n = np.minimum(np.floor(self.tokens_at(age_s)), self.max_tokens).astype(np.int64)
        return self.policy.resident_blocks(np.maximum(n, 0)).astype(float)

    def occupancy_poisson(self, rate_per_s: float, durations: Durations, t_s: float) -> tuple[float, float]:
        """Mean and variance of occupied blocks at time ``t_s`` for Poisson arrivals from t=0.

        M/G/∞ shot noise: sessions alive at t are a Poisson process over their ages ``a`` with intensity
        ``λ·P(D > a)``, so ``E[ρ] = λ∫₀ᵗ P(D>a)·b(a) da`` and ``Var[ρ] = λ∫₀ᵗ P(D>a)·b(a)² da``."""
        if t_s <= 0:
            return 0.0, 0.0
        # a fine grid (block counts are step functions) integrated with the trapezoid rule
        grid = np.linspace(0.0, t_s, 4001)
        sf = durations.survival(grid)
        b = self.blocks_at_age(grid)
        mean = rate_per_s * integrate.trapezoid(sf * b, grid)
        var = rate_per_s * integrate.trapezoid(sf * b * b, grid)
        return float(mean), float(var)

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
        for t in ts:
            mean, var = self.occupancy_poisson(rate_per_s, durations, float(t))
            if var <= 0:
                p = float(mean > budget)
            else:
                p = float(stats.norm.sf(budget + 0.5, loc=mean, scale=math.sqrt(var)))
            p_none *= 1.0 - p
        return 1.0 - p_none

    # -- collapse with N sessions started together ----------------------------------------------------
    MAX_CELLS = 4000  # the frame grid of silenced_fraction is coarsened to at most this many cells

    def _frame_cells(self, horizon_s: float):
        """The frame clock over ``[0, horizon_s)`` in cells of ``g`` whole frames (g = 1 up to MAX_CELLS frames).

        Returns ``(g, frames per cell, K per cell, frames a session can live)``: ``K`` is the fewest
        sessions of the common age the pool holds in any frame of the cell (``floor(B / blocks)``, blocks
        after that frame's tokens ``prompt + (f+1)·tokens_per_frame``). Unbounded sessions end at
        ``max_model_len`` (the engine finishes them); a bounded one is rebased onto its plateau, so its
        block count stays the policy's."""
        st = self.calibration.stream
        n_frames = max(0, int(math.ceil(horizon_s / st.frame_period_s - 1e-9)))
        g = max(1, cdiv(n_frames, self.MAX_CELLS))
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

        ``φ`` is the share of the frames answered from ``t_sat`` on that are silent: the sessions past the
        pool's ceiling are preempted and wait. It is the fraction the collapse rule of
        :mod:`metronome.sim.scenario` measures (silent frames of admitted sessions over all frames from
        the first preemption to the horizon), with the simulator's engine detail left out: a preempted
        session's history does not grow while it is silent, so it comes back holding fewer blocks and the
        engine fits slightly more than ``K_f`` — ``φ`` runs a few percent (relative) above the simulated
        fraction. The model also assumes the N sessions all fit at their first frame (admitted at t=0).
        Frames are grouped into cells of ``g`` frames when the horizon has more than ``MAX_CELLS`` (``A``
        at a cell's first frame, the cell's smallest ``K``).

        Returns ``(t_sat_s, φ)`` arrays of length R (``nan`` and 0 for runs that never saturate)."""
        d = np.atleast_2d(np.asarray(durations_s, dtype=float))
        runs, n = d.shape
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
