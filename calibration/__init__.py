"""Calibration presets shipped with Metronome (the repository's calibration/ folder)."""
