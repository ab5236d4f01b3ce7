"""Metronome: serving real-time interaction models without falling off the KV cliff.

The core (this package's top level) is pure: calibration schema, KV policies, the fill model,
admission controllers. It knows no clock and no engine. ``metronome.sim`` (SimPy) and
``metronome.probe`` (the real vLLM engine) build on it; the CLIs and reports sit on top.
"""

__version__ = "0.1.0"
