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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import integrate, stats

from metronome.calibration import Calibration
from metronome.kv_policy import KVPolicy
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

    @property
    def peak_resident_blocks(self) -> int | None:
        """The most blocks one session ever holds under a bounded policy (None when unbounded)."""
        if not self.policy.bounded:
            return None
        p = self.policy
        n = np.arange(0, p.sink_tokens + p.window_tokens + 3 * p.block_size)
        return int(p.resident_blocks(n).max())

    def memory_ceiling(self, duration_s: float | None = None) -> int | None:
        """The most sessions the pool can hold: ``floor(B / peak blocks per session)``.

        Unbounded KV has a ceiling only for a given session length (``duration_s``)."""
        peak = self.peak_resident_blocks
        if peak is None:
            if duration_s is None or not math.isfinite(duration_s):
                return None
            n = min(int(self.tokens_at(duration_s)), self.max_tokens)
            peak = int(self.policy.resident_blocks(max(n, 1)))
        return self.usable_blocks // max(peak, 1)

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
        n = np.arange(0, p.sink_tokens + p.window_tokens + 3 * p.block_size)
        over = np.nonzero(n_sessions * p.resident_blocks(n) > budget)[0]
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
    def _blocks_at_age(self, age_s):
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
        b = self._blocks_at_age(grid)
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
