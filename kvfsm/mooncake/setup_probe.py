"""A Mooncake client's set-up, first asked of the master from a child process under a deadline.

Mooncake's `MooncakeDistributedStore.setup` holds the GIL while it waits for the master, so a master that accepts
TCP connections but never answers (a paused process, another service on its port) would hang it for good, and no
thread of the process that called it could end the wait: every thread, the engine's included, stops with it. So
before the client sets itself up in this process it runs the same set-up in a child Python process and kills the
child at the deadline: only a master that answered the child's set-up is set up with here. The child lends the store
no memory and asks for the smallest transfer buffer, so the probe costs a process start and one handshake.

Threads: `set_up_store` and `setup_answers` block their caller (start-up only) and start no thread.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from kvfsm.mooncake.errors import StoreUnavailable
from kvfsm.mooncake.local import port_accepts
from kvfsm.mooncake.settings import ClientSettings

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


def set_up_store(settings: ClientSettings) -> Any:
    """A `MooncakeDistributedStore` set up with `settings`' master within `connect_timeout_s`, else
    `StoreUnavailable` naming why: no master listens, it did not answer the child's set-up in time, or this
    process's set-up failed after all (its code)."""
    from mooncake.store import MooncakeDistributedStore

    s = settings
    if not port_accepts(s.master.host, s.master.port, timeout_s=min(1.0, s.connect_timeout_s)):
        raise StoreUnavailable(f"no Mooncake master listens on {s.master}")
    if not setup_answers(s.local_hostname, str(s.master), s.connect_timeout_s):
        raise StoreUnavailable(f"the Mooncake master at {s.master} did not answer a client's set-up within "
                               f"{s.connect_timeout_s}s")
    store = MooncakeDistributedStore()
    code = store.setup(s.local_hostname, "P2PHANDSHAKE", s.segment_bytes, s.transfer_buffer_bytes, "tcp", "",
                       str(s.master))
    if code != 0:
        raise StoreUnavailable(f"Mooncake client set-up with {s.master} failed: {code}")
    return store
