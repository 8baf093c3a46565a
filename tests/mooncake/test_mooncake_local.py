"""The local deployment the tier tests stand on: it starts, answers, survives a master restart, and leaves nothing."""

from __future__ import annotations

import os
import sys
import time

import pytest

pytest.importorskip("mooncake.store")

from kvfsm.mooncake import local  # noqa: E402
from kvfsm.mooncake.local import (  # noqa: E402
    DeploymentSettings, LocalMooncake, MasterAddress, MooncakeProcessError, port_accepts,
)


def test_a_deployment_listens_on_loopback_and_stops_without_leftovers(tmp_path) -> None:
    deployment = LocalMooncake(DeploymentSettings(segment_bytes=16 << 20), log_dir=tmp_path)
    with deployment:
        address = deployment.address
        pids = deployment.pids()
        assert address.host == "127.0.0.1" and port_accepts(address.host, address.port)
        assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not port_accepts(address.host, address.port)


def test_a_restarted_master_keeps_its_port(fresh_mooncake) -> None:
    before = fresh_mooncake.address
    fresh_mooncake.kill_master()
    assert not port_accepts(before.host, before.port)
    assert fresh_mooncake.restart_master() == before
    assert port_accepts(before.host, before.port)


def test_a_master_that_cannot_start_is_a_named_error_within_its_deadline(tmp_path, monkeypatch) -> None:
    deployment = LocalMooncake(DeploymentSettings(start_timeout_s=1.0), log_dir=tmp_path)
    monkeypatch.setattr(deployment, "_master_command", lambda port: ["/bin/false"])
    with pytest.raises(MooncakeProcessError):
        deployment.start()
    assert deployment.pids() == []


def test_master_addresses_parse_or_refuse() -> None:
    assert MasterAddress.parse("127.0.0.1:50051") == MasterAddress(host="127.0.0.1", port=50051)
    for bad in ("127.0.0.1", ":5", "host:port", "h:99999"):
        with pytest.raises(ValueError):
            MasterAddress.parse(bad)


def test_without_the_mooncake_package_its_executables_are_a_named_error(monkeypatch) -> None:
    monkeypatch.setattr(local.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MooncakeProcessError) as refused:
        local._binary("mooncake_master")
    assert str(refused.value) == "the mooncake package is not installed: pip install 'kvfsm[mooncake]'"


def test_an_executable_the_package_lacks_is_a_named_error() -> None:
    with pytest.raises(MooncakeProcessError) as refused:
        local._binary("no_such_tool")
    assert str(refused.value) == "the mooncake package has no no_such_tool executable"


def test_starting_a_running_process_again_is_refused(mooncake) -> None:
    with pytest.raises(MooncakeProcessError) as refused:
        mooncake.master.start(mooncake._master_command)
    assert str(refused.value) == "mooncake_master is already running"


def test_a_process_that_cannot_start_is_tried_on_three_fresh_ports_then_once_on_its_own(tmp_path) -> None:
    """A fresh port may be taken by another process before the child binds it, so a first start tries three; a
    restart keeps the port clients know, so it tries that one only. Each try logs to a file of its own, in a
    folder made with its parents."""
    logs = tmp_path / "not" / "yet"
    child = local._Child("child", logs, timeout_s=1.0)
    ports: list[int] = []
    with pytest.raises(MooncakeProcessError) as refused:
        child.start(lambda port: ports.append(port) or ["/bin/false"])
    assert str(refused.value) == f"child did not start within 1.0s; see {logs}/child-3.log"
    assert len(set(ports)) == 3 and sorted(p.name for p in logs.iterdir()) == [f"child-{n}.log" for n in (1, 2, 3)]
    child.port = ports[0]
    with pytest.raises(MooncakeProcessError):
        child.start(lambda port: ports.append(port) or ["/bin/false"])
    assert ports[3:] == [ports[0]]


def test_a_process_that_ignores_sigterm_is_killed_once_its_grace_ran_out(tmp_path) -> None:
    child = local._Child("stubborn", tmp_path, timeout_s=5.0)
    serve = ("import signal, socket, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); time.sleep(10)")
    child.start(lambda port: [sys.executable, "-c", serve, str(port)])
    pid = child.pid
    started = time.monotonic()
    child.stop(grace_s=0.2)
    assert time.monotonic() - started < 2.0 and not child.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # type: ignore[arg-type]
