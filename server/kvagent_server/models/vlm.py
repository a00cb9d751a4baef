"""A tiny random-weight vision-language model (LLaVA architecture: a CLIP vision tower, a
two-layer projector and a Llama decoder) with a processor built offline: the demo model's
tokenizer plus an `<image>` token, and a CLIP image processor configured by hand.

Images are resized to 56x56 pixels and cut into 14x14 patches: every image becomes 16
`<image>` placeholder tokens in the prompt, whose KV depends on the image's pixels. Two
prompts with different images therefore have identical token ids but different KV, which
is what multimodal-aware KV reuse must notice. Usage::

    from kvagent_server.models.vlm import ensure_vlm_model, vlm_serve_args
    path = ensure_vlm_model()
    argv = ["--model", str(path), *vlm_serve_args()]
"""

from __future__ import annotations

import json
from pathlib import Path

from kvagent_server.models.cache import ensure_built

VLM_MODEL_NAME = "kvagent-demo-vlm"
VLM_MODEL_VERSION = "demo-vlm-v1"
VLM_MAX_MODEL_LEN = 8192
IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 56
PATCH_SIZE = 14
#: Placeholder tokens per image: one per patch (the CLS feature is dropped).
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2

_SEED = 20251203
_HIDDEN = 256
_LAYERS = 4
_HEADS = 4
_INTERMEDIATE = 704
_VISION_HIDDEN = 64
_LM_HEAD_STD = 0.25


def vlm_serve_args(max_model_len: int = VLM_MAX_MODEL_LEN) -> list[str]:
    """vLLM serve arguments the model needs besides `--model PATH`: at most 4 images per
    prompt keeps the encoder's profiling run small."""
    return [
        "--served-model-name", VLM_MODEL_NAME,
        "--max-model-len", str(max_model_len),
        "--limit-mm-per-prompt", '{"image":4}',
        "--dtype", "float32",
    ]


def vlm_serve_env() -> dict[str, str]:
    return {}


def ensure_vlm_model(cache_dir: Path | None = None) -> Path:
    """The model's directory, built (deterministically) on first use."""
    return ensure_built(VLM_MODEL_VERSION, lambda out: _build(out, cache_dir), cache_dir)


def chat_template() -> str:
    """The demo model's template, with an `<image>` placeholder for each image part."""
    from kvagent_server.demo_model import CHAT_TEMPLATE

    text_only = "{%- if part.text is defined -%}{{ part.text }}{%- endif -%}"
    assert text_only in CHAT_TEMPLATE, "the demo template changed: update the VLM's"
    with_images = ("{%- if part.type is defined and part.type in ('image', 'image_url') -%}"
                   + IMAGE_TOKEN + "{%- elif part.text is defined -%}{{ part.text }}"
                   "{%- endif -%}")
    return CHAT_TEMPLATE.replace(text_only, with_images)


def _build(out: Path, cache_dir: Path | None) -> None:
    import torch
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        GenerationConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    from kvagent_server.demo_model import DEMO_MAX_MODEL_LEN, ensure_demo_model

    tok = AutoTokenizer.from_pretrained(str(ensure_demo_model(cache_dir)))
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    template = chat_template()
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=tok, patch_size=PATCH_SIZE, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, image_token=IMAGE_TOKEN, chat_template=template)
    processor.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = template
    cfg.pop("backend", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    ids = {k: tok.convert_tokens_to_ids(v) for k, v in
           (("bos", tok.bos_token), ("eos", tok.eos_token), ("pad", tok.pad_token))}
    text = LlamaConfig(
        vocab_size=len(tok), hidden_size=_HIDDEN, intermediate_size=_INTERMEDIATE,
        num_hidden_layers=_LAYERS, num_attention_heads=_HEADS, num_key_value_heads=_HEADS,
        max_position_embeddings=DEMO_MAX_MODEL_LEN * 2, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=ids["bos"],
        eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    vision = CLIPVisionConfig(
        hidden_size=_VISION_HIDDEN, intermediate_size=2 * _VISION_HIDDEN,
        num_hidden_layers=2, num_attention_heads=1, image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE, projection_dim=_VISION_HIDDEN)
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_id,
        vision_feature_select_strategy="default", vision_feature_layer=-1,
        projector_hidden_act="gelu", image_seq_length=IMAGE_TOKENS, torch_dtype="float32")
    torch.manual_seed(_SEED)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, _LM_HEAD_STD)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    model.save_pretrained(str(out), safe_serialization=True)


def main() -> None:
    """Build (if needed) and print the model's path."""
    print(ensure_vlm_model())


if __name__ == "__main__":
    main()
