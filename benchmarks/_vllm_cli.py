"""vLLM's own `vllm serve` argument parser, for checks that validate rendered node argv.

The parser moved between releases (`vllm.entrypoints.openai.cli_args` up to 0.26,
`vllm.entrypoints.launchers.cli_args` later); the GPU checks run on whichever release the
GPU machine's torch allows, so both are tried.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def serve_parser() -> Any:
    """A fresh `vllm serve` parser (needs vllm importable)."""
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ModuleNotFoundError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def parse_node_argv(argv: Sequence[str]) -> tuple[argparse.Namespace, Any]:
    """Parse a node's argv from `--model` on: (namespace, vLLM `EngineArgs`)."""
    from vllm.engine.arg_utils import EngineArgs

    argv = list(argv)
    ns = serve_parser().parse_args(argv[argv.index("--model"):])
    return ns, EngineArgs.from_cli_args(ns)
