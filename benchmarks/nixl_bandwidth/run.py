"""NIXL/UCX bandwidth between two processes on this machine, against memcpy.

A pull of reused KV from D to P is a NIXL READ of many same-sized blocks from another
process's registered DRAM. This measures exactly that, outside vLLM: two processes, one
NIXL agent each (UCX backend), a registered buffer of `--mib` MiB cut into `--block-kib`
blocks, the initiator READs all blocks from the target; repeated `--repeats` times. The
same bytes copied by numpy in one process give the memcpy ceiling. Every UCX transport
set in `--tls` is measured in one run, so the ratios share the machine's state.

    python -m benchmarks.nixl_bandwidth.run --mib 64 --tls "tcp,self,sm" "sm,self" "cma,self"
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent


def _set_ucx(setting: str) -> None:
    """`TLS[;KEY=VALUE...]`: UCX_TLS plus any other UCX variables for this process."""
    tls, *extra = setting.split(";")
    os.environ["UCX_TLS"] = tls
    for kv in extra:
        key, _, value = kv.partition("=")
        os.environ[key] = value


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _blocks(buf: np.ndarray, block_bytes: int) -> np.ndarray:
    """(address, length, device) rows, one per block: the descriptors vLLM's connector uses."""
    base = buf.ctypes.data
    n = buf.nbytes // block_bytes
    return np.array([(base + i * block_bytes, block_bytes, 0) for i in range(n)], dtype=np.uint64)


def _target(conn: Connection, tls: str, nbytes: int, block_bytes: int) -> None:
    _set_ucx(tls)
    agent = _agent("target")
    buf = np.frombuffer(np.random.default_rng(0).bytes(nbytes), dtype=np.uint8).copy()
    agent.register_memory(agent.get_reg_descs([(buf.ctypes.data, nbytes, 0, "")], "DRAM"))
    conn.send((agent.get_agent_metadata(), _blocks(buf, block_bytes).tobytes(),
               int(buf[:4096].sum())))
    conn.recv()  # wait until the initiator is done
    conn.close()


def _initiator(conn: Connection, tls: str, nbytes: int, block_bytes: int, repeats: int,
               out: Connection) -> None:
    _set_ucx(tls)
    agent = _agent("initiator")
    buf = np.zeros(nbytes, dtype=np.uint8)
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
                 timeout_s: float = 40.0) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    res_recv, res_send = ctx.Pipe(duplex=False)
    target = ctx.Process(target=_target, args=(a, tls, nbytes, block_bytes), daemon=True)
    init = ctx.Process(target=_initiator,
                       args=(b, tls, nbytes, block_bytes, repeats, res_send), daemon=True)
    target.start()
    init.start()
    try:
        if not res_recv.poll(timeout_s):
            return {"tls": tls, "error": f"no result within {timeout_s:.0f} s"}
        return res_recv.recv()
    finally:
        for p in (init, target):
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def measure_memcpy(nbytes: int, repeats: int) -> list[float]:
    src = np.frombuffer(np.random.default_rng(1).bytes(nbytes), dtype=np.uint8).copy()
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        out.append(time.perf_counter() - t0)
    return out


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
    ap.add_argument("--out", type=Path, default=HERE / "results.json")
    args = ap.parse_args(argv)
    nbytes = args.mib << 20
    block = args.block_kib << 10
    if nbytes % block:
        ap.error("--mib must be a multiple of --block-kib")
    memcpy = measure_memcpy(nbytes, args.repeats)
    memcpy_gbps = _gbps(nbytes, statistics.median(memcpy))
    rows = []
    for tls in args.tls:
        r = measure_nixl(tls, nbytes, block, args.repeats)
        if "times_s" in r:
            med = statistics.median(r["times_s"])
            r["median_gbps"] = _gbps(nbytes, med)
            r["of_memcpy"] = r["median_gbps"] / memcpy_gbps
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "times_s"}), flush=True)
    report = {"command": " ".join([sys.executable, "-m", "benchmarks.nixl_bandwidth.run",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "bytes": nbytes, "block_bytes": block, "repeats": args.repeats,
              "memcpy_median_gbps": memcpy_gbps, "nixl": rows}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"memcpy {memcpy_gbps:.2f} GB/s; " + "; ".join(
        f"{r['tls']}: {r.get('median_gbps', float('nan')):.2f} GB/s "
        f"({r.get('of_memcpy', float('nan')):.0%} of memcpy)" if "median_gbps" in r
        else f"{r['tls']}: {r.get('error')}" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
