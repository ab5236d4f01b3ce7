"""Units on the command line: one reading of durations, rates, shares and sizes for every CLI.

A value may carry its unit (``80ms``, ``0.08s``, ``2min``; ``120/min``; ``1%``; ``512MiB``); a bare number is in the
flag's base unit (seconds, sessions per second, a fraction of 1, the size unit the flag names). A bare number that is
implausible for its flag (a deadline of 80 "seconds" on an 80 ms stream) is refused in one line that suggests the
unit, since the user most likely meant another one; a number written with its unit is taken as written.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from metronome.errors import MetronomeError

_NUMBER = re.compile(r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([^\d\s].*?)?\s*$")


class Quantity(float):
    """A value in its kind's base unit that remembers how it was written (``text``) and whether it was ``bare``
    (no unit): the plausibility checks look only at bare values."""

    bare: bool
    text: str

    def __new__(cls, value: float, bare: bool = True, text: str = ""):
        q = super().__new__(cls, value)
        q.bare = bare
        q.text = text or f"{value:g}"
        return q

    def __reduce__(self):  # (a what-if point travels to worker processes)
        return (Quantity, (float(self), self.bare, self.text))


@dataclass(frozen=True)
class Kind:
    """A kind of quantity: its ``name`` for messages, its ``base`` unit and the units it accepts (factor to base)."""

    name: str
    base: str
    units: dict

    @property
    def __name__(self) -> str:  # (messages name a parser by its kind)
        return self.name

    def parse(self, text: str, flag: str) -> Quantity:
        """``text`` as a :class:`Quantity` of this kind; one-line error naming ``flag`` if it cannot be read."""
        m = _NUMBER.match(str(text))
        if m is None:
            raise MetronomeError(f"{flag}: cannot read {text!r} as a {self.name} ({self.examples()})")
        number, unit = float(m.group(1)), (m.group(2) or "").strip()
        if unit and unit not in self.units:
            raise MetronomeError(f"{flag}: unknown unit {unit!r} in {text!r} (a {self.name} takes "
                                 f"{', '.join(u for u in self.units if u)}; a bare number is {self.base})")
        value = number * self.units[unit] if unit else number
        if not math.isfinite(value):
            raise MetronomeError(f"{flag}: must be finite, got {text!r}")
        return Quantity(value, bare=not unit, text=str(text).strip())

    def __call__(self, text: str, flag: str = "") -> Quantity:
        return self.parse(text, flag or "value")

    def examples(self) -> str:
        return {"duration": "e.g. 80ms, 0.08s or 2min; a bare number is seconds",
                "rate": "e.g. 2, 2/s or 120/min; a bare number is per second",
                "share": "e.g. 0.01 or 1%; a bare number is a fraction of 1"}.get(self.name,
                                                                                 f"a bare number is {self.base}")


DURATION = Kind("duration", "seconds", {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "min": 60.0,
                                        "h": 3600.0})
RATE = Kind("rate", "per second", {"/s": 1.0, "/min": 1 / 60, "/h": 1 / 3600})
SHARE = Kind("share", "a fraction of 1", {"%": 0.01})
_BYTES = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 1e3, "MB": 1e6, "GB": 1e9}


def size_kind(base: str) -> Kind:
    """Sizes whose bare number is in ``base`` (``B``, ``GiB``, ...): ``512MiB`` is read as ``0.5`` of ``GiB``."""
    return Kind("size", base, {u: f / _BYTES[base] for u, f in _BYTES.items()})


def duration(text: str, flag: str, *, bare_max: float | None = None, why: str = "") -> Quantity:
    """Seconds from ``80ms``, ``0.08s``, ``2min`` or a bare number; a bare number over ``bare_max`` is refused
    (``why`` says what the limit is)."""
    q = DURATION.parse(text, flag)
    if bare_max is not None:
        check_bare_duration(q, flag, bare_max, why)
    return q


def check_bare_duration(q: float, flag: str, limit: float, why: str) -> None:
    """Refuse a bare duration over ``limit`` seconds: the user most likely wrote milliseconds."""
    if getattr(q, "bare", False) and q > limit:
        raise MetronomeError(f"{flag} {q.text}: {q.text} seconds is over {why}; write the unit: "
                             f"{q.text}ms for milliseconds, or {q.text}s if you mean seconds")


def deadline_limit(frame_period_s: float) -> float:
    """The longest bare ``--deadline`` taken as seconds: ten frame periods (a later answer is no longer real time)."""
    return 10 * frame_period_s


PERIOD_BARE_MAX = 10.0  # seconds: the slowest real-time stream shipped sends a frame every 2 s


def check_deadline(q: float, frame_period_s: float, what: str, flag: str = "--deadline") -> None:
    """A bare deadline over ten frame periods of ``what`` (a calibration or model) is refused."""
    limit = deadline_limit(frame_period_s)
    check_bare_duration(q, flag, limit, f"10 frame periods of {what} ({limit:g} s; a frame every "
                                        f"{frame_period_s * 1e3:g} ms)")


def rate(text: str, flag: str) -> Quantity:
    """Sessions per second from ``2``, ``2/s``, ``120/min`` or ``7200/h``."""
    return RATE.parse(text, flag)


def share(text: str, flag: str, *, closed: bool = True, upper: float = 1.0) -> Quantity:
    """A fraction of 1 from ``0.01`` or ``1%``; a value past ``upper`` (or at it when not ``closed``) is refused,
    with the percent form suggested for a bare one."""
    q = SHARE.parse(text, flag)
    check_share(q, flag, closed=closed, upper=upper)
    return q


def check_share(q: float, flag: str, *, closed: bool = True, upper: float = 1.0, lower_open: bool = True) -> None:
    """A share in (0, upper] (``closed``) or (0, upper); a bare number past it most likely meant percent."""
    ok = (q > 0 if lower_open else q >= 0) and (q <= upper if closed else q < upper)
    if ok:
        return
    rng = f"{'(' if lower_open else '['}0, {upper:g}{']' if closed else ')'}"
    text = getattr(q, "text", f"{q:g}")
    hint = (f"; for {text} percent write {text}% or {float(q) / 100:g}"
            if getattr(q, "bare", False) and 1 <= q <= 100 else "")
    raise MetronomeError(f"{flag} must be in {rng}, got {text}{hint}")


def percentile(text: str, flag: str) -> Quantity:
    """A percentile in percent (``99``, ``99%``, ``99.9``); a bare number at or under 1 most likely meant a fraction
    (``0.99``) and is refused."""
    m = _NUMBER.match(str(text))
    unit = (m.group(2) or "").strip() if m else None
    if m is None or unit not in ("", "%"):
        raise MetronomeError(f"{flag}: cannot read {text!r} as a percentile in percent (e.g. 99 or 99.9)")
    v = float(m.group(1))
    if not 0 < v < 100:
        raise MetronomeError(f"{flag} must be in (0, 100) percent, got {text}")
    if not unit and v <= 1:
        raise MetronomeError(f"{flag} {text}: a percentile is in percent; write {v * 100:g} for p{v * 100:g}, or "
                             f"{text}% if you mean p{text}")
    return Quantity(v, bare=not unit, text=str(text).strip())


def size(text: str, flag: str, base: str = "B") -> Quantity:
    """A size from ``65536``, ``64KiB`` or ``1GiB``, in ``base`` units."""
    return size_kind(base).parse(text, flag)


def parse_list(kind, text: str, flag: str) -> list[Quantity]:
    """A comma list of one kind (``60ms,80ms``), each value read as :meth:`Kind.parse` reads it."""
    vals = [kind.parse(x, flag) if isinstance(kind, Kind) else kind(x, flag) for x in str(text).split(",")
            if x.strip()]
    if not vals:
        raise MetronomeError(f"{flag}: no values in {text!r}")
    return vals


def seconds_spec(text: str, flag: str) -> str:
    """A session-length spec (``SECONDS``, ``exp:MEAN``, ``lognormal:MEAN:SIGMA``, ``list:A,B``) with each duration
    written in a unit (``5min``, ``exp:90s``) turned into seconds, so the spec's own reader sees numbers; a field
    without a unit (a bare number, or ``lognormal``'s SIGMA) stays as written."""
    def one(field: str) -> str:
        m = _NUMBER.match(field)
        if m is None or not (m.group(2) or "").strip():
            return field
        return f"{DURATION.parse(field, flag):.12g}"

    parts = str(text).split(":")
    head = parts[0] if parts and not _NUMBER.match(parts[0]) else None
    fields = parts[1:] if head is not None else parts
    if head == "lognormal" and len(fields) == 2:
        fields = [one(fields[0]), fields[1]]  # SIGMA is a shape, not a time
    else:
        fields = [",".join(one(x) for x in f.split(",")) for f in fields]
    return ":".join(([head] if head is not None else []) + fields)


def argtype(parse, flag: str, **kw):
    """``parse`` as an argparse ``type`` for ``flag`` (its errors stay one-line :class:`MetronomeError`)."""
    def read(text: str):
        return parse(text, flag, **kw)

    read.__name__ = getattr(parse, "__name__", "value")
    return read
