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
            self._p, self._r = np.array(model.jitter, dtype=float).T
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

    def ratio(self, step, frame) -> np.ndarray:
        """The ratio of step(s) ``step`` taken on frame(s) ``frame`` (ints or arrays of ints, broadcast)."""
        idx = np.atleast_1d(np.asarray(step, dtype=np.uint64))
        if not self.on:
            return np.ones(idx.shape)
        if not self.rho and not self.rho_f:
            return np.interp(_uniform(idx, self.seed), self._p, self._r)
        from scipy.special import ndtr, ndtri

        fr = np.broadcast_to(np.atleast_1d(np.asarray(frame, dtype=np.int64)), idx.shape)
        y = math.sqrt(1 - self.rho - self.rho_f) * ndtri(_open_uniform(idx, self.seed))
        if self.rho:
            y = y + math.sqrt(self.rho) * self._shared(fr)
        if self.rho_f:
            y = y + math.sqrt(self.rho_f) * ndtri(_open_uniform(fr.astype(np.uint64), self.seed ^ _FRAME_STREAM))
        return np.interp(ndtr(y), self._p, self._r)


_SHARED_STREAM = 0x2545F4914F6CDD1D  # the shared part's innovations: a second counter stream of the seed
_FRAME_STREAM = 0x61C8864680B583EB  # the frame-only part: a third


def _open_uniform(index: np.ndarray, seed: int) -> np.ndarray:
    """:func:`_uniform` moved to the open interval (0, 1), for normal scores."""
    return _uniform(index, seed) + 2.0 ** -54
