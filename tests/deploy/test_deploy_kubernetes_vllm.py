"""The Kubernetes manifests' node args parse with vLLM's own parser (vLLM installed)."""

from __future__ import annotations

from typing import Any

import pytest
from test_deploy_kubernetes import container, find, objects


@pytest.mark.vllm
def test_node_args_parse_with_vllm(cfg: Any) -> None:
    pytest.importorskip("vllm", reason="vLLM is not importable here (CI installs it)")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    for role in ("prefill", "decode"):
        c = container(find(objects(cfg), "StatefulSet", f"kvagent-{role}"))
        ns = parser.parse_args(c["args"])
        assert ns.port == (8100 if role == "prefill" else 8200)
        ktc = EngineArgs.from_cli_args(ns).kv_transfer_config
        assert ktc.kv_connector == "NixlConnector" and ktc.engine_id == "$(POD_NAME)"
