"""The server's pool gauges tell the truth while the engine is idle (issue 46): they are set at each engine step, and
once every session has left no step runs, so the gateway reads the pool again while it naps. The app over a real
gateway on the fake engine (tests/serve_harness.py), seen on ``/metrics`` as a scraper sees it."""

from __future__ import annotations

import asyncio

import serve_harness as h


def test_after_every_session_left_the_pool_gauges_read_the_idle_pool():
    with h.Served(cap=4) as srv:
        stepped = []  # the pool usage each engine step set the gauge to
        step = srv.metrics.step
        srv.metrics.step = lambda row, limit: (stepped.append(row["kv_usage"]), step(row, limit))
        _, answered = asyncio.run(h.real_client(srv.url, frames=5))
        assert answered == list(range(5))
        assert max(stepped) > 0  # the session held blocks while it ran, and a step said so
        assert h.wait_for(lambda: srv.sessions() == 0 and not srv.gateway.clients)
        idle = srv.engine.pool()  # (the fake engine's own account of its pool, not the gauge's)
        assert idle.used_blocks == 0 and idle.running == 0

        def reads_idle() -> bool:
            return (h.metric(srv.port, "metronome_kv_pool_usage") == idle.kv_usage
                    and h.metric(srv.port, "metronome_sessions_running") == idle.running
                    and h.metric(srv.port, "metronome_sessions_waiting") == idle.waiting
                    and h.metric(srv.port, "metronome_sessions_active") == 0)

        # refreshed at least every second while no step runs: well within the cap (a generous one, for a busy host)
        assert h.wait_for(reads_idle, cap_s=10.0), h.metric(srv.port, "metronome_kv_pool_usage")
