"""tools/gpu/offline_site.py and assemble_site.sh: what travels to an offline GPU
machine, and that the chunks come back together (or are refused when one is damaged)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "offline_site", ROOT / "tools" / "gpu" / "offline_site.py")
assert _spec and _spec.loader
osite = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(osite)


def test_names_and_platform_tags() -> None:
    assert osite.normalize("Nvidia_Cutlass.DSL") == "nvidia-cutlass-dsl"
    tags = osite.platforms(39)
    assert "manylinux_2_28_x86_64" in tags and "manylinux_2_39_x86_64" in tags
    assert "manylinux_2_40_x86_64" not in tags


def test_the_image_list_reads_names_and_skips_comments(tmp_path: Path) -> None:
    f = tmp_path / "image.txt"
    f.write_text("# the image\nPyYAML\ntyping_extensions  # comment\n\n")
    assert osite.read_image_packages(f) == {"pyyaml", "typing-extensions"}
    shipped = osite.read_image_packages(osite.HERE / "image_packages.txt")
    assert {"torch", "transformers", "triton"} <= shipped
    assert "vllm" not in shipped and "pydantic" not in shipped


def test_vllm_requirements_leave_torch_and_media_to_the_image() -> None:
    reqs = ["regex", "torch==2.11.0", "torchaudio==2.11.0", "flashinfer-python==0.6.14",
            "PyNvVideoCodec==2.0.4", "triton>=3", "xgrammar<1.0.0,>=0.2.1; platform_machine"]
    assert osite.vllm_requirements(reqs) == [
        "regex", "flashinfer-python==0.6.14", "xgrammar<1.0.0,>=0.2.1; platform_machine"]


def test_only_what_the_image_lacks_travels() -> None:
    resolved = [("torch", "2.11.0+standin"), ("numpy", "2.3.5"), ("pydantic", "2.14.4"),
                ("nixl-cu12", "1.5.1"), ("nixl-cu13", "1.5.1"), ("nixl", "1.5.1"),
                ("nvidia-cutlass-dsl", "4.6.0"), ("apache-tvm-ffi", "0.1.15")]
    carry = osite.to_carry(resolved, {"numpy", "torch"}, cuda="13")
    assert carry == [("apache-tvm-ffi", "0.1.15"), ("nixl", "1.5.1"),
                     ("nixl-cu13", "1.5.1"), ("pydantic", "2.14.4")]
    assert ("nixl-cu12", "1.5.1") in osite.to_carry(resolved, set(), cuda="12")


def test_chunks_leave_room_for_the_checkout() -> None:
    assert osite.chunk_size_mib(5.4) == 56
    assert osite.chunk_size_mib(31.8) == 30
    with pytest.raises(ValueError, match="no room"):
        osite.chunk_size_mib(57.0)
    assert osite.checkout_mib() > 1  # this checkout, tracked files at least


def test_a_standin_wheel_carries_only_metadata(tmp_path: Path) -> None:
    whl = osite.standin_wheel(tmp_path, "torch", "2.11.0")
    assert whl.name == "torch-2.11.0+standin-py3-none-any.whl"
    with zipfile.ZipFile(whl) as z:
        assert all(n.startswith("torch-2.11.0+standin.dist-info/") for n in z.namelist())
    assert osite.wheel_requirements(whl) == []


def test_drop_keeps_fa3_and_this_pythons_build(tmp_path: Path) -> None:
    site = tmp_path / "site"
    files = ["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
             "vllm/vllm-rs", "vllm/third_party/fmha_sm100/a.h", "nixl_ep_cu13/x.so",
             "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so",
             "vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so", "bin/tool"]
    for f in files:
        (site / f).parent.mkdir(parents=True, exist_ok=True)
        (site / f).write_text("x")
    gone = osite.drop_unneeded(site, "3.12")
    assert gone == sorted(["bin", "nixl_ep_cu13", "vllm/third_party/fmha_sm100",
                           "vllm/vllm-rs", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
                           "vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so"])
    assert (site / "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so").exists()
    assert (site / "vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so").exists()


def _packed(tmp_path: Path) -> Path:
    site = tmp_path / "build" / "site"
    (site / "probe_pkg").mkdir(parents=True)
    (site / "probe_pkg" / "__init__.py").write_bytes(os.urandom(3000).hex().encode())
    out = tmp_path / "build"
    chunks = osite.pack(site, out, chunk_mib=1)
    manifest = {"vllm": "0.26.0", "nixl": "1.5.1", "allow_vllm": "0.26", "carried": [],
                "chunks": chunks}
    (out / "part-00" / "manifest.json").write_text(json.dumps(manifest))
    return out / "part-00"


def _assemble(out: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVAGENT_SITE": str(tmp_path / "unpacked" / "site"),
           "PYTHON": sys.executable}
    (tmp_path / "unpacked").mkdir(exist_ok=True)
    return subprocess.run([str(ROOT / "tools" / "gpu" / "assemble_site.sh"), str(out),
                           "--", "--budget", "60", "--out", str(tmp_path / "dc")],
                          capture_output=True, text=True, env=env, timeout=120, check=False)


def test_chunks_join_unpack_and_reach_the_checks(tmp_path: Path) -> None:
    out = _packed(tmp_path)
    res = _assemble(out, tmp_path)
    assert "joined 1 chunks: vllm 0.26.0" in res.stdout, res.stdout + res.stderr
    assert (tmp_path / "unpacked" / "site" / "probe_pkg" / "__init__.py").is_file()
    # Then the checks: without torch/vllm/nixl here it stops (5); with them, at nvidia-smi.
    assert res.returncode in (2, 5), res.stdout[-2000:] + res.stderr[-2000:]


def test_a_damaged_chunk_is_refused(tmp_path: Path) -> None:
    out = _packed(tmp_path)
    chunk = out / "site.tar.xz.00"
    assert chunk.is_file()
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    res = _assemble(out, tmp_path)
    assert res.returncode == 3
    assert "does not match its digest" in res.stdout + res.stderr


@pytest.mark.parametrize("argv", [["build"], ["check", "--site", "x"]])
def test_missing_arguments_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        osite.main(argv)
    assert exc.value.code == 2
