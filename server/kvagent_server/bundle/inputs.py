"""The outside world the plan depends on: cores, GPUs, the model, the vLLM plugin's needs.

Kept apart from `render` so that the plan stays a pure function: tests build `PlanInputs`
by hand, the CLI and `Bundle` call `gather_inputs`.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

from kvagent_server.bundle.render import ModelSource, PlanInputs
from kvagent_server.bundle.topology import HostFacts
from kvagent_server.common.types import ROLES
from kvagent_server.config import BundleConfig, ConfigError

#: Flags the plan sets itself; dropped from the demo model's own argument list.
_PLAN_FLAGS = {"--served-model-name": 1, "--max-model-len": 1, "--model": 1}


def detect_host() -> HostFacts:
    """Cores this process may run on and the NVIDIA GPUs visible to it (no torch import)."""
    try:
        cores = tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cores = tuple(range(os.cpu_count() or 1))
    return HostFacts(cpu_cores=cores, gpu_count=count_gpus())


def count_gpus() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip() and v.strip() != "-1"]
        if not ids:
            return 0
    gpus_dir = Path("/proc/driver/nvidia/gpus")
    try:
        present = len(list(gpus_dir.iterdir()))
    except OSError:
        present = 0
    if visible is not None:
        return min(len(ids), present) if present else 0
    return present


def strip_flags(args: list[str], flags: dict[str, int]) -> list[str]:
    """Drop `flags` (and their value counts) from an argument list."""
    out: list[str] = []
    i = 0
    while i < len(args):
        tok = args[i]
        name = tok.split("=", 1)[0]
        if name in flags:
            i += 1 + (flags[name] if "=" not in tok else 0)
            continue
        out.append(tok)
        i += 1
    return out


def resolve_model(cfg: BundleConfig, *, build: bool = True) -> ModelSource:
    """The configured model: a built-in one by id (null: the demo model), built on first use
    when `build`, or a path/hub name passed to vLLM as is."""
    from kvagent_server.models.builtin import builtin_model

    lora = resolve_lora(cfg, build=build)
    builtin = builtin_model(cfg.model)
    if builtin is None:
        assert cfg.model is not None
        return ModelSource(model=cfg.model, served_name=cfg.served_model_name or cfg.model,
                           lora_modules=lora,
                           mm_placeholder_token_ids=placeholder_token_ids(Path(cfg.model)))
    path = builtin.ensure(None) if build else builtin.path()
    extra = strip_flags(list(builtin.serve_args(builtin.max_model_len)), _PLAN_FLAGS)
    return ModelSource(
        model=str(path), served_name=builtin.name, extra_args=tuple(extra),
        default_max_model_len=builtin.max_model_len,
        extra_env=tuple(sorted(builtin.serve_env().items())), lora_modules=lora,
        mm_placeholder_token_ids=placeholder_token_ids(path),
    )


#: Hugging Face config keys that name a multimodal placeholder token (architectures differ).
_PLACEHOLDER_KEYS = ("image_token_id", "image_token_index", "video_token_id",
                     "video_token_index", "audio_token_id", "audio_token_index")


def placeholder_token_ids(model_dir: Path) -> tuple[int, ...]:
    """The placeholder token ids a local model's config.json names; () when it names none,
    or is not a local directory (a hub name is read by vLLM, not here)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return ()
    if not isinstance(config, dict):
        return ()
    found = {config[k] for k in _PLACEHOLDER_KEYS if isinstance(config.get(k), int)}
    return tuple(sorted(found))


def resolve_lora(cfg: BundleConfig, *, build: bool = True) -> tuple[tuple[str, str], ...]:
    """(name, path) of each configured adapter; a path-less one is a built-in adapter."""
    from kvagent_server.models.builtin import builtin_model
    from kvagent_server.models.cache import default_cache_dir
    from kvagent_server.models.lora import BUILTIN_ADAPTERS

    out: list[tuple[str, str]] = []
    problems: list[str] = []
    base = builtin_model(cfg.model)
    for i, module in enumerate(cfg.lora_modules):
        if module.path is not None:
            out.append((module.name, module.path))
        elif module.name in BUILTIN_ADAPTERS:
            adapter = BUILTIN_ADAPTERS[module.name]
            if base is None or base.name != adapter.base:
                # Its weights have the shapes of that model: vLLM would fail to load it.
                problems.append(f"lora_modules[{i}]: the built-in adapter {module.name!r} is "
                                f"for model {adapter.base!r}, not {cfg.model!r}")
                continue
            path = adapter.ensure(None) if build else default_cache_dir() / adapter.version
            out.append((module.name, str(path)))
        else:
            problems.append(f"lora_modules[{i}].path: required (no built-in adapter is named "
                            f"{module.name!r}; built-in: {', '.join(BUILTIN_ADAPTERS)})")
    if problems:
        raise ConfigError(problems)
    return tuple(out)


def plugin_needs() -> tuple[dict[str, dict[str, str]], dict[str, tuple[str, ...]]]:
    """Per-role env and args of kvagent's vLLM plugin (idle-spin fix, streaming params).

    Empty when the plugin module is absent, so the bundle still runs stock vLLM.
    """
    try:
        mod = importlib.import_module("kvagent_server.vllm_plugin.env")
    except ImportError:
        return {}, {}
    env_fn = getattr(mod, "node_env", None)
    args_fn = getattr(mod, "node_args", None)
    role_env: dict[str, dict[str, str]] = {r: dict(env_fn(r)) for r in ROLES} if env_fn else {}
    role_args: dict[str, tuple[str, ...]] = (
        {r: tuple(args_fn(r)) for r in ROLES} if args_fn else {})
    return role_env, role_args


def gather_inputs(cfg: BundleConfig, *, build_model: bool = True) -> PlanInputs:
    """Collect the plan's inputs on this machine."""
    role_env, role_args = plugin_needs()
    return PlanInputs(
        host=detect_host(),
        model=resolve_model(cfg, build=build_model),
        python=cfg.python or sys.executable,
        role_env=role_env,
        role_args=role_args,
    )
