"""Sessions against vLLM's own engine loop, as a client of ``AsyncLLM`` (``--loop vllm``).

:class:`OwnLoopEngine` starts vLLM the way ``vllm serve`` does: ``AsyncLLM`` with its EngineCore in a process of
its own, stepping on its own whenever any request has work. Each session is one streaming-input request
(``AsyncLLM.generate`` fed by an async generator of ``StreamingInput`` chunks, the PR #28973 path). The
driver (:class:`metronome.probe.driver.Driver`) keeps every session on its own clock and applies the serving
rules, but it cannot step the engine or read its scheduler: it sees only what a server sees.

* **Steps, as vLLM's loop reports them.** Every EngineCore step sends one ``EngineCoreOutputs`` to the client
  (new tokens per request, and with stats on, ``SchedulerStats``: KV usage, running and waiting counts and,
  with ``enable_logging_iteration_details``, the step's batch and token counts). They are read where
  ``AsyncLLM``'s output handler pulls them (``engine_core.get_output_async``), so :meth:`step` returns
  one reported step at a time, stamped with when it reached the client and timed as the client sees it
  (from the previous report, or from the first work sent after it, to its own report). :meth:`step` returns
  ``None`` when no step was reported within ``POLL_S``: the driver then attends to its clock (due ticks go to
  the engine at once, as a server's would) and asks again.
* **The pool**, from the last reported ``kv_cache_usage`` (``free = (1 - usage) · (num_blocks - 1)``: vLLM
  counts usage without its null block), less the blocks of requests started that have not run yet (the
  reported usage cannot hold them). Per-request counts (tokens, blocks) are the client's own bookkeeping.
* **What the client cannot see.** Which waiting request vLLM skipped for want of blocks
  (:meth:`is_scheduled_waiting` is always False), and a preemption of a running request, which vLLM
  reports only with that request's next output (it re-prefills it on its own: the session's frames are
  late, then resume). So the deadlock rule fires on what is visible: a reported step that scheduled nothing
  while requests had work (``serving.deadlock_pick`` with no starved sessions: the most recently admitted
  session is aborted and readmitted later with its history). The simulator models this front end with
  ``loop="vllm"`` (``metronome.serving.LOOPS``).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import deque

from metronome.errors import MetronomeError
from metronome.kv_policy import cdiv
from metronome.probe import lifetime
from metronome.probe.engine import (EngineConfig, PoolState, StepInfo, _engine_args, _fds_to, _one_line,
                                    _sinks_plugin, check_build, check_version, let_vllm_scan_modules)
from metronome.probe.lifetime import ENGINE_CLOSE_S  # (the bound on close(), which a server's drain names)

POLL_S = 0.002  # how long step() waits for vLLM's next step report before handing the driver its clock back
START_TIMEOUT_S = 600.0


class OwnLoopEngine:
    """The engine interface the driver uses (``append``, ``abort``, ``step``, ``pool``, per-request counts),
    over ``AsyncLLM`` running its own loop in its own process. Start it once per run; ``close()`` stops it."""

    num_blocks: int  # set once vLLM has started
    max_model_len: int

    def __init__(self, config: EngineConfig, log_path: str | os.PathLike | None = None):
        self.config = config
        check_build(config.device)
        self.dist, self.version = check_version()
        if config.device == "cpu":
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # the engine process inherits it
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.log_path = log_path
        self._cv = threading.Condition()
        self._reports: deque[tuple[int, StepInfo]] = deque()  # (report number, step)
        self._streams: dict[str, asyncio.Queue] = {}  # session rid -> its chunk queue (loop thread)
        self._consumers: dict[str, asyncio.Task] = {}
        self._sent: dict[str, int] = {}  # rid -> tokens handed to the engine (prompt, chunks)
        self._got: dict[str, int] = {}  # rid -> tokens it produced
        self._owed: dict[str, int] = {}  # rid -> tokens still to come for its current chunk
        self._fresh: dict[str, int] = {}  # rid -> blocks of a new request that has not run yet
        self._since: dict[str, int] = {}  # rid -> reports received when its current chunk was sent
        self._seq = 0  # step reports received
        self._quiet_until = -1  # empty-step reports up to this one may predate the last abort: not stalls
        self._stats = None  # the last SchedulerStats
        self._prev_end = 0.0  # when the last step report came in
        self._first_send: float | None = None  # when the first work since that report was sent
        self._busy = False  # work was owed when the last report came in
        self._error: str | None = None  # a failure of this client: raised as MetronomeError
        self._dead: str | None = None  # the engine's process died: raised as EngineDied
        self._closed = False
        # set by _start() on the loop thread: vLLM's client, the classes its requests use, the pool's shape
        self.llm = None
        self._SP = self._TP = self._SI = self._DELTA = None
        self.num_blocks = self.max_model_len = self.block_size = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="metronome-asyncllm", daemon=True)
        self._ready = threading.Event()
        with _fds_to(log_path):  # vLLM's start-up output goes to the log
            self._thread.start()
            if not self._ready.wait(START_TIMEOUT_S) or self._error:
                self._thread.join(timeout=5)
                where = f" (log: {self.log_path})" if self.log_path else ""
                raise MetronomeError(self._error or f"the vLLM engine did not start in {START_TIMEOUT_S:.0f} s{where}")

    # -- the loop thread --------------------------------------------------------------------------------
    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._start()
        except Exception as exc:
            where = f" (log: {self.log_path})" if self.log_path else ""
            self._error = (exc.args[0] if isinstance(exc, MetronomeError) and exc.args else
                           f"the vLLM engine failed to start: {type(exc).__name__}: {_one_line(exc)}{where}")
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    def _start(self) -> None:
        try:
            from vllm import SamplingParams, TokensPrompt
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.engine.protocol import StreamingInput
            from vllm.sampling_params import RequestOutputKind
            from vllm.v1.engine.async_llm import AsyncLLM
            from vllm.v1.metrics.loggers import StatLoggerBase
        except Exception as exc:
            raise MetronomeError(f"vLLM failed to import ({type(exc).__name__}: {_one_line(exc)}); "
                                 "reinstall with scripts/install_live_cpu.sh") from None

        class _Quiet(StatLoggerBase):
            """A stat logger that logs nothing: its presence turns vLLM's stats on (log_stats) without the
            default loggers, which would print every step once iteration details are on. (vLLM's
            ``StatLoggerManager`` still adds its ``PrometheusStatLogger``: see :meth:`metrics_registry`.)"""

            def __init__(self, vllm_config, engine_index=0):
                pass

            def record(self, *args, **kwargs):
                pass

            def log_engine_initialized(self):
                pass

        self._SP, self._TP, self._SI = SamplingParams, TokensPrompt, StreamingInput
        self._DELTA = RequestOutputKind.DELTA
        args = _engine_args(self.config)
        args["disable_log_stats"] = True  # the quiet logger above turns stats on
        args["enable_logging_iteration_details"] = True  # each step's duration and token counts
        let_vllm_scan_modules()  # a forked engine process inherits this process's modules
        # The engine process inherits METRONOME_KV_SINKS at its start, and dies with this process (however it ends)
        # and with this loop thread, which started it and ends in close(): probe/lifetime.py.
        with _sinks_plugin(self.config), lifetime.engine_children():
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args), stat_loggers=[_Quiet])
        vc = self.llm.vllm_config
        self.num_blocks = int(vc.cache_config.num_gpu_blocks)
        self.max_model_len = int(vc.model_config.max_model_len)
        self.block_size = int(vc.cache_config.block_size)
        core = self.llm.engine_core
        pull = core.get_output_async

        async def tapped():  # AsyncLLM's output handler calls this once per EngineCore output batch
            outs = await pull()
            try:
                self._on_outputs(outs, time.perf_counter())
            except Exception as exc:  # never break vLLM's handler; the driver sees it on its next call
                self._error = f"reading vLLM's step report failed: {type(exc).__name__}: {_one_line(exc)}"
            return outs

        core.get_output_async = tapped

    def _on_outputs(self, outs, received: float) -> None:
        stats = outs.scheduler_stats
        if stats is None and not outs.outputs:
            return  # not a step (a reply to a utility call)
        states = self.llm.output_processor.request_states
        tokens: dict[str, list[int]] = {}
        for o in outs.outputs:
            st = states.get(o.request_id)
            rid = getattr(st, "external_req_id", None) or o.request_id
            if o.new_token_ids:
                tokens.setdefault(rid, []).extend(o.new_token_ids)
        det = getattr(stats, "iteration_details", None)  # None: the step scheduled nothing
        with self._cv:
            # When the step started, as the client can tell: right after the previous step's report if work
            # was still owed then (vLLM steps back to back), else when the first work since was sent. Its
            # duration so includes the trip to and from the engine's process, as every frame sees it
            # (vLLM's own elapsed_ms times only the wait on a model run that already ran).
            start = self._prev_end if self._busy or self._first_send is None else self._first_send
            self._prev_end, self._first_send = received, None
            k, self._seq = self._seq, self._seq + 1
            if stats is not None:
                self._stats = stats
            # Tokens of a request this client aborted are not its anymore: vLLM may report a step of it after the
            # abort, named by its external id, or by its internal one once vLLM dropped its state.
            tokens = {rid: toks for rid, toks in tokens.items() if rid in self._sent}
            for rid, toks in tokens.items():
                self._got[rid] = self._got.get(rid, 0) + len(toks)
                if rid in self._owed:
                    self._owed[rid] = max(0, self._owed[rid] - len(toks))
                self._fresh.pop(rid, None)  # its blocks are in the reported usage once it has run
            self._busy = any(n > 0 for n in self._owed.values())
            if det is None and not tokens:
                # A step that scheduled nothing. vLLM steps only while some request has work, but the work
                # a client just sent, or the blocks it just freed, may reach the engine a step late: it is a
                # stall only when work sent two reports ago is still owed and no abort is that recent.
                if k <= self._quiet_until or not any(n > 0 and self._since.get(r, k) <= k - 2
                                                     for r, n in self._owed.items()):
                    return
            info = StepInfo(t_start=start, duration_s=received - start,
                            batch=(det.num_ctx_requests + det.num_generation_requests) if det is not None else 0,
                            new_tokens=(det.num_ctx_tokens + det.num_generation_tokens) if det is not None else 0,
                            context_tokens=0, prefill_tokens=det.num_ctx_tokens if det is not None else 0,
                            t_end=received)
            info.outputs = tokens
            for rid in tokens:
                info.scheduled[rid] = len(tokens[rid])
                info.computed[rid] = self._tokens(rid) - 1  # all but the token sampled last
                info.context_tokens += info.computed[rid]
            self._reports.append((k, info))
            self._cv.notify_all()

    def _call(self, fn, *args):
        """Run ``fn(*args)`` in the loop thread (fire and forget: an error surfaces on the next step)."""
        self._loop.call_soon_threadsafe(fn, *args)

    # -- sessions -----------------------------------------------------------------------------------------
    def _params(self, max_tokens: int):
        return self._SP(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, output_kind=self._DELTA,
                        detokenize=False)

    def append(self, sid: str, tokens: list[int], max_tokens: int, resumable: bool = True) -> None:
        """Start session ``sid`` (its first chunk) or append its next chunk; see ``Engine.append``."""
        with self._cv:
            new = sid not in self._sent
            self._sent[sid] = self._sent.get(sid, 0) + len(tokens)
            self._owed[sid] = max_tokens
            self._since[sid] = self._seq
            if self._first_send is None:
                self._first_send = time.perf_counter()
            if new:
                self._fresh[sid] = cdiv(len(tokens) + max_tokens, self.block_size)
        chunk = self._SI(prompt=self._TP(prompt_token_ids=list(tokens)), sampling_params=self._params(max_tokens))
        self._call(self._push, sid, chunk, new)

    def _push(self, sid: str, chunk, new: bool) -> None:
        if new:
            q: asyncio.Queue = asyncio.Queue()
            self._streams[sid] = q
            self._consumers[sid] = self._loop.create_task(self._consume(sid, q, chunk.sampling_params))
        q = self._streams.get(sid)
        if q is not None:
            q.put_nowait(chunk)

    async def _consume(self, sid: str, q: asyncio.Queue, params) -> None:
        """Feed the session's chunks to ``generate`` and drain its outputs (the tokens are read from the step
        reports, where they come with the step that produced them)."""

        async def chunks():
            while True:
                c = await q.get()
                if c is None:  # aborted: end the stream without the closing chunk (vLLM aborts the request)
                    raise asyncio.CancelledError
                yield c

        try:
            async for _ in self.llm.generate(chunks(), params, request_id=sid):
                pass
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            if self.llm.errored:  # the EngineCore process is gone: the driver stops and keeps what it recorded
                self._dead = f"the engine's process died ({type(exc).__name__}: {_one_line(exc)})"
            else:
                self._error = f"session {sid}: {type(exc).__name__}: {_one_line(exc)}"

    def abort(self, sid: str) -> None:
        with self._cv:
            for d in (self._sent, self._got, self._owed, self._fresh, self._since):
                d.pop(sid, None)
            self._quiet_until = self._seq + 1
        self._call(self._abort, sid)

    def _abort(self, sid: str) -> None:
        q = self._streams.pop(sid, None)
        if q is not None:
            q.put_nowait(None)
        task = self._consumers.pop(sid, None)
        self._loop.create_task(self.llm.abort(sid))
        if task is not None:
            task.cancel()

    def add(self, sid: str, tokens: list[int], max_tokens: int) -> None:
        raise MetronomeError("one-shot requests are not supported on vLLM's own loop")

    # -- what the client knows --------------------------------------------------------------------------
    def has_work(self) -> bool:
        """A report is waiting to be read, or some request still owes tokens."""
        with self._cv:
            return bool(self._reports) or any(n > 0 for n in self._owed.values())

    def step(self, wait_s: float | None = None) -> StepInfo | None:
        """The next step vLLM's loop reported, or None if none came within ``wait_s`` (at most ``POLL_S``): the
        driver asks for no longer than its next tick is away, so that a frame coming due while vLLM steps is
        handed over at its tick, not up to a poll later."""
        with self._cv:
            if not self._reports:
                self._cv.wait(POLL_S if wait_s is None else max(0.0, min(wait_s, POLL_S)))
            while self._reports:
                k, info = self._reports.popleft()
                if info.batch == 0 and k <= self._quiet_until:
                    continue  # a stall reported before the driver's last abort took effect: stale
                for rid in [r for r in info.scheduled if r not in self._sent]:  # aborted since it was reported
                    del info.scheduled[rid]
                    info.computed.pop(rid, None)
                    info.outputs.pop(rid, None)
                return info
        self.check_alive()
        return None

    def check_alive(self) -> None:
        """Raise EngineDied if vLLM's engine process is gone, MetronomeError if this client failed."""
        from metronome.probe.remote import EngineDied

        if self._dead or self.llm.errored:
            exc = EngineDied(self._dead or "the engine's process died")
            exc.log_path = str(self.log_path) if self.log_path else None
            raise exc
        if self._error:
            raise MetronomeError(self._error)

    def ready(self) -> bool:
        """True: the constructor returns once the engine has started, and it is never restarted."""
        return True

    def restart(self) -> None:
        raise MetronomeError("vLLM's own loop cannot be restarted after its engine died "
                             "(a restart needs the driver stepping the engine: --loop driver)")

    def pool(self) -> PoolState:
        with self._cv:
            st = self._stats
            usable = self.num_blocks - 1
            used = round(st.kv_cache_usage * usable) if st is not None else 0
            used = min(usable, used + sum(self._fresh.values()))
            running = st.num_running_reqs if st is not None else 0
            waiting = st.num_waiting_reqs + st.num_skipped_waiting_reqs if st is not None else 0
        return PoolState(free_blocks=usable - used, used_blocks=used, kv_usage=used / usable if usable else 0.0,
                         running=running, waiting=waiting, paused=0)

    def _tokens(self, sid: str) -> int:
        return self._sent.get(sid, 0) + self._got.get(sid, 0)

    def tokens_of(self, sid: str) -> int:
        with self._cv:
            return self._tokens(sid)

    def computed_tokens(self, sid: str) -> int:
        with self._cv:
            return max(0, self._tokens(sid) - 1 - self._owed.get(sid, 0)) if sid in self._sent else 0

    def blocks_of(self, sid: str) -> int:
        n = self.computed_tokens(sid)
        return int(self.policy.resident_blocks(n)) if n else 0

    def is_scheduled_waiting(self, sid: str) -> bool:
        return False  # a client cannot see which waiting request vLLM skipped (module docstring)

    # -- the engine as configured ---------------------------------------------------------------------------
    @property
    def max_num_batched_tokens(self) -> int:
        return int(self.config.max_num_batched_tokens)

    @property
    def policy(self):
        return self.config.policy  # the engine process builds its KV spec from the same settings

    @property
    def pid(self) -> int | None:
        for p in self._processes():
            return p.pid
        return None

    def metrics_registry(self):
        """The Prometheus registry vLLM's own series (``vllm:*``) are in, or None if vLLM keeps none.

        With stats on, ``AsyncLLM``'s ``StatLoggerManager`` adds a ``PrometheusStatLogger`` beside the custom
        loggers (the quiet one above) and feeds it every step's ``SchedulerStats`` in its output handler, on this
        client's loop thread: the EngineCore process only sends the stats. It registers its series in
        prometheus_client's default ``REGISTRY``, in this process. (``vllm serve`` sets up the multiprocess
        collector only for several API server processes; this is one.)"""
        from prometheus_client import REGISTRY
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        loggers = getattr(getattr(self.llm, "logger_manager", None), "stat_loggers", None) or ()
        return REGISTRY if any(isinstance(x, PrometheusStatLogger) for x in loggers) else None

    def describe(self) -> str:
        return f"{self.dist} {self.version} (AsyncLLM, EngineCore in its own process)"

    def reset(self, timeout_s: float = 5.0) -> None:
        """Abort every session and wait until vLLM reports its pool empty, so the next run starts clean (and
        reads none of this one's step reports)."""
        with self._cv:
            sids = list(self._sent)
        for sid in sids:
            self.abort(sid)
        deadline = time.perf_counter() + timeout_s
        with self._cv:
            while sids and (self._stats is None or self._stats.kv_cache_usage > 0) and time.perf_counter() < deadline:
                self._cv.wait(0.01)
            self._reports.clear()
            self._fresh.clear()

    def _processes(self) -> list:
        """vLLM's EngineCore processes (``multiprocessing`` Process objects, this process's children)."""
        procs = getattr(getattr(getattr(self.llm, "engine_core", None), "resources", None), "engine_manager", None)
        return list(getattr(procs, "processes", ()) or ())

    def close(self) -> None:
        """Stop the engine: returns within ``ENGINE_CLOSE_S``, every process of the engine ended or SIGKILLed, and
        EngineCore reaped (by a thread of its own if the kernel takes longer to free it).

        vLLM's shutdown asks EngineCore to exit (SIGTERM), waits ``lifetime.GRACE_S`` and then SIGKILLs it with its
        workers; its own default waits 5 s. Any process of the engine still running after it (a worker whose
        EngineCore exited before it) is SIGKILLed here."""
        if self._closed:
            return
        self._closed = True
        end = time.monotonic() + ENGINE_CLOSE_S  # (the wind-down's share is what is left of it)
        procs = self._processes()
        engine = lifetime.tree([p.pid for p in procs])  # seen before any of them ends (a worker is reparented then)
        with _fds_to(self.log_path):  # vLLM's shutdown messages go to the log too
            if self.llm is not None:
                try:
                    self.llm.shutdown(timeout=lifetime.GRACE_S)
                except Exception:
                    pass
            lifetime.kill_and_reap(engine, procs)

            async def drain():  # end the client's own tasks and vLLM's, so none is left pending at exit
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            if not self._loop.is_closed():
                try:
                    asyncio.run_coroutine_threadsafe(drain(), self._loop).result(max(0.1, end - time.monotonic()))
                except Exception:
                    pass
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(max(0.1, end - time.monotonic()))
            if not self._thread.is_alive():
                self._loop.close()
