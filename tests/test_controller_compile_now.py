"""A live driver compiles its admission controller before its clock starts: numba compiling inside the first live
interval (tens of seconds on an empty cache) stopped the frame clock, and the supervisor saw a silent engine."""

import subprocess
import sys
import textwrap

import numpy as np

from metronome.admission import AIMDParams, make_controller


def test_compile_now_compiles_the_live_calls_in_a_fresh_process():
    # a fresh process: nothing is compiled yet there (numba's cache, when warm, is loaded by the same calls)
    code = textwrap.dedent("""
        from metronome import control_kernel as ck
        from metronome.admission import AIMDParams, make_controller
        live = (ck.advance, ck.observe, ck.may_admit)
        assert all(not f.signatures for f in live), [f.signatures for f in live]
        make_controller("aimd", 0.08, AIMDParams(interval_s=0.5)).compile_now()
        print(all(f.signatures for f in live))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"


def test_compile_now_leaves_the_controller_as_it_was():
    ctl = make_controller("aimd", 0.08, AIMDParams(interval_s=0.5))
    ctl.observe(0.0, 0.01)
    before = (ctl.arrays.cs.tobytes(), ctl.arrays.lat.copy(), ctl.arrays.tr.copy(), ctl.limit)
    ctl.compile_now()
    # (the state record's bytes: numpy finds no NaN in a record to compare equal, and bytes are stricter)
    assert ctl.arrays.cs.tobytes() == before[0] and np.array_equal(ctl.arrays.lat, before[1])
    assert np.array_equal(ctl.arrays.tr, before[2]) and ctl.limit == before[3] and ctl.trace() == []


def test_a_live_driver_compiles_its_controller_before_its_clock_starts():
    # a fresh process again: constructing the driver (over the fake engine) compiles the controller's live calls
    tests = str(__import__("pathlib").Path(__file__).resolve().parent)
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {tests!r})
        from fake_engine import FakeEngine
        from metronome import control_kernel as ck
        from metronome.admission import AIMDParams, make_controller
        from metronome.calibration import TokenStream
        from metronome.probe.driver import Driver, DriverConfig
        eng = FakeEngine(num_blocks=64)
        ctl = make_controller("aimd", 0.1, AIMDParams(interval_s=0.5))
        Driver(eng, DriverConfig(stream=TokenStream(0.1, 14, 2), horizon_s=1.0), admission=ctl, clock=eng.clock,
               sleep=eng.sleep)
        print(all(f.signatures for f in (ck.advance, ck.observe, ck.may_admit)))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"
