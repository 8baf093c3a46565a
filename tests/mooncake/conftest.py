"""Real Mooncake deployments for the shared-tier tests: a `mooncake_master` and a segment host on free loopback
ports, started within a bounded time and always torn down, checked to leave no process behind.

`mooncake` is shared by a module's tests (objects of one test stay visible to the next: use distinct keys);
`fresh_mooncake` is a test's own, for tests that kill, pause or restart the master.
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Callable, Iterator

import pytest

from kvfsm.mooncake.client import MooncakeClient
from kvfsm.mooncake.local import DeploymentSettings, LocalMooncake
from kvfsm.mooncake.settings import ClientSettings
from kvfsm.mooncake.value import ValueMac
from kvfsm.testing.mooncake_store import tenant_mac

SEGMENT_BYTES = 64 << 20
UNANSWERED_RELEASE_S = 4.0
"""How long `unanswering_port` keeps its connections hanging: a call that waits without a bound still ends."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _deployment(tmp: Path, settings: DeploymentSettings) -> Iterator[LocalMooncake]:
    deployment = LocalMooncake(settings, log_dir=tmp)
    pids: list[int] = []
    deployment.start()
    try:
        yield deployment
    finally:
        pids = deployment.pids()
        deployment.stop()
    assert not any(_alive(pid) for pid in pids), f"Mooncake processes left behind: {pids}"


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMooncake]:
    yield from _deployment(tmp_path_factory.mktemp("mooncake"), DeploymentSettings(segment_bytes=SEGMENT_BYTES))


@pytest.fixture
def fresh_mooncake(tmp_path: Path) -> Iterator[LocalMooncake]:
    yield from _deployment(tmp_path, DeploymentSettings(segment_bytes=SEGMENT_BYTES, lease_ttl_ms=500))


ClientFactory = Callable[..., MooncakeClient]


@pytest.fixture
def connect() -> Iterator[ClientFactory]:
    """`connect(deployment, mac=..., **settings)`: a connected client, closed when the test ends."""
    clients: list[MooncakeClient] = []

    def make(deployment: LocalMooncake, mac: ValueMac | None = None, **overrides: object) -> MooncakeClient:
        client = MooncakeClient(ClientSettings(master=deployment.address, **overrides),  # type: ignore[arg-type]
                                mac or tenant_mac())
        client.connect()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def unanswering_port() -> Iterator[int]:
    """A loopback port whose accept queue is full: connections to it are neither accepted nor refused (Linux drops
    their SYNs), as a master host that is up but does not answer, until the listener closes after
    `UNANSWERED_RELEASE_S`."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    first = socket.create_connection(("127.0.0.1", port))
    timer = threading.Timer(UNANSWERED_RELEASE_S, listener.close)
    timer.start()
    yield port
    timer.cancel()
    first.close()
    listener.close()
