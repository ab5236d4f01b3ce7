"""The live probe: drives the real vLLM engine with paced real-time sessions (vLLM imported lazily).

Modules (one idea each; none imports vLLM at import time, so ``metronome-sim`` works without it):

* ``models``    ``--model NAME|PATH`` → :class:`~metronome.probe.models.ResolvedModel` (presets with their
  backbone-equivalent configs and streams, ``tiny``, ``smollm2``, local checkpoints, ``--weights dummy``).
* ``engine``    :class:`~metronome.probe.engine.Engine`: the in-process vLLM V1 engine, stepped one step at a
  time, with streaming-input sessions and reads of the scheduler's pool (the only module touching vLLM).
* ``driver``    :class:`~metronome.probe.driver.Driver` / :func:`~metronome.probe.driver.run_live`: paces
  sessions on the frame clock; per-frame and per-step records; admission controller; Prometheus export.
* ``records``   append-only JSONL journals converted to Parquet (a crash keeps every sample).
* ``calibrate`` :func:`~metronome.probe.calibrate.run_calibration`: pool, KV growth, step-latency grid and
  fill rate → a ``measured`` calibration.
* ``live_aimd`` live AIMD against the simulator's N* (``benchmarks/bench_live_aimd.py``): the scenario, settled
  concurrency, the deadline and AIMD-interval choices, one live run and its live-vs-simulated figures.

Running a scenario live (what ``validate`` needs)::

    from metronome.probe.calibrate import CalibrateOptions, engine_config, run_calibration
    from metronome.probe.engine import Engine
    from metronome.probe.driver import SessionPlan, run_live

    opts = CalibrateOptions(model="tiny", out="runs/x", num_blocks=64, max_model_len=992)
    engine = Engine(engine_config(opts))                 # one engine per policy (a window is an engine flag)
    cal = run_calibration(opts, engine=engine).calibration
    res = run_live(engine, cal.stream, [SessionPlan("s0"), ...], horizon_s=30, policy=policy, out_dir="runs/x")
    res.frames, res.steps, res.summary                   # per-frame records, per-step pressure, t_sat/p50/p99/silent
"""
