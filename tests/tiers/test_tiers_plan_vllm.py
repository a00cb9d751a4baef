"""The tiered plan's argv parses with vLLM's own parser."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvagent_server.bundle.render import plan
from support import pd_config
from test_tiers_plan import inputs, tiered


@pytest.mark.vllm
def test_planned_argv_parses_with_vllm(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not importable here (CI installs it)")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    for node in plan(pd_config(tiered(tmp_path)), inputs(gpus=2)).nodes:
        argv = list(node.argv)
        ns = parser.parse_args(argv[argv.index("--model"):])
        ktc = EngineArgs.from_cli_args(ns).kv_transfer_config
        assert ktc.kv_connector == "MultiConnector" and ktc.engine_id == node.engine_id
        assert ns.prefix_caching_hash_algo == "sha256"
