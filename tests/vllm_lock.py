"""The machine's vLLM lock, taken by the suite itself before its first real-engine test.

Two sets of vLLM nodes on the two cores of a development machine measure each other,
not the code: a benchmark beside a test run records contention, and both get slower.
Benchmarks and long runs hold `/tmp/kvagent-vllm.lock` (`flock /tmp/kvagent-vllm.lock
...`); a pytest run that reaches a `vllm`-marked test takes the same lock first, waiting
for whoever holds it, unless the holder is one of its own ancestors (the run was started
under `flock`). It keeps the lock until it exits. The lock is advisory and local: CI
holds nothing, so there it is taken at once.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from pathlib import Path
from typing import IO

LOCK_PATH = Path(os.environ.get("KVAGENT_VLLM_LOCK", "/tmp/kvagent-vllm.lock"))
#: How long a run waits for another holder before it fails (s).
WAIT_S = float(os.environ.get("KVAGENT_VLLM_LOCK_WAIT_S", "5400"))

_held: IO[bytes] | None = None


def holders(path: Path, locks_text: str | None = None) -> set[int]:
    """PIDs holding (not waiting for) a lock on `path`, from /proc/locks."""
    try:
        st = path.stat()
        text = locks_text if locks_text is not None else Path("/proc/locks").read_text()
    except OSError:
        return set()
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    out = set()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[1] != "->" and fields[5] == dev:
            out.add(int(fields[4]))
    return out


def ancestors(pid: int | None = None) -> set[int]:
    """This process and its parents, up to init."""
    pid = os.getpid() if pid is None else pid
    seen: set[int] = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state
    return seen


def hold() -> None:
    """Take the lock (once per process) unless an ancestor holds it; wait for others."""
    global _held
    if _held is not None or holders(LOCK_PATH) & ancestors():
        return
    f = open(LOCK_PATH, "ab")  # noqa: SIM115 - held until the process exits
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        who = sorted(holders(LOCK_PATH))
        sys.stderr.write(f"\nwaiting for {LOCK_PATH} (held by pid {who}: another vLLM run "
                         f"or benchmark) before the first real-engine test\n")
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    f.close()
                    raise TimeoutError(f"{LOCK_PATH} still held after {WAIT_S:.0f} s") from None
                time.sleep(2)
    _held = f
