#!/usr/bin/env python3
"""Build vLLM, NIXL and kvagent's server dependencies for a GPU machine without network.

A GPU image that holds torch but reaches no package index cannot `pip install vllm nixl`.
`build` does it here instead: it resolves what vLLM and kvagent need for that image's
Python and torch (torch and triton stand in as empty wheels at the image's versions, so
nothing is resolved against another torch), leaves out what the image already holds
(`image_packages.txt`), installs the rest into one folder, drops kernels the checks never
load, adds kvagent's plugin entry point, and packs the folder as `.tar.xz` chunks small
enough to travel one per transfer (`part-NN/`), each with `manifest.json` (versions, chunk
digests).

`check` imports, with that folder on PYTHONPATH, the modules a GPU node, the router and the
benchmark load, in an interpreter like the image's (same Python, same torch), and fails
on any module that is missing. On the GPU machine, `assemble_site.sh` joins the chunks and
runs the GPU checks.

    python tools/gpu/offline_site.py build --out DIR [--vllm 0.26.0] [--torch 2.11.0]
    python tools/gpu/offline_site.py check --site DIR/site --python PY

vLLM is pinned to the release built for the image's torch (vLLM pins torch exactly):
0.26.0 for torch 2.11. The plugin runs on it with a known gap (`KVAGENT_ALLOW_VLLM`).
"""

from __future__ import annotations

import argparse
import email.parser
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

#: Packages a text model on one GPU never imports: media, other kernels' compilers (the
#: CUTLASS DSL alone is 440 MB; FlashInfer imports without it). `check` proves the imports.
LEAVE_OUT = frozenset({
    "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "tilelang",
    "fastsafetensors", "quack-kernels", "tokenspeed-mla", "humming-kernels", "cuda-tile",
    "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13",
})
#: Files dropped after install, relative to the site folder: kernels for other GPUs or
#: other Pythons, and binaries nothing here runs. vLLM's flash-attention package needs one
#: of FA2/FA3 to import; Hopper uses FA3, so FA2 (the largest file) goes.
DROP = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/vllm-rs",
    "vllm/third_party/fmha_sm100",
    "bin",
)
#: What a GPU node, the router and the benchmark import; `check` imports each.
MODULES = (
    "vllm.entrypoints.openai.api_server",
    "vllm.v1.engine.core",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.v1.sample.ops.topk_topp_sampler",
    "vllm.vllm_flash_attn",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.attention.backends.flashinfer",
    "vllm.v1.attention.backends.triton_attn",
    "vllm.model_executor.models.llama",
    "vllm.v1.structured_output.backend_xgrammar",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector",
    "nixl._api",
    "kvagent_server.vllm_plugin",
    "kvagent_server.bundle.supervisor",
    "kvagent_server.router.__main__",
    "benchmarks.multiturn.run",
)


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of -_. as one '-'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def platforms(glibc_max: int = 39) -> list[str]:
    """Every manylinux x86_64 tag up to glibc 2.`glibc_max` (pip matches tags exactly)."""
    return (["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"]
            + [f"manylinux_2_{n}_x86_64" for n in range(5, glibc_max + 1)])


def read_image_packages(path: Path) -> set[str]:
    """Normalized names from a package list (one per line, '#' comments)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {normalize(line) for line in lines if line}


def wheel_requirements(wheel: Path) -> list[str]:
    """A wheel's unconditional Requires-Dist lines (extras' lines left out)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    return [r for r in msg.get_all("Requires-Dist") or [] if "extra ==" not in r]


def requirement_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if not m:
        raise ValueError(f"not a requirement: {req!r}")
    return normalize(m.group(1))


def vllm_requirements(reqs: Iterable[str]) -> list[str]:
    """vLLM's requirements less torch (the image's) and what `LEAVE_OUT` names."""
    return [r for r in reqs
            if requirement_name(r) not in LEAVE_OUT | {"torch", "triton"}]


def kvagent_requirements(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    return [r for r in [*project["dependencies"], *project["optional-dependencies"]["server"]]
            if requirement_name(r) != "kvagent"]


def to_carry(resolved: Iterable[tuple[str, str]], image: set[str],
             cuda: str) -> list[tuple[str, str]]:
    """Resolved (name, version) pairs to carry: not in the image, not in `LEAVE_OUT`, not
    NIXL's build for the other CUDA major (the `nixl` package requires both), not torch's
    stand-ins."""
    other_nixl = {f"nixl-cu{major}" for major in ("12", "13") if major != cuda}
    return sorted((n, v) for n, v in resolved
                  if normalize(n) not in image | LEAVE_OUT | other_nixl
                  and "+standin" not in v)


def checkout_mib(root: Path = ROOT) -> float:
    """What a device transfer sends besides the carried chunks: tracked files and untracked
    ones git does not ignore."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], capture_output=True, check=True).stdout
    paths = (root / p.decode() for p in listed.split(b"\0") if p)
    return sum(p.stat().st_size for p in paths if p.is_file()) / 2**20


def chunk_size_mib(checkout: float, limit_mib: int = 64, margin_mib: int = 2) -> int:
    """The largest chunk that travels beside a checkout of `checkout` MiB in one transfer."""
    size = int(limit_mib - margin_mib - checkout)
    if size < 8:
        raise ValueError(f"the checkout ({checkout:.1f} MiB) leaves no room for chunks in "
                         f"{limit_mib} MiB; carry from a checkout without large results")
    return size


def standin_wheel(folder: Path, name: str, version: str) -> Path:
    """An empty wheel `name==version+standin`: satisfies `name==version` during resolution
    (a local label matches a bare pin) and outranks the real one, so pip never fetches it."""
    ver = f"{version}+standin"
    path = folder / f"{name}-{ver}-py3-none-any.whl"
    info = f"{name}-{ver}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: kvagent\n"
                                    "Root-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def _pip(args: Sequence[str], python_version: str) -> list[str]:
    target = ["--only-binary=:all:", "--python-version", python_version,
              "--implementation", "cp"]
    for p in platforms():
        target += ["--platform", p]
    return [sys.executable, "-m", "pip", *args, *target]


def _run(argv: Sequence[str]) -> None:
    print("+", " ".join(argv[:6]), "...", flush=True)
    env = {**os.environ, "PIP_CONSTRAINT": ""}  # a host-wide torch cap must not apply
    subprocess.run(argv, check=True, env=env)


def build(args: argparse.Namespace) -> int:
    out: Path = args.out.resolve()
    site = out / "site"
    if site.exists():
        shutil.rmtree(site)
    out.mkdir(parents=True, exist_ok=True)
    py = args.python
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        wheels, standins = tmp / "wheels", tmp / "standins"
        wheels.mkdir()
        standins.mkdir()
        _run(_pip(["download", "-q", "--no-deps", "-d", str(wheels), f"vllm=={args.vllm}"], py))
        vllm_wheel = next(wheels.glob("vllm-*.whl"))
        standin_wheel(standins, "torch", args.torch)
        standin_wheel(standins, "triton", args.triton)
        reqs = [*vllm_requirements(wheel_requirements(vllm_wheel)),
                *kvagent_requirements(ROOT / "pyproject.toml"),
                f"nixl=={args.nixl}", f"nixl-cu{args.cuda}=={args.nixl}",
                f"torch=={args.torch}", f"triton=={args.triton}"]
        (tmp / "reqs.txt").write_text("\n".join(reqs) + "\n")
        report = tmp / "report.json"
        _run(_pip(["install", "--dry-run", "-q", "--ignore-installed", "--report", str(report),
                   "--target", str(tmp / "unused"), "--find-links", str(standins),
                   "-r", str(tmp / "reqs.txt")], py))
        resolved = [(i["metadata"]["name"], i["metadata"]["version"])
                    for i in json.loads(report.read_text())["install"]]
        image = read_image_packages(args.image_packages)
        carry = to_carry(resolved, image, args.cuda)
        _run(_pip(["download", "-q", "--no-deps", "-d", str(wheels),
                   *(f"{n}=={v}" for n, v in carry)], py))
        _run(_pip(["install", "-q", "--no-deps", "--no-compile", "--no-index",
                   "--target", str(site), *map(str, sorted(wheels.glob("*.whl")))], py))
    dropped = drop_unneeded(site, py)
    write_entry_point(site)
    manifest = {
        "vllm": args.vllm, "torch": args.torch, "triton": args.triton, "nixl": args.nixl,
        "cuda": args.cuda, "python": py, "allow_vllm": ".".join(args.vllm.split(".")[:2]),
        "carried": [f"{n}=={v}" for n, v in carry],
        "left_to_image": sorted(f"{n}=={v}" for n, v in resolved
                                if normalize(n) in image and "+standin" not in v),
        "left_out": sorted(f"{n}=={v}" for n, v in resolved
                           if (n, v) not in carry and normalize(n) not in image),
        "dropped": dropped,
    }
    chunk_mib = args.chunk_mib or chunk_size_mib(checkout_mib())
    manifest["chunks"] = pack(site, out, chunk_mib)
    for where in [out, *sorted(out.glob("part-*"))]:  # each transfer carries the manifest
        (where / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    total = sum(c["bytes"] for c in manifest["chunks"]) / 2**20
    print(f"{len(carry)} packages, {total:.1f} MiB in {len(manifest['chunks'])} chunks "
          f"under {out}; next: check --site {site} --python <python {py} with torch "
          f"{args.torch}>")
    return 0


def drop_unneeded(site: Path, python_version: str) -> list[str]:
    """Remove `DROP`, NIXL's expert-parallel extension (built for other torches) and
    DeepGEMM's builds for other Pythons; the removed paths, relative to `site`."""
    tag = "cpython-" + python_version.replace(".", "")
    paths = [site / p for p in DROP] + list(site.glob("nixl_ep_cu*"))
    paths += [p for p in site.glob("vllm/third_party/deep_gemm/_C.cpython-*.so")
              if tag not in p.name]
    gone = []
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        gone.append(str(path.relative_to(site)))
    return sorted(gone)


def write_entry_point(site: Path) -> None:
    """kvagent's `vllm.general_plugins` entry point; the code comes from the checkout."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    info = site / f"kvagent-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kvagent\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nkvagent = kvagent_server.vllm_plugin:register\n")


def pack(site: Path, out: Path, chunk_mib: int) -> list[dict[str, object]]:
    """`site` as site.tar.xz in chunks of at most `chunk_mib` MiB, with their digests, one
    per folder `part-NN` (one folder per transfer)."""
    for old in out.glob("part-*"):
        shutil.rmtree(old)
    archive = out / "site.tar.xz"
    # tar | xz -T0: Python's lzma packs on one core, several times slower.
    with archive.open("wb") as f:
        tar = subprocess.Popen(["tar", "-C", str(site), "-cf", "-", "."], stdout=subprocess.PIPE)
        subprocess.run(["xz", "-6", "-T0", "-c"], stdin=tar.stdout, stdout=f, check=True)
        if tar.wait() != 0:
            raise RuntimeError("tar failed")
    whole = hashlib.sha256()
    chunks: list[dict[str, object]] = []
    with archive.open("rb") as f:
        for i, data in enumerate(iter(lambda: f.read(chunk_mib * 2**20), b"")):
            name = f"site.tar.xz.{i:02d}"
            (out / f"part-{i:02d}").mkdir()
            (out / f"part-{i:02d}" / name).write_bytes(data)
            whole.update(data)
            chunks.append({"name": name, "bytes": len(data),
                           "sha256": hashlib.sha256(data).hexdigest()})
    archive.unlink()
    return [{**c, "archive_sha256": whole.hexdigest()} for c in chunks]


CHECK_SNIPPET = """
import importlib, json, sys
missing, other = {}, {}
for mod in sys.argv[1:]:
    try:
        importlib.import_module(mod)
    except ModuleNotFoundError as exc:
        missing[mod] = exc.name
    except Exception as exc:  # needs a GPU, say: reported, not a packaging fault
        other[mod] = f"{type(exc).__name__}: {exc}"[:300]
print(json.dumps({"missing": missing, "other": other}))
"""


def check(args: argparse.Namespace) -> int:
    site = args.site.resolve()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(site), str(ROOT / "sdk"), str(ROOT / "server"), str(ROOT)])}
    proc = subprocess.run([args.python, "-c", CHECK_SNIPPET, *MODULES], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900, check=False)
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        print(proc.stderr[-3000:], file=sys.stderr)
        return 2
    for mod in MODULES:
        verdict = ("MISSING " + result["missing"][mod] if mod in result["missing"]
                   else "other: " + result["other"][mod] if mod in result["other"] else "ok")
        print(f"{mod}: {verdict}")
    return 1 if result["missing"] else 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="resolve, download, install, strip and pack")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--vllm", default="0.26.0")
    b.add_argument("--torch", default="2.11.0", help="the image's torch")
    b.add_argument("--triton", default="3.6.0", help="the image's triton")
    b.add_argument("--nixl", default="1.5.1")
    b.add_argument("--cuda", default="13", help="the image's CUDA major (nixl-cuNN)")
    b.add_argument("--python", default="3.12", help="the image's Python")
    b.add_argument("--image-packages", type=Path, default=HERE / "image_packages.txt")
    b.add_argument("--chunk-mib", type=int, default=0,
                   help="chunk size; default: what fits beside this checkout in one 64 MiB "
                        "transfer")
    c = sub.add_parser("check", help="import what the GPU run imports, with the site")
    c.add_argument("--site", type=Path, required=True)
    c.add_argument("--python", required=True,
                   help="an interpreter like the image's (its Python, its torch)")
    args = p.parse_args(argv)
    return build(args) if args.cmd == "build" else check(args)


if __name__ == "__main__":
    sys.exit(main())
