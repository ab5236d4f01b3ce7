"""Admission controllers: may a new real-time session start now?

Each session streams a frame every 80 ms to 2 s and every frame has a deadline. A controller is fed
what the engine loop saw and answers admit/refuse. It is pure, like Netflix concurrency-limits' limit
objects: **no clock** (the caller passes ``now_s``, a simulator's or a live driver's time), no engine,
no threads. Time only matters through fixed **control intervals** of ``interval_s``:

* the grid is anchored at the first call (``t0 = now_s`` of the first ``observe``/``advance``/
  ``may_admit``); interval ``k`` covers ``[t0 + k·I, t0 + (k+1)·I)``;
* ``observe(now_s, latency_s, frames, silent)`` adds ``frames`` answered frames to the open interval
  (first closing any interval that ended at or before ``now_s``); ``silent`` of them were *empty*
  (the session got no token). Silent frames are congestion and **never** latency samples: an empty
  frame answered "fast" is the worst case, not the best (Netflix #176: drops that read as fast RTTs);
* ``advance(now_s, in_flight)`` closes every interval that ended at or before ``now_s``; each closed
  interval gets exactly one decision (at most one change of the limit per interval, so one outlier
  costs at most one multiplicative step, Netflix #155/#174, palantir/dialogue #722). A gap of several
  intervals without calls closes each of them; an empty one counts as an interval with no samples;
* ``may_admit(now_s, in_flight)`` advances, then answers ``in_flight < limit`` (and refuses while the
  signal is dead). A refusal is never a latency sample.

The ``in_flight`` a closed interval is judged by is the **peak** reported during it (by ``advance`` /
``may_admit``, and by the call that closes it), as Netflix's ``WindowedLimit`` keeps ``maxInFlight``; an
interval closed from ``observe`` uses the last ``in_flight`` reported. It is what the app-limited guard
and the dead-signal rule compare, and what :meth:`AdmissionController.trace` reports.

Controllers: :class:`NoAdmission` (baseline, always admits), :class:`StaticCap` (fixed cap),
:class:`AIMDController` (the Metronome controller) and :class:`GradientController` (a Netflix
Gradient2-style baseline with the lessons from its issue tracker applied). :func:`make_controller`
builds one from a CLI spec. Queueing of refused sessions (``on_refuse="queue"``) is the driver's job;
the controller only carries the setting (``on_refuse``, ``queue_timeout_s``) so every driver reads it
from one place.
"""

from __future__ import annotations

import json
import math
import sys
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from metronome.errors import MetronomeError
from metronome.results import weighted_percentile  # the one percentile (re-exported: existing imports work)

__all__ = [
    "ControllerParams",
    "AIMDParams",
    "GradientParams",
    "CONTROLLERS",
    "register",
    "controller_specs",
    "check_params",
    "read_params",
    "AdmissionController",
    "NoAdmission",
    "StaticCap",
    "AIMDController",
    "GradientController",
    "make_controller",
    "weighted_percentile",
    "DECISIONS",
    "ON_REFUSE",
]

# What a closed control interval decided (the ``decision`` of every trace row):
#   increase  the limit grew (additive increase; Gradient: the gradient raised it)
#   decrease  congestion: the limit was cut
#   draining  congestion, but the interval's peak in-flight is still above the limit (an earlier cut is
#             still taking effect as sessions leave): no further cut (AIMD)
#   hold      the limit is unchanged (no samples, app-limited, or a fixed controller)
#   dead      no frame answered with sessions in flight for ``dead_intervals`` intervals: refuse everything
DECISIONS = ("increase", "decrease", "draining", "hold", "dead")
ON_REFUSE = ("reject", "queue")

# Interval ends are t0 + (k+1)·I in floating point; a call at "exactly" the end must close it.
_REL_EPS = 1e-9


# ---------------------------------------------------------------------------------------------------
# Parameters: each controller declares its own (``Params``); a parameter file may hold any of them
# ---------------------------------------------------------------------------------------------------
def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return (isinstance(x, (int, float, np.integer, np.floating))
            and not isinstance(x, (bool, np.bool_)) and math.isfinite(float(x)))


def _real(obj, key: str, what: str) -> float:
    x = getattr(obj, key)
    if not _is_real(x):
        raise MetronomeError(f"{what} must be a finite number, got {x!r} ({key})")
    return float(x)


def _integer(obj, key: str, what: str) -> int:
    x = getattr(obj, key)
    if not _is_int(x):
        raise MetronomeError(f"{what} must be an integer, got {x!r} ({key})")
    return int(x)


@dataclass(frozen=True, kw_only=True)
class ControllerParams:
    """What every controller reads: the control interval, the latency percentile of its trace, and what
    the driver does with a refused session (``on_refuse``, ``queue_timeout_s``: read by the driver, carried
    by the controller so every driver reads them from one place).

    A controller with settings of its own declares a subclass as its ``Params``. Construction validates;
    :meth:`validate` of a subclass checks its own fields after ``super().validate()``.
    """

    percentile: float = 99.0
    interval_s: float = 1.0
    on_refuse: str = "reject"
    queue_timeout_s: float = 30.0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise :class:`MetronomeError` (one line, naming the field) if any setting is invalid."""
        p = _real(self, "percentile", "percentile")
        if not 0 < p <= 100:
            raise MetronomeError(f"percentile must be in (0, 100], got {p:g} (percentile)")
        i = _real(self, "interval_s", "control interval")
        if i <= 0:
            raise MetronomeError(f"control interval must be > 0 s, got {i:g} (interval_s)")
        if self.on_refuse not in ON_REFUSE:
            raise MetronomeError(f"on_refuse must be one of {', '.join(ON_REFUSE)}, got {self.on_refuse!r} (on_refuse)")
        qt = _real(self, "queue_timeout_s", "queue timeout")
        if qt < 0:
            raise MetronomeError(f"queue timeout must be >= 0 s, got {qt:g} (queue_timeout_s)")

    def common(self) -> dict:
        """The settings every controller's constructor takes (:class:`AdmissionController`'s keywords)."""
        return {k: getattr(self, k) for k in ControllerParams.keys()}

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def to_dict(self) -> dict:
        """A JSON-ready dict of every field (``from_dict(to_dict())`` gives an equal object)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict):
        """Build from a dict (e.g. parsed JSON); missing keys take their defaults.

        Unknown keys, wrong types and out-of-range values raise :class:`MetronomeError` naming the key.
        """
        if not isinstance(d, dict):
            raise MetronomeError(f"admission parameters must be a JSON object, got {type(d).__name__}")
        known = cls.keys()
        for key in d:
            if key not in known:
                raise MetronomeError(f"unknown admission parameter {key!r} (known: {', '.join(known)})")
        return cls(**d)

    @classmethod
    def take(cls, given: "ControllerParams | dict | None"):
        """This controller's settings out of ``given``: a parameter file's object or another controller's
        ``Params``. Keys that only another controller reads are left to it (an AIMD file also sets a static
        cap's interval); a key no registered controller reads is an error (:func:`check_params`)."""
        if given is None:
            return cls()
        if isinstance(given, cls):
            return given
        d = check_params(given)
        known = cls.keys()
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True, kw_only=True)
class AIMDParams(ControllerParams):
    """Settings of the AIMD controller (the Gradient controller reads these too).

    ``target_fraction`` and ``percentile`` define congestion by latency: the interval's weighted
    ``percentile`` of non-silent frame latencies above ``target_fraction · deadline_s``. The limits
    are in sessions. ``dead_intervals · interval_s`` should exceed the longest frame period (2 s for the
    slowest models), or a healthy session between two frames reads as a dead signal.
    """

    additive_increase: float = 1.0
    decrease_factor: float = 0.9
    target_fraction: float = 0.8
    min_limit: int = 1
    max_limit: int = 10_000
    initial_limit: int | None = None
    silent_tolerance: float = 0.0
    dead_intervals: int = 3

    @property
    def start_limit(self) -> int:
        """The limit a fresh controller starts at: ``initial_limit``, or ``min_limit`` by default."""
        return self.min_limit if self.initial_limit is None else int(self.initial_limit)

    def validate(self) -> None:
        a = _real(self, "additive_increase", "additive increase")
        if a <= 0:
            raise MetronomeError(f"additive increase must be > 0, got {a:g} (additive_increase)")
        b = _real(self, "decrease_factor", "decrease factor")
        if not 0 < b < 1:
            raise MetronomeError(f"decrease factor must be in (0, 1), got {b:g} (decrease_factor)")
        tf = _real(self, "target_fraction", "target fraction")
        if not 0 < tf <= 1:
            raise MetronomeError(f"target fraction must be in (0, 1], got {tf:g} (target_fraction)")
        super().validate()
        lo = _integer(self, "min_limit", "minimum limit")
        hi = _integer(self, "max_limit", "maximum limit")
        if lo < 1:
            raise MetronomeError(f"minimum limit must be >= 1, got {lo} (min_limit)")
        if hi < lo:
            raise MetronomeError(f"maximum limit ({hi}) must be >= minimum limit ({lo}) (max_limit)")
        if self.initial_limit is not None:
            il = _integer(self, "initial_limit", "initial limit")
            if not lo <= il <= hi:
                raise MetronomeError(
                    f"initial limit must be in [min_limit, max_limit] = [{lo}, {hi}], got {il} (initial_limit)")
        st = _real(self, "silent_tolerance", "silent tolerance")
        if not 0 <= st < 1:
            raise MetronomeError(f"silent tolerance must be in [0, 1), got {st:g} (silent_tolerance)")
        d = _integer(self, "dead_intervals", "dead intervals")
        if d < 1:
            raise MetronomeError(f"dead intervals must be >= 1, got {d} (dead_intervals)")

    @classmethod
    def from_file(cls, path) -> "AIMDParams":
        """From a parameter file: what ``metronome-sim tune-aimd`` writes or a bare parameters object."""
        return cls.from_dict(read_params_file(path))


@dataclass(frozen=True, kw_only=True)
class GradientParams(AIMDParams):
    """The Gradient controller's own settings over the shared adaptive ones (defaults as Netflix's
    ``Gradient2Limit``; see :class:`GradientController`)."""

    smoothing: float = 0.2
    rtt_tolerance: float = 1.5
    queue_size: float = 4.0
    long_window: int = 600
    warmup: int = 10
    drift_fraction: float = 0.1

    def validate(self) -> None:
        super().validate()
        sm = _real(self, "smoothing", "gradient smoothing")
        if not 0 < sm <= 1:
            raise MetronomeError(f"gradient smoothing must be in (0, 1], got {sm:g} (smoothing)")
        if _real(self, "rtt_tolerance", "gradient rtt tolerance") < 1:
            raise MetronomeError(f"gradient rtt tolerance must be >= 1, got {self.rtt_tolerance!r} (rtt_tolerance)")
        if _real(self, "queue_size", "gradient queue size") < 0:
            raise MetronomeError(f"gradient queue size must be >= 0, got {self.queue_size!r} (queue_size)")
        if _integer(self, "long_window", "gradient long window") < 1:
            raise MetronomeError(f"gradient long window must be >= 1, got {self.long_window!r} (long_window)")
        if _integer(self, "warmup", "gradient warmup") < 0:
            raise MetronomeError(f"gradient warmup must be >= 0, got {self.warmup!r} (warmup)")
        df = _real(self, "drift_fraction", "gradient drift fraction")
        if not 0 <= df <= 1:
            raise MetronomeError(f"gradient drift fraction must be in [0, 1], got {df:g} (drift_fraction)")


def read_params_file(path) -> dict:
    """The parameters object of a JSON file: ``best_aimd.json`` as ``tune-aimd`` writes it
    (``{"params": {...}, "figures": {...}}``) or the bare object. One-line errors for a missing or bad file."""
    p = Path(path)
    try:
        obj = json.loads(p.read_text())
    except FileNotFoundError:
        raise MetronomeError(f"{p}: no such AIMD parameter file") from None
    except json.JSONDecodeError as exc:
        raise MetronomeError(f"{p}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if isinstance(obj, dict) and "params" in obj and isinstance(obj["params"], dict):
        obj = obj["params"]
    if not isinstance(obj, dict):
        raise MetronomeError(f"{p}: an AIMD parameter file must be a JSON object")
    return obj


def check_params(given: "ControllerParams | dict") -> dict:
    """A parameters object checked against every registered controller: each key is read by some
    controller, and each controller's own ``Params`` accepts its share. Returns it as a dict."""
    d = given.to_dict() if isinstance(given, ControllerParams) else given
    if not isinstance(d, dict):
        raise MetronomeError(f"admission parameters must be a JSON object, got {type(d).__name__}")
    types = {c.Params for c in CONTROLLERS.values()}
    known = sorted({k for t in types for k in t.keys()})
    for key in d:
        if key not in known:
            raise MetronomeError(f"unknown admission parameter {key!r} (known: {', '.join(known)})")
    for t in types:
        t(**{k: v for k, v in d.items() if k in t.keys()})
    return dict(d)


def read_params(path_or_obj: "str | Path | dict | ControllerParams") -> dict:
    """An ``--aimd-params`` value (a file, or an already parsed object) checked by :func:`check_params`:
    a missing file or a bad value fails here, before any work, whichever controller will read it."""
    if isinstance(path_or_obj, (dict, ControllerParams)):
        return check_params(path_or_obj)
    return check_params(read_params_file(path_or_obj))


# ---------------------------------------------------------------------------------------------------
# The interface and the interval machinery
# ---------------------------------------------------------------------------------------------------
class AdmissionController(ABC):
    """The interface the simulator and the live driver call; also the per-interval bookkeeping.

    Subclasses give :attr:`limit`, and :meth:`_decide`, called once per closed interval with its
    aggregates, which may change the limit and returns one of :data:`DECISIONS`. A controller the CLIs can
    name is registered (:func:`register`) with its ``name``, its ``spec`` (how the CLI writes it, e.g.
    ``static:N``), its ``Params`` (the settings it reads from a parameter file) and :meth:`from_spec`.
    """

    name: str = "controller"
    spec: str = "controller"
    Params: type[ControllerParams] = ControllerParams
    #: whether a parameter file can change anything it does (``none`` admits everything whatever the file says)
    reads_params: bool = True

    def __init__(self, interval_s: float = 1.0, percentile: float = 99.0,
                 on_refuse: str = "reject", queue_timeout_s: float = 30.0):
        ControllerParams(interval_s=interval_s, percentile=percentile, on_refuse=on_refuse,
                         queue_timeout_s=queue_timeout_s)  # the one check of what every controller reads
        self.interval_s = float(interval_s)
        self.percentile = float(percentile)
        self.on_refuse = on_refuse
        self.queue_timeout_s = float(queue_timeout_s)
        self._t0: float | None = None
        self._k = 0                      # index of the open interval
        self._lat: list[float] = []      # non-silent latencies of the open interval
        self._w: list[int] = []          # their weights (frames - silent)
        self._frames = 0
        self._silent = 0
        self._peak = 0                   # peak in_flight reported in the open interval
        self._last_in_flight = 0
        self._trace: list[tuple] = []

    @classmethod
    def from_spec(cls, arg: str | None, deadline_s: float, params: ControllerParams | dict | None):
        """Build from the CLI spec's argument (``"64"`` of ``static:64``; ``None`` without a colon), the
        frame deadline and a parameters object (this controller takes its share, :meth:`ControllerParams.take`)."""
        cls._no_argument(arg)
        return cls(**cls.Params.take(params).common())

    @classmethod
    def _no_argument(cls, arg: str | None) -> None:
        if arg is not None:
            raise MetronomeError(f"bad admission spec '{cls.name}:{arg}': {cls.name} takes no argument")

    # -- the interface -------------------------------------------------------------------------------
    @property
    @abstractmethod
    def limit(self) -> int:
        """The current concurrency limit (sessions)."""

    @property
    def dead(self) -> bool:
        """True while the controller refuses everything because the signal is dead (adaptive ones)."""
        return False

    def observe(self, now_s: float, latency_s: float, frames: int = 1, silent: int = 0) -> None:
        """``frames`` frames were answered at ``now_s`` with latency ``latency_s``; ``silent`` were empty.

        The ``frames - silent`` non-silent frames enter the interval's latency statistic with that
        latency; silent frames only count (their latency is ignored). Bad arguments are a caller bug
        (``ValueError``). A sample timed before the open interval (out-of-order delivery) goes into
        the open interval: closed intervals are never reopened.
        """
        now_s = self._check_time(now_s)
        if not _is_int(frames) or frames < 0:
            raise ValueError(f"frames must be an integer >= 0, got {frames!r}")
        if not _is_int(silent) or not 0 <= silent <= frames:
            raise ValueError(f"silent must be an integer in [0, frames={frames}], got {silent!r}")
        if not _is_real(latency_s) or latency_s < 0:
            raise ValueError(f"latency must be finite and >= 0 s, got {latency_s!r}")
        self._close_through(now_s, self._last_in_flight)
        frames, silent = int(frames), int(silent)
        if frames == 0:
            return
        self._frames += frames
        self._silent += silent
        if frames > silent:
            self._lat.append(float(latency_s))
            self._w.append(frames - silent)
        self._on_frames()

    def observe_many(self, now_s, latency_s, frames, silent, in_flight) -> None:
        """``advance(now_s[i], in_flight[i])`` then ``observe(now_s[i], latency_s[i], frames[i], silent[i])`` for
        each row in order, with the same result, a control interval at a time (the simulator's compiled loop
        hands over thousands of rows at once). Rows must be in time order; ``in_flight`` is one count for every
        row or one per row."""
        now = np.asarray(now_s, dtype=float).ravel()
        inf = np.broadcast_to(np.asarray(in_flight, dtype=np.int64), now.shape)
        lat = np.asarray(latency_s, dtype=float).ravel()
        fr = np.asarray(frames, dtype=np.int64).ravel()
        si = np.asarray(silent, dtype=np.int64).ravel()
        n = now.size
        if not (lat.size == fr.size == si.size == n):
            raise ValueError("observe_many: rows of unequal length")
        if n == 0:
            return
        if not (np.isfinite(now).all() and np.isfinite(lat).all() and (lat >= 0).all()):
            raise ValueError("observe_many: times and latencies must be finite, latencies >= 0")
        if (np.diff(now) < 0).any() or (fr < 0).any() or (si < 0).any() or (si > fr).any() or (inf < 0).any():
            raise ValueError("observe_many: rows out of time order, or frames/silent/in_flight out of range")
        i = 0
        while i < n:
            self.advance(float(now[i]), int(inf[i]))  # closes every interval that ended by row i
            # rows in the open interval: those advance() would not close (the test of _close_through)
            e = i + 1 + int(np.searchsorted((now[i + 1:] - self._t0) / self.interval_s, self._k + 1 - _REL_EPS))
            if e > i + 1:  # the rest of them advance() nothing but the peak and the last count
                self._peak = max(self._peak, int(inf[i + 1:e].max()))
                self._last_in_flight = int(inf[e - 1])
            f, s = fr[i:e], si[i:e]
            self._frames += int(f.sum())
            self._silent += int(s.sum())
            heard = f > s
            if heard.any():
                self._lat.extend(lat[i:e][heard].tolist())
                self._w.extend((f - s)[heard].tolist())
            if f.sum() > 0:
                self._on_frames()
            i = e

    def advance(self, now_s: float, in_flight: int) -> None:
        """Close every control interval that ended at or before ``now_s`` (one decision each)."""
        now_s = self._check_time(now_s)
        in_flight = self._check_in_flight(in_flight)
        self._last_in_flight = in_flight
        self._close_through(now_s, in_flight)
        self._peak = max(self._peak, in_flight)

    def may_admit(self, now_s: float, in_flight: int) -> bool:
        """Advance to ``now_s``, then: may one more session start with ``in_flight`` running?"""
        self.advance(now_s, in_flight)
        return (not self.dead) and int(in_flight) < self.limit

    def trace(self) -> list[dict]:
        """One dict per closed interval, oldest first.

        Keys: ``t_s`` (the interval's end), ``limit`` (after the decision), ``in_flight`` (the peak
        reported in the interval), ``p_latency_s`` (the weighted percentile of non-silent latencies,
        ``None`` without any), ``frames``, ``silent`` and ``decision`` (one of :data:`DECISIONS`).
        """
        keys = ("t_s", "limit", "in_flight", "p_latency_s", "frames", "silent", "decision")
        return [dict(zip(keys, row)) for row in self._trace]

    def take_trace(self) -> list[dict]:
        """The rows of :meth:`trace` closed so far, then forget them: a driver that runs for days (a fleet of
        engines over a simulated day, one row per engine per second) keeps its memory flat by taking the
        trace as it goes. A later :meth:`trace` or ``take_trace`` starts after the rows taken."""
        rows = self.trace()
        self._trace.clear()
        return rows

    # -- machinery -------------------------------------------------------------------------------------
    @staticmethod
    def _check_time(now_s) -> float:
        if not _is_real(now_s):
            raise ValueError(f"now_s must be a finite number, got {now_s!r}")
        return float(now_s)

    @staticmethod
    def _check_in_flight(in_flight) -> int:
        if not _is_int(in_flight) or in_flight < 0:
            raise ValueError(f"in_flight must be an integer >= 0, got {in_flight!r}")
        return int(in_flight)

    def _close_through(self, now_s: float, in_flight: int) -> None:
        if self._t0 is None:
            self._t0 = now_s
            return
        elapsed = (now_s - self._t0) / self.interval_s     # in intervals
        while elapsed >= self._k + 1 - _REL_EPS:
            end = self._t0 + (self._k + 1) * self.interval_s
            peak = max(self._peak, in_flight)
            p = weighted_percentile(self._lat, self._w, self.percentile) if self._w else None
            decision = self._decide(peak, p, self._frames, self._silent)
            if decision not in DECISIONS:  # every decision a trace records is one of the named ones
                raise RuntimeError(f"{type(self).__name__} decided {decision!r}, not one of {DECISIONS}")
            self._trace.append((end, self.limit, peak, p, self._frames, self._silent, decision))
            self._k += 1
            self._lat, self._w = [], []
            self._frames = self._silent = 0
            self._peak = in_flight   # what is in flight now was in flight when the next one began

    def _on_frames(self) -> None:
        """Hook: frames were observed (the adaptive controllers clear a dead signal here)."""

    @abstractmethod
    def _decide(self, in_flight: int, p_latency_s: float | None, frames: int, silent: int) -> str:
        """Judge one closed interval; may change the limit; returns one of :data:`DECISIONS`."""


# ---------------------------------------------------------------------------------------------------
# Baselines
# ---------------------------------------------------------------------------------------------------
class NoAdmission(AdmissionController):
    """Admit everything (the baseline that shows the KV cliff). ``limit`` is ``sys.maxsize``.

    It still closes intervals, so its :meth:`trace` has the same per-interval latencies as the others;
    every decision is ``"hold"``.
    """

    name = spec = "none"
    reads_params = False

    @property
    def limit(self) -> int:
        return sys.maxsize

    def may_admit(self, now_s: float, in_flight: int) -> bool:
        self.advance(now_s, in_flight)
        return True

    def _decide(self, in_flight, p_latency_s, frames, silent) -> str:
        return "hold"


class StaticCap(AdmissionController):
    """Admit while ``in_flight < n``: a fixed cap, e.g. from the fill model's memory ceiling."""

    spec = "static:N"

    def __init__(self, n: int, interval_s: float = 1.0, percentile: float = 99.0,
                 on_refuse: str = "reject", queue_timeout_s: float = 30.0):
        if not _is_int(n):
            raise MetronomeError(f"static admission limit must be an integer, got {n!r}")
        if n < 1:
            raise MetronomeError(f"static admission limit must be >= 1, got {n}")
        super().__init__(interval_s, percentile, on_refuse, queue_timeout_s)
        self._n = int(n)
        self.name = f"static:{self._n}"

    @classmethod
    def from_spec(cls, arg, deadline_s, params):
        try:
            n = int((arg or "").strip())
        except ValueError:
            spec = "static" if arg is None else f"static:{arg}"
            raise MetronomeError(
                f"bad admission spec {spec!r}: static needs an integer limit, e.g. static:64") from None
        return cls(n, **cls.Params.take(params).common())

    @property
    def limit(self) -> int:
        return self._n

    def _decide(self, in_flight, p_latency_s, frames, silent) -> str:
        return "hold"


# ---------------------------------------------------------------------------------------------------
# Adaptive controllers
# ---------------------------------------------------------------------------------------------------
class _Adaptive(AdmissionController):
    """Shared by AIMD and Gradient: params, the float limit, the latency target and the dead signal.

    Dead signal: an interval with sessions in flight (peak > 0) but not a single frame answered counts
    toward it; ``dead_intervals`` such intervals in a row make the controller refuse every admission
    and freeze the limit (decision ``"dead"``) until frames are seen again (``observe`` with
    ``frames > 0`` clears it at once). An interval with nothing in flight and no frames is a plain
    ``"hold"`` (cold start must admit) and also clears the dead state: with nothing in flight there
    is nothing to wait for, and refusing forever would deadlock (no session, so never a frame).
    """

    Params = AIMDParams

    def __init__(self, params: ControllerParams | dict | None, deadline_s: float):
        if params is not None and not isinstance(params, (ControllerParams, dict)):
            raise MetronomeError(f"admission parameters must be {self.Params.__name__}, got {type(params).__name__}")
        params = self.Params.take(params)
        if not _is_real(deadline_s) or deadline_s <= 0:
            raise MetronomeError(f"frame deadline must be > 0 s, got {deadline_s!r}")
        super().__init__(**params.common())
        self.params = params
        self.deadline_s = float(deadline_s)
        self.target_s = params.target_fraction * self.deadline_s
        self._limit = float(params.start_limit)
        self._dead = False
        self._dead_run = 0

    @classmethod
    def from_spec(cls, arg, deadline_s, params):
        cls._no_argument(arg)
        return cls(params, deadline_s)

    @property
    def limit(self) -> int:
        return int(math.floor(self._limit + 1e-9))

    @property
    def dead(self) -> bool:
        return self._dead

    def _on_frames(self) -> None:
        self._dead = False
        self._dead_run = 0

    def _no_frames(self, in_flight: int) -> str:
        """Bookkeeping of an interval without a single frame; returns its decision."""
        if in_flight > 0:
            self._dead_run += 1
            if self._dead_run >= self.params.dead_intervals:
                self._dead = True
        else:
            self._dead_run = 0
            self._dead = False
        return "dead" if self._dead else "hold"

    def _congested(self, p_latency_s: float | None, frames: int, silent: int) -> bool:
        """Absolute congestion: too many silent frames, or the latency percentile over the target."""
        if silent / frames > self.params.silent_tolerance:
            return True
        return p_latency_s is not None and p_latency_s > self.target_s

    def _clamp(self, x: float) -> float:
        return min(float(self.params.max_limit), max(float(self.params.min_limit), x))


class AIMDController(_Adaptive):
    """Additive increase, multiplicative decrease, once per control interval.

    Per closed interval (``a = additive_increase``, ``b = decrease_factor``):

    * no frame at all: the dead-signal bookkeeping (see :class:`_Adaptive`), limit unchanged;
    * **congestion** (silent fraction > ``silent_tolerance`` (any silent frame at 0), or the weighted
      ``percentile`` of non-silent latencies > ``target_fraction · deadline_s``): ``L ← max(min_limit,
      min(floor(b·L), floor(L) − 1))`` so even a small limit drops by at least one session — unless the
      interval's peak in-flight is still above ``L`` (decision ``"draining"``): admission never evicts,
      so after a cut the load falls only as sessions end, and the congestion seen meanwhile is the
      one already answered (TCP likewise cuts once per window of data, not once per loss);
    * otherwise, with non-silent samples and the interval's peak ``in_flight >= L/2`` (the app-limited
      guard: no growth while the limit is far above what is used): ``L ← min(max_limit, L + a)``;
    * otherwise hold.

    ``L`` is kept as a float (so ``a < 1`` works); :attr:`limit` is ``floor(L)``. Against a server of
    capacity ``K`` this gives the textbook sawtooth between about ``b·K`` and ``K + a``, mean
    ``(1+b)/2·K``.
    """

    name = spec = "aimd"

    def __init__(self, params: AIMDParams | dict | None = None, deadline_s: float = 1.0):
        super().__init__(params, deadline_s)

    def _decide(self, in_flight, p_latency_s, frames, silent) -> str:
        if frames == 0:
            return self._no_frames(in_flight)
        L = self._limit
        if self._congested(p_latency_s, frames, silent):
            if in_flight > math.floor(L + 1e-9):
                # the last cut has not taken effect yet: sessions are admitted, not evicted, so the
                # load only falls as sessions leave; cutting again would punish the same congestion twice
                return "draining"
            cut = min(math.floor(L * self.params.decrease_factor + 1e-9), math.floor(L + 1e-9) - 1)
            self._limit = self._clamp(float(cut))
            return "decrease"
        if p_latency_s is not None and 2 * in_flight >= L:
            self._limit = self._clamp(L + self.params.additive_increase)
            return "increase"
        return "hold"


class GradientController(_Adaptive):
    """A Netflix ``Gradient2Limit``-style baseline on per-interval aggregates, with its known bugs fixed.

    The Gradient2 core (defaults as in Netflix): per closed interval, ``short`` = the interval's weighted
    latency percentile (non-silent frames), ``long`` = an EMA of ``short`` over ``long_window`` intervals
    (factor ``2/(long_window+1)``, a plain mean over the first ``warmup`` intervals), ::

        gradient = clamp(rtt_tolerance · long / short, 0.5, 1.0)
        L ← (1 − smoothing)·L + smoothing·(gradient·L + queue_size)

    so it grows ``smoothing·queue_size`` = +0.8 per interval when unloaded, and, as in Gradient2, not at
    all while the interval's peak in_flight < L/2 (app-limited guard; growth only, a cut always applies).
    Then clamped to ``[min_limit, max_limit]``; :attr:`limit` is ``floor(L)``.

    Lessons applied (from the concurrency-limits issue tracker):

    * **Silent frames are congestion** (Netflix #176): a silent fraction over ``silent_tolerance``
      counts as the hardest cut (gradient 0.5) and the silent frames never enter ``short``.
    * **Absolute SLO check** (Netflix #137, "stable timeout"): a ratio alone is blind to a
      constant-but-bad latency, so ``short > target_fraction·deadline_s`` also counts as the hardest
      cut. A hard cut drops the ``+queue_size`` term (``L ← (1 − smoothing/2)·L``, ×0.9): with it,
      Gradient2's fixed point under gradient 0.5 is ``queue_size/0.5 = 8`` sessions, so from below 8 a
      sustained overload would *raise* the limit.
    * **No ratchet of the baseline** (Netflix #134, Envoy #11579): intervals that are congested
      (silent, over the target, or ``short > rtt_tolerance·long``) never feed ``long``, so overload
      cannot drag the baseline up to itself. Within the tolerance band, ``long`` follows a higher
      ``short`` only ``drift_fraction`` (0.1) times as fast as it follows a lower one (slow upward
      re-learning, e.g. for a permanently slower engine), and it is clamped to
      ``target / rtt_tolerance`` so the band never reaches past the SLO. The limit can therefore
      still drift up slowly under sub-target latency inflation, but never past the latency target.
    * Netflix's recovery rule is kept: when ``long > 2·short`` (overload ended), ``long ← 0.95·long``.
    """

    name = spec = "gradient"
    Params = GradientParams

    def __init__(self, params: GradientParams | AIMDParams | dict | None = None, deadline_s: float = 1.0,
                 **overrides):
        """``overrides`` set single Gradient settings (``smoothing=0.3``) over ``params``."""
        if overrides:
            params = {**(self.Params.take(params).to_dict()), **overrides}
        super().__init__(params, deadline_s)
        p = self.params
        self.smoothing = float(p.smoothing)
        self.rtt_tolerance = float(p.rtt_tolerance)
        self.queue_size = float(p.queue_size)
        self.long_window = int(p.long_window)
        self.warmup = int(p.warmup)
        self.drift_fraction = float(p.drift_fraction)
        self._ema = 2.0 / (self.long_window + 1)
        self._long: float | None = None
        self._n_long = 0

    @property
    def long_latency_s(self) -> float | None:
        """The baseline (long) latency, ``None`` before the first healthy interval."""
        return self._long

    def _update_long(self, short: float) -> None:
        if self._long is None or self._n_long < self.warmup:
            n = self._n_long
            self._long = short if self._long is None else (self._long * n + short) / (n + 1)
        else:
            rate = self._ema if short <= self._long else self._ema * self.drift_fraction
            self._long += rate * (short - self._long)
        self._n_long += 1
        if short > 0 and self._long / short > 2.0:
            self._long *= 0.95
        self._long = min(self._long, self.target_s / self.rtt_tolerance)

    def _decide(self, in_flight, p_latency_s, frames, silent) -> str:
        if frames == 0:
            return self._no_frames(in_flight)
        L = self._limit
        if self._congested(p_latency_s, frames, silent):
            self._limit = self._clamp(L * (1.0 - self.smoothing * 0.5))
            return "decrease"
        if p_latency_s is None:          # only silent frames, within the tolerance: nothing to learn
            return "hold"
        short = p_latency_s
        if self._long is None or short <= self.rtt_tolerance * self._long:
            self._update_long(short)
        if short <= 0:
            gradient = 1.0
        else:
            gradient = min(1.0, max(0.5, self.rtt_tolerance * self._long / short))
        new = (1.0 - self.smoothing) * L + self.smoothing * (gradient * L + self.queue_size)
        if new > L and 2 * in_flight < L:
            new = L                       # app-limited: do not grow
        new = self._clamp(new)
        self._limit = new
        if new > L + 1e-12:
            return "increase"
        if new < L - 1e-12:
            return "decrease"
        return "hold"


# ---------------------------------------------------------------------------------------------------
# Factory
# ---------------------------------------------------------------------------------------------------
CONTROLLERS: dict[str, type[AdmissionController]] = {}

#: the ``--aimd-params`` help of every CLI (the flag keeps its name: tune-aimd's files are its first use)
PARAMS_HELP = ("the controller's parameters, a JSON file: what metronome-sim tune-aimd writes, or an object of "
               "any registered controller's parameters (each controller reads its own)")


def register(cls: type[AdmissionController]) -> type[AdmissionController]:
    """Make a controller class nameable from the CLIs (``--admission NAME``) and by :func:`make_controller`;
    its ``Params`` keys become valid in a parameter file."""
    CONTROLLERS[cls.spec.partition(":")[0]] = cls
    return cls


for _cls in (NoAdmission, StaticCap, AIMDController, GradientController):
    register(_cls)


def controller_specs() -> tuple[str, ...]:
    """How the CLIs write each registered controller (``none``, ``static:N``, ...): for help and errors."""
    return tuple(c.spec for c in CONTROLLERS.values())


CONTROLLER_SPECS = controller_specs()


def _parse_spec(spec: str) -> tuple[type[AdmissionController], str | None]:
    if not isinstance(spec, str):
        raise MetronomeError(f"admission controller spec must be a string, got {spec!r}")
    name, colon, arg = spec.strip().lower().partition(":")
    cls = CONTROLLERS.get(name.strip())
    if cls is None:
        raise MetronomeError(f"unknown admission controller {spec!r} (one of {', '.join(controller_specs())})")
    return cls, (arg if colon else None)


def check_params_apply(specs, given: bool) -> None:
    """Refuse ``--aimd-params`` when no controller of ``specs`` reads them (``none`` admits every session and
    decides nothing). A grid may mix ``none`` with controllers that do."""
    if given and not any(_parse_spec(str(s))[0].reads_params for s in specs):
        readers = ", ".join(c.spec for c in CONTROLLERS.values() if c.reads_params)
        raise MetronomeError(f"--aimd-params does not apply to --admission {', '.join(map(str, specs))} (it admits "
                             f"every session); pass --admission one of {readers}, or leave --aimd-params out")


def make_controller(spec: str, deadline_s: float,
                    params: ControllerParams | dict | None = None) -> AdmissionController:
    """Build a controller from a CLI spec (``none``, ``static:N``, ``aimd``, ``gradient`` or any registered one).

    ``params`` (a parameter file's object, or a ``Params`` instance) configures it: each controller takes
    the keys its own ``Params`` declares (``interval_s``, ``percentile``, ``on_refuse`` and
    ``queue_timeout_s`` apply to all). Bad specs and bad parameters raise :class:`MetronomeError` with one line.
    """
    cls, arg = _parse_spec(spec)
    if params is not None and not isinstance(params, (ControllerParams, dict)):
        raise MetronomeError(f"admission parameters must be a parameters object, got {type(params).__name__}")
    return cls.from_spec(arg, deadline_s, params)  # each Params.take checks a dict against every controller
