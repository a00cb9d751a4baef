"""The deploy renderers with `topology: single` (and what `auto` picks for each target)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from deploy_helpers import NO_PLUGIN, config
from kvagent_server.deploy import DeployOptions, render_compose, render_kubernetes
from test_deploy_compose import compose_check


def compose(cfg: Any, **opts: Any) -> tuple[str, dict[str, Any]]:
    text = render_compose(cfg, DeployOptions(**opts), plugin=NO_PLUGIN)
    return text, yaml.safe_load(text)


def kubernetes(cfg: Any, **opts: Any) -> tuple[str, list[dict[str, Any]]]:
    text = render_kubernetes(cfg, DeployOptions(**opts), plugin=NO_PLUGIN)
    return text, [d for d in yaml.safe_load_all(text) if d is not None]


def test_compose_auto_on_one_gpu_is_one_node(tmp_path: Path) -> None:
    text, doc = compose(config(topology="auto", model="/models/qwen"), gpus=1)
    assert "# topology: single (auto: 1 GPU visible; P/D needs one per node (2))\n" in text
    assert list(doc["services"]) == ["decode-0", "router"]
    node = doc["services"]["decode-0"]
    assert node["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["0"]
    kv = json.loads(node["command"][node["command"].index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == "kv_both"
    router = doc["services"]["router"]
    assert "--prefill" not in router["command"] and router["command"].count("--decode") == 1
    assert router["depends_on"] == {"decode-0": {"condition": "service_healthy"}}
    assert compose_check(tmp_path, text).returncode == 0


def test_compose_auto_on_two_gpus_stays_pd() -> None:
    text, doc = compose(config(topology="auto", model="/models/qwen"), gpus=2)
    assert "# topology: pd (auto: 2 GPUs visible, one per P/D node)\n" in text
    assert list(doc["services"]) == ["prefill-0", "decode-0", "router"]


def test_kubernetes_single_is_one_decode_pod() -> None:
    text, objs = kubernetes(config(topology="single"), router_replicas=1)
    assert "# topology: single (set in the config)\n" in text
    kinds = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert kinds == [
        ("Namespace", "kvagent"),
        ("Service", "kvagent-decode"), ("StatefulSet", "kvagent-decode"),
        ("Secret", "kvagent-router-settings"), ("Deployment", "kvagent-router"),
        ("Service", "kvagent-router"),
    ]
    sts = objs[2]
    assert sts["spec"]["replicas"] == 1
    (node,) = sts["spec"]["template"]["spec"]["containers"]
    kv = json.loads(node["args"][node["args"].index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == "kv_both"
    (router,) = objs[4]["spec"]["template"]["spec"]["containers"]
    argv = router["args"]
    assert "--prefill" not in argv and argv.count("--decode") == 1
    assert "kvagent-decode-0.kvagent-decode.kvagent.svc.cluster.local" in argv[
        argv.index("--decode") + 1]


def test_kubernetes_auto_keeps_pd() -> None:
    """Every node runs in a pod of its own: P/D splits no device there."""
    text, objs = kubernetes(config(topology="auto"))
    assert "# topology: pd (auto: every node runs in a pod of its own)\n" in text
    assert ("StatefulSet", "kvagent-prefill") in [(o["kind"], o["metadata"]["name"])
                                                  for o in objs]


def test_compose_replicas_is_n_nodes_behind_one_router(tmp_path: Path) -> None:
    text, doc = compose(config(topology="replicas", model="/models/qwen",
                               decode={"count": 2}), gpus=2)
    assert "# topology: replicas (set in the config)\n" in text
    assert list(doc["services"]) == ["decode-0", "decode-1", "router"]
    ids = [doc["services"][f"decode-{i}"]["deploy"]["resources"]["reservations"]["devices"][0][
        "device_ids"] for i in range(2)]
    assert ids == [["0"], ["1"]]
    router = doc["services"]["router"]
    assert "--prefill" not in router["command"] and router["command"].count("--decode") == 2
    assert compose_check(tmp_path, text).returncode == 0


def test_kubernetes_replicas_is_one_decode_statefulset_of_n_pods() -> None:
    text, objs = kubernetes(config(topology="replicas", decode={"count": 3}),
                            router_replicas=1)
    assert "# topology: replicas (set in the config)\n" in text
    kinds = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert ("StatefulSet", "kvagent-prefill") not in kinds
    sts = next(o for o in objs if o["kind"] == "StatefulSet")
    assert sts["metadata"]["name"] == "kvagent-decode" and sts["spec"]["replicas"] == 3
    (node,) = sts["spec"]["template"]["spec"]["containers"]
    kv = json.loads(node["args"][node["args"].index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == "kv_both"
    router = next(o for o in objs if o["kind"] == "Deployment")
    argv = router["spec"]["template"]["spec"]["containers"][0]["args"]
    decodes = [argv[k + 1] for k, a in enumerate(argv) if a == "--decode"]
    assert "--prefill" not in argv and len(decodes) == 3
    assert all(f"kvagent-decode-{i}.kvagent-decode" in decodes[i] for i in range(3))
