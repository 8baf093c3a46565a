"""What the vLLM adapter's scenario tests share: the tiny model, drivers closed after each test, a stored prefix.

Imported only by `test_vllm_*.py` files, after they skip themselves when vLLM is missing.
"""

from __future__ import annotations

import threading
from pathlib import Path
from functools import partial
from typing import Any, Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvfsm.connector.metadata import LoadOrder
from kvfsm.integrations.vllm import KvfsmConnector
from kvfsm.integrations.vllm.rig import BLOCK_SIZE, FakeWorker, model_config, vllm_config
from kvfsm.tiers.disk import DiskIo
from vllm_harness import AdapterWorker, Driver

PREFIX = list(range(100, 100 + 4 * BLOCK_SIZE))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    return model_config(Path(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def make_driver(model) -> Iterator:
    """Builds drivers on the tiny model and stops their tracing when the test ends."""
    opened: list[Driver] = []

    def build(worker: FakeWorker | AdapterWorker | None = None, gpu_blocks: int = 64, cpu_blocks: int = 32,
              async_scheduling: bool = False, prefix_caching: bool = True, **extra: object) -> Driver:
        """`extra`: more of `kv_connector_extra_config` (e.g. `layer_loads=True`); an `AdapterWorker` is built on
        the same configuration when `worker` is the class itself."""
        config = vllm_config(model, {"cpu_blocks": cpu_blocks, **extra}, gpu_blocks, prefix_caching=prefix_caching,
                             async_scheduling=async_scheduling)
        chosen = worker(config) if worker is AdapterWorker else (worker or FakeWorker())
        d = Driver(config, chosen)
        opened.append(d)
        return d

    yield build
    for d in opened:
        d.close()


def store_prefix(d: Driver, prompt: list[int] = PREFIX + [1, 2, 3], req_id: str = "writer") -> None:
    """One request computes and stores the prompt, then vLLM's GPU prefix cache forgets it."""
    d.add(req_id, prompt)
    d.run()
    d.reset_gpu_prefix_cache()


def loads_of(d: Driver, req_id: str) -> list[LoadOrder]:
    return [order for log in d.log for order in log.orders.loads if order.req_id == req_id]


def scraped(d: Driver) -> CollectorRegistry:
    """A private registry holding kvfsm's vLLM metrics after they observed every stats payload of `d`'s run (engine 0
    of model `tiny`), as vLLM's loggers would record them."""
    registry = CollectorRegistry()
    types = {kind: partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    metrics = KvfsmConnector.build_prom_metrics(d.scheduler.vllm_config, types, ["model_name", "engine"],
                                                {0: ["tiny", "0"]})
    for payload in d.connector_stats:
        metrics.observe(payload, engine_idx=0)
    return registry


def hold_disk_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every disk tier's block writes wait (on the tier's I/O threads) until the returned event is set, 30 s at
    most: a disk that falls behind for as long as a test says."""
    released = threading.Event()
    write = DiskIo.write

    def held(self: DiskIo, fd: int, parts: Any) -> None:
        released.wait(30)
        write(self, fd, parts)

    monkeypatch.setattr(DiskIo, "write", held)
    return released


def hold_disk_reads(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every disk tier's block reads wait (on the tier's I/O threads) until the returned event is set, 30 s at most:
    a fetch stays in flight for as long as a test says."""
    released = threading.Event()
    read = DiskIo.read

    def held(self: DiskIo, fd: int, parts: Any) -> int:
        released.wait(30)
        return read(self, fd, parts)

    monkeypatch.setattr(DiskIo, "read", held)
    return released


def hide_preemptions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: the adapter's scheduler half never hears of vLLM's preemptions (each step's `preempted` emptied), so
    it cannot flush the stores still reading the blocks vLLM takes back."""
    import kvfsm.integrations.vllm.scheduler_side as side_module

    convert = side_module.scheduler_output
    monkeypatch.setattr(side_module, "scheduler_output", lambda output, tables, before: convert(
        output, tables, before).model_copy(update={"preempted": ()}))
