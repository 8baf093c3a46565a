"""Whether a Mooncake master answers a client's set-up, asked from a child process under a deadline.

Mooncake's `MooncakeDistributedStore.setup` holds the GIL while it waits for the master, so a master that accepts
TCP connections but never answers (a paused process, another service on its port) would hang it for good, and no
thread of the process that called it could end the wait: every thread, the engine's included, stops with it. So
before the client sets itself up in this process it runs the same set-up in a child Python process and kills the
child at the deadline: only a master that answered the child's set-up is set up with here. The child lends the store
no memory and asks for the smallest transfer buffer, so the probe costs a process start and one handshake.

Threads: `setup_answers` blocks its caller (start-up only) and starts no thread.
"""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import os, sys
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
code = store.setup(sys.argv[1], "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", sys.argv[2])
os._exit(0 if code == 0 else 3)
"""
"""The child's whole program: the client's own set-up call, lending no memory; exit 0 if the master answered it.
It exits at once (`os._exit`), as a child killed at the deadline does: a normal exit tears the store down first,
which waits about a second for Mooncake's own threads (1.17 s a probe, where import and set-up take 0.08 s), a
second every engine start and every test that opens a Mooncake tier paid."""


def setup_answers(local_hostname: str, master: str, timeout_s: float) -> bool:
    """Whether a Mooncake client set-up of `local_hostname` with the master at `master` succeeds within
    `timeout_s` (False if it fails, or is still waiting at the deadline: the child is then killed)."""
    try:
        probe = subprocess.run([sys.executable, "-c", PROBE, local_hostname, master], timeout=timeout_s,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False
    return probe.returncode == 0
