"""Live validation results (``metronome-probe validate --out DIR``), read and checked for the report.

``DIR/summary.json`` holds, per KV policy, the live run beside the simulation of the same scenario. The
policies sit under ``"policies"`` (or at the top level), each an object with::

    t_sat_observed_s, t_sat_predicted_s        number or null (null: the pool never ran dry)
    p50_frame_latency_s, p99_frame_latency_s   {"live": s, "simulated": s}  (or flat keys
                                               p50_frame_latency_live_s / p50_frame_latency_sim_s)
    silent_frame_fraction                      optional: a number, or {"live": x, "simulated": y}
    *relative_error*                           optional: recomputed here when absent

Relative errors are ``(predicted − measured) / measured``. Anything else in the file is ignored; a
missing or malformed field is one :class:`MetronomeError` line naming the file and the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from metronome.errors import MetronomeError

LATENCIES = ("p50_frame_latency_s", "p99_frame_latency_s")
LIVE_KEYS = ("live", "measured", "observed")
SIM_KEYS = ("simulated", "sim", "predicted")


def _number(origin: str, field: str, v: Any, nullable: bool = False) -> float | None:
    if v is None and nullable:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise MetronomeError(f"{origin}: field '{field}' must be a non-negative number"
                             f"{' or null' if nullable else ''}, got {v!r}")
    return float(v)


def _pair(origin: str, policy: str, obj: dict, metric: str, required: bool) -> dict | None:
    """(live, simulated) of one metric, from a nested object or flat ``*_live_s``/``*_sim_s`` keys."""
    stem = metric[:-2] if metric.endswith("_s") else metric
    unit = "_s" if metric.endswith("_s") else ""
    v = obj.get(metric)
    live = sim = None
    field = f"{policy}.{metric}"
    if isinstance(v, dict):
        live = next((v[k] for k in LIVE_KEYS if k in v), None)
        sim = next((v[k] for k in SIM_KEYS if k in v), None)
        if live is None or sim is None:
            raise MetronomeError(f"{origin}: field '{field}' needs 'live' and 'simulated'")
    else:
        flat_live = [f"{stem}_{k}{unit}" for k in LIVE_KEYS] + [f"{k}_{metric}" for k in LIVE_KEYS]
        flat_sim = [f"{stem}_{k}{unit}" for k in SIM_KEYS] + [f"{k}_{metric}" for k in SIM_KEYS]
        live = next((obj[k] for k in flat_live if k in obj), None)
        sim = next((obj[k] for k in flat_sim if k in obj), None)
        if live is None and sim is None and v is not None and not required:
            live = v  # a single number: the live figure only
        if (live is None or sim is None) and required:
            raise MetronomeError(f"{origin}: policy '{policy}' has no live and simulated '{metric}'")
        if live is None and sim is None:
            return None
    live_v = _number(origin, field + ".live", live)
    sim_v = None if sim is None else _number(origin, field + ".simulated", sim)
    return {"live": live_v, "simulated": sim_v, "relative_error": _rel(sim_v, live_v)}


def _rel(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return (predicted - measured) / measured


def read_live(folder: str | Path) -> dict:
    """Read and validate ``folder/summary.json``: ``{"source": path, "policies": {name: figures}}``."""
    d = Path(folder)
    f = d / "summary.json"
    origin = f"--live {f}"
    if not d.is_dir():
        raise MetronomeError(f"--live {d}: no such folder (give the --out folder of metronome-probe validate)")
    try:
        obj = json.loads(f.read_text())
    except FileNotFoundError:
        raise MetronomeError(f"{origin}: missing (metronome-probe validate writes it)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MetronomeError(f"{origin}: cannot read it ({exc.__class__.__name__})") from None
    except json.JSONDecodeError as exc:
        raise MetronomeError(f"{origin}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(obj, dict):
        raise MetronomeError(f"{origin}: must be a JSON object")
    raw = obj.get("policies", obj)
    if not isinstance(raw, dict):
        raise MetronomeError(f"{origin}: field 'policies' must be an object of policy -> figures")
    entries = {k: v for k, v in raw.items() if isinstance(v, dict) and "t_sat_observed_s" in v}
    if not entries:
        raise MetronomeError(f"{origin}: no policy with 't_sat_observed_s' found (is this a validate summary?)")
    policies = {}
    for name, e in entries.items():
        if "t_sat_predicted_s" not in e:
            raise MetronomeError(f"{origin}: field '{name}.t_sat_predicted_s' missing")
        obs = _number(origin, f"{name}.t_sat_observed_s", e["t_sat_observed_s"], nullable=True)
        pred = _number(origin, f"{name}.t_sat_predicted_s", e["t_sat_predicted_s"], nullable=True)
        fig = {"t_sat_observed_s": obs, "t_sat_predicted_s": pred, "t_sat_relative_error": _rel(pred, obs)}
        for metric in LATENCIES:
            fig[metric] = _pair(origin, name, e, metric, required=True)
        fig["silent_frame_fraction"] = _pair(origin, name, e, "silent_frame_fraction", required=False)
        policies[str(name)] = fig
    meta = {k: obj[k] for k in ("model", "calibration", "num_blocks", "device", "hardware") if
            isinstance(obj.get(k), (str, int, float))}
    return {"source": str(d), "policies": policies, "meta": meta}
