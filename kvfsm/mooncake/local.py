"""A Mooncake deployment on loopback made of child processes: a `mooncake_master` and a segment host.

The master keeps the object metadata; the segment host (Mooncake's standalone `mooncake_client`) lends the memory
objects live in, so engines can come and go without taking the shared KV with them, as in vLLM's
`standalone-store` mode. Tests, the demo and the benchmark all need a real deployment they own (never a mock
store), and none may leave a process behind: each child dies with its parent (`PR_SET_PDEATHSIG`), runs in its own
process group, and every wait on it has a deadline. Every address given to them is 127.0.0.1.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_PR_SET_PDEATHSIG = 1


class MooncakeProcessError(RuntimeError):
    """A Mooncake process could not be started, or did not answer within its deadline."""


class MasterAddress(BaseModel):
    """Where a master's RPC service listens, as `HOST:PORT`."""

    model_config = ConfigDict(frozen=True)

    host: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)

    @classmethod
    def parse(cls, text: str) -> MasterAddress:
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"a Mooncake master address is HOST:PORT, got {text!r}")
        return cls(host=host, port=int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


class DeploymentSettings(BaseModel):
    """The flags of the local deployment that kvfsm's tier depends on; the rest keep Mooncake's defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    segment_bytes: PositiveInt = 256 << 20
    """Memory the segment host lends to the store: the shared tier's capacity."""
    lease_ttl_ms: PositiveInt = 10_000
    """How long a read lease protects an object from eviction and removal (Mooncake's `default_kv_lease_ttl`)."""
    eviction_high_watermark: float = Field(default=0.9, gt=0.0, le=1.0)
    """Fill ratio of the segments above which the master evicts objects whose lease expired."""
    start_timeout_s: float = Field(default=20.0, gt=0.0)
    """Bound on the wait for a process to accept connections."""


def _binary(name: str) -> Path:
    """An executable shipped inside the `mooncake` wheel, found without loading the store library."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise MooncakeProcessError("the mooncake package is not installed: pip install 'kvfsm[mooncake]'")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / name
        if candidate.is_file():
            return candidate
    raise MooncakeProcessError(f"the mooncake package has no {name} executable")


def free_loopback_port() -> int:
    """A port nothing listens on right now (a start retries if another process takes it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def port_accepts(host: str, port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def die_with_parent() -> None:
    """Runs in a child (before exec, or after a fork): a killed test run takes its processes down with it."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class _Child:
    """One child process that is ready when `port` accepts connections; restarts keep `port`."""

    def __init__(self, name: str, log_dir: Path, timeout_s: float) -> None:
        self.name = name
        self._log_dir = log_dir
        self._timeout_s = timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self._starts = 0

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def log_path(self) -> Path:
        return self._log_dir / f"{self.name}-{self._starts}.log"

    def start(self, command_for_port: Callable[[int], list[str]]) -> int:
        """Start the child; its command line is built once its port is chosen."""
        if self.running:
            raise MooncakeProcessError(f"{self.name} is already running")
        for _ in range(1 if self.port is not None else 3):
            port = self.port if self.port is not None else free_loopback_port()
            if self._spawn_and_wait(command_for_port(port), port):
                self.port = port
                return port
        raise MooncakeProcessError(f"{self.name} did not start within {self._timeout_s}s; see {self.log_path}")

    def _spawn_and_wait(self, command: list[str], port: int) -> bool:
        self._starts += 1
        self._log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as sink:
            self._process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True,
                                             preexec_fn=die_with_parent)
        deadline = time.monotonic() + self._timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                log.warning("%s exited with %s on port %d", self.name, self._process.returncode, port)
                self._process = None
                return False
            if port_accepts(LOOPBACK, port):
                log.info("%s ready on %s:%d (pid %d)", self.name, LOOPBACK, port, self._process.pid)
                return True
            time.sleep(0.05)
        self.kill()
        return False

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def signal(self, signum: int) -> None:
        if self.running:
            assert self._process is not None
            os.killpg(self._process.pid, signum)

    def kill(self) -> None:
        """SIGKILL and reap; harmless when not running."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM (after SIGCONT, in case it was paused), SIGKILL after `grace_s`; reaped either way."""
        if self.running:
            assert self._process is not None
            self.signal(signal.SIGCONT)
            self._process.terminate()
            try:
                self._process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


class LocalMooncake:
    """A master and one segment host on loopback. `restart_master` keeps the master's port; the segment host
    re-registers its memory with the new master on its own (objects the old master knew are gone)."""

    def __init__(self, settings: DeploymentSettings | None = None, log_dir: Path | None = None) -> None:
        self.settings = settings or DeploymentSettings()
        self._made_log_dir = log_dir is None
        """The log folder is this deployment's own (a fresh temporary one), so `close` removes it."""
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvfsm-mooncake-"))
        timeout = self.settings.start_timeout_s
        self.master = _Child("mooncake_master", self.log_dir, timeout)
        self.segment_host = _Child("mooncake_client", self.log_dir, timeout)

    @property
    def address(self) -> MasterAddress:
        if self.master.port is None:
            raise MooncakeProcessError("the master was never started")
        return MasterAddress(host=LOOPBACK, port=self.master.port)

    def _master_command(self, port: int) -> list[str]:
        s = self.settings
        return [str(_binary("mooncake_master")), f"--port={port}", f"--rpc_address={LOOPBACK}",
                f"--metrics_port={free_loopback_port()}", f"--metrics_host={LOOPBACK}",
                f"--http_metadata_server_host={LOOPBACK}", f"--default_kv_lease_ttl={s.lease_ttl_ms}",
                f"--eviction_high_watermark_ratio={s.eviction_high_watermark}"]

    def _segment_host_command(self, port: int) -> list[str]:
        return [str(_binary("mooncake_client")), f"--host={LOOPBACK}", "--metadata_server=P2PHANDSHAKE",
                f"--master_server_address={self.address}", f"--global_segment_size={self.settings.segment_bytes}",
                f"--port={port}", "--protocol=tcp"]

    def start(self) -> MasterAddress:
        """Start both processes; return once each accepts connections, or raise `MooncakeProcessError`."""
        try:
            self.master.start(self._master_command)
            self.segment_host.start(self._segment_host_command)
        except BaseException:
            self.stop()
            raise
        return self.address

    def pids(self) -> list[int]:
        """Process ids of the children now running (for checks that none is left behind)."""
        return [pid for pid in (self.master.pid, self.segment_host.pid) if pid is not None]

    def kill_master(self) -> None:
        """SIGKILL the master, as a crash would."""
        self.master.kill()

    def restart_master(self) -> MasterAddress:
        """Kill the master if it runs and start a fresh one on the same port."""
        self.master.kill()
        self.master.start(self._master_command)
        return self.address

    def pause_master(self) -> None:
        """SIGSTOP: the master stops answering while its sockets stay open, a store that has become slow."""
        self.master.signal(signal.SIGSTOP)

    def resume_master(self) -> None:
        self.master.signal(signal.SIGCONT)

    def stop(self) -> None:
        """Stop the segment host, then the master; harmless when either is not running."""
        self.segment_host.stop()
        self.master.stop()

    def close(self) -> None:
        """Stop, then remove the log folder if this deployment made it (a folder the caller named is the caller's):
        every test, bench and demo run would otherwise leave one behind in the temporary directory."""
        self.stop()
        if self._made_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> LocalMooncake:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self.stop()  # the processes' logs stay for whoever reads the failure
