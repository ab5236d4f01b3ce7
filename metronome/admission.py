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

import copy
import json
import math
import sys
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from metronome import compiled
# (a module object: the kernel's dispatch reaches this module's rules, so the two may import each other in either
# order; nothing of the kernel is read here at import)
from metronome import control_kernel as ck
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
    "aimd_decide",
    "gradient_decide",
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
# the same, as compiled code writes them (DECISIONS' index)
D_INCREASE, D_DECREASE, D_DRAINING, D_HOLD, D_DEAD = range(5)
ON_REFUSE = ("reject", "queue")
# a controller's kind (AdmissionController.kind): which compiled decision control_kernel.decide runs at an
# interval's end; K_PYTHON: the class's own _decide, in Python
K_PYTHON, K_NONE, K_STATIC, K_AIMD, K_GRADIENT = range(5)


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

    The interval machinery is stated once in :mod:`metronome.control_kernel`, over the arrays this object holds
    (:attr:`arrays`, a :class:`~metronome.control_kernel.ControllerArrays`), and the decision of each controller
    shipped here is compiled beside its class (:func:`aimd_decide`, :func:`gradient_decide`), so the simulator's
    compiled loop runs the same code. A class whose ``kind`` is ``K_PYTHON`` (any controller a user registers)
    decides in Python, in its own :meth:`_decide`, at each interval's end.
    """

    name: str = "controller"
    spec: str = "controller"
    Params: type[ControllerParams] = ControllerParams
    #: whether a parameter file can change anything it does (``none`` admits everything whatever the file says)
    reads_params: bool = True
    #: which compiled decision this class's is (K_*); K_PYTHON: its own :meth:`_decide`
    kind: int = K_PYTHON

    def __init__(self, interval_s: float = 1.0, percentile: float = 99.0,
                 on_refuse: str = "reject", queue_timeout_s: float = 30.0):
        ControllerParams(interval_s=interval_s, percentile=percentile, on_refuse=on_refuse,
                         queue_timeout_s=queue_timeout_s)  # the one check of what every controller reads
        self.interval_s = float(interval_s)
        self.percentile = float(percentile)
        self.on_refuse = on_refuse
        self.queue_timeout_s = float(queue_timeout_s)
        #: the state, constants, open interval and trace the kernel reads and writes (replaced as they grow)
        self.arrays = ck.new_arrays(self.kind, self.interval_s, self.percentile)

    @property
    def compiled(self) -> bool:
        """Its decision is compiled: a compiled loop can run it (control_kernel)."""
        return self.kind != K_PYTHON

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
        return bool(self.arrays.cs[0]["dead"])

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
        self._room(now_s, 1)
        if self.compiled:
            ck.observe(self.arrays, now_s, float(latency_s), float(frames), float(silent))
            return
        self._close_through(now_s, self.arrays.cs[0]["last"])
        ck.take_frames(self.arrays, float(latency_s), float(frames), float(silent))

    def observe_many(self, now_s, latency_s, frames, silent, in_flight) -> None:
        """``advance(now_s[i], in_flight[i])`` then ``observe(now_s[i], latency_s[i], frames[i], silent[i])`` for
        each row in order, with the same result (the simulator hands over thousands of rows at once). Rows must
        be in time order; ``in_flight`` is one count for every row or one per row."""
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
        if self.compiled:
            self._room(float(now[0]), n, float(now[-1]))
            # (contiguous int64 counts, as the simulator's compiled loop hands them over: one compiled form)
            ck.observe_rows(self.arrays, now, lat, fr, si, np.ascontiguousarray(inf))
            return
        for t, lt, f, s, k in zip(now.tolist(), lat.tolist(), fr.tolist(), si.tolist(), inf.tolist()):
            self.advance(t, k)
            self.observe(t, lt, f, s)

    def advance(self, now_s: float, in_flight: int) -> None:
        """Close every control interval that ended at or before ``now_s`` (one decision each)."""
        now_s, in_flight = self._checked(now_s, in_flight)
        if self.compiled:
            ck.advance(self.arrays, now_s, float(in_flight))
            return
        s = self.arrays.cs[0]  # (a view: writing a field writes the array)
        s["last"] = in_flight
        self._close_through(now_s, in_flight)
        s["peak"] = max(s["peak"], in_flight)

    def may_admit(self, now_s: float, in_flight: int) -> bool:
        """Advance to ``now_s``, then: may one more session start with ``in_flight`` running?"""
        if self.compiled:
            now_s, in_flight = self._checked(now_s, in_flight)
            return bool(ck.may_admit(self.arrays, now_s, float(in_flight)))
        self.advance(now_s, in_flight)
        return (not self.dead) and int(in_flight) < self.limit

    def compile_now(self) -> None:
        """Compile what this controller's live calls run (:meth:`advance`, :meth:`observe`, :meth:`may_admit`) now,
        on a copy of it: a live driver calls it before its clock starts. On an empty numba cache the compiled
        controllers take tens of seconds to compile; inside a live turn that would stop the frame clock, and the
        engine would look silent to the supervisor. A controller that decides in Python has nothing of its own to
        compile and is not run (its :meth:`_decide` is the user's code)."""
        if not self.compiled:
            return
        c = copy.deepcopy(self)
        for k in range(3):  # intervals open, close, are decided and recorded, with a frame observed in each
            t = k * float(self.interval_s)
            c.advance(t, 1)
            c.observe(t, 0.001, frames=1, silent=0)
            c.may_admit(t, 1)

    def trace(self) -> list[dict]:
        """One dict per closed interval, oldest first.

        Keys: ``t_s`` (the interval's end), ``limit`` (after the decision), ``in_flight`` (the peak
        reported in the interval), ``p_latency_s`` (the weighted percentile of non-silent latencies,
        ``None`` without any), ``frames``, ``silent`` and ``decision`` (one of :data:`DECISIONS`).
        """
        rows = self.arrays.tr[:int(self.arrays.cs[0]["n_trace"])].tolist()
        return [{"t_s": t, "limit": sys.maxsize if math.isinf(lim) else int(lim), "in_flight": int(peak),
                 "p_latency_s": None if math.isnan(p) else p, "frames": int(f), "silent": int(s),
                 "decision": DECISIONS[int(d)]} for t, lim, peak, p, f, s, d in rows]

    def take_trace(self) -> list[dict]:
        """The rows of :meth:`trace` closed so far, then forget them: a driver that runs for days (a fleet of
        engines over a simulated day, one row per engine per second) keeps its memory flat by taking the
        trace as it goes. A later :meth:`trace` or ``take_trace`` starts after the rows taken."""
        rows = self.trace()
        self.arrays.cs[0]["n_trace"] = 0
        return rows

    def room(self, now_s: float, until_s: float, samples: int) -> None:
        """Make room for the intervals that close by ``until_s`` and ``samples`` more latency samples: what a
        compiled loop that runs this controller from ``now_s`` until then may write."""
        self._room(now_s, samples, until_s)

    # -- machinery -------------------------------------------------------------------------------------
    def _room(self, now_s: float, samples: int, until_s: float | None = None) -> None:
        """Room in ``tr`` for the intervals closed by calls from ``now_s`` to ``until_s`` (a grid not yet
        anchored is anchored at ``now_s`` or later), and in ``lat``/``w`` for ``samples`` more."""
        a = self.arrays
        s = a.cs[0]
        until_s = now_s if until_s is None else max(until_s, now_s)
        if math.isnan(s["t0"]):
            due = 0 if until_s == now_s else math.ceil((until_s - now_s) / self.interval_s) + 1
        else:
            due = int(ck.intervals_due(a, until_s))
        need = int(s["n_trace"]) + due
        if need > a.tr.shape[0]:
            a = a._replace(tr=np.concatenate([a.tr, np.zeros(max(need, 2 * a.tr.shape[0]) - a.tr.shape[0], ck.TRACE)]))
        n = int(s["n_lat"]) + samples
        if n > a.lat.size:
            grow = max(n, 2 * a.lat.size) - a.lat.size
            a = a._replace(lat=np.concatenate([a.lat, np.zeros(grow)]), w=np.concatenate([a.w, np.zeros(grow)]))
        self.arrays = a

    def _checked(self, now_s, in_flight) -> tuple[float, int]:
        """A call's time and in-flight count, checked, with room for the intervals it closes."""
        now_s, in_flight = self._check_time(now_s), self._check_in_flight(in_flight)
        self._room(now_s, 0)
        return now_s, in_flight

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

    def _close_through(self, now_s: float, in_flight: float) -> None:
        """A controller deciding in Python: control_kernel.close_through's steps, with its own decision."""
        a = self.arrays
        if math.isnan(a.cs[0]["t0"]):
            a.cs[0]["t0"] = now_s
            return
        for _ in range(int(ck.intervals_due(a, now_s))):
            end, peak, p, frames, silent = ck.close_one(a, float(in_flight))
            decision = self._decide(int(peak), None if math.isnan(p) else float(p), int(frames), int(silent))
            if decision not in DECISIONS:  # every decision a trace records is one of the named ones
                raise RuntimeError(f"{type(self).__name__} decided {decision!r}, not one of {DECISIONS}")
            ck.record(a, end, float(self.limit), peak, p, frames, silent, DECISIONS.index(decision))
            ck.next_interval(a, float(in_flight))

    def _decide(self, in_flight: int, p_latency_s: float | None, frames: int, silent: int) -> str:
        """Judge one closed interval; may change the limit; returns one of :data:`DECISIONS`. A controller deciding
        in Python (``kind`` K_PYTHON) states it; a compiled kind's is compiled beside its class (control_kernel.decide
        runs it), never called here."""
        raise NotImplementedError(f"{type(self).__name__} decides in Python (kind K_PYTHON) but states no _decide")


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
    kind = K_NONE

    @property
    def limit(self) -> int:
        return sys.maxsize


class StaticCap(AdmissionController):
    """Admit while ``in_flight < n``: a fixed cap, e.g. from the fill model's memory ceiling."""

    spec = "static:N"
    kind = K_STATIC

    def __init__(self, n: int, interval_s: float = 1.0, percentile: float = 99.0,
                 on_refuse: str = "reject", queue_timeout_s: float = 30.0):
        if not _is_int(n):
            raise MetronomeError(f"static admission limit must be an integer, got {n!r}")
        if n < 1:
            raise MetronomeError(f"static admission limit must be >= 1, got {n}")
        super().__init__(interval_s, percentile, on_refuse, queue_timeout_s)
        self._n = int(n)
        self.arrays.cp[0]["static_limit"] = self._n
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
        c = self.arrays.cp[0]  # (a view: writing a field writes the array)
        c["target_s"], c["additive_increase"] = self.target_s, params.additive_increase
        c["decrease_factor"] = params.decrease_factor
        c["min_limit"], c["max_limit"] = float(params.min_limit), float(params.max_limit)
        c["silent_tolerance"], c["dead_intervals"] = params.silent_tolerance, params.dead_intervals
        self.arrays.cs[0]["limit"] = float(params.start_limit)

    @classmethod
    def from_spec(cls, arg, deadline_s, params):
        cls._no_argument(arg)
        return cls(params, deadline_s)

    @property
    def limit(self) -> int:
        return int(ck.limit_of(self.arrays))


# The adaptive controllers' shared rules, compiled (``s``/``c``: the controller's state and constants records,
# control_kernel.STATE and PARAMS), as the class above explains them.
@compiled.counted
def adaptive_no_frames(s, c, in_flight):
    """An interval without a single frame: with sessions in flight it counts toward a dead signal
    (``dead_intervals`` in a row refuse everything); with none, it clears it (cold start must admit)."""
    if in_flight > 0:
        s.dead_run += 1
        if s.dead_run >= c.dead_intervals:
            s.dead = 1.0
    else:
        s.dead_run = 0.0
        s.dead = 0.0
    return D_DEAD if s.dead != 0.0 else D_HOLD


@compiled.counted
def adaptive_congested(c, p, frames, silent):
    """Absolute congestion: too many silent frames, or the latency percentile over the target."""
    if silent / frames > c.silent_tolerance:
        return True
    return not np.isnan(p) and p > c.target_s


@compiled.counted
def adaptive_clamp(c, x):
    """``x`` within ``[min_limit, max_limit]``."""
    return min(c.max_limit, max(c.min_limit, x))


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
    kind = K_AIMD

    def __init__(self, params: AIMDParams | dict | None = None, deadline_s: float = 1.0):
        super().__init__(params, deadline_s)


@compiled.counted
def aimd_decide(s, c, in_flight, p, frames, silent):
    """:class:`AIMDController`'s decision on one closed interval (its peak ``in_flight``, percentile ``p`` (NaN:
    none), frames, silent frames), compiled: may change ``s.limit``; returns a ``D_*`` decision."""
    if frames == 0:
        return adaptive_no_frames(s, c, in_flight)
    L = s.limit
    if adaptive_congested(c, p, frames, silent):
        if in_flight > math.floor(L + 1e-9):
            return D_DRAINING  # the last cut has not taken effect yet
        cut = min(math.floor(L * c.decrease_factor + 1e-9), math.floor(L + 1e-9) - 1)
        s.limit = adaptive_clamp(c, float(cut))
        return D_DECREASE
    if not np.isnan(p) and 2 * in_flight >= L:
        s.limit = adaptive_clamp(c, L + c.additive_increase)
        return D_INCREASE
    return D_HOLD


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
    kind = K_GRADIENT

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
        c = self.arrays.cp[0]  # (a view: writing a field writes the array)
        c["smoothing"], c["rtt_tolerance"], c["queue_size"] = self.smoothing, self.rtt_tolerance, self.queue_size
        c["ema"] = 2.0 / (self.long_window + 1)
        c["warmup"], c["drift_fraction"] = self.warmup, self.drift_fraction

    @property
    def long_latency_s(self) -> float | None:
        """The baseline (long) latency, ``None`` before the first healthy interval."""
        long = float(self.arrays.cs[0]["long"])
        return None if math.isnan(long) else long


@compiled.counted
def gradient_update_long(s, c, short):
    """:class:`GradientController`'s baseline: a plain mean over the warm-up, then an EMA that follows a rise
    ``drift_fraction`` times as fast as a fall; Netflix's recovery rule; never past target / tolerance."""
    if np.isnan(s.long) or s.n_long < c.warmup:
        n = s.n_long
        s.long = short if np.isnan(s.long) else (s.long * n + short) / (n + 1)
    else:
        rate = c.ema if short <= s.long else c.ema * c.drift_fraction
        s.long += rate * (short - s.long)
    s.n_long += 1
    if short > 0 and s.long / short > 2.0:
        s.long *= 0.95
    s.long = min(s.long, c.target_s / c.rtt_tolerance)


@compiled.counted
def gradient_decide(s, c, in_flight, p, frames, silent):
    """:class:`GradientController`'s decision on one closed interval (as :func:`aimd_decide`'s), compiled."""
    if frames == 0:
        return adaptive_no_frames(s, c, in_flight)
    L = s.limit
    smoothing = c.smoothing
    if adaptive_congested(c, p, frames, silent):
        s.limit = adaptive_clamp(c, L * (1.0 - smoothing * 0.5))
        return D_DECREASE
    if np.isnan(p):  # only silent frames, within the tolerance: nothing to learn
        return D_HOLD
    short = p
    if np.isnan(s.long) or short <= c.rtt_tolerance * s.long:
        gradient_update_long(s, c, short)
    if short <= 0:
        gradient = 1.0
    else:
        gradient = min(1.0, max(0.5, c.rtt_tolerance * s.long / short))
    new = (1.0 - smoothing) * L + smoothing * (gradient * L + c.queue_size)
    if new > L and 2 * in_flight < L:
        new = L  # app-limited: do not grow
    new = adaptive_clamp(c, new)
    s.limit = new
    if new > L + 1e-12:
        return D_INCREASE
    if new < L - 1e-12:
        return D_DECREASE
    return D_HOLD


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


def check_params_apply(specs, given: bool, flag: str = "--aimd-params") -> None:
    """Refuse ``flag`` (``--aimd-params``, or an option that only shapes a controller's decisions, like a server's
    ``--queue-timeout``) when no controller of ``specs`` reads parameters (``none`` admits every session and
    decides nothing). A grid may mix ``none`` with controllers that do."""
    if given and not any(_parse_spec(str(s))[0].reads_params for s in specs):
        readers = ", ".join(c.spec for c in CONTROLLERS.values() if c.reads_params)
        raise MetronomeError(f"{flag} does not apply to --admission {', '.join(map(str, specs))} (it admits "
                             f"every session); pass --admission one of {readers}, or leave {flag} out")


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
