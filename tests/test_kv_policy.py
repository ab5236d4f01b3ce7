"""KV policies: block-granular residency, the way a paged engine frees blocks."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metronome.errors import MetronomeError
from metronome.kv_policy import KVPolicy, make_policy

block_sizes = st.sampled_from([1, 2, 16, 32])


@st.composite
def policies(draw):
    bs = draw(block_sizes)
    kind = draw(st.sampled_from(["unbounded", "window", "sinks"]))
    if kind == "unbounded":
        return KVPolicy.unbounded(bs)
    w = draw(st.integers(max(bs, 2), 40 * bs))
    if kind == "window":
        return KVPolicy.window(bs, w)
    s = draw(st.integers(1, w - 1))
    return KVPolicy.sinks(bs, s, w)


def kept_positions(p: KVPolicy, n: int) -> set[int]:
    """Brute force: the token positions the next query (at n) may attend to, from the cache.

    Block-granular sinks+window: k < S* (sinks rounded up to whole blocks) or k >= bs*floor((n-W+1)/bs)."""
    if not p.bounded:
        return set(range(n))
    bs = p.block_size
    s_star = -(-p.sink_tokens // bs) * bs
    first = max(n - p.window_tokens + 1, 0) // bs * bs
    return {k for k in range(n) if k < s_star or k >= first}


def blocks_brute(p: KVPolicy, n: int) -> int:
    """A paged engine keeps a block while any position in it is kept (blocks past n are not allocated)."""
    return len({k // p.block_size for k in kept_positions(p, n)} | ({(n - 1) // p.block_size} if n else set()))


@given(policies(), st.integers(0, 3000))
def test_resident_blocks_match_a_brute_force_paged_cache(p, n):
    assert int(p.resident_blocks(n)) == blocks_brute(p, n)


@given(policies(), st.integers(0, 3000))
def test_blocks_never_negative_and_tokens_fill_blocks(p, n):
    b, t = int(p.resident_blocks(n)), int(p.resident_tokens(n))
    assert b >= 0 and t >= 0
    assert t <= b * p.block_size  # resident tokens live in resident blocks
    assert t >= len(kept_positions(p, n))  # and include every kept position


@given(policies(), st.integers(0, 3000))
def test_unbounded_is_monotone_and_bounded_is_capped(p, n):
    if not p.bounded:
        assert p.resident_tokens(n + 1) == p.resident_tokens(n) + 1
        assert p.resident_blocks(n + 1) >= p.resident_blocks(n)
    else:
        cap = p.sink_blocks + p.window_blocks + 1
        assert p.max_resident_blocks == cap
        assert p.resident_blocks(n) <= cap
        assert p.resident_tokens(n) <= cap * p.block_size


@given(st.integers(1, 64), st.integers(1, 200), st.integers(0, 5000))
def test_sink_blocks_are_never_freed(bs, s, n):
    w = s + bs + 7
    p = KVPolicy.sinks(bs, s, w)
    kept = {k // bs for k in kept_positions(p, n)}
    sink_blocks = set(range(min(p.sink_blocks, -(-n // bs))))
    assert sink_blocks <= kept
    # and the count includes them: dropping sinks (window only) never holds more
    assert p.resident_blocks(n) >= KVPolicy.window(bs, w).resident_blocks(n)


@given(policies(), st.integers(0, 3000), st.integers(0, 500))
def test_canonical_form_preserves_residency_for_every_future(p, n, d):
    n_c, b_off, t_off = p.canonical(n)
    assert p.resident_blocks(n + d) == p.resident_blocks(n_c + d) + b_off
    assert p.resident_tokens(n + d) == p.resident_tokens(n_c + d) + t_off


@given(policies(), st.integers(0, 3000))
def test_attended_tokens_is_the_mask_size(p, n):
    # the next query (position n) attends to the kept positions and itself
    assert p.attended_tokens(n) == len(kept_positions(p, n)) + 1


@given(st.integers(2, 200), st.integers(0, 3000))
def test_with_one_token_blocks_the_mask_is_streaming_llms(w, n):
    s = max(1, w // 4)
    p = KVPolicy.sinks(1, s, w)
    mask = [k for k in range(n + 1) if k < s or n - k < w]
    assert p.attended_tokens(n) == len(mask)


def test_the_window_keeps_between_w_and_w_plus_a_block_of_recent_keys():
    p = KVPolicy.window(32, 64)
    recent = [int(p.attended_tokens(n)) for n in range(200, 400)]
    assert min(recent) == 64 and max(recent) == 64 + 31


def test_vectorised_equals_scalar():
    p = KVPolicy.sinks(16, 20, 100)
    n = np.arange(0, 1000)
    assert list(p.resident_blocks(n)) == [int(p.resident_blocks(int(x))) for x in n]


def test_window_example_by_hand():
    # W=64, bs=32: after 65 tokens the next query needs positions 2..64 -> blocks 0,1,2 all still held
    p = KVPolicy.window(32, 64)
    assert p.resident_blocks(65) == 3
    # after 96 tokens: positions 33..95 -> blocks 1,2 (block 0 wholly out of the window is freed)
    assert p.resident_blocks(96) == 2
    s = KVPolicy.sinks(32, 4, 64)
    assert s.resident_blocks(96) == 3  # sink block 0 stays pinned


@pytest.mark.parametrize("kind,w,s,msg", [
    ("window", 8, None, "under one block"),
    ("sinks", 64, 64, "fewer than the window"),
    ("sinks", 64, 0, "needs --sinks"),
    ("window", None, None, "needs --window"),
    ("bogus", 64, None, "unknown KV policy"),
])
def test_bad_policies_are_one_line_errors(kind, w, s, msg):
    with pytest.raises(MetronomeError, match=msg) as e:
        make_policy(kind, 16, window=w, sinks=s)
    assert "\n" not in str(e.value)


@given(needs=st.lists(st.integers(0, 50), max_size=30), free=st.integers(0, 300))
def test_admit_fcfs_admits_the_longest_prefix_that_fits(needs, free):
    from metronome.serving import admit_fcfs

    asked = []
    k = admit_fcfs(list(range(len(needs))), lambda i: asked.append(i) or needs[i], free)
    assert asked == list(range(min(k + 1, len(needs))))  # head first, and no one past the first that did not fit
    assert sum(needs[:k]) <= free  # what it admitted fits
    assert k == len(needs) or sum(needs[:k + 1]) > free  # and it stopped at the first head that did not


# ------------------------------------------------------------------------------ the policy answers for itself
def test_the_policy_says_how_it_is_named_served_and_selected():
    from metronome.kv_policy import make_policy

    s, w, u = KVPolicy.sinks(16, 16, 368), KVPolicy.window(16, 368), KVPolicy.unbounded(16)
    assert [p.short_words() for p in (s, w, u)] == ["sinks S=16, W=368", "window W=368", "unbounded"]
    assert [p.slug() for p in (s, w, u)] == ["-sinks16-window368", "-window368", ""]
    assert [p.cli_args() for p in (s, w, u)] == [["--kv", "sinks", "--sinks", "16", "--window", "368"],
                                                 ["--kv", "window", "--window", "368"], ["--kv", "unbounded"]]
    assert s.engine_settings() == {"sliding_window": 368, "sinks": 16}  # the plugin
    assert w.engine_settings() == {"sliding_window": 368, "sinks": None}  # vLLM's own window
    assert u.engine_settings() == {"sliding_window": None, "sinks": None}
    assert [p.runs_plugin for p in (s, w, u)] == [True, False, False]
    for p in (s, w, u):  # the options read back into the same policy
        o = p.options()
        assert make_policy(o.pop("kv"), 16, **o) == p


def test_no_code_outside_kv_policy_branches_on_a_policy_kind():
    """A new policy is a new KVPolicy, not a new branch in every caller: outside metronome/kv_policy.py no code
    compares a policy's kind (or a --kv value) with a policy name."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    branch = re.compile(r"""\b(kind|kv)\s*(==|!=)\s*["'](unbounded|window|sinks)["']"""
                        r"""|(==|!=)\s*["'](window|sinks)["']|\bin\s*\(\s*["'](window|sinks)["']""")
    found = []
    for folder in ("metronome", "sim", "probe", "benchmarks", "examples"):
        for f in sorted((root / folder).rglob("*.py")):
            if f == root / "metronome" / "kv_policy.py":
                continue
            for no, line in enumerate(f.read_text().splitlines(), 1):
                if branch.search(line) and not line.lstrip().startswith("for "):  # a loop over policies is fine
                    found.append(f"{f.relative_to(root)}:{no}: {line.strip()}")
    assert found == [], "\n".join(found)


# ------------------------------------------------------------------------------ policies as types: the registry
def test_a_budget_of_b_tokens_keeps_the_sinks_and_the_last_b_minus_s():
    """The trial policy: ``budget`` B (with optional sinks S) keeps what ``sinks(S, W = B − S)`` keeps, and with
    no sinks what ``window(B)`` keeps, so vLLM's own window serves it then and the plugin otherwise."""
    b, s = make_policy("budget", 16, budget=384, sinks=16), KVPolicy.sinks(16, 16, 368)
    n = np.arange(0, 3000)
    assert (b.resident_blocks(n) == s.resident_blocks(n)).all() and b.max_resident_blocks == 1 + 23 + 1
    assert b.engine_settings() == {"sliding_window": 368, "sinks": 16} and b.runs_plugin
    assert b.rebase_tokens() == 384 and b.admission_cap_blocks(64, 4096) == s.admission_cap_blocks(64, 4096)
    w = make_policy("budget", 16, budget=368)
    assert (w.resident_blocks(n) == KVPolicy.window(16, 368).resident_blocks(n)).all()
    assert w.engine_settings() == {"sliding_window": 368, "sinks": None} and not w.runs_plugin
    assert (w.describe(), w.short_words(), w.slug()) == ("budget(B=368)", "budget B=368", "-budget368")
    assert (b.describe(), b.short_words(), b.slug()) == ("budget(B=384, S=16)", "budget B=384, S=16",
                                                         "-budget384-sinks16")
    assert b.cli_args() == ["--kv", "budget", "--budget", "384", "--sinks", "16"]
    o = b.options()
    assert make_policy(o.pop("kv"), 16, **o) == b and b != s


@pytest.mark.parametrize("kind,params,msg", [
    ("budget", {}, "--kv budget needs --budget"),
    ("budget", {"budget": 40, "sinks": 32}, "leaves 8 tokens past the 32 sinks, under one block"),
    ("window", {"window": 64, "bogus": 1}, "no KV policy takes bogus"),
])
def test_bad_parameters_of_a_policy_are_one_line_errors(kind, params, msg):
    with pytest.raises(MetronomeError, match=msg) as e:
        make_policy(kind, 16, **params)
    assert "\n" not in str(e.value)


def test_every_command_knows_a_registered_policy_and_its_parameters():
    """No command has a hand-written flag per policy: ``--kv budget --budget B`` reaches the simulator's commands,
    the probe's and the report from the registry line alone."""
    from metronome.cli import probe_cli, sim_cli
    from metronome.kv_policy import check_policy_options, given_params
    from metronome.report.build import reproduce_command
    from metronome.report.plan import ReportOptions, default_window_tokens, make_plan

    p = sim_cli.build_parser()
    for cmd in (["run", "--sessions", "4"], ["what-if", "--sessions", "4"], ["capacity"],
                ["fleet", "--arrival-rate", "1"]):
        args = p.parse_args([*cmd, "--kv", "budget", "--budget", "384", "--sinks", "16"])
        assert (args.kv, args.budget, args.sinks) == ("budget", "384", "16")  # parsed as values (grids) later
    cal, pol = sim_cli._calibration_and_policy(p.parse_args(["run", "--sessions", "4", "--kv", "budget",
                                                             "--budget", "384", "--sinks", "16"]), "moshi-7b-h200")
    assert pol == make_policy("budget", cal.engine.block_size_tokens, budget=384, sinks=16)
    for sub in ("calibrate", "run"):
        parser = probe_cli.calibrate_parser() if sub == "calibrate" else probe_cli.run_parser()
        args = parser.parse_args(["--model", "tiny", "--out", "x", "--kv", "budget", "--budget", "160"]
                                 + (["--horizon", "5", "--arrival-rate", "1"] if sub == "run" else []))
        assert given_params(args) == (("budget", 160),)
    with pytest.raises(MetronomeError, match="--budget does not apply to --kv window"):
        check_policy_options("window", {"budget": 160})
    # the report sizes the budget as it sizes a window when not given, and keeps what it is given
    rp = p.parse_args(["report", "--kv", "budget", "--out", "x"])
    options = ReportOptions(calibrations=("moshi-7b-h200",), kv=rp.kv, kv_params=given_params(rp))
    from metronome import calibration as calmod

    cal = calmod.load("moshi-7b-h200")
    plan = make_plan("moshi-7b-h200", cal, options)
    assert plan.policy == make_policy("budget", 16, budget=default_window_tokens(cal, 0)) and plan.window_defaulted
    given = ReportOptions(calibrations=("moshi-7b-h200",), kv="budget", kv_params=(("budget", 400), ("sinks", 16)))
    plan = make_plan("moshi-7b-h200", cal, given)
    assert plan.policy.window_tokens == 384 and plan.policy.sink_tokens == 16 and not plan.window_defaulted
    assert "--kv budget --budget 400 --sinks 16" in reproduce_command(given)


def test_the_simulator_runs_a_budget_as_the_sinks_and_window_it_keeps():
    """200 sessions of up to 25 blocks each, most of them past their window: a budget that kept other than the
    S sinks and the last B − S tokens would hold other blocks in the steps and the summary."""
    from metronome.sim import scenario as sc

    kw = dict(calibration="moshi-7b-h200", sessions=200, horizon=60.0, session_duration="exp:40", seed=1,
              num_blocks=3000)
    a = sc.run(sc.make_scenario(kv="budget", budget=384, sinks=16, **kw))
    b = sc.run(sc.make_scenario(kv="sinks", sinks=16, window=368, **kw))
    assert a.summary["policy"] == "budget(B=384, S=16)"
    assert {k: v for k, v in a.summary.items() if k not in ("policy", "wall_s")} == \
        {k: v for k, v in b.summary.items() if k not in ("policy", "wall_s")}
    assert a.steps.equals(b.steps)
    last = a.steps.iloc[-1]  # the sessions still running are held to 1 sink + 23 window blocks + 1, by hand
    assert last.running > 0 and last.resident_blocks <= last.running * (1 + 23 + 1)


def test_a_rebase_keeps_the_sinks_and_the_last_tokens_by_hand():
    """What a rebased session keeps of its token ids (serving.rebase_ids, rebase_request_ids), by hand: ids 0..99,
    block 16. Sinks S=16, W=32: keep 48, ids 0..15 then 68..99. A window of 32: the last 32. Unbounded keeping 10:
    the last 10. A history of 20 fits whole. When the kept history and the chunk leave no room for the output
    (max_model_len 60: 48 + 10 + 2 >= 60; 64 still fits), the new request is what a rebase keeps of all of it, as its
    chunk."""
    from metronome import serving

    ids = list(range(100))
    sinks, window, unb = KVPolicy.sinks(16, 16, 32), KVPolicy.window(16, 32), KVPolicy.unbounded(16)
    assert serving.rebase_ids(sinks, ids, 48) == list(range(16)) + list(range(68, 100))
    assert serving.rebase_ids(window, ids, 32) == list(range(68, 100))
    assert serving.rebase_ids(unb, ids, 10) == list(range(90, 100))
    assert serving.rebase_ids(sinks, ids[:20], 48) == list(range(20))
    chunk = list(range(100, 110))
    kept, ch = serving.rebase_request_ids(sinks, ids, chunk, 2, 48, 128)  # 48 + 10 + 2 < 128: fits
    assert kept == list(range(16)) + list(range(68, 100)) and ch == chunk
    kept, ch = serving.rebase_request_ids(sinks, ids, chunk, 2, 48, 64)  # 48 + 10 + 2 = 60 < 64: fits
    assert kept == list(range(16)) + list(range(68, 100)) and ch == chunk
    kept, ch = serving.rebase_request_ids(sinks, ids, chunk, 2, 48, 60)  # 60 >= 60: all of it, rebased
    assert kept == [] and ch == list(range(16)) + list(range(78, 100)) + chunk
    assert serving.rebase_keep_tokens(unb, 1000) == 500 and serving.rebase_keep_tokens(unb, 1000, unbounded=16) == 16
    assert serving.rebase_keep_tokens(sinks, 1000, unbounded=16) == 48


def test_compiled_blocks_in_floors_as_python_does():
    """Compiled code divides by a block size that is a power of two with a shift (serving's compiled form of
    kv_policy.blocks_in), by any other with a division: either way the floor Python's // gives, negatives and
    zero included."""
    import numba as nb

    from metronome import serving  # noqa: F401 (registers the compiled form)
    from metronome.kv_policy import blocks_in

    f = nb.njit(lambda n, bs: blocks_in(n, bs))
    for bs in (1, 2, 4, 16, 64, 3, 12, 48):
        for n in range(-3 * bs - 2, 5 * bs + 3):
            assert f(n, bs) == n // bs, (n, bs)


@given(st.sampled_from([1, 2, 16, 32, 3, 12]), st.sampled_from(["unbounded", "window", "sinks"]),
       st.integers(0, 3000))
def test_the_compiled_residency_matches_a_brute_force_paged_cache(bs, kind, n):
    """What the engine step compiles (serving.resident_blocks_jit, resident_tokens_jit) keeps what a paged cache
    keeps, for block sizes that are powers of two (a shift) and others (a division)."""
    from metronome.serving import resident_blocks_jit, resident_tokens_jit

    p = {"unbounded": KVPolicy.unbounded(bs), "window": KVPolicy.window(bs, 7 * bs + 5),
         "sinks": KVPolicy.sinks(bs, bs + 1, 7 * bs + 5)}[kind]
    assert resident_blocks_jit(n, *p.residency()) == blocks_brute(p, n)
    assert resident_tokens_jit(n, *p.residency()) == len(kept_positions(p, n))
