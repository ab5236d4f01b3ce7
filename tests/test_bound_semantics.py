"""The bound's attention semantics (probe/plugin/semantics.py, no vLLM needed) are the core KV policy's."""

from hypothesis import given
from hypothesis import strategies as st

from metronome.kv_policy import KVPolicy
from metronome.probe.plugin.semantics import SinkWindow


@given(st.sampled_from([1, 16, 32]), st.integers(0, 100), st.integers(1, 400), st.integers(0, 2000))
def test_plugin_visibility_is_exactly_the_resident_set(bs, s, w, q):
    w = max(w, bs, s + 1)
    sw = SinkWindow(s, w)
    policy = sw.policy(bs)
    assert policy == (KVPolicy.sinks(bs, s, w) if s else KVPolicy.window(bs, w))
    visible = [k for k in range(q + 1) if sw.visible(q, k, bs)]
    assert len(visible) == sw.attended(q, bs) == policy.attended_tokens(q)
    # every key the query sees is in a resident block (or is the query itself), and nothing more
    resident_blocks = {k // bs for k in visible if k < q}
    assert len(resident_blocks) == policy.resident_blocks(q) or q == 0
