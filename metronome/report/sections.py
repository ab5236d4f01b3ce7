"""The report as typed sections: what :mod:`metronome.report.build` assembles, field by field.

The builder fills these from the phases' typed results; :meth:`Report.to_dict` is the one place they become the
plain, JSON-ready dict that report.json holds and both renderers read (the field order here is the key order there,
so the file stays as it was). A calibration's section is written as one flat object on disk; in memory it is three
groups (what was planned, the answer, the sections that show it), so no record here takes more than a dozen fields.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class FillCurve:
    """One pool-fill curve: the fill model's line beside the simulated points, and t_sat both ways."""

    policy: str  # "unbounded" or "bounded"
    label: str
    sessions: int
    t_line_s: list[float]
    occupancy_predicted: list[float]
    t_sim_s: list[float]
    occupancy_simulated: list[float]
    t_sat_predicted_s: float | None
    t_sat_observed_s: float | None
    collapsed: bool


@dataclass(frozen=True)
class Fill:
    horizon_s: float
    curves: list[FillCurve]


# the summary figures the signal section plots against N, in the order report.json lists them
SIGNAL_FIGURES = ("p50_frame_latency_s", "p99_frame_latency_s", "silent_frame_fraction", "deadline_miss_fraction",
                  "collapsed", "t_sat_observed_s")


@dataclass
class SignalSeries:
    """Latency and silence against N under one policy, a list entry per N (ascending)."""

    label: str
    sessions: list[int] = field(default_factory=list)
    p50_frame_latency_s: list = field(default_factory=list)
    p99_frame_latency_s: list = field(default_factory=list)
    silent_frame_fraction: list = field(default_factory=list)
    deadline_miss_fraction: list = field(default_factory=list)
    collapsed: list = field(default_factory=list)
    t_sat_observed_s: list = field(default_factory=list)

    def add(self, sessions: int, summary: dict) -> None:
        """The run at ``sessions`` (its simulation summary)."""
        self.sessions.append(sessions)
        for k in SIGNAL_FIGURES:
            getattr(self, k).append(summary[k])


@dataclass(frozen=True)
class MetastabilityPolicy:
    """One policy's metastability grid, a row per mean duration and a column per N."""

    label: str
    predicted: list[list[float]]  # the fill model's P(collapse)
    predicted_saturation: list[list[float]]
    simulated_collapse: list[list[float]]  # the Monte Carlo fractions
    simulated_saturation: list[list[float]]
    runs: list[list[int]]
    collapse_interval: list[list[list[float]]]  # Wilson interval of the collapsed fraction


@dataclass(frozen=True)
class Metastability:
    sessions: list[int]
    mean_duration_s: list[float]
    runs_per_cell: int
    edge_runs: int
    n_star: int
    past_n_star: list[bool]  # a column past the deadline-bound N*: compute-overloaded whatever the pool does
    horizon_factor: float
    policies: dict[str, MetastabilityPolicy]


@dataclass(frozen=True)
class AdmissionPolicy:
    label: str
    trace: dict  # the controller trace in buckets (build._bucket_trace)
    summary: dict


@dataclass(frozen=True)
class Admission:
    pattern: list[list[float]]  # (seconds, sessions/s) steps of the offered rate
    mean_duration_s: float
    policies: dict[str, AdmissionPolicy]


@dataclass(frozen=True)
class TuningSection:
    """The recommended admission: the tuned AIMD setting (None: the static limit, ``error`` says why)."""

    params: dict | None
    figures: dict | None
    grid: dict
    miss_budget: float
    seeds: list[int]
    offered_rate_per_s: float
    overload: float
    horizon_s: float
    error: str | None
    table: list[dict]
    offered_is_overload: bool


@dataclass(frozen=True)
class Planned:
    """What a calibration's report assumed: the calibration, the workload and the bound."""

    name: str
    spec: str
    model: str
    hardware: str
    provenance: dict
    stream: dict
    pool: dict
    deadline_s: float
    session_duration: str
    session_duration_mean_s: float
    seed: int
    policy: dict


@dataclass(frozen=True)
class Answer:
    """The answer for a calibration: N* and what binds, the ceilings, the recommended admission and the unbounded
    run at N*."""

    capacity: dict  # metronome.sim.capacity.capacity's, with other_regime and ranges
    memory_ceiling_unbounded: float
    pool_ceiling: int  # the pool's own ceiling, and whether vLLM's request limit caps sessions before it
    seqs_bind: bool
    max_num_seqs: int
    tuning: TuningSection
    unbounded_at_n_star: dict


@dataclass(frozen=True)
class Shown:
    """The sections that show the answer: pool fill, the signal, metastability, admission, live fidelity, GPUs
    for a few loads and N* per serving stack."""

    fill: Fill
    signal: dict[str, SignalSeries]
    metastability: Metastability
    admission: Admission
    live: dict | None
    live_differences: list[dict]
    gpus_for_loads: dict
    stacks: list[dict]


@dataclass(frozen=True)
class CalibrationSection:
    planned: Planned
    answer: Answer
    shown: Shown

    def to_dict(self) -> dict:
        # flat on disk: the three groups' fields in order
        return {**asdict(self.planned), **asdict(self.answer), **asdict(self.shown)}


@dataclass(frozen=True)
class Report:
    title: str
    options: dict
    command: str
    reproduce: str
    versions: dict
    executor: str
    simulated_runs: int
    cache: dict
    wall_s: float
    calibrations: list[CalibrationSection]
    fleet: dict | None

    def to_dict(self) -> dict:
        """The JSON-ready dict (numpy scalars as numbers, NaN as null): report.json's schema."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["calibrations"] = [c.to_dict() for c in self.calibrations]
        return clean(out)


def clean(x: Any) -> Any:
    """numpy scalars and NaN -> plain JSON values."""
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (list, dict, str)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
