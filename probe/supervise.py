"""Watching the engine for the live driver: its silence, its death, its restart.

The driver (:mod:`metronome.probe.driver`) owns one :class:`Supervisor` per run. The supervisor keeps the
engine's health (silent episodes, outages, deaths, restarts), writes the ``events`` rows about it through the
driver's journal, sets the engine gauges and tells the user; what happens to the sessions when the engine dies
(each goes back to the waiting queue, to be readmitted as a rebase) stays in the driver, between
:meth:`Supervisor.died` and :meth:`Supervisor.recover`.
"""

from __future__ import annotations

from typing import Callable

from metronome.probe.engine import DrivenEngine
from metronome.probe.metrics import LiveMetrics
from metronome.probe.remote import EngineDied


def _log_of(exc: EngineDied) -> str:
    return f" (its log: {exc.log_path})" if exc.log_path else ""


class Supervisor:
    """The engine's health over one run.

    The engine is *silent* when frames wait in it and it produced no token for ``silence_s``. When its process
    dies (:class:`~metronome.probe.remote.EngineDied`), with ``restart`` a new engine is started, at most
    ``max_restarts`` times; without, the run stops with :attr:`error` saying why.
    """

    def __init__(self, engine: DrivenEngine, record: Callable[[str, dict], None], *, silence_s: float,
                 restart: bool, max_restarts: int, metrics: LiveMetrics | None = None, notify=None):
        self.engine = engine
        self._record = record  # record(table, row): the driver's journals
        self.silence_s = silence_s
        self.restart, self.max_restarts = restart, max_restarts
        self.metrics = metrics
        self.notify = notify  # notify(line): one line for the user when the engine dies or comes back
        self.last_token_s = 0.0  # when the engine last produced a token (or nothing was waiting for one)
        self._silent_since: float | None = None  # start of the current engine-silent episode
        self.silence: list[tuple[float, float]] = []  # engine-silent episodes (start, end)
        self.down_since: float | None = None  # the engine died at this time and a new one is loading
        self.outages: list[tuple[float, float]] = []  # engine deaths: (died, back or run end)
        self.deaths = 0
        self.restarts = 0
        self.error: str | None = None  # why the run stopped, when the engine died for good

    def _event(self, now: float, event: str, **extra) -> None:
        self._record("events", {"t_s": now, "event": event, "session": None, "rid": None, **extra})

    def _say(self, line: str) -> None:
        if self.notify is not None:
            self.notify(line)

    def started(self) -> None:
        """The run starts: name an engine in its own process, for operators."""
        if self.engine.pid is not None:
            self._event(0.0, "engine_started", pid=self.engine.pid)

    # -- silence ---------------------------------------------------------------------------------------------
    def token(self, now: float) -> None:
        """The engine produced a token at ``now``."""
        self.last_token_s = now

    def watch(self, now: float, waiting_for_tokens: bool) -> None:
        """Flag the engine silent when frames wait in it (``waiting_for_tokens``) and no token came for
        ``silence_s``; the episode ends at the next token."""
        if not waiting_for_tokens:
            self.last_token_s = now
        silent = waiting_for_tokens and now - self.last_token_s >= self.silence_s
        if silent and self._silent_since is None:
            self._silent_since = self.last_token_s
            self._event(now, "engine_silent", since_s=self.last_token_s)
        elif not silent and self._silent_since is not None:
            self.silence.append((self._silent_since, now))
            self._event(now, "engine_resumed", since_s=self._silent_since)
            self._silent_since = None
        if self.metrics:
            self.metrics.engine_silent.set(1 if silent else 0)

    # -- death and restart -------------------------------------------------------------------------------------
    def died(self, exc: EngineDied, now: float) -> None:
        """The engine's process is gone (again, if it died while a new one was loading)."""
        self.deaths += 1
        if self.down_since is None:
            self.down_since = now
        self._event(now, "engine_died", error=str(exc))
        if self.metrics:
            self.metrics.engine_up.set(0)

    def recover(self, exc: EngineDied, now: float, lost: int) -> bool:
        """After a death (``lost`` sessions lost their KV): start a new engine and return True, or give up
        (no ``restart``, or ``max_restarts`` spent), set :attr:`error` and return False."""
        if self.restart and self.restarts < self.max_restarts:
            self.restarts += 1
            self._say(f"{exc} at {now:.1f} s{_log_of(exc)}; restarting it ({self.restarts} of {self.max_restarts}), "
                      f"{lost} session(s) will be readmitted as a rebase")
            self.engine.restart()
            self._event(now, "engine_restarting")
            return True
        why = "" if not self.restart else f" (gave up after {self.max_restarts} restarts)"
        self.error = f"{exc} at {now:.1f} s{why}{_log_of(exc)}"
        return False

    def back(self, now: float) -> bool:
        """While a new engine loads: True once it is up (raises EngineDied if it failed to start)."""
        if not self.engine.ready():
            return False
        since = self.down_since
        self.outages.append((since, now))
        self.down_since = None
        self._event(now, "engine_restarted", outage_s=now - since, pid=self.engine.pid)
        if self.metrics:
            self.metrics.engine_up.set(1)
            self.metrics.restarts.inc()
        self._say(f"the engine is back at {now:.1f} s after {now - since:.1f} s down; readmitting sessions")
        return True

    # -- the run's end ---------------------------------------------------------------------------------------
    def close(self, now: float) -> None:
        """The run ends at ``now``: an outage or a silent episode still open ends with it."""
        if self.down_since is not None:
            self.outages.append((self.down_since, now))
            self.down_since = None
        if self._silent_since is not None:
            self.silence.append((self._silent_since, now))
            self._silent_since = None

    def summary(self) -> dict:
        """The run summary's engine-health keys (:data:`metronome.results.LIVE_ONLY_KEYS`)."""
        return {
            "engine_silent_episodes": len(self.silence),
            "engine_silent_s": round(sum(b - a for a, b in self.silence), 6),
            "t_first_engine_silent_s": self.silence[0][0] if self.silence else None,
            "silence_threshold_s": self.silence_s,
            "engine_deaths": self.deaths, "engine_restarts": self.restarts,
            "engine_error": self.error,
            "engine_outage_s": round(sum(b - a for a, b in self.outages), 6),
            "engine_outages": [[round(a, 6), round(b, 6)] for a, b in self.outages],
        }
