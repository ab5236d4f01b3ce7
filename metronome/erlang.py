"""Erlang B: how often a fleet of loss systems refuses a session, and how many engines keep that under a target.

An engine whose admission controller caps it at ``N`` sessions (``N*`` from :func:`metronome.sim.capacity.capacity`)
is a *loss system*: a session that arrives while all ``N`` places are taken is refused at the door (real-time
sessions do not queue). With Poisson arrivals at rate ``λ`` and sessions of mean length ``E[D]``, the offered
load is ``A = λ·E[D]`` Erlangs, and the probability that an arrival finds all ``c`` places taken is Erlang's loss
formula::

    B(c, A) = (A^c / c!) / Σ_{k=0..c} A^k / k!

It depends on the session-length distribution **only through its mean** (the loss formula is insensitive to
the holding-time distribution, Sevastyanov 1957): exponential, lognormal or fixed sessions of the same mean
are refused equally often. Arrivals must be Poisson; a time-varying rate is handled by sizing at its peak
(``A = peak rate × E[D]`` over-states the load of a rise shorter than a session, so that sizing errs on the
side of more engines).

A fleet of ``G`` engines of ``N`` places each, behind a router:

* ``pooled`` — a router that finds any free engine (least-loaded with equal caps): the fleet is one loss
  system of ``G·N`` places, ``B(G·N, A)``;
* ``random`` — each arrival goes to an engine drawn at random and is refused there if it is full: a random
  split of a Poisson stream is Poisson, so each engine is its own loss system fed ``A/G``, ``B(N, A/G)``.

Every other router that does not retry refuses between the two. Pure math: no clock, no engine.
"""

from __future__ import annotations

import math

import numpy as np

from metronome.errors import MetronomeError

DEFAULT_MAX_REFUSAL = 0.01  # at most 1% of conversations refused at the door at the peak

ROUTINGS = ("pooled", "random")


def _check_load(offered_erlangs: float) -> float:
    a = float(offered_erlangs)
    if not (math.isfinite(a) and a >= 0):
        raise MetronomeError(f"offered load must be a finite number of Erlangs >= 0, got {offered_erlangs!r}")
    return a


def check_refusal(max_refusal: float, what: str = "the refusal target") -> float:
    """A refusal target must be a share in (0, 1); ``what`` names it in the one-line error (e.g. a flag)."""
    p = float(max_refusal)
    if not 0 < p < 1:
        raise MetronomeError(f"{what} must be in (0, 1), got {max_refusal:g}")
    return p


def _check_places(places: int, what: str) -> int:
    if isinstance(places, bool) or int(places) != places or places < 1:
        raise MetronomeError(f"{what} must be an integer >= 1, got {places!r}")
    return int(places)


def erlang_b(servers: int, offered_erlangs: float) -> float:
    """``B(servers, A)``: the share of Poisson arrivals a loss system of ``servers`` places refuses.

    The recursion ``B(0) = 1, B(k) = A·B(k−1) / (k + A·B(k−1))`` only ever divides numbers of the same
    order, so it is stable for tens of thousands of places, where ``A^c/c!`` overflows a float."""
    if isinstance(servers, bool) or int(servers) != servers or servers < 0:
        raise MetronomeError(f"the number of places must be an integer >= 0, got {servers!r}")
    a = _check_load(offered_erlangs)
    b = 1.0
    for k in range(1, int(servers) + 1):
        ab = a * b
        b = ab / (k + ab)
    return b


def refusal_probability(offered_erlangs: float, places_per_engine: int, engines: int,
                        routing: str = "pooled") -> float:
    """The refused share of a fleet of ``engines`` loss systems of ``places_per_engine`` each, under ``routing``."""
    n = _check_places(places_per_engine, "places per engine")
    g = _check_places(engines, "the number of engines")
    a = _check_load(offered_erlangs)
    if routing == "pooled":
        return erlang_b(g * n, a)
    if routing == "random":
        return erlang_b(n, a / g)
    raise MetronomeError(f"unknown routing {routing!r} (one of {', '.join(ROUTINGS)})")


def engines_needed(offered_erlangs: float, places_per_engine: int, max_refusal: float,
                   routing: str = "pooled") -> int:
    """The fewest engines of ``places_per_engine`` places whose fleet refuses at most ``max_refusal`` of an
    offered load of ``offered_erlangs`` (= arrival rate × mean session length; only the mean matters).

    ``routing``: ``pooled`` (a router that finds any free engine) or ``random`` (see the module docstring).
    No load needs no engine (0)."""
    n = _check_places(places_per_engine, "places per engine")
    a = _check_load(offered_erlangs)
    p = check_refusal(max_refusal)
    if routing not in ROUTINGS:
        raise MetronomeError(f"unknown routing {routing!r} (one of {', '.join(ROUTINGS)})")
    if a == 0:
        return 0
    if routing == "pooled":
        # one pass of the recursion, looking at every multiple of N places
        b, k = 1.0, 0
        while True:
            k += 1
            ab = a * b
            b = ab / (k + ab)
            if k % n == 0 and b <= p:
                return k // n
    # B(N, A/G) falls as G grows: double to a G that meets the target, then bisect
    lo, hi = 0, max(1, math.ceil(a / n))  # lo always misses the target (0 engines refuse everything)
    while erlang_b(n, a / hi) > p:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if erlang_b(n, a / mid) <= p else (mid, hi)
    return hi


def engines_by_routing(offered_erlangs: float, places_per_engine: int, max_refusal: float) -> dict[str, int]:
    """:func:`engines_needed` under each routing of ``ROUTINGS``: ``{"pooled": G, "random": G'}`` (the closed form
    ``metronome-sim fleet`` and the report print)."""
    return {rt: engines_needed(offered_erlangs, places_per_engine, max_refusal, rt) for rt in ROUTINGS}


def batch_means_interval(refused, offered, confidence: float = 0.95) -> tuple[float, float, float]:
    """``(p, lo, hi)``: the refused fraction ``p = Σ refused / Σ offered`` over batches, and a Student-t
    confidence interval from the spread of the batches.

    A binomial (Wilson) interval would treat every arrival as an independent coin; it is not: refusals come
    in bursts while the fleet is full, and a full fleet stays full for about a session length, so one run's
    refusals are correlated and a binomial interval is too narrow by about the burst size. Batches that are
    independent (runs of different seeds) or much longer than a session (an hour of a stationary run with
    5-minute sessions, the warm-up left out) give honest error bars: the interval is that of a ratio
    estimator, ``p ± t·s/(ō·√B)`` with ``s`` the standard deviation of ``refused_b − p·offered_b`` over the ``B``
    batches and ``ō`` their mean offered count. Needs two or more batches with arrivals."""
    from scipy import stats

    r = np.asarray(refused, dtype=float).ravel()
    o = np.asarray(offered, dtype=float).ravel()
    if r.size != o.size:
        raise MetronomeError("refused and offered counts need one value per batch each")
    if not 0 < confidence < 1:
        raise MetronomeError(f"confidence must be in (0, 1), got {confidence:g}")
    if (r < 0).any() or (r > o).any():
        raise MetronomeError("each batch needs 0 <= refused <= offered")
    keep = o > 0
    r, o = r[keep], o[keep]
    nb = r.size
    if nb < 2:
        raise MetronomeError(f"a batch-means interval needs at least 2 batches with arrivals, got {nb}")
    p = float(r.sum() / o.sum())
    s = float(np.std(r - p * o, ddof=1))
    half = float(stats.t.ppf(0.5 + confidence / 2, nb - 1)) * s / (o.mean() * math.sqrt(nb))
    return p, max(0.0, p - half), min(1.0, p + half)
