"""A tiny random-weight model on a real third-party tokenizer and chat format: Mistral's
tekken tokenizer (the one Mistral NeMo ships), copied from the `mistral_common` package
that vLLM depends on, served with `--tokenizer-mode mistral`.

Unlike the demo model's Hermes-style template, this format is *not* a pure append between
turns (`mistral_common`'s v3 instruct tokenizer renders it, not a Jinja template):

- the tool definitions (`[AVAILABLE_TOOLS]...`) and the system prompt are rendered right
  before the *last* user message, so a new user message moves them: the previous turn's
  tokens after `<s>` no longer match;
- tool calls carry their 9-character call ids (`[TOOL_CALLS][{..., "id": "abcdefghi"}]`)
  and tool results repeat them (`[TOOL_RESULTS]{"content": ..., "call_id": ...}`), so the
  ids are part of the prompt's tokens.

Within one agent step (assistant tool call, then tool results, no new user message) the
rendering *is* an append. Answers end like the demo model's: a level chain in the weights
(models/ending.py) makes every greedy answer 33..160 tokens, then `</s>`. Usage::

    from kvagent_server.models.tekken import ensure_tekken_model, tekken_serve_args
    path = ensure_tekken_model()
    argv = ["--model", str(path), *tekken_serve_args()]
"""

from __future__ import annotations

import json
import math
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

from kvagent_server.models import ending
from kvagent_server.models.cache import ensure_built

TEKKEN_MODEL_NAME = "kvagent-demo-tekken"
TEKKEN_MODEL_VERSION = "demo-tekken-v2"
TEKKEN_MAX_MODEL_LEN = 16384
TEKKEN_TOOL_CALL_PARSER = "mistral"
#: Mistral NeMo's tokenizer (tekken, instruct format v3), as `mistral_common` ships it.
TEKKEN_SOURCE = "tekken_240718.json"
TEKKEN_FILE = "tekken.json"

_SEED = 20251201
_HIDDEN = 128
_LAYERS = 2
_HEADS = 2  # head_dim 64, a size vLLM's CPU attention supports
_INTERMEDIATE = 384
#: Wide enough that greedy argmax never hinges on float noise (see demo_model).
_LM_HEAD_STD = 0.5
#: The level chain that ends answers (models/ending.py): 33..160 answer tokens, then `</s>`.
ANSWER_LEVELS = 160
_FIRST_MAX = 128
_PER_LEVEL = 16
#: Twice the largest residual norm outside the control dims measured (0.254, over 24 seeded
#: chats and their answers; see the demo model's `_RESIDUAL_BOUND`).
_RESIDUAL_BOUND = 0.5


def tekken_source() -> Path:
    """The tekken tokenizer file inside the installed `mistral_common` package."""
    path = Path(str(resources.files("mistral_common") / "data" / TEKKEN_SOURCE))
    if not path.is_file():
        raise FileNotFoundError(f"{path}: mistral_common does not ship {TEKKEN_SOURCE} "
                                "(install vLLM, which depends on mistral_common)")
    return path


def tekken_vocab_size(path: Path | None = None) -> int:
    """The tokenizer's vocabulary size (special tokens included)."""
    data = json.loads((path or tekken_source()).read_text())
    return int(data["config"]["default_vocab_size"])


def tekken_serve_args(max_model_len: int = TEKKEN_MAX_MODEL_LEN) -> list[str]:
    """vLLM serve arguments the model needs besides `--model PATH`.

    `--tokenizer-mode mistral` makes vLLM tokenize and render chats with `mistral_common`
    (the tekken.json in the model directory) instead of a Hugging Face tokenizer.

    The `mistral` tool parser is what makes `tool_choice: "required"` produce calls (vLLM
    constrains the output to `[{"name": ..., "arguments": ...}]`). Its *streaming* variant
    in vLLM 0.32 corrupts arguments whose `:{` arrives in one delta (they start with `:`;
    see docs/engine.md); non-streamed responses are parsed whole and are correct.
    """
    return [
        "--served-model-name", TEKKEN_MODEL_NAME,
        "--max-model-len", str(max_model_len),
        "--tokenizer-mode", "mistral",
        "--enable-auto-tool-choice",
        "--tool-call-parser", TEKKEN_TOOL_CALL_PARSER,
        "--structured-outputs-config", '{"backend":"xgrammar","disable_any_whitespace":true}',
        "--dtype", "float32",
    ]


def tekken_serve_env() -> dict[str, str]:
    """Same as the demo model: bounded tool arguments complete (see `demo_serve_env`)."""
    return {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}


def ensure_tekken_model(cache_dir: Path | None = None) -> Path:
    """The model's directory, built (deterministically) on first use."""
    return ensure_built(TEKKEN_MODEL_VERSION, _build, cache_dir)


def _is_text(piece: bytes) -> bool:
    """Whether a token's bytes are whole UTF-8 text (an answer made of them decodes cleanly)."""
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def calibration_chats() -> list[list[dict[str, str]]]:
    """The demo model's calibration chats (see `ending.center_head`)."""
    from kvagent_server.models.demo import calibration_chats as demo_chats

    return demo_chats()


def _render(tok: Any, chat: list[dict[str, str]]) -> list[int]:
    from mistral_common.protocol.instruct.request import ChatCompletionRequest

    return list(tok.encode_chat_completion(ChatCompletionRequest(messages=chat)).tokens)


def _build(out: Path) -> None:
    import torch
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
    from transformers import GenerationConfig, MistralConfig, MistralForCausalLM

    source = tekken_source()
    shutil.copyfile(source, out / TEKKEN_FILE)
    vocab = tekken_vocab_size(source)
    bos_id, eos_id, pad_id = 1, 2, 11  # tekken v3: <s>, </s>, <pad>
    config = MistralConfig(
        vocab_size=vocab, hidden_size=_HIDDEN, intermediate_size=_INTERMEDIATE,
        num_hidden_layers=_LAYERS, num_attention_heads=_HEADS, num_key_value_heads=_HEADS,
        head_dim=_HIDDEN // _HEADS, max_position_embeddings=TEKKEN_MAX_MODEL_LEN * 2,
        sliding_window=None, rope_theta=1_000_000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=bos_id, eos_token_id=eos_id,
        pad_token_id=pad_id, torch_dtype="float32",
    )
    torch.manual_seed(_SEED)
    model = MistralForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, _LM_HEAD_STD)
        tok = MistralTokenizer.from_file(str(out / TEKKEN_FILE))
        pieces = tok.instruct_tokenizer.tokenizer
        plan = ending.plan_levels(vocab, range(pieces.num_special_tokens),
                                  levels=ANSWER_LEVELS, first_max=_FIRST_MAX,
                                  per_level=_PER_LEVEL, seed=_SEED,
                                  eligible=lambda t: _is_text(pieces.id_to_byte_piece(t, "keep")))
        ending.shape_model(plan=plan, embed=model.model.embed_tokens, lm_head=model.lm_head,
                           final_norm=model.model.norm, layers=model.model.layers,
                           eos_id=eos_id, bias_unit=0.0)
        states = [model.model(torch.tensor([_render(tok, chat)])).last_hidden_state[0, -1]
                  for chat in calibration_chats()]
        ending.center_head(model.lm_head, torch.stack(states), ANSWER_LEVELS)
        gain = ending.max_random_spread(model.lm_head, ANSWER_LEVELS) * _RESIDUAL_BOUND
        ending.set_gain(model.model.norm, math.ceil(gain), ANSWER_LEVELS)
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id,
                                               pad_token_id=pad_id)
    model.save_pretrained(str(out), safe_serialization=True)


def main() -> None:
    """Build (if needed) and print the model's path."""
    print(ensure_tekken_model())


if __name__ == "__main__":
    main()
