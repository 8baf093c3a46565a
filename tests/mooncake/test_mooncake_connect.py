"""Connecting to a master that accepts connections but never answers (a paused process) ends at the deadline with a
named error while every thread of the process keeps running; its control shows why the set-up is tried in a child
process first: Mooncake's own set-up holds the GIL, so in-process it stops every thread until the master answers."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("mooncake.store")

from kvfsm.mooncake.client import MooncakeClient  # noqa: E402
from kvfsm.mooncake.errors import StoreUnavailable  # noqa: E402
from kvfsm.mooncake.settings import ClientSettings  # noqa: E402
from kvfsm.mooncake.setup_probe import setup_answers  # noqa: E402
from kvfsm.testing.mooncake_store import tenant_mac  # noqa: E402

DEADLINE_S = 2.0
TICK_S = 0.05


class Ticker:
    """A thread that notes the time every `TICK_S`: the longest gap between its ticks is how long it was held up."""

    def __init__(self) -> None:
        self.ticks: list[float] = [time.monotonic()]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            self.ticks.append(time.monotonic())

    def longest_gap(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(later - earlier for earlier, later in zip(self.ticks, self.ticks[1:]))


def test_connecting_to_a_master_that_never_answers_ends_at_the_deadline_and_holds_no_thread(fresh_mooncake) -> None:
    client = MooncakeClient(ClientSettings(master=fresh_mooncake.address, connect_timeout_s=DEADLINE_S), tenant_mac())
    fresh_mooncake.pause_master()
    try:
        ticker, started = Ticker(), time.monotonic()
        with pytest.raises(StoreUnavailable) as refused:
            client.connect()
        waited, gap = time.monotonic() - started, ticker.longest_gap()
    finally:
        fresh_mooncake.resume_master()
    assert str(refused.value) == (f"the Mooncake master at {fresh_mooncake.address} did not answer a client's set-up "
                                  f"within {DEADLINE_S}s")
    assert DEADLINE_S <= waited < DEADLINE_S + 1.5 and gap < 0.5, (waited, gap)
    assert not client.connected and client.close()


def test_a_master_that_answers_is_connected_to_after_the_probe(fresh_mooncake) -> None:
    assert setup_answers("127.0.0.1", str(fresh_mooncake.address), 30.0)
    client = MooncakeClient(ClientSettings(master=fresh_mooncake.address), tenant_mac())
    client.connect()
    try:
        assert client.connected
    finally:
        assert client.close()


HELD = """
import sys, threading, time
from mooncake.store import MooncakeDistributedStore
threading.Thread(target=lambda: [time.sleep(1.0), print("thread ran", flush=True)], daemon=True).start()
print("setting up", flush=True)
MooncakeDistributedStore().setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", sys.argv[1])
"""
"""Mooncake's set-up in-process, and a thread that prints a second after it started (if it can run)."""


def test_control_in_process_the_set_up_with_a_master_that_never_answers_stops_every_thread(fresh_mooncake) -> None:
    """What the probe exists for: a thread of a process whose set-up waits on a paused master does not run either
    (so neither could a join with a timeout end the wait). Shown in a child, killed after 3 s."""
    fresh_mooncake.pause_master()
    try:
        child = subprocess.Popen([sys.executable, "-c", HELD, str(fresh_mooncake.address)], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)
        try:
            child.wait(timeout=3.0)
        except subprocess.TimeoutExpired:
            child.kill()
        output = child.communicate()[0]
    finally:
        fresh_mooncake.resume_master()
    assert output.splitlines() == ["setting up"], output


class FailingSetUp:
    """Mooncake's store whose set-up answers an error code: a master that went away after the probe answered."""

    def setup(self, *args: object) -> int:
        return -1


def test_a_set_up_that_fails_here_after_the_probe_answered_is_refused_naming_the_master_and_the_code(
        mooncake, monkeypatch) -> None:
    import mooncake.store as bindings

    monkeypatch.setattr(bindings, "MooncakeDistributedStore", FailingSetUp)
    client = MooncakeClient(ClientSettings(master=mooncake.address), tenant_mac())
    with pytest.raises(StoreUnavailable) as refused:
        client.connect()
    assert str(refused.value) == f"Mooncake client set-up with {mooncake.address} failed: -1"
    assert not client.connected and client.close()


def test_the_probe_keeps_the_child_s_mooncake_log_out_of_this_process_s_output(mooncake, capfd) -> None:
    """The child's set-up logs a screenful to stderr (glog); an engine's own log must not carry it at every start."""
    assert setup_answers("127.0.0.1", str(mooncake.address), 30.0)
    assert capfd.readouterr() == ("", "")
