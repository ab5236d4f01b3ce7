"""The live run's records (``metronome.probe.live_sink``): what the driver decides, kept in memory, on disk, or both.

The driver runs on the fake engine's virtual time (``tests/fake_engine.py``), so two runs of one scenario are
the same run: whatever differs between them is the sink's doing.
"""

from __future__ import annotations

from fake_engine import FakeEngine

from metronome.calibration import TokenStream
from metronome.probe.driver import Driver, DriverConfig, SessionPlan
from metronome.probe.live_sink import TABLES, LiveSink
from metronome.probe.records import read_journal

STREAM = TokenStream(0.1, 14, 2)
# four sessions over 14 usable blocks (a session holds k + 1 blocks at its frame k): the pool runs dry, so the
# run has preemptions, a readmission and a re-prefill (events) as well as frames, steps and sessions; b and c
# leave early, d arrives late
PLANS = [SessionPlan("a", prompt_tokens=1), SessionPlan("b", prompt_tokens=1, duration_s=0.45),
         SessionPlan("c", prompt_tokens=1, duration_s=0.45), SessionPlan("d", prompt_tokens=1, arrival_s=0.3,
                                                                         duration_s=0.5)]


def run(out_dir=None, retain=True, sleeps=None):
    eng = FakeEngine(num_blocks=15)
    sleep = eng.sleep
    if sleeps is not None:  # what is on disk each time the driver goes idle
        def sleep(dt):
            sleeps.append({t: len(read_journal(out_dir / f"{t}.jsonl")) if (out_dir / f"{t}.jsonl").exists()
                           else 0 for t in TABLES})
            eng.sleep(dt)
    cfg = DriverConfig(stream=STREAM, horizon_s=1.2, run="sink")
    return Driver(eng, cfg, clock=eng.clock, sleep=sleep, out_dir=out_dir, retain=retain).run(PLANS)


def tables(res) -> dict[str, list[dict]]:
    return {"frames": res.frames, "steps": res.steps, "sessions": res.sessions, "events": res.events}


def test_a_run_kept_only_on_disk_reads_back_every_row_in_order(tmp_path):
    in_memory = tables(run())
    assert in_memory["events"] and all(in_memory[t] for t in TABLES)  # the scenario writes every table
    assert {e["event"] for e in in_memory["events"]} == {"preempt", "readmit", "prefilled"}
    on_disk = run(tmp_path, retain=False)
    # retain=False: the rows lived only in the journals during the run and came back from them at its end
    assert tables(on_disk) == in_memory
    assert on_disk.summary == run().summary
    for t in TABLES:
        assert read_journal(tmp_path / f"{t}.jsonl") == in_memory[t]
        assert all(r["run"] == "sink" for r in in_memory[t])


def test_rows_reach_disk_while_the_engine_is_idle_not_only_at_the_end(tmp_path):
    sleeps: list[dict] = []
    res = run(tmp_path, retain=False, sleeps=sleeps)
    assert sleeps, "the driver never went idle"
    # by the last idle wait, most frames answered so far were on disk (the run ends 1.2 s in; frames come
    # every 0.1 s, so a few at most can still be pending then)
    assert sleeps[-1]["frames"] >= len(res.frames) - 2 * len(PLANS)
    assert sleeps[-1]["steps"] > 0 and max(s["frames"] for s in sleeps[: len(sleeps) // 2]) > 0


def test_a_sink_without_retain_keeps_nothing_in_memory_until_it_closes(tmp_path):
    sink = LiveSink("r", tmp_path, retain=False)
    sink.record("steps", {"t_s": 0.0})
    sink.flush(10.0)
    sink.record("steps", {"t_s": 0.5})
    assert sink.tables["steps"] == [] and read_journal(tmp_path / "steps.jsonl") == [{"run": "r", "t_s": 0.0}]
    assert not sink.flush_due(10.9) and sink.flush_due(11.0)  # a second after the last flush, on its clock
    sink.close()
    assert sink.tables["steps"] == [{"run": "r", "t_s": 0.0}, {"run": "r", "t_s": 0.5}]
    assert LiveSink("r").retain  # without a directory the rows can only be kept in memory
