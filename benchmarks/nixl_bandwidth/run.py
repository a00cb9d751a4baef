"""NIXL/UCX bandwidth between two processes on this machine, against memcpy.

A pull of reused KV from D to P is a NIXL READ of many same-sized blocks from another
process's registered DRAM. This measures exactly that, outside vLLM: two processes, one
NIXL agent each (UCX backend), a registered buffer of `--mib` MiB cut into `--block-kib`
blocks, the initiator READs all blocks from the target; repeated `--repeats` times. The
same bytes copied by numpy in one process give the memcpy ceiling, and the kernel's
cross-process single copy of the same blocks (`process_vm_readv`, what UCX's `cma` calls)
the ceiling for two processes. Every UCX transport set in `--tls`, under every progress-
thread delay in `--pthr-delay-us`, is measured in one run, so the ratios share the
machine's state. The agents are built as a bundle node builds them: vLLM's `num_threads`
and the plugin's progress-thread delay (stock NIXL's busy-polling progress threads, one
per agent, take the cores the copy needs on a small machine).

    python -m benchmarks.nixl_bandwidth.run --mib 64 --tls "tcp,self,sm" "sm,self" "cma,self"
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from kvagent_server.vllm_plugin.env import DEFAULT_NIXL_DELAY_US
from kvagent_server.vllm_plugin.nixl_delay import patch_api_module

HERE = Path(__file__).resolve().parent
#: vLLM 0.32's NixlConnector builds its agent with this many UCX threads unless
#: `kv_connector_extra_config.num_threads` says otherwise.
VLLM_NUM_THREADS = 4


class AgentSettings(NamedTuple):
    """How each NIXL agent is built: as in a bundle node by default."""

    #: The UCX progress thread's poll timeout (0: NIXL's own busy loop; the bundle's
    #: plugin sets `DEFAULT_NIXL_DELAY_US`).
    pthr_delay_us: int = DEFAULT_NIXL_DELAY_US
    num_threads: int = VLLM_NUM_THREADS


BUNDLE_AGENT = AgentSettings()


def _set_ucx(setting: str) -> None:
    """`TLS[;KEY=VALUE...]`: UCX_TLS plus any other UCX variables for this process."""
    tls, *extra = setting.split(";")
    os.environ["UCX_TLS"] = tls
    for kv in extra:
        key, _, value = kv.partition("=")
        os.environ[key] = value


def _buffer(nbytes: int, thp: bool) -> np.ndarray:
    """A zeroed buffer; with `thp`, anonymous memory advised to use transparent huge
    pages before its first touch (fewer pages for the kernel to pin per copy)."""
    if not thp:
        return np.zeros(nbytes, dtype=np.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(m, dtype=np.uint8)


def _random_buffer(nbytes: int, thp: bool, *, seed: int) -> np.ndarray:
    buf = _buffer(nbytes, thp)
    buf[:] = np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8)
    return buf


def _run_pair(first: Any, second: Any, results: Connection, label: str,
              timeout_s: float) -> dict[str, Any]:
    """Start two processes, wait for the result one of them sends, then reap both."""
    for proc in (first, second):
        proc.start()
    try:
        if not results.poll(timeout_s):
            return {"tls": label, "error": f"no result within {timeout_s:.0f} s"}
        result: dict[str, Any] = results.recv()
        return result
    finally:
        for proc in (second, first):
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def _agent(name: str, agent: AgentSettings) -> Any:
    from nixl import _api
    from nixl._api import nixl_agent, nixl_agent_config

    if agent.pthr_delay_us:  # what the bundle's vLLM plugin does in every node
        patch_api_module(_api, agent.pthr_delay_us)
    return nixl_agent(name, nixl_agent_config(backends=["UCX"],
                                              num_threads=agent.num_threads))


def _blocks(buf: np.ndarray, block_bytes: int) -> np.ndarray:
    """(address, length, device) rows, one per block: the descriptors vLLM's connector uses."""
    base = buf.ctypes.data
    n = buf.nbytes // block_bytes
    return np.array([(base + i * block_bytes, block_bytes, 0) for i in range(n)], dtype=np.uint64)


def _target(conn: Connection, tls: str, nbytes: int, block_bytes: int, thp: bool,
            settings: AgentSettings) -> None:
    _set_ucx(tls)
    agent = _agent("target", settings)
    buf = _random_buffer(nbytes, thp, seed=0)
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, nbytes, 0, "")], "DRAM"))
    conn.send((agent.get_agent_metadata(), _blocks(buf, block_bytes).tobytes(),
               int(buf[:4096].sum())))
    conn.recv()  # wait until the initiator is done
    conn.close()


def _initiator(conn: Connection, tls: str, nbytes: int, block_bytes: int, repeats: int,
               out: Connection, thp: bool, settings: AgentSettings) -> None:
    _set_ucx(tls)
    agent = _agent("initiator", settings)
    buf = _buffer(nbytes, thp)
    buf[:] = 0  # fault the pages in, as a KV cache's are
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, nbytes, 0, "")], "DRAM"))
    meta, remote_rows, checksum = conn.recv()
    remote = agent.add_remote_agent(meta)
    local_descs = agent.get_xfer_descs(_blocks(buf, block_bytes), "DRAM")
    remote_descs = agent.get_xfer_descs(
        np.frombuffer(remote_rows, dtype=np.uint64).reshape(-1, 3), "DRAM")
    times: list[float] = []
    for _ in range(repeats + 1):  # the first pays connection set-up: reported apart
        handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote)
        t0 = time.perf_counter()
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        dt = time.perf_counter() - t0
        agent.release_xfer_handle(handle)
        if state != "DONE":
            out.send({"tls": tls, "error": f"transfer state {state}"})
            conn.send("done")
            return
        times.append(dt)
    ok = int(buf[:4096].sum()) == checksum
    conn.send("done")
    out.send({"tls": tls, "first_s": times[0], "times_s": times[1:], "data_ok": ok})


def measure_nixl(tls: str, nbytes: int, block_bytes: int, repeats: int,
                 timeout_s: float = 40.0, thp: bool = False,
                 agent: AgentSettings = BUNDLE_AGENT) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    res_recv, res_send = ctx.Pipe(duplex=False)
    target = ctx.Process(target=_target, args=(a, tls, nbytes, block_bytes, thp, agent),
                         daemon=True)
    init = ctx.Process(target=_initiator,
                       args=(b, tls, nbytes, block_bytes, repeats, res_send, thp, agent),
                       daemon=True)
    return _run_pair(target, init, res_recv, tls, timeout_s)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _vm_target(conn: Connection, nbytes: int, thp: bool) -> None:
    buf = _random_buffer(nbytes, thp, seed=0)
    conn.send((os.getpid(), buf.ctypes.data, int(buf[:4096].sum())))
    conn.recv()  # wait until the reader is done
    conn.close()


def _vm_reader(conn: Connection, nbytes: int, block_bytes: int, repeats: int,
               out: Connection, thp: bool, per_call: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    readv = libc.process_vm_readv
    readv.restype = ctypes.c_ssize_t
    buf = _buffer(nbytes, thp)
    buf[:] = 0
    pid, remote_base, checksum = conn.recv()
    n = nbytes // block_bytes
    local = (_IoVec * n)(*[(buf.ctypes.data + i * block_bytes, block_bytes) for i in range(n)])
    remote = (_IoVec * n)(*[(remote_base + i * block_bytes, block_bytes) for i in range(n)])
    size = ctypes.sizeof(_IoVec)
    times: list[float] = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for i in range(0, n, per_call):
            k = min(per_call, n - i)
            got = readv(pid, ctypes.byref(local, i * size), k, ctypes.byref(remote, i * size),
                        k, 0)
            if got != k * block_bytes:
                out.send({"error": f"process_vm_readv: errno {ctypes.get_errno()}"})
                conn.send("done")
                return
        times.append(time.perf_counter() - t0)
    ok = int(buf[:4096].sum()) == checksum
    conn.send("done")
    out.send({"tls": "process_vm_readv", "first_s": times[0], "times_s": times[1:],
              "data_ok": ok})


def measure_single_copy(nbytes: int, block_bytes: int, repeats: int,
                        thp: bool = False, timeout_s: float = 40.0,
                        per_call: int = 1024) -> dict[str, Any]:
    """The kernel's cross-process single copy (`process_vm_readv`, what UCX's `cma`
    transport calls) of the same blocks, without NIXL or UCX: the ceiling for a pull
    between two processes that share no memory mapping. `per_call` blocks go into one
    call (1024 is IOV_MAX; 1 is one call per block, as one READ per descriptor)."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    res_recv, res_send = ctx.Pipe(duplex=False)
    target = ctx.Process(target=_vm_target, args=(a, nbytes, thp), daemon=True)
    reader = ctx.Process(target=_vm_reader,
                         args=(b, nbytes, block_bytes, repeats, res_send, thp, per_call),
                         daemon=True)
    return _run_pair(target, reader, res_recv, "process_vm_readv", timeout_s)


def measure_memcpy(nbytes: int, repeats: int, thp: bool = False) -> list[float]:
    src = _random_buffer(nbytes, thp, seed=1)
    dst = _buffer(nbytes, thp)
    np.copyto(dst, src)  # fault the pages in
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        out.append(time.perf_counter() - t0)
    return out


def _delay_label(row: dict[str, Any]) -> str:
    return f" (delay {row['pthr_delay_us']} us)" if "pthr_delay_us" in row else ""


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--block-kib", type=int, default=256,
                    help="block size; the demo model's KV block (16 tokens) is 256 KiB per "
                         "layer group on P/D, so the default mirrors it")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tls", nargs="+", default=["tcp,self,sm", "tcp,self,cma", "tcp,self"],
                    help="UCX settings to compare, each `UCX_TLS[;UCX_VAR=value...]`")
    ap.add_argument("--pthr-delay-us", type=int, nargs="+", default=[DEFAULT_NIXL_DELAY_US],
                    help="UCX progress-thread poll timeouts to compare (both agents); the "
                         "default is what the bundle's plugin sets, 0 is stock NIXL, whose "
                         "idle progress threads busy-poll and take cores from the copy")
    ap.add_argument("--num-threads", type=int, default=VLLM_NUM_THREADS,
                    help="UCX backend threads per agent (vLLM's NixlConnector default)")
    ap.add_argument("--thp", action="store_true",
                    help="back every buffer (both agents' and memcpy's) with transparent "
                         "huge pages (madvise), where the kernel allows it")
    ap.add_argument("--out", type=Path, default=HERE / "results.json")
    args = ap.parse_args(argv)
    nbytes = args.mib << 20
    block = args.block_kib << 10
    if nbytes % block:
        ap.error("--mib must be a multiple of --block-kib")
    memcpy = measure_memcpy(nbytes, args.repeats, args.thp)
    memcpy_gbps = _gbps(nbytes, statistics.median(memcpy))
    rows = []
    single = measure_single_copy(nbytes, block, args.repeats, thp=args.thp)
    for delay in args.pthr_delay_us:
        for tls in args.tls:
            r = measure_nixl(tls, nbytes, block, args.repeats, thp=args.thp,
                             agent=AgentSettings(delay, args.num_threads))
            rows.append({**r, "pthr_delay_us": delay})
    for r in [single, *rows]:
        if "times_s" in r:
            med = statistics.median(r["times_s"])
            r["median_gbps"] = _gbps(nbytes, med)
            r["of_memcpy"] = r["median_gbps"] / memcpy_gbps
        print(json.dumps({k: v for k, v in r.items() if k != "times_s"}), flush=True)
    report = {"command": " ".join([sys.executable, "-m", "benchmarks.nixl_bandwidth.run",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "bytes": nbytes, "block_bytes": block, "repeats": args.repeats,
              "thp": args.thp, "num_threads": args.num_threads,
              "memcpy_median_gbps": memcpy_gbps, "single_copy": single, "nixl": rows}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"memcpy {memcpy_gbps:.2f} GB/s; " + "; ".join([
        f"{r['tls']}{_delay_label(r)}: {r.get('median_gbps', float('nan')):.2f} GB/s "
        f"({r.get('of_memcpy', float('nan')):.0%} of memcpy)" if "median_gbps" in r
        else f"{r['tls']}: {r.get('error')}" for r in [single, *rows]]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
