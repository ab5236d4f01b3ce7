"""The compiled loop's cache follows the form of what it compiles in from elsewhere: the step model and the
jitter ratio (sim/fastpath.forget_other_forms)."""

from metronome.sim import fastpath as fp


def test_cached_loops_of_another_form_are_dropped_and_todays_kept(tmp_path):
    old = [tmp_path / "fastpath.run_span-150.py311.nbi", tmp_path / "fastpath.run_span-150.py311.1.nbc"]
    other = tmp_path / "engine._x-1.py311.nbi"  # another module's cache is not this module's to drop
    for f in old + [other]:
        f.write_bytes(b"x")
    (tmp_path / "fastpath.step_inputs.sha256").write_text("an older form")
    assert fp.forget_other_forms(tmp_path, fp.STEP_FORM) is True
    assert not any(f.exists() for f in old) and other.exists()
    assert (tmp_path / "fastpath.step_inputs.sha256").read_text() == fp.STEP_FORM
    kept = tmp_path / "fastpath.run_span-150.py311.nbi"
    kept.write_bytes(b"compiled from today's form")
    assert fp.forget_other_forms(tmp_path, fp.STEP_FORM) is False and kept.exists()


def test_the_form_is_the_step_models_and_the_jitter_kernels_source():
    import hashlib
    import inspect

    from metronome import jitter_kernel
    from metronome.calibration import step_inputs

    form = inspect.getsource(step_inputs) + inspect.getsource(jitter_kernel)
    assert fp.STEP_FORM == hashlib.sha256(form.encode()).hexdigest()
