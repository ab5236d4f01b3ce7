"""``metronome-probe run``: arriving sessions, live, through the simulator's own admission controller.

The workload (arrival times and durations) is drawn by the function the simulator draws it with
(:func:`metronome.workload.draw`: one ``numpy`` generator seeded with ``--seed``, arrivals first, then
durations), so one seed gives the same sessions live and simulated, and the controller is the object
``metronome.admission.make_controller`` builds for the simulator, with the ``--aimd-params`` file
``metronome-sim tune-aimd`` writes. The run writes, in ``--out``:

* ``frames``, ``steps``, ``sessions``, ``events`` as JSONL journals while it runs, Parquet at the end;
* ``controller.parquet``: the controller's trace, one row per control interval (limit, in-flight peak,
  latency percentile, frames, silent frames, silent fraction, decision);
* ``summary.json``: the driver's summary (the keys a simulated run's summary shares, with the same meaning:
  :mod:`metronome.results`) plus the run's options, the controller's figures and the stop / silence fields
  (``stopped``, ``stop_reason``, ``engine_silent_episodes``, ``engine_silent_s``).

A SIGTERM or Ctrl-C stops the run cleanly: sessions are ended (aborted in the engine), the journals are
closed and converted, and the summary covers what ran.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from metronome.errors import MetronomeError
from metronome.kv_policy import policy_option_values
from metronome.outputs import check_out, run_dir

from metronome.probe.records import RUN_TABLES as TABLES


@dataclass
class RunOptions:
    model: str
    out: str
    admission: str = "none"
    aimd_params: str | None = None
    arrival_rate: float | None = None
    rate_pattern: str | None = None
    session_duration: str = "30"
    horizon_s: float = 30.0
    kv: str = "unbounded"
    kv_params: tuple[tuple[str, int], ...] = ()  # the policy's parameters as given (CalibrateOptions.kv_params)
    num_blocks: int | None = None
    block_size: int = 32
    max_model_len: int | None = None
    stream: object | None = None  # TokenStream
    deadline_s: float | None = None
    metrics_port: int | None = None
    seed: int = 0
    prompt_tokens: int = 1
    weights: str = "auto"
    device: str | None = None
    dtype: str | None = None
    restart: bool = False
    max_restarts: int = 3
    phases: str = "aligned"  # serving.PHASES: sessions in lockstep, or each on its own seeded phase
    loop: str = "driver"  # serving.LOOPS: the driver steps the engine, or vLLM's own loop does (probe.own_loop)
    replace: bool = False  # write into a temporary folder that replaces out only once the run ends
    target: str | None = None  # ws://HOST:PORT: the sessions are clients of that metronome-serve (probe.ws_client)
    api_key: str | None = None  # the server's bearer token (--target)
    poll_s: float = 1.0  # how often the server's /metrics is read (--target)


@dataclass
class Checked:
    """What ``check`` parsed: the workload, the policy and a controller factory."""

    arrivals: object
    durations: object
    policy: object
    params: object | None
    make_controller: object  # () -> controller


def check_port(port: int, flag: str = "--metrics-port", host: str = "0.0.0.0") -> None:
    """Fail with one line if ``port`` (given as ``flag``) cannot be bound (checked before the engine starts)."""
    if not 0 < port < 65536:
        raise MetronomeError(f"{flag} must be in 1..65535, got {port}")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server that binds it later does
        try:
            s.bind((host, port))
        except OSError as exc:
            raise MetronomeError(f"{flag} {port} is not available ({exc.strerror or exc})") from None


def check(opts: RunOptions) -> Checked:
    """Validate every option before any engine starts or any file is made; raise MetronomeError (one line)."""
    from metronome import serving

    check_out(opts.out, opts.replace)
    serving.check_phases(opts.phases)
    if opts.target is not None:
        from metronome.probe.ws_client import endpoints

        endpoints(opts.target)
        # the server runs the engine and decides admission: what only an engine in this process takes is refused
        given = [flag for flag, v in (("--admission", opts.admission != "none"), ("--aimd-params", opts.aimd_params),
                                      ("--restart", opts.restart), ("--metrics-port", opts.metrics_port is not None),
                                      ("--loop", opts.loop != "driver"), ("--num-blocks", opts.num_blocks is not None))
                 if v]
        if given:
            raise MetronomeError(f"{given[0]} is the server's with --target (metronome-serve takes it)")
        if not (opts.poll_s > 0 and math.isfinite(opts.poll_s)):
            raise MetronomeError(f"--poll must be positive seconds, got {opts.poll_s}")
    if serving.check_loop(opts.loop) == "vllm" and opts.restart:
        raise MetronomeError("--restart needs --loop driver (the engine is restarted from the driver's process)")
    from metronome import admission as adm
    from metronome.workload import Arrivals, Durations

    if (opts.arrival_rate is None) == (opts.rate_pattern is None):
        raise MetronomeError("give exactly one of --arrival-rate R and --rate-pattern SPEC|FILE")
    if opts.arrival_rate is not None:
        arrivals = Arrivals("poisson", rate_per_s=float(opts.arrival_rate))
    else:
        arrivals = Arrivals.parse_pattern(opts.rate_pattern)
    durations = Durations.parse(str(opts.session_duration))
    if not (opts.horizon_s > 0 and math.isfinite(opts.horizon_s)):
        raise MetronomeError(f"--horizon must be positive seconds, got {opts.horizon_s}")
    if opts.deadline_s is not None and not opts.deadline_s > 0:
        raise MetronomeError(f"--deadline must be positive seconds, got {opts.deadline_s}")
    if opts.num_blocks is not None and opts.num_blocks < 2:
        raise MetronomeError(f"--num-blocks must be at least 2 (vLLM keeps one null block), got {opts.num_blocks}")
    if opts.max_restarts < 0:
        raise MetronomeError(f"--max-restarts must be >= 0, got {opts.max_restarts}")
    if opts.prompt_tokens < 1:
        raise MetronomeError(f"--prompt-tokens must be at least 1, got {opts.prompt_tokens}")
    from metronome.probe.calibrate import CalibrateOptions, policy_for

    policy = policy_for(CalibrateOptions(model=opts.model, out=opts.out, kv=opts.kv, kv_params=opts.kv_params,
                                         block_size=opts.block_size))
    params = adm.read_params(opts.aimd_params) if opts.aimd_params else None
    adm.check_params_apply([opts.admission], params is not None)
    deadline = opts.deadline_s or (opts.stream.frame_period_s if opts.stream is not None else 1.0)
    adm.make_controller(opts.admission, deadline, params)  # bad specs (static:0, ...) fail here
    if opts.metrics_port is not None:
        check_port(opts.metrics_port)
    return Checked(arrivals, durations, policy, params, lambda d: adm.make_controller(opts.admission, d, params))


def make_plans(arrivals, durations, horizon_s: float, seed: int, prompt_tokens: int = 1, phases: str = "aligned"):
    """Session plans: :func:`metronome.workload.draw` and ``draw_phases``, the sessions (and phases) the simulator
    draws for the same seed."""
    from metronome.probe.driver import SessionPlan
    from metronome.workload import draw, draw_phases

    times, durs = draw(arrivals, durations, horizon_s, seed)
    slots = draw_phases(times.size, phases, seed)
    return [SessionPlan(f"s{i}", arrival_s=float(t), duration_s=float(d), prompt_tokens=prompt_tokens,
                        phase_slot=int(k)) for i, (t, d, k) in enumerate(zip(times, durs, slots))]


def controller_rows(controller) -> list[dict]:
    rows = []
    for r in controller.trace():
        r = dict(r)
        r["silent_fraction"] = (r["silent"] / r["frames"]) if r["frames"] else None
        r["dead"] = r["decision"] == "dead"
        if r["limit"] >= 2**62:  # NoAdmission: no limit
            r["limit"] = None
        rows.append(r)
    return rows


def write_outputs(out: Path, driver, controller, summary: dict, extra: dict) -> dict:
    """Journals to Parquet, the controller trace, summary.json. Returns the summary written."""
    import pandas as pd

    from metronome.probe.records import journal_to_parquet

    for t in TABLES:
        journal_to_parquet(out / f"{t}.jsonl")
    rows = controller_rows(controller)
    cols = ["t_s", "limit", "in_flight", "p_latency_s", "frames", "silent", "silent_fraction", "decision", "dead"]
    pd.DataFrame(rows, columns=cols).to_parquet(out / "controller.parquet", index=False)
    limits = [r["limit"] for r in rows if r["limit"] is not None]
    summary = {**summary, **extra,
               "controller": {"name": getattr(controller, "name", type(controller).__name__),
                              "params": _params_of(controller), "intervals": len(rows),
                              "final_limit": limits[-1] if limits else None,
                              "max_limit": max(limits) if limits else None,
                              "dead_intervals": sum(r["dead"] for r in rows),
                              "cuts": sum(r["decision"] == "decrease" for r in rows),
                              "draining_intervals": sum(r["decision"] == "draining" for r in rows)}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _params_of(controller) -> dict | None:
    """The controller's settings as ``metronome-sim tune-aimd`` writes them (None for none/static)."""
    params = getattr(controller, "params", None)
    return params.to_dict() if params is not None else None


def run(engine, stream, plans, horizon_s: float, controller, out_dir, *, extra: dict | None = None, on_driver=None,
        notify=None, policy=None, **config):
    """One live run with a controller; writes every output. ``on_driver(driver)`` is called before the run
    starts (tests and the CLI use it to hold the driver, e.g. to ``stop()`` it); ``notify(line)`` hears when the
    engine dies and comes back. The other keywords are :class:`~metronome.probe.driver.DriverConfig`'s (e.g.
    ``deadline_s``, ``prometheus_port``, ``seed``, ``restart=True``; ``cap`` is ``rebase`` unless given).
    ``policy``: the KV policy as the user named it (default: read back from the engine's KV spec, which knows only
    the residency it runs, not which policy asked for it). Returns (RunResult, summary)."""
    from metronome.probe.driver import Driver, DriverConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if policy is None:
        policy = engine.policy
    elif policy.residency() != engine.policy.residency():
        raise MetronomeError(f"the engine runs {engine.policy.describe()}, not {policy.describe()}")
    if policy.bounded:
        config.setdefault("rebase_tokens", policy.rebase_tokens())
    config.setdefault("cap", "rebase")
    cfg = DriverConfig(stream=stream, horizon_s=horizon_s, run=policy.describe(), policy=policy, **config)
    engine.reset()
    # rows live in the journals, not in memory, while the run lasts: a long run's memory stays flat
    driver = Driver(engine, cfg, admission=controller, out_dir=out, notify=notify, retain=False)
    if on_driver is not None:
        on_driver(driver)
    t0 = time.time()
    try:
        res = driver.run(plans)
    finally:
        try:
            engine.reset()
        except MetronomeError:  # a dead engine has nothing left to reset; what ran is written below
            pass
    extra = {"sessions_planned": len(plans), "wall_s": round(time.time() - t0, 3), **(extra or {})}
    summary = write_outputs(out, driver, controller, res.summary, extra)
    res.summary = summary
    return res, summary


def main(opts: RunOptions, echo=print, err=print) -> int:
    """The CLI body: check, start the engine, run with SIGTERM/SIGINT as a clean stop, report one line."""
    checked = check(opts)
    if opts.target is not None:
        return main_target(opts, checked, echo, err)
    from metronome.probe.calibrate import CalibrateOptions, engine_config
    from metronome.probe.remote import RemoteEngine

    out = Path(opts.out)
    from metronome.probe import models
    from metronome.probe.engine import default_device

    resolved = models.resolve(opts.model, opts.weights, opts.device or default_device(), opts.dtype, opts.stream)
    max_len = opts.max_model_len
    if max_len is None and opts.num_blocks is not None:
        max_len = resolved.max_len_on_pool(opts.num_blocks, opts.block_size)
    copts = CalibrateOptions(model=opts.model, out=opts.out, weights=opts.weights, device=opts.device,
                             dtype=opts.dtype, kv=opts.kv, kv_params=opts.kv_params,
                             num_blocks=opts.num_blocks, block_size=opts.block_size,
                             max_model_len=max_len, stream=opts.stream, seed=opts.seed)
    signals = {}
    stop_box: dict = {}

    def on_signal(signum, frame):
        name = signal.Signals(signum).name
        stop_box.setdefault("signal", (signum, name))
        if "driver" in stop_box:
            stop_box["driver"].stop(name)

    # installed before the engine starts: a signal during the start ends the run before it begins
    for sig in (signal.SIGTERM, signal.SIGINT):
        signals[sig] = signal.signal(sig, on_signal)
    try:
        ecfg = engine_config(copts, resolved)
        with run_dir(out, opts.replace) as work:  # with --replace, out is left as it was until the run ends
            # the engine lives in its own process, so the driver (and what it recorded) outlives it
            if opts.loop == "vllm":  # AsyncLLM: vLLM's EngineCore steps on its own in its own process
                from metronome.probe.own_loop import OwnLoopEngine

                engine = OwnLoopEngine(ecfg, log_path=work / "engine.log")
            else:
                engine = RemoteEngine(ecfg, log_path=work / "engine.log")  # vLLM's own output goes to the log
            try:
                if "signal" in stop_box:
                    raise KeyboardInterrupt
                stream = ecfg.model.stream
                deadline = opts.deadline_s or stream.frame_period_s
                controller = checked.make_controller(deadline)
                plans = make_plans(checked.arrivals, checked.durations, opts.horizon_s, opts.seed,
                                   opts.prompt_tokens, opts.phases)
                options = {k: (v if not hasattr(v, "frame_period_s") else asdict(v))
                           for k, v in asdict(opts).items() if k not in ("stream", "kv_params")}
                options.update(policy_option_values(dict(opts.kv_params)))  # flat, as the report reads them
                options["stream"] = {"period_s": stream.frame_period_s, "in": stream.input_tokens_per_frame,
                                     "out": stream.output_tokens_per_frame}

                def hold(driver):
                    stop_box["driver"] = driver
                    if "signal" in stop_box:
                        driver.stop(stop_box["signal"][1])

                res, summary = run(engine, stream, plans, opts.horizon_s, controller, work, deadline_s=deadline,
                                   prometheus_port=opts.metrics_port, seed=opts.seed,
                                   cap="rebase" if checked.policy.bounded else "finish",
                                   extra={"options": options, "engine": engine.describe(),
                                          "arrivals": checked.arrivals.describe(),
                                          "durations": checked.durations.describe(), "loop": opts.loop},
                                   on_driver=hold, notify=lambda line: err(f"metronome-probe: {line}"),
                                   policy=checked.policy,
                                   restart=opts.restart, max_restarts=opts.max_restarts, phases=opts.phases)
            finally:
                engine.close()
    except KeyboardInterrupt:
        err(f"metronome-probe: interrupted while the engine started; nothing ran ({out})")
        return 130
    finally:
        for sig, old in signals.items():
            signal.signal(sig, old)
    s = summary
    line = (f"{s['frames']} frames, {s['sessions_admitted']} sessions admitted, {s['sessions_refused']} refused; "
            f"p50 {_ms(s['p50_frame_latency_s'])} p99 {_ms(s['p99_frame_latency_s'])}; "
            f"silent {s['silent_frame_fraction']:.3f}; preemptions {s['preemptions']}; "
            f"final limit {s['controller']['final_limit']}; engine silent {s['engine_silent_s']:.1f} s; "
            + (f"engine died {s['engine_deaths']}x, restarted {s['engine_restarts']}x, down "
               f"{s['engine_outage_s']:.1f} s; " if s.get("engine_deaths") else "")
            + f"summary: {out / 'summary.json'}")
    if s.get("stop_reason") == "engine_died":
        err(f"metronome-probe: error: {s['engine_error']}; what ran is kept: {line}")
        return 1
    if s.get("stopped"):
        signum = stop_box.get("signal", (signal.SIGTERM, "SIGTERM"))[0]
        err(f"metronome-probe: stopped by {s['stop_reason']} at {s['t_stopped_s']:.1f} s; {line}")
        return 128 + int(signum)
    echo(line)
    return 0


def main_target(opts: RunOptions, checked: Checked, echo=print, err=print) -> int:
    """``--target``: the same sessions as WebSocket clients of a server (:mod:`metronome.probe.ws_client`); the
    same outputs, written when the run ends, stopped (SIGTERM, Ctrl-C: exit 128 + the signal) or not."""
    import asyncio

    import pandas as pd

    from metronome.probe import ws_client

    out = Path(opts.out)
    plans = make_plans(checked.arrivals, checked.durations, opts.horizon_s, opts.seed, opts.prompt_tokens,
                       opts.phases)
    ws_client.check_reachable(opts.target)  # before any folder is made
    made = not out.exists()
    got: dict = {}

    async def go():
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        def on_signal(sig):
            got.setdefault("signal", sig)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            return await ws_client.run_target(opts.target, plans, opts.horizon_s, api_key=opts.api_key,
                                              seed=opts.seed, poll_s=opts.poll_s, stop=stop)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    with run_dir(out, opts.replace) as work:
        res = asyncio.run(go())
        if res.errors.get("unauthorized") and not any(r["admitted"] for r in res.sessions):
            if made and not opts.replace:
                shutil.rmtree(out, ignore_errors=True)
            raise MetronomeError(f"--target {opts.target}: the server answered 401 to every session (give --api-key "
                                 "or set METRONOME_API_KEY)")
        if "signal" in got:
            res.stopped = signal.Signals(got["signal"]).name
            res.t_stopped_s = round(res.wall_s, 3)
        summary = ws_client.summary_of(res)
        info = res.info or {}
        server = info.get("server") or {}
        options = {"horizon_s": opts.horizon_s, "arrival_rate": opts.arrival_rate, "rate_pattern": opts.rate_pattern,
                   "session_duration": opts.session_duration, "seed": opts.seed, "phases": opts.phases,
                   "prompt_tokens": opts.prompt_tokens, "target": opts.target,
                   # what the server runs, as it said in session.created (the report re-simulates with these)
                   **{k: v for k, v in server.items() if k not in ("num_blocks",)}}
        if info:
            options["deadline_s"] = info.get("deadline_s")
            options["stream"] = {"period_s": info["frame_period_s"], "in": info["input_tokens_per_frame"],
                                 "out": info["output_tokens_per_frame"]}
        polls = pd.DataFrame(res.polls, columns=["t_s", "sessions", *ws_client.METRIC_NAMES])
        pd.DataFrame(res.frames).to_parquet(work / "frames.parquet", index=False)
        pd.DataFrame(res.sessions).to_parquet(work / "sessions.parquet", index=False)
        polls[["t_s", "sessions"]].to_parquet(work / "steps.parquet", index=False)
        ctl = pd.DataFrame({"t_s": polls["t_s"], "limit": polls["limit"], "in_flight": polls["active"],
                            "p_latency_s": polls["p99"]})
        ctl.to_parquet(work / "controller.parquet", index=False)
        limits = [x for x in ctl["limit"].tolist() if x is not None and math.isfinite(x)]
        summary.update({
            "sessions_planned": len(plans), "wall_s": round(res.wall_s, 3), "loop": "server",
            "target": opts.target, "options": options, "engine": server.get("engine"),
            "arrivals": checked.arrivals.describe(), "durations": checked.durations.describe(),
            "num_blocks": server.get("num_blocks"), "stopped": res.stopped is not None,
            "stop_reason": res.stopped, "t_stopped_s": res.t_stopped_s,
            "controller": {"name": server.get("admission", "server"), "params": None, "intervals": len(ctl),
                           "final_limit": limits[-1] if limits else None,
                           "max_limit": max(limits) if limits else None, "source": "the server's /metrics"}})
        (work / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    s = summary
    line = (f"{s['frames']} frames, {s['sessions_admitted']} sessions admitted, {s['sessions_refused']} refused "
            f"by {opts.target}; p50 {_ms(s['p50_frame_latency_s'])} p99 {_ms(s['p99_frame_latency_s'])} (the "
            f"server's), round trip p99 {_ms(s['client']['p99_round_trip_s'])}; silent "
            f"{s['silent_frame_fraction']:.3f}; inputs answered {s['client']['inputs_answered']}/"
            f"{s['client']['frames_sent']}; summary: {out / 'summary.json'}")
    if res.stopped:
        err(f"metronome-probe: stopped by {res.stopped} at {res.t_stopped_s:.1f} s; {line}")
        return 128 + int(got["signal"])
    echo(line)
    return 0


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"
