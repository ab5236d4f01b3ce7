"""Which admitted sessions an engine's memory leaves silent (the fleet's unbounded-memory path, see
:mod:`metronome.sim.fleet`): each engine runs its sessions in admission order while their blocks fit in its
usable blocks and ``max_num_seqs``; the rest wait, silent while still in flight.
"""

from __future__ import annotations

import math

import numpy as np

from metronome.fill_model import FillModel


def silent_mask(blocks: np.ndarray, starts: np.ndarray, usable: int, max_seqs: int) -> np.ndarray:
    """Which sessions are silent, for groups of sessions (one engine at one instant each) laid one after another,
    each in admission order: a group runs the longest prefix whose blocks fit in ``usable`` blocks and that has
    at most ``max_seqs`` sessions; the rest wait (vLLM preempts the most recently admitted, and its waiting
    queue is first come, first served)."""
    if blocks.size == 0:
        return np.zeros(0, dtype=bool)
    lens = np.diff(np.append(starts, blocks.size))
    first = np.repeat(starts, lens)
    cs = np.cumsum(blocks)
    within = cs - (cs - blocks)[first]
    return (within > usable) | (np.arange(blocks.size) - first >= max_seqs)


def silent_on_grid(start, stop, eng, n_eng, fill: FillModel, max_seqs: int, grid_s: float, horizon_s: float,
                    bin_s: float, n_bins: int):
    """Silent and in-flight session counts summed over the ticks ``(k + ½)·grid_s`` of each (engine, bin), for
    admitted sessions in admission order (``start`` sorted)."""
    silent = np.zeros(n_eng * n_bins)
    flying = np.zeros(n_eng * n_bins)
    n_ticks = int(math.ceil(horizon_s / grid_s - 0.5))
    if start.size == 0 or n_ticks <= 0:
        return silent.reshape(n_eng, n_bins), flying.reshape(n_eng, n_bins)
    first_tick = np.maximum(np.ceil(start / grid_s - 0.5), 0).astype(np.int64)  # first k with (k+½)g >= start
    end_tick = np.minimum(np.ceil(stop / grid_s - 0.5), n_ticks).astype(np.int64)  # first k with (k+½)g >= stop
    chunk = max(1, int(300 // grid_s))  # five minutes of ticks at a time: a 100-engine fleet's pairs stay ~50 MB
    for k0 in range(0, n_ticks, chunk):
        k1 = min(n_ticks, k0 + chunk)
        hi = int(np.searchsorted(first_tick, k1, side="left"))
        cand = np.flatnonzero(end_tick[:hi] > k0)
        if cand.size == 0:
            continue
        a = np.maximum(first_tick[cand], k0)
        b = np.minimum(end_tick[cand], k1)
        lens = np.maximum(b - a, 0)
        total = int(lens.sum())
        if total == 0:
            continue
        sess = np.repeat(cand, lens)
        k = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens) + np.repeat(a, lens)
        t = (k + 0.5) * grid_s
        key = (k - k0) * n_eng + eng[sess]
        order = np.argsort(key, kind="stable")  # stable: within an (instant, engine), admission order stays
        key, sess, t = key[order], sess[order], t[order]
        blocks = fill.blocks_at_age(t - start[sess])
        starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        mute = silent_mask(blocks, starts, fill.usable_blocks, max_seqs)
        cell = eng[sess] * n_bins + np.minimum((t // bin_s).astype(np.int64), n_bins - 1)
        silent += np.bincount(cell, weights=mute, minlength=n_eng * n_bins)
        flying += np.bincount(cell, minlength=n_eng * n_bins)
    return silent.reshape(n_eng, n_bins), flying.reshape(n_eng, n_bins)
