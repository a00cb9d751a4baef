"""The package import graph, derived from the source: no cycles, no upward imports.

docs/architecture.md ("Code map") draws the same layers; this test is what keeps them true.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"kvagent": ROOT / "sdk" / "kvagent", "kvagent_server": ROOT / "server" / "kvagent_server"}

#: The server's top-level packages, lowest first: a module may import its own layer or lower
#: ones. `common` is the shared vocabulary; the router and the vLLM plugin run alone (their
#: own tests below narrow what they may import); `engine` and `config` describe what to run,
#: `models` builds the built-in models, `bundle` runs it all on one machine, `deploy` renders
#: it for others, and `demo` and `cli` are the commands on top.
SERVER_LAYERS = ["common", "router", "vllm_plugin", "engine", "config", "models", "bundle",
                 "deploy", "demo", "cli"]

#: The router's subpackages, lowest first: a module may import its own layer or lower ones.
ROUTER_LAYERS = ["common", "telemetry", "kv", "settings", "auth", "store", "reuse", "turns",
                 "apis", "http", "__main__"]


def _module_name(root_pkg: str, path: Path) -> str:
    rel = path.relative_to(SOURCES[root_pkg]).with_suffix("")
    parts = [root_pkg, *rel.parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(module: str, path: Path) -> set[str]:
    """Every module of ours that `module` imports, at any depth (lazy imports included)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in out if m.split(".")[0] in SOURCES}


def _graph() -> dict[str, set[str]]:
    modules: dict[str, Path] = {}
    for root_pkg, src in SOURCES.items():
        for path in src.rglob("*.py"):
            modules[_module_name(root_pkg, path)] = path
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for target in _imports(name, path):
            # `from a.b import c` names a.b.c when c is a module, else a.b itself.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return {m: graph.get(m, set()) for m in modules}


GRAPH = _graph()


def _server_layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "kvagent_server" or len(parts) < 2:
        return None
    return SERVER_LAYERS.index(parts[1])


def _router_layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["kvagent_server", "router"] or len(parts) < 3:
        return None
    return ROUTER_LAYERS.index(parts[2])


def test_graph_is_not_empty() -> None:
    assert "kvagent_server.router.turns.orchestrate" in GRAPH
    assert "kvagent_server.router.reuse.planner" in GRAPH["kvagent_server.router.turns.orchestrate"]


def test_no_import_cycles_between_modules() -> None:
    # Package __init__ modules are skipped as nodes: importing a.b.c runs a/__init__ too,
    # but that is not a dependency of a.b.c on a's contents.
    graph = {m: {t for t in ts if not _is_package(t)} for m, ts in GRAPH.items()
             if not _is_package(m)}
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_server_module_has_a_layer() -> None:
    """A new top-level module or package is placed in SERVER_LAYERS, not left flat."""
    src = SOURCES["kvagent_server"]
    tops = {p.stem for p in src.glob("*.py") if p.stem != "__init__"} | {
        d.name for d in src.iterdir() if (d / "__init__.py").is_file()}
    assert tops == set(SERVER_LAYERS), f"source {sorted(tops)}, layers {SERVER_LAYERS}"


def test_server_imports_point_down_its_layers() -> None:
    upward = []
    for module, targets in GRAPH.items():
        here = _server_layer(module)
        if here is None:
            continue
        for target in targets:
            there = _server_layer(target)
            if there is not None and there > here:
                upward.append(f"{module} -> {target}")
    assert not upward, "upward imports in the server: " + ", ".join(sorted(upward))


def test_common_imports_nothing_of_ours() -> None:
    """The router and the vLLM plugin use `common` and run alone: it must stay a leaf."""
    bad = sorted(f"{m} -> {t}" for m, ts in GRAPH.items()
                 if m.startswith("kvagent_server.common") for t in ts
                 if not t.startswith("kvagent_server.common"))
    assert not bad, bad


def test_router_imports_point_down_its_layers() -> None:
    upward = []
    for module, targets in GRAPH.items():
        here = _router_layer(module)
        if here is None:
            continue
        for target in targets:
            there = _router_layer(target)
            if there is not None and there > here:
                upward.append(f"{module} -> {target}")
    assert not upward, "upward imports in the router: " + ", ".join(sorted(upward))


def test_the_architecture_map_names_every_router_module() -> None:
    """Each subpackage's node in docs/architecture.md's diagram lists exactly its modules."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    router = SOURCES["kvagent_server"] / "router"
    for package in (p for p in ROUTER_LAYERS if (router / p).is_dir()):
        node = re.search(rf'^\s*{package}\["{package}<br/>(.*?)"\]', doc, re.MULTILINE)
        assert node, f"no {package} node in the diagram"
        drawn = {m.strip() for m in node.group(1).replace("<br/>", ",").split(",")} - {""}
        actual = {p.stem for p in (router / package).glob("*.py") if p.stem != "__init__"} | {
            d.name for d in (router / package).iterdir() if (d / "__init__.py").is_file()}
        assert drawn == actual, f"{package}: diagram {sorted(drawn)}, source {sorted(actual)}"


def test_the_architecture_map_names_every_server_module() -> None:
    """Each package's node in docs/architecture.md's server diagram lists exactly its
    modules (the router has a diagram of its own; the plugin's patches are not listed)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    src = SOURCES["kvagent_server"]
    for package in SERVER_LAYERS:
        node = re.search(rf'^\s*{package}\["kvagent_server\.{package}<br/>(.*?)"\]', doc,
                         re.MULTILINE)
        assert node, f"no {package} node in the server diagram"
        if package in ("router", "vllm_plugin"):
            continue
        drawn = {m.strip() for m in node.group(1).split(",")} - {""}
        actual = {p.stem for p in (src / package).glob("*.py") if p.stem != "__init__"}
        assert drawn == actual, f"{package}: diagram {sorted(drawn)}, source {sorted(actual)}"


def test_router_depends_on_nothing_else_in_the_server_package() -> None:
    """The router runs alone (`python -m kvagent_server.router`): no bundle code in it, only
    the shared vocabulary of `common`."""
    bad = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if m.startswith("kvagent_server.router")
                 for t in ts if t.startswith("kvagent_server.")
                 and not t.startswith(("kvagent_server.router", "kvagent_server.common"))
                 and t != "kvagent_server")
    assert not bad, bad


def test_sdk_never_imports_the_server() -> None:
    bad = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if m.startswith("kvagent.")
                 or m == "kvagent" for t in ts if t.startswith("kvagent_server"))
    assert not bad, bad


def _sdk_private(target: str) -> bool:
    return target.startswith("kvagent.") and target.split(".")[1].startswith("_")


def test_server_uses_only_the_sdks_public_modules() -> None:
    bad = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if m.startswith("kvagent_server")
                 for t in ts if _sdk_private(t))
    assert not bad, bad


def test_benchmarks_use_only_the_sdks_public_modules() -> None:
    bad = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        bad += [f"{module} -> {t}" for t in sorted(_imports(module, path)) if _sdk_private(t)]
    assert not bad, bad


def test_vllm_plugin_takes_only_the_transfer_vocabulary_from_the_router() -> None:
    """The plugin runs inside vLLM: the one router module it loads is `reuse.transfer`,
    and neither that module nor the package `__init__`s it runs import anything of ours.
    Besides it the plugin takes only `common` (a leaf, see above)."""
    transfer = "kvagent_server.router.reuse.transfer"
    bad = sorted(f"{m} -> {t}" for m, ts in GRAPH.items()
                 if m.startswith("kvagent_server.vllm_plugin") for t in ts
                 if t.startswith("kvagent_server.") and t != transfer
                 and not t.startswith(("kvagent_server.vllm_plugin", "kvagent_server.common")))
    assert not bad, bad
    for module in ("kvagent_server.router", "kvagent_server.router.reuse", transfer):
        assert not GRAPH[module], f"{module} imports {sorted(GRAPH[module])}"


@pytest.mark.parametrize("top", ["benchmarks", "tests"])
def test_packages_never_import_benchmarks_or_tests(top: str) -> None:
    bad = []
    for src in SOURCES.values():
        for path in src.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == top:
                    bad.append(str(path))
    assert not bad, bad


#: Tests outside tests/benchmarks/ that run (a slice of) a benchmark, and the benchmark each
#: may import. The rule: a test imports only the benchmark it exercises (tests/benchmarks/
#: tests any of them); anything else it needs lives in tests/ or the packages.
BENCHMARK_USERS = {
    "tests/deploy/test_multihost_rehearsal.py": "benchmarks.multihost",
    "tests/deploy/test_multihost_wiring.py": "benchmarks.multihost",
    "tests/e2e/test_fuzz.py": "benchmarks.fuzz",
    "tests/models/real.py": "benchmarks.fuzz",
    "tests/reliability/test_load_small.py": "benchmarks.load",
    "tests/sdk/test_bench_sdk_overhead.py": "benchmarks.sdk_overhead",
    # Counts connections on the SDK overhead benchmark's local SSE server.
    "tests/sdk/test_connection_reuse.py": "benchmarks.sdk_overhead",
}


def _benchmark_imports(path: Path) -> set[str]:
    """The `benchmarks` modules (or names) `path` imports, at any depth."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.update([node.module] if "." in node.module
                       else (f"{node.module}.{a.name}" for a in node.names))
    return {m for m in out if m.split(".")[0] == "benchmarks"}


def test_tests_import_only_the_benchmark_they_exercise() -> None:
    bad, unused = [], set(BENCHMARK_USERS)
    for path in sorted((ROOT / "tests").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("tests/benchmarks/"):
            continue
        allowed = BENCHMARK_USERS.get(rel)
        for name in sorted(_benchmark_imports(path)):
            unused.discard(rel)
            if allowed is None or not (name == allowed or name.startswith(allowed + ".")):
                bad.append(f"{rel} -> {name}")
    assert not bad, "tests importing a benchmark they do not exercise: " + ", ".join(bad)
    assert not unused, f"BENCHMARK_USERS lists tests that import no benchmark: {sorted(unused)}"


def _is_package(module: str) -> bool:
    root = module.split(".")[0]
    rel = module.split(".")[1:]
    return (SOURCES[root].joinpath(*rel) / "__init__.py").exists()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_tests_import_support_only_as_support() -> None:
    """tests/ is on sys.path, so tests/support.py is `support`; imported as `tests.support`
    as well, it would load twice, as two modules with their own state."""
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            if "tests.support" in names:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "import `support`, not `tests.support`: " + ", ".join(bad)
