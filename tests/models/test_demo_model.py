"""The demo model builds deterministically, loads with transformers, renders tool calls."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from kvagent_server.models import demo as demo_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
            },
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
]


def _digest(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_model.ensure_demo_model(tmp_path_factory.mktemp("a"))


def test_build_is_deterministic(built: Path, tmp_path: Path) -> None:
    again = demo_model.ensure_demo_model(tmp_path)
    assert again == tmp_path / demo_model.DEMO_MODEL_VERSION
    assert _digest(again) == _digest(built)


def test_second_call_reuses_the_cache(built: Path) -> None:
    before = (built / "model.safetensors").stat().st_mtime_ns
    assert demo_model.ensure_demo_model(built.parent) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == before
    assert not [p for p in built.parent.iterdir() if p.name.startswith(".")], "temp dir left"


def test_env_overrides_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(demo_model.CACHE_DIR_ENV, str(tmp_path))
    assert demo_model.default_cache_dir() == tmp_path
    monkeypatch.delenv(demo_model.CACHE_DIR_ENV)
    assert demo_model.default_cache_dir() == Path.home() / ".cache" / "kvagent"


def test_loads_with_transformers_and_fits_long_contexts(built: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(built)
    assert config.model_type == "llama"
    assert config.max_position_embeddings >= 16384
    tok = transformers.AutoTokenizer.from_pretrained(built)
    assert len(tok) == config.vocab_size
    model = transformers.AutoModelForCausalLM.from_pretrained(built)
    import torch

    ids = torch.tensor([tok("hello world, call a tool", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        a = model(ids).logits[0, -1].argmax().item()
        b = model(ids).logits[0, -1].argmax().item()
    assert a == b


def test_special_tokens_are_single_tokens(built: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(built)
    for special in demo_model.SPECIAL_TOKENS:
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1, special
    assert tok.eos_token == demo_model.EOS


def test_template_renders_tools_calls_and_results(built: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(built)
    text = tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith(demo_model.BOS + "<|im_start|>system\nYou are terse.")
    assert '"name": "get_weather"' in text.split("<tools>\n")[1].split("</tools>")[0]
    call = text.split("<tool_call>\n")[-1].split("\n</tool_call>")[0]
    assert json.loads(call) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    response = text.split("<tool_response>\n")[1].split("\n</tool_response>")[0]
    assert json.loads(response) == {"tool_call_id": "call_1", "content": "sunny, 21C"}
    assert text.endswith("<|im_start|>assistant\n")


def test_template_accepts_dict_arguments(built: Path) -> None:
    """vLLM may hand the template parsed (dict) arguments instead of a JSON string."""
    tok = transformers.AutoTokenizer.from_pretrained(built)
    msgs = json.loads(json.dumps(MESSAGES))
    msgs[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    a = tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False)
    b = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False)
    assert a == b


def test_template_is_a_prefix_across_turns(built: Path) -> None:
    """Appending a turn never rewrites earlier text: the property KV reuse depends on."""
    tok = transformers.AutoTokenizer.from_pretrained(built)
    turn1 = tok.apply_chat_template(MESSAGES[:2], tools=TOOLS, tokenize=False,
                                    add_generation_prompt=True)
    turn2 = tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False,
                                    add_generation_prompt=True)
    assert turn2.startswith(turn1)


def test_serve_args_name_the_parser() -> None:
    args = demo_model.demo_serve_args()
    assert args[args.index("--served-model-name") + 1] == demo_model.DEMO_MODEL_NAME
    assert args[args.index("--tool-call-parser") + 1] == "hermes"
    assert int(args[args.index("--max-model-len") + 1]) >= 8192
    assert demo_model.demo_serve_env() == {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}


def _chats(n: int) -> list[tuple[list[dict], list[dict] | None]]:
    """Seeded chats of several shapes: a word to a few hundred, system or not, tools or not,
    multi-turn with a tool call and its result."""
    import random

    rng = random.Random(48)
    words = demo_model._WORDS
    out = []
    for i in range(n):
        text = " ".join(rng.choices(words, k=rng.choice([1, 4, 30, 300])))
        msgs: list[dict] = ([{"role": "system", "content": "You are terse."}]
                            if i % 2 else [])
        if i % 3 == 2:
            msgs += MESSAGES[1:]
        msgs.append({"role": "user", "content": f"{text}? {rng.randint(0, 10**6)}"})
        out.append((msgs, TOOLS if i % 4 >= 2 else None))
    return out


def test_answers_end_with_eos_within_the_bound_and_follow_the_prompt(built: Path) -> None:
    """Greedy answers end in `<|im_end|>` after `min_answer_tokens..max_answer_tokens` tokens
    (the level chain, models/ending.py), and different prompts give different answers: the
    first token (whose level sets the length) of each of 12 chats, three decoded to the end."""
    import torch

    tok = transformers.AutoTokenizer.from_pretrained(built)
    model = transformers.AutoModelForCausalLM.from_pretrained(built).eval()
    plan = demo_model.ending_plan(len(tok))
    eos = tok.convert_tokens_to_ids(demo_model.EOS)
    firsts, answers = [], []
    for i, (messages, tools) in enumerate(_chats(12)):
        ids = torch.tensor([tok.apply_chat_template(messages, tools=tools, tokenize=True,
                                                    add_generation_prompt=True,
                                                    return_dict=False)])
        with torch.no_grad():
            firsts.append(int(model(ids).logits[0, -1].argmax()))
            if i % 4 == 1:
                out = model.generate(ids, do_sample=False, eos_token_id=eos, pad_token_id=eos,
                                     max_new_tokens=plan.max_answer_tokens + 1)
                answers.append(out[0, ids.shape[1]:].tolist())
    for answer in answers:
        assert answer[-1] == eos, f"no EOS within {plan.max_answer_tokens} tokens"
        assert eos not in answer[:-1]
        assert len(answer) - 1 == plan.levels - plan.level_of[answer[0]] + 1
    assert all(1 <= plan.level_of.get(t, 0) <= plan.first_max for t in firsts), firsts
    assert len({tuple(a) for a in answers}) == len(answers), "two prompts, one answer"
    assert len(set(firsts)) >= len(firsts) // 2, "first tokens ignore the prompt"
    lengths = {plan.levels - plan.level_of[t] + 1 for t in firsts}
    assert len(lengths) >= len(firsts) // 2, "lengths ignore the prompt"
    assert all(plan.min_answer_tokens <= n <= plan.max_answer_tokens for n in lengths)


def test_the_chain_uses_rare_tokens_and_spares_the_specials() -> None:
    plan = demo_model.ending_plan()
    assert plan.max_answer_tokens == demo_model.ANSWER_LEVELS <= 256
    assert 16 < plan.min_answer_tokens < plan.max_answer_tokens
    assert min(plan.level_of) >= len(demo_model.SPECIAL_TOKENS)
    assert sorted(set(plan.level_of.values())) == list(range(1, demo_model.ANSWER_LEVELS + 1))
