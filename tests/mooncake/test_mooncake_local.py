"""The local deployment the tier tests stand on: it starts, answers, survives a master restart, and leaves nothing.
Each child logs to a file named after it, reads no stdin, dies with its parent, and is given up at its deadline."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("mooncake.store")

from kvfsm.mooncake import local  # noqa: E402
from kvfsm.mooncake.local import (  # noqa: E402
    LOOPBACK, DeploymentSettings, LocalMooncake, MasterAddress, MooncakeProcessError, free_loopback_port, port_accepts,
)


def serving(first: str = "") -> Callable[[int], list[str]]:
    """The command line of a child that runs the Python statements `first`, then listens on its port until it is
    stopped."""
    code = (f"import socket, sys, time\n{first}\n"
            "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); time.sleep(10)")
    return lambda port: [sys.executable, "-c", code, str(port)]


def logged(child: local._Child) -> str:
    """What the child wrote, once it is stopped."""
    child.stop(grace_s=0.2)
    return child.log_path.read_text()


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
    with pytest.raises(ValueError):
        MasterAddress.parse("h:99999")


def test_a_master_address_splits_at_its_last_colon() -> None:
    """An IPv6 host holds colons of its own: only the last one ends the host."""
    assert MasterAddress.parse("[::1]:50051") == MasterAddress(host="[::1]", port=50051)


@pytest.mark.parametrize("bad", ["127.0.0.1", ":5", "host:port", "h:"])
def test_a_malformed_master_address_is_refused_naming_the_form_it_needs(bad: str) -> None:
    """A missing host, port or colon is refused by the parser's own words, not by a field validator's."""
    with pytest.raises(ValueError) as refused:
        MasterAddress.parse(bad)
    assert str(refused.value) == f"a Mooncake master address is HOST:PORT, got {bad!r}"


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
    child.start(serving("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)"))
    pid = child.pid
    started = time.monotonic()
    child.stop(grace_s=0.2)
    assert time.monotonic() - started < 2.0 and not child.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # type: ignore[arg-type]


def test_a_process_that_ignores_sigterm_is_given_three_seconds_by_default(tmp_path) -> None:
    """The default grace: long enough for a master to flush and exit, short enough for a test's teardown."""
    child = local._Child("stubborn", tmp_path, timeout_s=5.0)
    child.start(serving("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)"))
    started = time.monotonic()
    child.stop()
    assert 3.0 <= time.monotonic() - started < 3.8 and not child.running


def test_each_process_of_a_deployment_logs_to_a_file_named_after_it(fresh_mooncake) -> None:
    """A deployment of the test's own: the module's, shared, may have started a process again (its log numbered 2)."""
    deployment = fresh_mooncake
    assert deployment.master.log_path == deployment.log_dir / "mooncake_master-1.log"
    assert deployment.segment_host.log_path == deployment.log_dir / "mooncake_client-1.log"
    assert deployment.master.log_path.is_file() and deployment.segment_host.log_path.is_file()


def test_a_deployment_given_no_log_folder_logs_in_a_fresh_temporary_one_named_for_kvfsm() -> None:
    deployment = LocalMooncake()
    try:
        assert deployment.log_dir.is_dir() and deployment.log_dir.parent == Path(tempfile.gettempdir())
        assert deployment.log_dir.name.startswith("kvfsm-mooncake-")
    finally:
        deployment.log_dir.rmdir()


def test_a_deployment_removes_the_log_folder_it_made_when_its_block_ends_cleanly() -> None:
    with LocalMooncake(DeploymentSettings(segment_bytes=16 << 20)) as deployment:
        assert deployment.master.log_path.is_file()
    assert not deployment.log_dir.exists()


def test_closing_a_deployment_again_is_harmless() -> None:
    deployment = LocalMooncake(DeploymentSettings(segment_bytes=16 << 20))
    with deployment:
        pass
    deployment.close()  # its folder is gone already, as after a user removed it
    assert not deployment.log_dir.exists() and deployment.pids() == []


def test_a_deployment_keeps_its_logs_when_its_block_raises_and_never_removes_a_folder_it_was_given(tmp_path) -> None:
    deployment = LocalMooncake(DeploymentSettings(segment_bytes=16 << 20))
    with pytest.raises(RuntimeError, match="a failed run"), deployment:
        raise RuntimeError("a failed run")
    try:
        assert deployment.master.log_path.is_file()
    finally:
        shutil.rmtree(deployment.log_dir)
    given = LocalMooncake(DeploymentSettings(segment_bytes=16 << 20), log_dir=tmp_path / "logs")
    with given:
        pass
    assert given.master.log_path.is_file()


def test_a_childs_output_and_its_errors_go_to_its_log_file(tmp_path) -> None:
    child = local._Child("talker", tmp_path, timeout_s=5.0)
    child.start(serving("print('on stdout', flush=True); print('on stderr', file=sys.stderr, flush=True)"))
    assert logged(child).splitlines() == ["on stdout", "on stderr"]


def test_a_child_reads_nothing_of_its_parents_stdin(tmp_path) -> None:
    """A child must not take input meant for the program that started it (the demo's terminal): its stdin is
    empty whatever the parent's is, here a pipe holding a line."""
    child = local._Child("reader", tmp_path, timeout_s=5.0)
    typed, writer = os.pipe()
    os.write(writer, b"typed at the terminal\n")
    os.close(writer)
    parents = os.dup(0)
    try:
        os.dup2(typed, 0)
        child.start(serving("print(repr(sys.stdin.read()), flush=True)"))
    finally:
        os.dup2(parents, 0)
        os.close(parents)
        os.close(typed)
    assert logged(child).splitlines() == ["''"]


def test_a_child_is_set_to_die_with_its_parent(tmp_path) -> None:
    child = local._Child("orphan", tmp_path, timeout_s=5.0)
    child.start(serving("import ctypes; sig = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(sig)); "
                        "print(sig.value, flush=True)"))  # 2: PR_GET_PDEATHSIG
    assert logged(child).splitlines() == [str(int(local.signal.SIGKILL))]


def test_a_child_that_exits_before_it_listens_is_logged_with_its_exit_code_and_port(tmp_path, caplog) -> None:
    child = local._Child("quitter", tmp_path, timeout_s=5.0)
    child.port = free_loopback_port()
    with caplog.at_level(logging.WARNING, logger=local.log.name), pytest.raises(MooncakeProcessError):
        child.start(lambda port: ["/bin/false"])
    assert caplog.messages == [f"quitter exited with 1 on port {child.port}"]


def test_a_child_that_listens_is_logged_ready_with_its_address_and_pid(tmp_path, caplog) -> None:
    child = local._Child("server", tmp_path, timeout_s=5.0)
    with caplog.at_level(logging.INFO, logger=local.log.name):
        port = child.start(serving())
    assert caplog.messages == [f"server ready on 127.0.0.1:{port} (pid {child.pid})"]
    child.stop(grace_s=0.2)


def test_a_child_that_never_listens_is_killed_at_its_deadline_and_is_a_named_error(tmp_path) -> None:
    child = local._Child("mute", tmp_path, timeout_s=0.5)
    child.port = free_loopback_port()
    with pytest.raises(MooncakeProcessError, match="^mute did not start within 0.5s"):
        child.start(lambda port: ["sleep", "10"])
    assert not child.running and child.pid is None


def test_a_child_is_ready_when_its_own_ipv4_port_listens_not_the_same_port_on_ipv6(tmp_path) -> None:
    """Readiness is probed where the child listens (127.0.0.1): another process on `::1` at that port is not it."""
    other = socket.socket(socket.AF_INET6)
    try:
        other.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    child = local._Child("mute", tmp_path, timeout_s=0.5)
    with other:
        other.listen()
        child.port = other.getsockname()[1]
        if port_accepts("127.0.0.1", child.port):
            pytest.skip("the port is taken on IPv4 too")
        with pytest.raises(MooncakeProcessError):
            child.start(lambda port: ["sleep", "10"])


def test_a_child_is_given_up_once_the_clock_reads_its_deadline(tmp_path, monkeypatch) -> None:
    """The deadline is not part of the wait: a start whose clock stands at it gives up a child that would listen."""
    readings = iter([0.0])  # the start; then the clock stands at the deadline
    monkeypatch.setattr(local, "time", SimpleNamespace(monotonic=lambda: next(readings, 0.5), sleep=time.sleep))
    child = local._Child("late", tmp_path, timeout_s=0.5)
    child.port = free_loopback_port()
    with pytest.raises(MooncakeProcessError):
        child.start(serving())
    assert not child.running


def test_a_child_that_listens_a_fifth_of_its_timeout_late_is_noticed_in_time(tmp_path) -> None:
    """Readiness is probed often enough that a child that listens late, but well within its timeout, is started.
    The port here is opened by this test 0.2 s after the spawn (the child only sleeps): the same to the probe."""
    child = local._Child("slow", tmp_path, timeout_s=1.0)
    child.port = free_loopback_port()
    late = socket.socket()
    opener = threading.Timer(0.2, lambda: (late.bind(("127.0.0.1", child.port)), late.listen()))
    with late:
        opener.start()
        try:
            assert child.start(lambda port: ["sleep", "10"]) == child.port
        finally:
            opener.join()
            child.stop(grace_s=0.2)


def test_a_port_that_never_answers_the_handshake_is_given_up_on_within_the_timeout(unanswering_port: int) -> None:
    """The client's start-up asks this before it sets up a store, so a dead master host fails start-up in bounded
    time (the default: 0.2 s) instead of hanging it."""
    start = time.monotonic()
    assert port_accepts(LOOPBACK, unanswering_port, timeout_s=0.1) is False
    assert port_accepts(LOOPBACK, unanswering_port) is False
    assert time.monotonic() - start < 1.0
