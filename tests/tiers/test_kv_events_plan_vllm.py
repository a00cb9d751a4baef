"""vLLM parses the planned `--kv-events-config` and binds its publisher where planned."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvagent_server.bundle.render import plan
from kvagent_server.config import validate_config
from test_kv_events_plan import events_of, inputs


@pytest.mark.vllm
@pytest.mark.parametrize("bind", ["127.0.0.1", "0.0.0.0"])
def test_vllm_parses_the_kv_events_flag(tmp_path: Path, bind: str) -> None:
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except Exception as exc:  # noqa: BLE001 - any import failure means "not installed"
        pytest.skip(f"vLLM is not importable ({exc!r})")
    bp = plan(validate_config({"run_dir": str(tmp_path), "bind_host": bind,
                                    "topology": "pd"}), inputs())
    parser = make_arg_parser(FlexibleArgumentParser())
    for node in bp.nodes:
        ev = parser.parse_args(list(node.argv[3:])).kv_events_config
        assert ev.enable_kv_cache_events and ev.publisher == "zmq" and ev.topic == "kvagent"
        assert ev.endpoint == events_of(node.argv)["endpoint"]
        # vLLM binds (not connects) its PUB socket for exactly these endpoints.
        from vllm.distributed.kv_events import ZmqEventPublisher
        assert ZmqEventPublisher._is_bind_endpoint(ev.endpoint)
