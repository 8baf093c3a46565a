"""A second vLLM engine in a process of its own: engine A runs vLLM's real Scheduler and the adapter's real worker
role over a lower tier, writes a prompt back, hands its prefix blocks' bytes to the test, and stays up (a live engine
beside the test's engine B) until it is killed: mid-write by a test, or at the test's end.

Forked, not spawned: vLLM is imported already, so a child starts in milliseconds where a fresh interpreter takes
seconds to import it. The child builds its own configuration, scheduler, worker, tier clients and files after the
fork, and shares nothing with the test but the tier (a master, a directory) the test is about. Mooncake's client
library cannot be set up again in a child forked from a process that set one up before (its set-up hangs), and the
test process sets up many; so engines that open a Mooncake tier are forked from `Zygote`, a process forked from the
test process when the test module is imported (during collection, before any test opened a client). Every wait is
bounded.

Imported only by the two-engine tests, after they skip themselves when vLLM is missing.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from kvfsm.integrations.vllm.rig import BLOCK_SIZE, model_config, vllm_config
from kvfsm.mooncake.local import die_with_parent
from vllm_harness import AdapterWorker, Driver

FORK = multiprocessing.get_context("fork")
WAIT_S = 60.0
"""Longest the test waits for engine A at any point: past it the test fails, never hangs."""
MAX_STEPS = 4000
"""As the tier tests' bound: the tier's I/O runs on threads, so a busy machine takes many idle steps."""
GPU_BLOCKS = 64

Control = Callable[[pytest.MonkeyPatch], None]
"""A control applied in engine A before it starts (a module-level function: it travels to the zygote by name)."""
Then = Callable[[Driver, AdapterWorker], None]
"""What engine A does after its write-back landed and its bytes went out: e.g. start a write the test kills."""


def engine_config(model_folder: str, tier: dict[str, Any]) -> Any:
    """The configuration both engines run: 8 CPU blocks over one lower tier."""
    return vllm_config(model_config(Path(model_folder)), {"cpu_blocks": 8, "lower_tiers": [tier]}, GPU_BLOCKS)


def blocks_bytes(worker: AdapterWorker, blocks: list[int]) -> bytes:
    """Every layer's K and V bytes of `blocks`, in order: what a prefix is, compared between engines."""
    return torch.stack([cache[:, blocks] for cache in worker.caches.values()]).numpy().tobytes()


def _engine_a(conn: Connection, model_folder: str, tier: dict[str, Any], prompt: list[int], cache_salt: str | None,
              controls: tuple[Control, ...], then: Then) -> None:
    """In the child: write `prompt` back, send its full blocks' bytes, run `then`, stay up until killed (by the
    test, or with the process that forked it)."""
    die_with_parent()
    try:
        for control in controls:
            control(pytest.MonkeyPatch())  # never undone: the process ends with the engine
        config = engine_config(model_folder, tier)
        worker = AdapterWorker(config)
        d = Driver(config, worker)
        d.add("writer", prompt, cache_salt=cache_salt)
        d.step()
        blocks = list(d.scheduler.kv_cache_manager.get_block_ids("writer")[0][:len(prompt) // BLOCK_SIZE])
        d.run(MAX_STEPS)
        conn.send(("written", blocks_bytes(worker, blocks)))
        then(d, worker)
        threading.Event().wait()
    except BaseException:  # the test reads it: a child's traceback is the only account of its failure
        conn.send(("error", traceback.format_exc()))


class EngineA:
    """Engine A in a child process, as the test sees it: `written()` its prefix bytes, then `kill()`."""

    def __init__(self, conn: Connection, pid: int) -> None:
        self._conn = conn
        self.pid = pid

    def _expect(self, word: str) -> Any:
        if not self._conn.poll(WAIT_S):
            raise AssertionError(f"engine A said nothing for {WAIT_S} s (waiting for {word!r})")
        said, payload = self._conn.recv()
        if said != word:
            raise AssertionError(f"engine A failed:\n{payload}")
        return payload

    def written(self) -> bytes:
        """Wait until A's write-back landed on every rank: the bytes of its prompt's full blocks."""
        return self._expect("written")

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self) -> None:
        """kill -9: whatever A was writing stays as it was."""
        os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        """At the test's end, whatever happened: A is gone."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._conn.close()


class ForkedEngine(EngineA):
    """Engine A forked from the test process: for tiers whose libraries survive a fork (the disk)."""

    def __init__(self, model_folder: str, tier: dict[str, Any], prompt: list[int], then: Then) -> None:
        conn, child = FORK.Pipe()
        self.process = FORK.Process(target=_engine_a, args=(child, model_folder, tier, prompt, None, (), then),
                                    daemon=True)
        self.process.start()
        super().__init__(conn, self.process.pid)  # type: ignore[arg-type]

    def kill(self) -> None:
        super().kill()
        self.process.join(WAIT_S)
        assert self.process.exitcode == -signal.SIGKILL

    def close(self) -> None:
        super().close()
        self.process.join(WAIT_S)


def _zygote(conn: Connection) -> None:
    """Fork an engine A for each request, for as long as the test process lives (it dies with it)."""
    die_with_parent()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # engines are reaped as they exit
    while True:
        child, request = conn.recv()
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                _engine_a(child, *request, lambda d, worker: None)
            finally:
                os._exit(0)
        conn.send(pid)
        child.close()


class Zygote:
    """A process forked from the test process before any Mooncake client was set up in it; it forks engines."""

    def __init__(self) -> None:
        self._conn, child = FORK.Pipe()
        self.process = FORK.Process(target=_zygote, args=(child,), daemon=True)
        self.process.start()

    def engine_a(self, model_folder: str, tier: dict[str, Any], prompt: list[int], cache_salt: str | None = None,
                 controls: tuple[Control, ...] = ()) -> EngineA:
        ours, theirs = FORK.Pipe()
        self._conn.send((theirs, (model_folder, tier, prompt, cache_salt, controls)))
        theirs.close()
        if not self._conn.poll(WAIT_S):
            raise AssertionError(f"the zygote forked no engine within {WAIT_S} s")
        return EngineA(ours, self._conn.recv())
