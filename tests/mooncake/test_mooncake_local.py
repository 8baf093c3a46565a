"""The local deployment the tier tests stand on: it starts, answers, survives a master restart, and leaves nothing."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("mooncake.store")

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
