"""``ChatKVAgent`` as LangChain tooling expects: serializable, token counts without a hub."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("langchain_core", reason="extra kvagent[langchain] not installed")

from kvagent.integrations.langchain import ChatKVAgent
from langchain_core.load import dumpd, dumps, loads
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage


def test_round_trips_through_dumps_and_loads_with_the_key_as_a_secret() -> None:
    llm = ChatKVAgent(model="kvagent-demo", base_url="http://router.test/v1", api_key="sk-1",
                      temperature=0.0, max_tokens=64, session_id="conv-1",
                      extra_body={"top_k": 20})
    assert ChatKVAgent.is_lc_serializable()
    data = dumpd(llm)
    assert data["type"] == "constructor"
    assert data["id"] == ["kvagent", "integrations", "langchain", "ChatKVAgent"]
    assert data["kwargs"]["api_key"] == {"lc": 1, "type": "secret", "id": ["KVAGENT_API_KEY"]}
    assert "sk-1" not in dumps(llm)

    back = loads(dumps(llm), valid_namespaces=["kvagent"], allowed_objects=[ChatKVAgent],
                 secrets_map={"KVAGENT_API_KEY": "sk-1"})
    assert isinstance(back, ChatKVAgent)
    for field in ("model", "base_url", "temperature", "max_tokens", "session_id",
                  "extra_body"):
        assert getattr(back, field) == getattr(llm, field), field
    assert back.api_key is not None and back.api_key.get_secret_value() == "sk-1"


def test_bound_tools_serialize_too() -> None:
    from langchain_core.tools import tool

    @tool
    def lookup(order_id: str) -> str:
        """Status of an order."""
        return "shipped"

    bound = ChatKVAgent(model="m", base_url="http://router.test/v1").bind_tools([lookup])
    from langchain_core.runnables import RunnableBinding

    back = loads(dumps(bound), valid_namespaces=["kvagent"],
                 allowed_objects=[ChatKVAgent, RunnableBinding])
    assert isinstance(back.bound, ChatKVAgent)
    assert back.kwargs["tools"][0]["function"]["name"] == "lookup"


MESSAGES = [SystemMessage("You are terse."), HumanMessage("Where is order A-101? " * 10),
            AIMessage("It shipped yesterday.")]


def test_token_counts_without_transformers() -> None:
    """LangChain's default counter loads GPT-2 through transformers (and the model hub)."""
    code = (
        "import sys\n"
        "sys.modules['transformers'] = None  # as if not installed\n"
        "from kvagent.integrations.langchain import ChatKVAgent\n"
        "from langchain_core.messages import HumanMessage\n"
        "llm = ChatKVAgent(model='m', base_url='http://router.test/v1')\n"
        "print(llm.get_num_tokens('a' * 400), "
        "llm.get_num_tokens_from_messages([HumanMessage('b' * 400)]))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    text_count, messages_count = map(int, res.stdout.split())
    assert text_count == 100
    assert 100 < messages_count < 110  # the text plus the role's overhead


def test_token_counts_grow_with_the_input_and_count_tools() -> None:
    llm = ChatKVAgent(model="m", base_url="http://router.test/v1")
    short = llm.get_num_tokens_from_messages(MESSAGES[:2])
    assert llm.get_num_tokens_from_messages(MESSAGES) > short > 50
    tool = {"type": "function", "function": {"name": "lookup", "description": "x" * 200,
                                             "parameters": {"type": "object"}}}
    assert llm.get_num_tokens_from_messages(MESSAGES, tools=[tool]) > \
        llm.get_num_tokens_from_messages(MESSAGES) + 40


def test_your_tokenizer_gives_exact_counts() -> None:
    llm = ChatKVAgent(model="m", base_url="http://router.test/v1",
                      custom_get_token_ids=lambda text: list(range(len(text.split()))))
    assert llm.get_num_tokens("one two three") == 3
