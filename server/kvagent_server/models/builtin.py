"""The models kvagent builds itself, by id: what `model:` (config), `--model` (CLI) and
`kvagent demo --model` accept besides a path or hub name.

Each entry knows how to build its directory (once, then cached) and the vLLM arguments and
environment it must be served with; `bundle.inputs.resolve_model` turns one into a `ModelSource`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvagent_server.models.cache import default_cache_dir


@dataclass(frozen=True)
class BuiltinModel:
    """A locally built model: its id (also its served name) and how to build and serve it."""

    name: str
    version: str  # the cache directory's name: a new version is a new build
    ensure: Callable[[Path | None], Path]
    serve_args: Callable[[int], list[str]]
    serve_env: Callable[[], dict[str, str]]
    max_model_len: int
    description: str
    #: Its chat format takes an assistant message with both text and tool calls (Mistral's
    #: rejects one: a message is either).
    text_with_tool_calls: bool = True

    def path(self, cache_dir: Path | None = None) -> Path:
        """Where the build lives (whether or not it is built yet)."""
        return (cache_dir or default_cache_dir()) / self.version


def _demo() -> BuiltinModel:
    from kvagent_server.models import demo as m

    return BuiltinModel(m.DEMO_MODEL_NAME, m.DEMO_MODEL_VERSION, m.ensure_demo_model,
                        m.demo_serve_args, m.demo_serve_env, m.DEMO_MAX_MODEL_LEN,
                        "4-layer Llama, locally trained BPE, Hermes-style template")


def _tekken() -> BuiltinModel:
    from kvagent_server.models import tekken as m

    return BuiltinModel(m.TEKKEN_MODEL_NAME, m.TEKKEN_MODEL_VERSION, m.ensure_tekken_model,
                        m.tekken_serve_args, m.tekken_serve_env, m.TEKKEN_MAX_MODEL_LEN,
                        "2-layer Mistral, Mistral NeMo's tekken tokenizer and chat format",
                        text_with_tool_calls=False)


def _vlm() -> BuiltinModel:
    from kvagent_server.models import vlm as m

    return BuiltinModel(m.VLM_MODEL_NAME, m.VLM_MODEL_VERSION, m.ensure_vlm_model,
                        m.vlm_serve_args, m.vlm_serve_env, m.VLM_MAX_MODEL_LEN,
                        "Idefics3: tiny SigLIP-style vision tower + 4-layer Llama, 64 tokens per image")


_FACTORIES: dict[str, Callable[[], BuiltinModel]] = {
    "kvagent-demo": _demo,
    "kvagent-demo-tekken": _tekken,
    "kvagent-demo-vlm": _vlm,
}
DEFAULT_MODEL = "kvagent-demo"


def builtin_names() -> list[str]:
    """The ids of the built-in models."""
    return list(_FACTORIES)


def builtin_model(name: str | None) -> BuiltinModel | None:
    """The built-in model `name` (None: the default demo model); None if `name` is not one."""
    factory = _FACTORIES.get(DEFAULT_MODEL if name is None else name)
    return factory() if factory is not None else None
