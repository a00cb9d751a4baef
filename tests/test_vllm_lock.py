"""The suite's own hold on the machine's vLLM lock: who holds it, and whether that is us."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import vllm_lock


def test_holders_reads_holders_not_waiters(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.write_text("")
    st = lock.stat()
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    text = (f"1: FLOCK  ADVISORY  WRITE 111 {dev} 0 EOF\n"
            f"1: -> FLOCK  ADVISORY  WRITE 222 {dev} 0 EOF\n"
            f"2: POSIX  ADVISORY  WRITE 333 00:01:{st.st_ino + 1} 0 EOF\n")
    assert vllm_lock.holders(lock, text) == {111}


def test_a_lock_held_by_an_ancestor_is_ours_and_another_is_not(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    with open(lock, "ab") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        assert os.getpid() in vllm_lock.holders(lock)
        assert vllm_lock.holders(lock) & vllm_lock.ancestors()
        # a child process sees its parent (us) as the holder: an ancestor
        code = ("import sys, pathlib, vllm_lock; p = pathlib.Path(sys.argv[1]); "
                "print(bool(vllm_lock.holders(p) & vllm_lock.ancestors()))")
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
        out = subprocess.run([sys.executable, "-c", code, str(lock)], env=env,
                             capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "True"
    assert vllm_lock.holders(lock) == set()
