"""Drawing step jitter: the counter-based sampler behind :meth:`StepLatencyModel.draws`.

A calibration's step-latency model (:class:`~metronome.calibration.StepLatencyModel`) describes the jitter a
real-time engine adds around the model (``jitter``) and how it hangs together in time (``jitter_shared``,
``jitter_tau_s``, ``jitter_frame``); this module draws it. Every number is hashed from (seed, counter), so a span
simulated step by step or fast-forwarded gets the same draws. The fits that find these parameters are in
:mod:`metronome.fit`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the schema imports this module: no import of it at run time
    from metronome.calibration import StepLatencyModel

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _uniform(index: np.ndarray, seed: int) -> np.ndarray:
    """Counter-based uniform numbers in [0, 1): splitmix64 of (seed, index). Pure, so any subset of indices
    gives the same numbers whatever order they are asked in."""
    with np.errstate(over="ignore"):
        x = index.astype(np.uint64) + np.uint64(int(seed) & 0xFFFFFFFFFFFFFFFF) * _GOLDEN + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


class JitterDraws:
    """One run's step-jitter ratios (:class:`StepLatencyModel`'s ``jitter``, ``jitter_shared``, ``jitter_tau_s``,
    ``jitter_frame``).

    ``ratio(step, frame)`` is a pure function of (seed, step index, frame index): any subset asked in any order
    gives the same numbers, so a span simulated step by step or fast-forwarded draws the same. The shared part is
    an AR(1) over frame indices whose innovations are hashed from (seed, frame); it is computed in fixed chunks
    from frame 0 and kept, so it never depends on which frames were asked for first.
    """

    CHUNK = 4096

    def __init__(self, model: "StepLatencyModel", seed: int, frame_period_s: float):
        self.on = bool(model.jitter)
        self.seed = int(seed)
        self.rho = float(model.jitter_shared) if self.on else 0.0
        self.rho_f = float(model.jitter_frame) if self.on else 0.0
        if self.on:
            # contiguous: the compiled loop takes them, and a strided view would be a second type signature,
            # compiled again (the whole loop) beside the one every other caller uses
            self._p, self._r = (np.ascontiguousarray(c) for c in np.array(model.jitter, dtype=float).T)
        self._phi = math.exp(-float(frame_period_s) / model.jitter_tau_s) if self.rho else 0.0
        self._a = np.zeros(0)

    def _shared(self, frame: np.ndarray) -> np.ndarray:
        from scipy.signal import lfilter
        from scipy.special import ndtri

        need = int(frame.max()) + 1 if frame.size else 0
        while self._a.size < need:
            lo = self._a.size
            idx = np.arange(lo, lo + self.CHUNK, dtype=np.uint64)
            e = ndtri(_open_uniform(idx, self.seed ^ _SHARED_STREAM))
            phi = self._phi
            if lo == 0:  # stationary start: a_0 ~ N(0, 1)
                head = e[:1]
                rest = lfilter([math.sqrt(1 - phi * phi)], [1.0, -phi], e[1:], zi=[phi * e[0]])[0]
                chunk = np.concatenate([head, rest])
            else:
                chunk = lfilter([math.sqrt(1 - phi * phi)], [1.0, -phi], e, zi=[phi * self._a[-1]])[0]
            self._a = np.concatenate([self._a, chunk])
        return self._a[frame]

    @property
    def correlated(self) -> bool:
        """Whether a step's ratio depends on its frame (the shared or the frame-only part is on)."""
        return self.on and bool(self.rho or self.rho_f)

    def weights(self) -> tuple[float, float, float]:
        """The weights of a step's normal score, its frame's shared part and its frame-only part."""
        return math.sqrt(1 - self.rho - self.rho_f), math.sqrt(self.rho), math.sqrt(self.rho_f)

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        """The jitter distribution's points: probabilities rising from 0 to 1 and their ratios."""
        return self._p, self._r

    def step_scores(self, step) -> np.ndarray:
        """Each step's own normal score (hashed from (seed, step))."""
        from scipy.special import ndtri

        return ndtri(_open_uniform(np.atleast_1d(np.asarray(step, dtype=np.uint64)), self.seed))

    def frame_parts(self, frame) -> tuple[np.ndarray, np.ndarray]:
        """Each frame's shared part (the AR(1)) and its frame-only normal score (zeros where a part is off)."""
        from scipy.special import ndtri

        fr = np.atleast_1d(np.asarray(frame, dtype=np.int64))
        shared = self._shared(fr) if self.rho else np.zeros(fr.shape)
        own = (ndtri(_open_uniform(fr.astype(np.uint64), self.seed ^ _FRAME_STREAM)) if self.rho_f
               else np.zeros(fr.shape))
        return shared, own

    def ratio(self, step, frame) -> np.ndarray:
        """The ratio of step(s) ``step`` taken on frame(s) ``frame`` (ints or arrays of ints, broadcast)."""
        idx = np.atleast_1d(np.asarray(step, dtype=np.uint64))
        if not self.on:
            return np.ones(idx.shape)
        if not self.correlated:
            return np.interp(_uniform(idx, self.seed), self._p, self._r)
        fr = np.broadcast_to(np.atleast_1d(np.asarray(frame, dtype=np.int64)), idx.shape)
        shared, own = self.frame_parts(fr)
        from metronome.jitter_kernel import correlated_ratios  # compiled: numba is imported only when needed

        return correlated_ratios(self.step_scores(idx), shared, own, *self.weights(), self._p, self._r)


def mean_ratio(model: "StepLatencyModel") -> float:
    """The mean of the ratio :meth:`JitterDraws.ratio` draws (1 without jitter). Every draw, correlated or not, is
    the piecewise-linear quantile function through ``model.jitter`` at a uniform number, so its mean is that
    function's integral over [0, 1]: the trapezoid rule on the points is exact."""
    if not model.jitter:
        return 1.0
    p, r = np.array(model.jitter, dtype=float).T
    return float(np.sum(np.diff(p) * (r[1:] + r[:-1]) / 2))


_SHARED_STREAM = 0x2545F4914F6CDD1D  # the shared part's innovations: a second counter stream of the seed
_FRAME_STREAM = 0x61C8864680B583EB  # the frame-only part: a third


def _open_uniform(index: np.ndarray, seed: int) -> np.ndarray:
    """:func:`_uniform` moved to the open interval (0, 1), for normal scores."""
    return _uniform(index, seed) + 2.0 ** -54
