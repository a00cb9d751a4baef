"""Random LoRA adapters for the built-in models, written in PEFT's on-disk format without PEFT
(`adapter_config.json` + `adapter_model.safetensors`), for `--enable-lora --lora-modules`.

Its B matrices are random, not zero as in a fresh PEFT adapter, so serving it really changes
the model: the same prompt gives another greedy answer with the adapter than without, which
is what makes adapter-aware KV reuse testable. Usage::

    from kvagent_server.models.lora import DEMO_LORA_NAME, ensure_demo_lora
    path = ensure_demo_lora()
    # vllm serve <demo model> --enable-lora --lora-modules kvagent-demo-lora=<path>
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvagent_server.models.cache import ensure_built

DEMO_LORA_NAME = "kvagent-demo-lora"
DEMO_LORA_VERSION = "demo-lora-v2"
TEKKEN_LORA_NAME = "kvagent-demo-tekken-lora"
TEKKEN_LORA_VERSION = "tekken-lora-v2"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
LORA_RANK = 8
LORA_ALPHA = 16
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_SEED = 20251202
#: Std of A (scaled by 1/sqrt(fan-in)) and B: large enough that the adapter moves greedy
#: argmaxes of the random base model, small enough to stay a perturbation.
_B_STD = 0.05
_RESIDUAL_WRITERS = ("self_attn.o_proj", "mlp.down_proj")


def lora_config(base_model: str, rank: int = LORA_RANK, alpha: int = LORA_ALPHA,
                target_modules: tuple[str, ...] = TARGET_MODULES) -> dict[str, object]:
    """The `adapter_config.json` of a plain LoRA (the fields vLLM's PEFTHelper reads)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(target_modules), "fan_in_fan_out": False,
        "modules_to_save": None, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True,
    }


def lora_weights(shapes: dict[str, tuple[int, int]], num_layers: int, *, rank: int = LORA_RANK,
                 seed: int = _SEED, control_dims: int = 0) -> dict[str, Any]:
    """Random A/B tensors named as PEFT saves them, for `shapes`: module -> (out, in)
    (`self_attn.q_proj`, `mlp.down_proj`, ...) in each of `num_layers` layers.

    The last `control_dims` rows of the modules that write the residual stream (`o_proj`,
    `down_proj`) are zero: the adapter leaves the base model's level chain (models/ending.py)
    alone, so its answers end the same way."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for layer in range(num_layers):
        for module, (fan_out, fan_in) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=gen) * _B_STD
            if control_dims and module in _RESIDUAL_WRITERS:
                b[-control_dims:] = 0.0
            out[f"{prefix}.lora_A.weight"] = a.contiguous()
            out[f"{prefix}.lora_B.weight"] = b.contiguous()
    return out


def llama_module_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(out, in) of each LoRA target of a Llama-style decoder layer, from its config.json."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    return {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }


def write_lora(out: Path, base_model_dir: Path, *, rank: int = LORA_RANK,
               alpha: int = LORA_ALPHA, seed: int = _SEED, control_dims: int = 0) -> None:
    """Write a random LoRA adapter for the Llama-style model in `base_model_dir` to `out`
    (leaving its last `control_dims` residual dims alone, see `lora_weights`)."""
    from safetensors.torch import save_file

    config = json.loads((base_model_dir / "config.json").read_text())
    tensors = lora_weights(llama_module_shapes(config), int(config["num_hidden_layers"]),
                           rank=rank, seed=seed, control_dims=control_dims)
    save_file(tensors, str(out / ADAPTER_WEIGHTS))
    cfg = lora_config(str(base_model_dir), rank, alpha)
    (out / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def ensure_demo_lora(cache_dir: Path | None = None) -> Path:
    """The demo model's adapter directory, built (deterministically) on first use."""
    from kvagent_server.models.demo import ANSWER_LEVELS, ensure_demo_model
    from kvagent_server.models.ending import control_dims

    base = ensure_demo_model(cache_dir)
    ctl = control_dims(ANSWER_LEVELS)
    return ensure_built(DEMO_LORA_VERSION, lambda out: write_lora(out, base, control_dims=ctl),
                        cache_dir, marker=ADAPTER_CONFIG)


def ensure_tekken_lora(cache_dir: Path | None = None) -> Path:
    """The tekken-format model's adapter directory, built (deterministically) on first use."""
    from kvagent_server.models.ending import control_dims
    from kvagent_server.models.tekken import ANSWER_LEVELS, ensure_tekken_model

    base = ensure_tekken_model(cache_dir)
    ctl = control_dims(ANSWER_LEVELS)
    return ensure_built(TEKKEN_LORA_VERSION, lambda out: write_lora(out, base, control_dims=ctl),
                        cache_dir, marker=ADAPTER_CONFIG)


@dataclass(frozen=True)
class BuiltinAdapter:
    """An adapter kvagent builds itself, for one built-in model (its shapes)."""

    base: str  # the built-in model's served name
    version: str  # cache directory name
    ensure: Callable[[Path | None], Path]


#: Built-in adapters by name: what a `lora_modules` entry without a path refers to.
BUILTIN_ADAPTERS: dict[str, BuiltinAdapter] = {
    DEMO_LORA_NAME: BuiltinAdapter("kvagent-demo", DEMO_LORA_VERSION, ensure_demo_lora),
    TEKKEN_LORA_NAME: BuiltinAdapter("kvagent-demo-tekken", TEKKEN_LORA_VERSION,
                                     ensure_tekken_lora),
}


def builtin_adapter_for(model: str) -> str | None:
    """The name of the built-in adapter made for the built-in model `model`, if any."""
    return next((name for name, a in BUILTIN_ADAPTERS.items() if a.base == model), None)


def main() -> None:
    """Build (if needed) and print the adapter's path."""
    print(ensure_demo_lora())


if __name__ == "__main__":
    main()
