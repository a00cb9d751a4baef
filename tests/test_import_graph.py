"""The package import graph, derived from the source: no cycles, no upward imports.

docs/architecture.md ("Code map") draws the same layers; this test is what keeps them true.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Callable
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
#: `nodes` (the I/O with the vLLM nodes) sits below `turns`, whose stages use it.
ROUTER_LAYERS = ["common", "telemetry", "kv", "settings", "auth", "store", "reuse", "nodes",
                 "turns", "apis", "http", "__main__"]


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
    assert "kvagent_server.router.turns.pipeline" in GRAPH
    assert "kvagent_server.router.reuse.planner" in GRAPH["kvagent_server.router.turns.policy"]


#: A turn's stages in the order it runs them (docs/architecture.md, "One turn"): each is a
#: module of `router.turns` reading the shape the one before built (`turns.shapes`).
TURN_STAGES = ["gather", "policy", "execute", "relay", "settle"]


def _turns(module: str) -> str:
    return f"kvagent_server.router.turns.{module}"


def test_no_turn_stage_imports_another() -> None:
    """So no stage can call back into one the turn has left (or skip ahead): data flows
    only through the shapes, and only `pipeline` (and the HTTP shell) strings them."""
    stages = {_turns(s) for s in TURN_STAGES}
    bad = sorted(f"{m} -> {t}" for m in stages for t in GRAPH[m] if t in stages)
    assert not bad, bad
    shared = {_turns("shapes"), _turns("context"), _turns("policy_params")}
    for module in shared:  # the shapes, the router's state and the policy's protocol
        assert not GRAPH[module] & stages, GRAPH[module]  # know no stage
    # `context` holds the router's policy object: the protocol, nothing it runs
    assert _turns("policy_params") in GRAPH[_turns("context")]


def test_only_the_pipeline_asks_the_policy_and_only_settle_learns() -> None:
    """The policy object reaches the stages through the shared `Router`, which the import
    graph cannot see: no stage but the pipeline calls it (gather once asked it mid-way),
    and no stage but settle writes what the router learns (`Router.learned`)."""
    turns = SOURCES["kvagent_server"] / "router" / "turns"
    for stage in ("gather", "execute", "relay", "settle"):
        assert ".policy." not in (turns / f"{stage}.py").read_text(), stage
    writes = re.compile(r"learned\.(\w+\.)?(observe\w*|resumed|ended)\(|learned\.\w+ = ")
    assert writes.search((turns / "settle.py").read_text())  # the pattern finds them
    for path in (SOURCES["kvagent_server"] / "router").rglob("*.py"):
        if path.name not in ("settle.py", "learned.py"):
            assert not writes.search(path.read_text()), path


def test_the_pipeline_runs_the_stages_in_order() -> None:
    """`open_turn` calls gather, the policy's decide and execute, in this order; the
    shell relays and then settles."""
    src = (SOURCES["kvagent_server"] / "router" / "turns" / "pipeline.py").read_text()
    body = src[src.index("async def open_turn"):]
    calls = [body.index(c) for c in ("gather(", ".decide(", "execute(")]
    assert calls == sorted(calls)
    shell = (SOURCES["kvagent_server"] / "router" / "http" / "turn.py").read_text()
    stream = shell[shell.index("async def _stream("):]
    assert stream.index(".relay(") < stream.index("settle(") < stream.index(".tail(")
    whole = shell[shell.index("async def _whole("):shell.index("async def _stream(")]
    assert whole.index(".scrub(") < whole.index("settle(") < whole.index("rewrite_response(")


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


def _upward(layer: Callable[[str], int | None]) -> list[str]:
    """Imports from a module to one of a higher layer (`layer`: None, not layered)."""
    out = []
    for module, targets in GRAPH.items():
        here = layer(module)
        if here is None:
            continue
        out += [f"{module} -> {t}" for t in targets
                if (there := layer(t)) is not None and there > here]
    return sorted(out)


def test_server_imports_point_down_its_layers() -> None:
    upward = _upward(_server_layer)
    assert not upward, "upward imports in the server: " + ", ".join(upward)


def test_common_imports_nothing_of_ours() -> None:
    """The router and the vLLM plugin use `common` and run alone: it must stay a leaf."""
    bad = sorted(f"{m} -> {t}" for m, ts in GRAPH.items()
                 if m.startswith("kvagent_server.common") for t in ts
                 if not t.startswith("kvagent_server.common"))
    assert not bad, bad


def test_router_imports_point_down_its_layers() -> None:
    upward = _upward(_router_layer)
    assert not upward, "upward imports in the router: " + ", ".join(upward)


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


@pytest.mark.parametrize("top", ["benchmarks", "tools"])
def test_benchmarks_use_only_the_sdks_public_modules(top: str) -> None:
    bad = []
    for path in sorted((ROOT / top).rglob("*.py")):
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


@pytest.mark.parametrize("top", ["benchmarks", "tools", "tests"])
def test_packages_never_import_benchmarks_or_tests(top: str) -> None:
    bad = []
    for src in SOURCES.values():
        for path in src.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.ImportFrom) and not node.level
                        and (node.module or "").split(".")[0] == top):
                    bad.append(str(path))
    assert not bad, bad


#: The one module tests reach benchmarks and tools through (its `NAMES` is the list).
ENTRY = "benchmarks.api"


def _imported_from(path: Path, tops: tuple[str, ...]) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of each import of a module under `tops`, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names
                    if a.name.split(".")[0] in tops]
        elif (isinstance(node, ast.ImportFrom) and not node.level and node.module
              and node.module.split(".")[0] in tops):
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def _api_names() -> set[str]:
    tree = ast.parse((ROOT / "benchmarks" / "api.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "NAMES":
            assert isinstance(node.value, ast.Dict)
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    raise AssertionError("benchmarks/api.py defines no NAMES")


def test_tests_import_benchmarks_and_tools_only_through_the_entry() -> None:
    names = _api_names()
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for line, module, imported in _imported_from(path, ("benchmarks", "tools")):
            if module != ENTRY:
                bad.append(f"{rel}:{line} imports {module}")
            bad += [f"{rel}:{line} imports {n}, which {ENTRY} does not name"
                    for n in imported if n not in names]
    assert not bad, f"tests import benchmarks and tools only through {ENTRY}: " + ", ".join(bad)


def test_every_name_of_the_entry_exists() -> None:
    """Each name `benchmarks.api` lends is a module of ours, or defined at its top level."""
    import importlib.util

    api = importlib.util.spec_from_file_location("_api", ROOT / "benchmarks" / "api.py")
    assert api is not None and api.loader is not None
    module = importlib.util.module_from_spec(api)
    api.loader.exec_module(module)
    bad = []
    for name, (target, attribute) in module.NAMES.items():
        base = ROOT.joinpath(*target.split("."))
        path = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        if not path.exists():
            bad.append(f"{name}: no module {target}")
            continue
        if attribute is None:
            continue
        defined = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defined.add(node.name)
            elif isinstance(node, ast.Assign):
                defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                defined.add(node.target.id)
            elif isinstance(node, ast.ImportFrom | ast.Import):
                defined.update((a.asname or a.name).split(".")[0] for a in node.names)
        if attribute not in defined:
            bad.append(f"{name}: {target} defines no {attribute}")
    assert not bad, bad


@pytest.mark.parametrize("top", ["benchmarks", "tools"])
def test_benchmarks_and_tools_never_import_tests_nor_edit_sys_path(top: str) -> None:
    bad = []
    for path in sorted((ROOT / top).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        bad += [f"{rel}:{line} imports {m}" for line, m, _ in _imported_from(path, ("tests",))]
        bad += [f"{rel}:{n} edits sys.path" for n, text in
                enumerate(path.read_text().splitlines(), 1)
                if re.search(r"sys\.path\.(insert|append|extend)|sys\.path\s*[+]?=", text)]
    assert not bad, bad



def test_tests_never_edit_sys_path() -> None:
    """pytest puts tests/ and the test folders on sys.path and `pyproject.toml` the
    repository root; a conftest or module that adds more makes a helper importable in one
    run and not in another (a test folder run alone)."""
    bad = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "tests").rglob("*.py"))
           for n, text in enumerate(path.read_text().splitlines(), 1)
           if re.search(r"sys\.path\.(insert|append|extend)|sys\.path\s*[+]?=", text)]
    assert not bad, bad


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


def test_test_helpers_are_imported_by_one_name() -> None:
    """pytest puts tests/ and each test folder on sys.path, so a helper is `support`,
    `fakes`, `router_client` or `e2e.e2e_helpers` (folders with an `__init__.py`); through
    `tests.` (the repository root is on sys.path too) the same file would load again, as a
    second module with its own state."""
    bad = []
    for path in sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            if any(n == "tests" or n.startswith("tests.") for n in names):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "import test helpers as `support`, not `tests.support`: " + ", ".join(bad)


def test_test_modules_have_unique_basenames() -> None:
    """pytest imports test modules by basename (folders without `__init__.py`): two
    `test_x.py` anywhere under tests/ fail the collection of the whole suite."""
    seen: dict[str, list[str]] = defaultdict(list)
    for path in (ROOT / "tests").rglob("test_*.py"):
        if not (path.parent / "__init__.py").exists():
            seen[path.name].append(path.relative_to(ROOT).as_posix())
    assert not {n: ps for n, ps in seen.items() if len(ps) > 1}


#: The most lines a router module may have: past it a module holds several things, and a
#: reader needs a room per thing (split it by what it holds, as `turns.policy` and
#: `turns.policy_params` are).
ROUTER_MODULE_MAX_LINES = 450


def test_no_router_module_is_over_the_line_limit() -> None:
    router = SOURCES["kvagent_server"] / "router"
    long = {str(p.relative_to(router)): n for p in router.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > ROUTER_MODULE_MAX_LINES}
    assert not long, long
