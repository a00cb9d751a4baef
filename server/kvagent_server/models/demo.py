"""A tiny, deterministic Llama-architecture model for demos and tests.

No model hub is reachable where kvagent is developed and tested, so the bundle builds its own
model: random weights (fixed seed, shaped by hand so that answers end) and a byte-level BPE
tokenizer trained locally on a generated corpus. Greedy output of a fixed model is deterministic, which turns "reuse on vs
reuse off gives the same answer" into a real correctness test.

The chat template is Hermes/Qwen style (`<|im_start|>role ... <|im_end|>`, tools listed in the
system prompt, tool calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
tool results as `<tool_response>` with their `tool_call_id`), so vLLM's `hermes` tool parser
understands the model's tool calls.

Usage::

    from kvagent_server.models.demo import demo_serve_args, demo_serve_env, ensure_demo_model
    path = ensure_demo_model()          # builds once, then returns the cached directory
    argv = ["--model", str(path), *demo_serve_args()]
    env = {**os.environ, **demo_serve_env()}

The model emits a *complete* tool call when asked with `tool_choice` named or "required"
(with `parallel_tool_calls: false`) and the tool's parameters are bounded (enums,
booleans); free-text string arguments never end (random weights), and `"auto"` yields text.

Answers end: a level chain written into the weights (models/ending.py) makes every greedy
answer 33..224 tokens of the vocabulary's rarest tokens followed by `<|im_end|>`, so clients
see `stop` / `end_turn`, never a max-tokens stop. Which tokens, and how many, is still the
random model's choice from the whole context (the head has the mean answer-start state taken
out, so the first token follows the prompt, not the common `assistant\n` suffix). No answer
ends before 33 tokens: a request capped at 32 or fewer still stops at its cap.

or ``python -m kvagent_server.models.demo`` to build it and print its path.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

# Re-exported: callers find the cache location next to the demo model.
from kvagent_server.models import ending
from kvagent_server.models.cache import CACHE_DIR_ENV, default_cache_dir, ensure_built  # noqa: F401

DEMO_MODEL_NAME = "kvagent-demo"
DEMO_MODEL_VERSION = "demo-model-v2"
DEMO_MAX_MODEL_LEN = 16384
DEMO_TOOL_CALL_PARSER = "hermes"

_SEED = 20251130
_VOCAB_SIZE = 8192
_HIDDEN = 256
_LAYERS = 4
_HEADS = 4
_INTERMEDIATE = 704
# Logit scale of the random head: wide enough that greedy argmax never hinges on float noise
# (chunked vs whole-prompt prefill, KV pulled vs recomputed), so outputs compare exactly.
_LM_HEAD_STD = 0.25
# The level chain that ends answers (models/ending.py): 33..224 answer tokens, then EOS.
ANSWER_LEVELS = 224
_FIRST_MAX = 192
_PER_LEVEL = 16
# The largest residual norm (outside the control dims) the level rule is guaranteed for: twice
# the largest measured over diverse prompts up to 30k tokens (tools/model_endings/check.py).
_RESIDUAL_BOUND = 4.0

BOS = "<|begin_of_text|>"
EOS = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [
    PAD,
    BOS,
    "<|end_of_text|>",
    "<|im_start|>",
    EOS,
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<tools>",
    "</tools>",
]

CHAT_TEMPLATE = """\
{%- macro render_args(args) -%}
{%- if args is string -%}{{ args }}{%- else -%}{{ args | tojson }}{%- endif -%}
{%- endmacro -%}
{%- macro render_content(content) -%}
{%- if content is none -%}
{%- elif content is string -%}{{ content }}
{%- else -%}{%- for part in content -%}{%- if part.text is defined -%}{{ part.text }}\
{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- if tools -%}
<|im_start|>system
{% if messages and messages[0].role == 'system' %}{{ render_content(messages[0].content) }}

{% endif %}# Tools

You may call one or more functions. Their signatures are within <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each call, return a JSON object within <tool_call></tool_call>:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages and messages[0].role == 'system' -%}
<|im_start|>system
{{ render_content(messages[0].content) }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' and loop.first -%}
{%- elif message.role == 'assistant' -%}
<|im_start|>assistant
{{ render_content(message.content) }}
{%- if message.tool_calls -%}
{%- for tc in message.tool_calls -%}
{%- set fn = tc.function if tc.function is defined else tc -%}
{%- if loop.first and message.content %}
{% endif -%}
<tool_call>
{"name": "{{ fn.name }}", "arguments": {{ render_args(fn.arguments) }}}
</tool_call>
{%- endfor -%}
{%- endif -%}
<|im_end|>
{% elif message.role == 'tool' -%}
<|im_start|>tool
<tool_response>
{"tool_call_id": {{ (message.tool_call_id or '') | tojson }}, \
"content": {{ render_content(message.content) | tojson }}}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ message.role }}
{{ render_content(message.content) }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% endif -%}
"""

_WORDS = ["the", "a", "an", "of", "to", "in", "and", "or", "for", "with", "on", "at", "by", "from", "as", "is", "are", "was", "be", "this", "that", "it", "agent", "tool", "call", "result", "user", "system", "assistant", "file", "read", "write", "search", "list", "open", "close", "run", "test", "build", "cache", "token", "prefix", "decode", "prefill", "node", "router", "session", "turn", "block", "memory", "weather", "city", "temperature", "forecast", "json", "value", "key", "name", "arguments", "function", "return", "error", "python", "import", "def", "class", "self", "if", "else", "while", "for", "yield", "async", "await", "print", "string", "number", "true", "false", "null", "data", "path", "line", "code", "model", "request", "response", "stream", "chunk", "reuse", "kv", "transfer", "remote", "local", "engine", "time", "second", "minute", "hour", "day", "week", "today", "tomorrow", "please", "thanks", "hello", "world", "find", "get", "set", "update", "delete", "create", "add", "remove", "check", "status", "ok", "done"]


def demo_serve_args(max_model_len: int = DEMO_MAX_MODEL_LEN) -> list[str]:
    """vLLM serve arguments the demo model needs (besides `--model PATH`).

    Compact JSON (no free whitespace) keeps a random model from padding tool arguments with
    whitespace forever; see `demo_serve_env` for the rest of the tool-call setup.
    """
    return [
        "--served-model-name",
        DEMO_MODEL_NAME,
        "--max-model-len",
        str(max_model_len),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        DEMO_TOOL_CALL_PARSER,
        "--structured-outputs-config",
        '{"backend":"xgrammar","disable_any_whitespace":true}',
        "--dtype",
        "float32",
    ]


def demo_serve_env() -> dict[str, str]:
    """Environment the demo model's vLLM node needs.

    With strict tool calling on (vLLM's default), `tool_choice: "required"`/named use the
    Hermes structural tag, whose JSON allows unbounded whitespace that a random model never
    stops emitting. Off, vLLM constrains those calls with a compact JSON schema instead, so
    a tool whose parameters are bounded (enums, booleans) yields a complete call.
    """
    return {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """Return the demo model's directory, building it first if it is not cached yet
    (atomically: see `models.cache.ensure_built`)."""
    return ensure_built(DEMO_MODEL_VERSION, _build, cache_dir)


def _corpus(lines: int = 30000) -> list[str]:
    """A deterministic pseudo-text corpus: prose, JSON tool calls, code and numbers."""
    rng = random.Random(_SEED)
    out: list[str] = []
    for i in range(lines):
        kind = i % 4
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 24))]
        if kind == 0:
            out.append(" ".join(words).capitalize() + ".")
        elif kind == 1:
            args = {rng.choice(_WORDS): rng.choice([rng.randint(0, 9999), rng.choice(_WORDS)])}
            call = {"name": f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)}", "arguments": args}
            out.append(json.dumps(call))
        elif kind == 2:
            name = "_".join(words[:2])
            out.append(f"def {name}({words[2]}, {words[3]}):\n    return {words[2]} + {i}")
        else:
            out.append(" ".join(f"{w} {rng.randint(0, 100000)}" for w in words[:6]))
    return out


def _build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=DEMO_MAX_MODEL_LEN,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    # Name the class every transformers release resolves (4.x has no `TokenizersBackend`),
    # and keep the template inside the config too for loaders that ignore the .jinja file.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg.pop("backend", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def ending_plan(vocab_size: int = _VOCAB_SIZE) -> ending.EndingPlan:
    """Which tokens form the demo model's level chain (the special tokens never do)."""
    return ending.plan_levels(vocab_size, range(len(SPECIAL_TOKENS)), levels=ANSWER_LEVELS,
                              first_max=_FIRST_MAX, per_level=_PER_LEVEL, seed=_SEED)


def _build_model(out: Path, vocab_size: int, bos_id: int, eos_id: int, pad_id: int,
                 calibration: list[list[int]]) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=_HIDDEN,
        intermediate_size=_INTERMEDIATE,
        num_hidden_layers=_LAYERS,
        num_attention_heads=_HEADS,
        num_key_value_heads=_HEADS,
        max_position_embeddings=DEMO_MAX_MODEL_LEN * 2,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    torch.manual_seed(_SEED)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, _LM_HEAD_STD)
        ending.shape_model(plan=ending_plan(vocab_size), embed=model.model.embed_tokens,
                           lm_head=model.lm_head, final_norm=model.model.norm,
                           layers=model.model.layers, eos_id=eos_id, bias_unit=0.0)
        states = [model.model(torch.tensor([ids])).last_hidden_state[0, -1]
                  for ids in calibration]
        ending.center_head(model.lm_head, torch.stack(states), ANSWER_LEVELS)
        gain = ending.max_random_spread(model.lm_head, ANSWER_LEVELS) * _RESIDUAL_BOUND
        ending.set_gain(model.model.norm, math.ceil(gain), ANSWER_LEVELS)
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.save_pretrained(str(out), safe_serialization=True)


def calibration_chats(n: int = 24) -> list[list[dict[str, str]]]:
    """Seeded chats (system or not, 1-3 turns, a few to a few hundred words) whose answer
    start states `ending.center_head` averages."""
    rng = random.Random(_SEED + 1)
    chats = []
    for _ in range(n):
        msgs = [{"role": "system", "content": " ".join(rng.choices(_WORDS, k=rng.randint(3, 40)))}
                ] if rng.random() < 0.5 else []
        for turn in range(rng.randint(1, 3)):
            if turn:
                msgs.append({"role": "assistant",
                             "content": " ".join(rng.choices(_WORDS, k=rng.randint(5, 60)))})
            msgs.append({"role": "user",
                         "content": " ".join(rng.choices(_WORDS, k=rng.choice([2, 20, 300])))})
        chats.append(msgs)
    return chats


def _build(out: Path) -> None:
    from transformers import AutoTokenizer

    _build_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(str(out))
    bos_id, eos_id, pad_id = (tok.convert_tokens_to_ids(t) for t in (BOS, EOS, PAD))
    calibration = [tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True,
                                           return_dict=False) for c in calibration_chats()]
    _build_model(out, len(tok), bos_id, eos_id, pad_id, calibration=calibration)


def main() -> None:
    """Build (if needed) and print the demo model's path."""
    print(ensure_demo_model())


if __name__ == "__main__":
    main()
