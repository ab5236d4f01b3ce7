"""Workload: when sessions arrive and how long they last. Pure and seeded (a numpy Generator is passed in).

Durations are ``fixed``, ``exponential``, ``lognormal`` or a ``list`` of seconds to draw from; each
gives samples and its survival function ``P(D > t)`` (the fill model needs the latter).
Arrivals are ``all`` at t=0, a linear ``ramp`` over a number of seconds, ``poisson`` at a rate, or a
``pattern`` of Poisson rates (``SECONDS:RATE,...``, or a ``time,rate`` CSV such as a day in 15-minute buckets).
:func:`draw` is the one place a run's sessions are drawn: the simulator (``metronome.sim.scenario.workload``)
and a live run (``metronome.probe.live_run.make_plans``) both call it, so one seed gives the same sessions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy import stats

from metronome import serving
from metronome.errors import MetronomeError

DURATION_KINDS = ("fixed", "exponential", "lognormal", "list")
ARRIVAL_KINDS = ("all", "ramp", "poisson", "pattern")


@dataclass(frozen=True)
class Durations:
    """Session duration distribution, in seconds. ``mean_s`` is the mean for every kind;
    ``sigma`` is the lognormal shape; ``values_s`` are the empirical durations of ``list``."""

    kind: str
    mean_s: float = math.inf
    sigma: float = 1.0
    values_s: tuple[float, ...] = field(default=())

    def __post_init__(self):
        if self.kind not in DURATION_KINDS:
            raise MetronomeError(f"unknown duration kind {self.kind!r} (one of {', '.join(DURATION_KINDS)})")
        if self.kind == "list":
            if not self.values_s or any(not (v > 0) for v in self.values_s):
                raise MetronomeError("a duration list needs one or more positive values")
            object.__setattr__(self, "mean_s", float(np.mean(self.values_s)))
        elif not (self.mean_s > 0):
            raise MetronomeError(f"session duration must be positive, got {self.mean_s}")
        if self.kind == "lognormal" and not (self.sigma > 0):
            raise MetronomeError(f"lognormal sigma must be positive, got {self.sigma}")

    @classmethod
    def parse(cls, spec: str) -> "Durations":
        """``600`` or ``fixed:600``, ``exp:600``, ``lognormal:600:0.8`` (mean, sigma), ``list:60,120,600``."""
        s = spec.strip()
        try:
            if ":" not in s:
                return cls("fixed", float(s))
            kind, _, rest = s.partition(":")
            kind = {"exp": "exponential", "exponential": "exponential", "fixed": "fixed",
                    "lognormal": "lognormal", "list": "list"}.get(kind)
            if kind == "list":
                return cls("list", values_s=tuple(float(x) for x in rest.split(",") if x.strip()))
            if kind == "lognormal":
                mean, _, sigma = rest.partition(":")
                return cls("lognormal", float(mean), float(sigma or 1.0))
            if kind is None:
                raise ValueError
            return cls(kind, float(rest))
        except ValueError:
            raise MetronomeError(
                f"cannot parse session duration {spec!r} (use SECONDS, exp:MEAN, lognormal:MEAN:SIGMA or list:A,B,...)"
            ) from None

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"{self.mean_s:g} s"
        if self.kind == "exponential":
            return f"exp(mean {self.mean_s:g} s)"
        if self.kind == "lognormal":
            return f"lognormal(mean {self.mean_s:g} s, sigma {self.sigma:g})"
        return f"list({len(self.values_s)} values, mean {self.mean_s:g} s)"

    def _lognorm(self):
        mu = math.log(self.mean_s) - self.sigma**2 / 2
        return stats.lognorm(s=self.sigma, scale=math.exp(mu))

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, self.mean_s)
        if self.kind == "exponential":
            return rng.exponential(self.mean_s, n)
        if self.kind == "lognormal":
            mu = math.log(self.mean_s) - self.sigma**2 / 2
            return rng.lognormal(mu, self.sigma, n)
        return rng.choice(np.asarray(self.values_s, dtype=float), n)

    def survival(self, t):
        """P(D > t), vectorised."""
        t = np.asarray(t, dtype=float)
        if self.kind == "fixed":
            return (t < self.mean_s).astype(float)
        if self.kind == "exponential":
            return np.exp(-np.maximum(t, 0) / self.mean_s)
        if self.kind == "lognormal":
            return self._lognorm().sf(t)
        v = np.sort(np.asarray(self.values_s, dtype=float))
        return 1.0 - np.searchsorted(v, t, side="right") / len(v)


@dataclass(frozen=True)
class Arrivals:
    """``all``: ``sessions`` at t=0; ``ramp``: ``sessions`` evenly over ``ramp_s``;
    ``poisson``: rate ``rate_per_s`` until the horizon; ``pattern``: Poisson with a piecewise-constant
    rate, ``segments`` of ``(seconds, rate_per_s)`` one after the other (rate 0 after the last)."""

    kind: str
    sessions: int = 0
    rate_per_s: float = 0.0
    ramp_s: float = 0.0
    segments: tuple[tuple[float, float], ...] = ()

    def __post_init__(self):
        if self.kind not in ARRIVAL_KINDS:
            raise MetronomeError(f"unknown arrival kind {self.kind!r} (one of {', '.join(ARRIVAL_KINDS)})")
        if self.kind in ("all", "ramp") and self.sessions <= 0:
            raise MetronomeError(f"--sessions must be a positive integer, got {self.sessions}")
        if self.kind == "ramp" and not (self.ramp_s > 0):
            raise MetronomeError(f"--ramp must be positive seconds, got {self.ramp_s}")
        if self.kind == "poisson" and not (self.rate_per_s > 0 and math.isfinite(self.rate_per_s)):
            raise MetronomeError(f"--arrival-rate must be a positive number of sessions/s, got {self.rate_per_s}")
        if self.kind == "pattern":
            if not self.segments:
                raise MetronomeError("a rate pattern needs at least one SECONDS:RATE segment")
            for d, r in self.segments:
                check_segment(d, r, f"rate pattern segment {d:g}:{r:g}")

    @classmethod
    def parse_pattern(cls, spec: str) -> "Arrivals":
        """``SECONDS:RATE,SECONDS:RATE,...`` (e.g. ``120:0.5,120:2,120:0.5``), or a file holding that text,
        one segment per line, or a JSON list of ``[seconds, rate]`` pairs."""
        text, origin = spec, "--rate-pattern"
        p = Path(spec)
        if ":" not in spec or p.is_file():
            try:
                text, origin = p.read_text(), str(p)
            except OSError:
                raise MetronomeError(f"{spec}: no such rate pattern file") from None
        try:
            if text.lstrip().startswith("["):
                import json

                pairs = [(float(d), float(r)) for d, r in json.loads(text)]
            else:
                items = [x.strip() for x in text.replace("\n", ",").split(",") if x.strip() and not x.strip().startswith("#")]
                pairs = [(float(a), float(b)) for a, b in (x.split(":") for x in items)]
        except (ValueError, TypeError):
            raise MetronomeError(f"{origin}: cannot parse the rate pattern (want SECONDS:RATE,... or [[seconds, rate], ...])") from None
        return cls("pattern", segments=tuple(pairs))

    @classmethod
    def from_csv(cls, path: str | Path) -> "Arrivals":
        """A ``pattern`` from a CSV of ``time,rate`` rows: the offered rate in sessions per second from each
        row's time on, e.g. a day in 15-minute buckets. A time is seconds from the start or a clock time
        ``HH:MM`` (``HH:MM:SS``); an optional ``time,rate`` header, blank lines and ``#`` comments are skipped.

        The rows must start at 0 (``00:00``) and be evenly spaced, so that a missing row (a gap), a repeated
        or an out-of-order time is an error and not a silently stretched bucket; each row lasts that spacing,
        the last one too. Every row's rate is checked as a pattern segment's (:func:`check_segment`)."""
        p = Path(path)
        try:
            lines = p.read_text().splitlines()
        except (OSError, UnicodeDecodeError):
            raise MetronomeError(f"{p}: no such load CSV file (or not a text file)") from None
        rows: list[tuple[int, float, float]] = []  # (line number, time s, rate)
        for no, line in enumerate(lines, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            fields = [f.strip() for f in text.split(",")]
            if len(fields) != 2:
                raise MetronomeError(f"{p} line {no}: want TIME,RATE, got {line.strip()!r}")
            if not rows and fields[0].lower() == "time":
                continue  # the header
            t = _clock_seconds(fields[0])
            if t is None:
                raise MetronomeError(f"{p} line {no}: cannot read {fields[0]!r} as a time (seconds or HH:MM)")
            try:
                r = float(fields[1])
            except ValueError:
                raise MetronomeError(f"{p} line {no}: cannot read {fields[1]!r} as a rate (sessions/s)") from None
            rows.append((no, t, r))
        if len(rows) < 2:
            raise MetronomeError(f"{p}: a load CSV needs two or more time,rate rows (their spacing is each "
                                 f"row's length), got {len(rows)}")
        if rows[0][1] != 0:
            raise MetronomeError(f"{p} line {rows[0][0]}: the first row must be at time 0 (00:00), got "
                                 f"{rows[0][1]:g} s")
        step = rows[1][1] - rows[0][1]
        segments = []
        for k, (no, t, r) in enumerate(rows):
            if k:
                prev = rows[k - 1][1]
                if t == prev:
                    raise MetronomeError(f"{p} line {no}: time {t:g} s repeats the row before")
                if t < prev:
                    raise MetronomeError(f"{p} line {no}: time {t:g} s comes before the row before ({prev:g} s); "
                                         "rows must be in time order")
                if abs((t - prev) - step) > 1e-9 * max(1.0, step):
                    raise MetronomeError(f"{p} line {no}: time {t:g} s is {t - prev:g} s after the row before, "
                                         f"but rows are {step:g} s apart (a gap, or uneven rows)")
            check_segment(step, r, f"{p} line {no}")
            segments.append((step, r))
        return cls("pattern", segments=tuple(segments))

    @classmethod
    def parse_offered(cls, spec: str) -> "Arrivals":
        """An offered load as a user writes it: a rate in sessions per second (``4.5``), a load CSV (a ``.csv``
        file, :meth:`from_csv`) or a rate pattern (:meth:`parse_pattern`: ``SECONDS:RATE,...`` or a file of it)."""
        text = str(spec).strip()
        try:
            rate = float(text)
        except ValueError:
            rate = None
        if rate is not None:
            if not (rate > 0 and math.isfinite(rate)):
                raise MetronomeError(f"an offered load of {text} sessions/s: the rate must be a positive number")
            return cls("poisson", rate_per_s=rate)
        if text.lower().endswith(".csv"):
            return cls.from_csv(text)
        return cls.parse_pattern(text)

    @property
    def peak_rate_per_s(self) -> float | None:
        """The highest offered arrival rate (sessions/s) of a ``poisson`` or ``pattern`` workload (else None)."""
        if self.kind == "poisson":
            return self.rate_per_s
        if self.kind == "pattern":
            return max(r for _, r in self.segments)
        return None

    @property
    def pattern_s(self) -> float | None:
        """The length of a ``pattern`` (the sum of its segments; the rate is 0 after it), else None."""
        return float(sum(d for d, _ in self.segments)) if self.kind == "pattern" else None

    def rate_at(self, t_s: float) -> float:
        """The offered arrival rate at time ``t_s`` (sessions per second)."""
        if self.kind == "poisson":
            return self.rate_per_s
        if self.kind == "pattern":
            start = 0.0
            for d, r in self.segments:
                if t_s < start + d:
                    return r
                start += d
        return 0.0

    def times(self, rng: np.random.Generator, horizon_s: float) -> np.ndarray:
        if self.kind == "all":
            return np.zeros(self.sessions)
        if self.kind == "ramp":
            return np.linspace(0.0, self.ramp_s, self.sessions, endpoint=False)
        if self.kind == "pattern":
            out, start = [], 0.0
            for d, r in self.segments:
                end = min(start + d, horizon_s)
                if end > start and r > 0:
                    out.append(np.sort(rng.uniform(start, end, rng.poisson(r * (end - start)))))
                start += d
            return np.concatenate(out) if out else np.zeros(0)
        # Poisson: draw the count, then uniform order statistics (no loop, deterministic per seed)
        n = rng.poisson(self.rate_per_s * horizon_s)
        return np.sort(rng.uniform(0.0, horizon_s, n))

    def describe(self) -> str:
        if self.kind == "all":
            return f"{self.sessions} sessions at t=0"
        if self.kind == "ramp":
            return f"{self.sessions} sessions ramped over {self.ramp_s:g} s"
        if self.kind == "pattern":
            if len(self.segments) > 6:  # a day in buckets: the shape, not 96 items
                return (f"Poisson arrivals, rate pattern of {len(self.segments)} segments over {self.pattern_s:g} s, "
                        f"peak {self.peak_rate_per_s:g}/s")
            return "Poisson arrivals, rate pattern " + ", ".join(f"{d:g} s at {r:g}/s" for d, r in self.segments)
        return f"Poisson arrivals at {self.rate_per_s:g}/s"


def check_segment(seconds: float, rate: float, where: str) -> None:
    """The one check of a piece of offered load (a rate pattern's segment, a load CSV's row): a length of
    seconds > 0 and a rate >= 0, both finite. ``where`` names the piece in the one-line error."""
    if not (rate >= 0 and math.isfinite(rate)):
        raise MetronomeError(f"{where}: the rate must be a finite number of sessions/s >= 0, got {rate:g}")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise MetronomeError(f"{where}: the length must be a finite number of seconds > 0, got {seconds:g}")


def _clock_seconds(text: str) -> float | None:
    """Seconds from ``SECONDS``, ``HH:MM`` or ``HH:MM:SS`` (None if it is neither)."""
    parts = text.split(":")
    try:
        if len(parts) == 1:
            v = float(text)
            return v if math.isfinite(v) else None
        if len(parts) in (2, 3) and all(x.strip().isdigit() for x in parts):
            h, m, s = (int(x) for x in parts + ["0"] * (3 - len(parts)))
            return float(3600 * h + 60 * m + s) if m < 60 and s < 60 else None
    except ValueError:
        pass
    return None


def draw(arrivals: Arrivals, durations: Durations | None, horizon_s: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A run's sessions: arrival times (s from the run's start) and durations (s; ``inf`` without
    ``durations``: they last until the horizon), drawn from one generator seeded with ``seed``, arrivals
    first, then durations. Every run draws its workload here (simulated and live), so the same arrivals,
    durations, horizon and seed give the same sessions in both."""
    rng = np.random.default_rng(seed)
    arrival = np.asarray(arrivals.times(rng, horizon_s), dtype=float)
    if durations is None:
        return arrival, np.full(arrival.size, math.inf)
    return arrival, np.asarray(durations.sample(rng, arrival.size), dtype=float)


def draw_phases(n: int, phases: str, seed: int) -> np.ndarray:
    """Each session's phase slot (``serving.PHASE_SLOTS`` per period): all 0 when ``aligned``; uniform and
    seeded when ``independent``, from a generator of its own so that a run's arrivals and durations do not
    depend on the regime."""
    serving.check_phases(phases)
    if phases == "aligned" or n == 0:
        return np.zeros(n, dtype=np.int64)
    rng = np.random.default_rng([int(seed), 0x9E3779B9])
    return rng.integers(0, serving.PHASE_SLOTS, n).astype(np.int64)
