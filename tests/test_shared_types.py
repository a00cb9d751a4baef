"""The literal types several packages share are spelled once, in `kvagent_server.common.types`.

A second `Literal["prefill", "decode"]` elsewhere would drift from the first the day a role
or device is added; importing `Role`, `Device` and `HashAlgo` keeps every user in step.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOME = "server/kvagent_server/common/types.py"
SHARED = {
    frozenset({"prefill", "decode"}): "Role",
    frozenset({"pd", "single", "replicas"}): "Topology",
    frozenset({"cpu", "cuda"}): "Device",
    frozenset({"sha256", "sha256_cbor", "xxhash", "xxhash_cbor"}): "HashAlgo",
}


def _literal_values(node: ast.Subscript) -> frozenset[str] | None:
    if not (isinstance(node.value, ast.Name) and node.value.id == "Literal"):
        return None
    elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    values = [e.value for e in elts if isinstance(e, ast.Constant)]
    if len(values) != len(elts) or not all(isinstance(v, str) for v in values):
        return None
    return frozenset(values)


def _copies() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for top in ("server", "sdk", "benchmarks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == HOME:
                continue
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.Subscript):
                    name = SHARED.get(_literal_values(node) or frozenset())
                    if name:
                        found.setdefault(rel, []).append(f"{name} at line {node.lineno}")
    return found


def test_shared_literals_are_imported_not_spelled_out() -> None:
    bad = _copies()
    assert not bad, f"import these from kvagent_server.common.types instead: {bad}"
