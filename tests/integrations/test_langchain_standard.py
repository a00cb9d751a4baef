"""LangChain's own standard unit tests for chat models, run against ``ChatKVAgent``."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_core", reason="extra kvagent[langchain] not installed")
pytest.importorskip("langchain_tests", reason="langchain-tests (extra dev) not installed")

from kvagent.integrations.langchain import ChatKVAgent
from langchain_tests.unit_tests import ChatModelUnitTests


class TestChatKVAgentStandard(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatKVAgent]:
        return ChatKVAgent

    @property
    def chat_model_params(self) -> dict:
        return {"model": "kvagent-demo", "base_url": "http://127.0.0.1:9/v1"}

    @property
    def init_from_env_params(self) -> tuple[dict, dict, dict]:
        return (
            {"KVAGENT_BASE_URL": "http://router.example:8000/v1", "KVAGENT_API_KEY": "sk-env",
             "KVAGENT_MODEL": "env-model"},
            {},
            {"base_url": "http://router.example:8000/v1", "api_key": "sk-env",
             "model": "env-model"},
        )
