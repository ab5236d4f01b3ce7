"""The sink+window KV bound as a vLLM general plugin.

**Enable it for any vLLM launch** (``vllm serve``, ``LLM(...)``, the probe) by setting::

    METRONOME_KV_SINKS="S,W"      # e.g. METRONOME_KV_SINKS=32,512
    # and keep prefix caching off: --no-enable-prefix-caching / enable_prefix_caching=False

With the variable unset the plugin does nothing at all. vLLM runs ``register()`` (entry point
``vllm.general_plugins: metronome_sinks``) in every process it starts; it is idempotent.

Each session then keeps ``ceil(S/bs)`` sink blocks plus the blocks covering its last ``W`` positions
(+1 block in flight); blocks that slide out of the window go back to the pool and sink blocks stay put.
Each query attends to the sink blocks and to the blocks holding its last ``W`` positions
(block-granular; the exact definition is in ``semantics.py``).

In-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as the probe and the tests use) load plugins once
per process, possibly before the variable is set: call :func:`activate` (or set the variable and call
:func:`install`) before building the engine. The patches read the variable when an engine builds its KV
specs, so engines built while it is unset are untouched.
"""

from __future__ import annotations

import os
import sys

from metronome.errors import MetronomeError
from metronome.probe.plugin.semantics import ENV_VAR, SinkWindow, mask  # noqa: F401  (re-exported)

_installed = False


def register() -> None:
    """vLLM's entry point: install the plugin when ``METRONOME_KV_SINKS`` asks for it, else do nothing.

    A malformed value stops the process that loads it (``vllm serve``'s API server first, before any engine
    starts) with one line and exit code 2, rather than a traceback or, worse, an engine without the bound.

    First, in a process vLLM starts for an engine metronome started, it arms that process to die with its parent
    (vLLM runs this at the start of each of them: probe/lifetime.py)."""
    from metronome.probe import lifetime

    lifetime.arm_from_env()
    text = os.environ.get(ENV_VAR, "").strip()
    if not text:
        return
    try:
        SinkWindow.parse(text)
        install()
    except MetronomeError as exc:
        sys.stderr.write(f"metronome: error: {exc}\n")
        raise SystemExit(2) from None


def install() -> str:
    """Install the spec, manager and attention patches (idempotent). Returns the attention path used
    ("cpu" or "cuda"). Raises MetronomeError on an unsupported vLLM."""
    global _installed
    from metronome.probe.plugin import versions

    _, _, path = versions.check()
    if _installed:
        return path
    from metronome.probe.plugin import attention, kv

    kv.register_spec()
    kv.patch_attention_spec()
    attention.patch_builders()
    _installed = True
    return path


def activate(sink_tokens: int, window_tokens: int) -> None:
    """Ask for the bound in this process (and in any vLLM process it starts), and install the patches."""
    os.environ[ENV_VAR] = SinkWindow(int(sink_tokens), int(window_tokens)).to_env()
    install()


def deactivate() -> None:
    """Engines built after this run unbounded (patches stay installed but inert)."""
    os.environ.pop(ENV_VAR, None)


def engine_overrides(sink_tokens: int, window_tokens: int, block_size: int) -> dict:
    """What the probe must set to run an engine under the bound (``--kv sinks --sinks S --window W``).

    Returns ``{"env": {...}, "engine_args": {...}, "policy": KVPolicy}``: put ``env`` into ``os.environ``
    and call :func:`install` (or just :func:`activate`) before building the engine, merge ``engine_args``
    into the ``EngineArgs``. The policy is the simulator's matching ``KVPolicy.sinks``."""
    sw = SinkWindow(int(sink_tokens), int(window_tokens))
    sw.check_block_size(int(block_size))
    return {
        "env": {ENV_VAR: sw.to_env()},
        "engine_args": {
            "block_size": int(block_size),
            "enable_prefix_caching": False,  # a hit would re-pin freed gap blocks until the next step
            "enforce_eager": True,  # the pseudo-request count changes per step: no CUDA graphs
        },
        "policy": sw.policy(int(block_size)),
    }
