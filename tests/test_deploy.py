"""deploy/: the Kubernetes manifest and the Grafana dashboard, checked against the server they deploy and watch: the
manifest's flags are metronome-serve's own, its probes are the app's routes, its grace period covers the drain and
the exit after it; every series the dashboard plots is one the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from metronome.cli.serve_cli import EXIT_MARGIN_S, parser
from metronome.probe.metrics import LiveMetrics

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _container():
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()))
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    return spec, c


def test_the_manifest_runs_the_servers_own_flags_probes_its_routes_and_waits_out_its_drain():
    from metronome.serve.app import ServeState, make_app

    spec, c = _container()
    assert c["args"][0] == "metronome-serve"
    args = parser().parse_args(c["args"][1:])  # a flag the server does not have fails here (one line, exit 2)
    assert args.out is None  # a long-lived server journals nothing unless told where
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    assert port == args.port
    routes = {r.path for r in make_app(ServeState()).routes}
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and "/ready" in routes
    assert c["livenessProbe"]["httpGet"]["path"] in routes and c["startupProbe"]["httpGet"]["path"] in routes
    pre = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre[0] == "sleep"
    # the kubelet's grace period runs from the preStop hook: it must outlast the hook, the whole drain and the exit
    # after it (the server's own bound: it exits within --drain-timeout plus EXIT_MARGIN_S of SIGTERM)
    assert spec["terminationGracePeriodSeconds"] >= float(pre[1]) + args.drain_timeout + EXIT_MARGIN_S
    assert any(e["name"] == "METRONOME_API_KEY" for e in c["env"])


def _exported() -> set[str]:
    m = LiveMetrics(None)
    m.refused_for("refused")  # (a labelled series shows once it has a label)
    m.client_frames({"sent": 1, "answered": 0, "counted": 1, "counted_session_ended": 1})
    m.n_star(1)  # (a server with a calibration: --calibrate-first, --calibration)
    return {s.name for fam in m.registry.collect() for s in fam.samples}


def test_every_series_the_dashboard_plots_is_exported():
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"\bmetronome_[a-z0-9_]+", e)}
    assert len(used) >= 10
    assert used <= _exported(), sorted(used - _exported())
    # and what the issue asks an operator to see is there: sessions, the limit, latency, silent, late, refusals, N*
    for name in ("metronome_sessions_active", "metronome_admission_limit", "metronome_frame_latency_seconds_bucket",
                 "metronome_silent_frames_total", "metronome_late_frames_total", "metronome_sessions_refused_total",
                 "metronome_n_star"):
        assert name in used, name
