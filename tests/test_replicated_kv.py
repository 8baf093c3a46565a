"""Replicated (MLA) KV under tensor parallelism, stored once per host: the ranks share one host pool (a `/dev/shm`
region each rank process maps), each store is copied by its writer rank alone (`replicated-single-writer`), every
rank loads from the shared slot. In one process (two ranks on SimDevices) and in two gloo processes
(`python -m kvfsm.tp --mla`): byte-exact reloads, host pool bytes of one copy (measured), one copy over PCIe, and
the controls caught."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvfsm.config import OffloadConfig, store_writer
from kvfsm.connector.refusals import StoreBytesNotKept
from kvfsm.connector.worker import SharedHostMissing, WorkerConnector
from kvfsm.engine.oracle import BlockOracle
from kvfsm.engine.ranks import Rank
from kvfsm.executor.pool import HostPool
from kvfsm.executor.shared_host import SharedHostMemory, SharedRegionMismatch
from kvfsm.executor.sim import SimDevice
from kvfsm.rank_invariants import STORE_JOBS, replicated_single_writer_bytes
from kvfsm.records import TransferJob
from kvfsm.testing.harness import TP_SHAPE, Harness

PROMPT = (11, 12, 13, 14, 15, 16, 17)
SMALL = ["--conversations", "4", "--agents", "2", "--turns", "3"]
RUN_LIMIT_S = 300
"""A run that takes longer has hung (each takes seconds on an idle machine; collectives give up after 120 s)."""


def replicated_ranks(mutant: str | None = None) -> Harness:
    return Harness([SimDevice(), SimDevice()], num_gpu_blocks=8, cpu_blocks=6, shape=TP_SHAPE, replicated=True,
                   mutant=mutant)


def store_then_reload(harness: Harness) -> None:
    harness.add_request(PROMPT, 2)
    harness.drain()
    harness.engine.reset_prefix_cache()
    harness.add_request(PROMPT + (18, 19), 2)
    harness.drain()


def slot_writes(device: SimDevice) -> int:
    """Host slot writes by store copies this device ran: one per CPU slot a store of this rank filled."""
    return sum(1 for a in device.accesses if a.actor == "store" and a.mode == "write" and a.space == "cpu")


def test_mla_caches_at_two_ranks_store_and_reload_byte_exact_with_one_host_copy() -> None:
    harness = replicated_ranks()
    try:
        store_then_reload(harness)
        assert harness.engine.cpu_hit_tokens > 0, "the second request reloaded nothing from CPU"
        assert not harness.final_violations()  # tokens equal the one-device run's; the shared slots hold every head
        pools = [worker.pool for worker in harness.connector.workers]
        one_copy = pools[0].num_slots * pools[0].slot_bytes
        assert pools[0].slot_bytes == TP_SHAPE.gpu_block_bytes, "a slot does not hold every head's KV"
        assert [device.host_bytes for device in harness.devices] == [0, 0], "a rank pinned a pool of its own"
        assert harness.connector.shared_host is not None and harness.connector.shared_host.nbytes == one_copy
        pools[0].slot(5).fill_(0x5A)
        assert torch.equal(pools[1].slot(5), pools[0].slot(5)), "the ranks' pools are not one memory"
    finally:
        harness.close()


def logged_store_bytes(device: SimDevice, jobs: dict[int, TransferJob], slot_bytes: int) -> dict[int, int]:
    """Per store job, the bytes this device's log says its store copies wrote into host slots: a slot is one GPU
    block of every layer here, written whole by one copy; a copy of merged jobs names them all, its slot tells whose."""
    found: dict[int, int] = {}
    for access in device.accesses:
        named = STORE_JOBS.match(access.label)
        if access.actor == "store" and access.mode == "write" and access.space == "cpu" and named is not None:
            job_id = next(j for j in map(int, named.group(1).split(",")) if access.block in jobs[j].cpu_slots)
            found[job_id] = found.get(job_id, 0) + slot_bytes
    return found


@pytest.mark.parametrize("mutant", [None, "every-rank-writes"])
def test_the_bytes_each_rank_sent_per_store_job_agree_with_its_device_log(mutant: str | None) -> None:
    """What `replicated_single_writer_bytes` reads where no device log exists (a GPU), against the log: four
    prompts stored in one step, each rank's share merged into one pipeline of two-block chunks, so that one copy
    ends a job and begins the next."""
    harness = Harness([SimDevice(), SimDevice()], num_gpu_blocks=16, cpu_blocks=12, shape=TP_SHAPE,
                      replicated=True, mutant=mutant, staging_blocks=2)
    try:
        for prompt in (PROMPT, PROMPT[:5], (21, 22, 23, 24, 25, 26, 27), (31, 32, 33, 34, 35)):
            harness.add_request(prompt, 2)
        harness.drain()
        slot_bytes = harness.connector.workers[0].pool.slot_bytes
        sent = [worker.store_bytes for worker in harness.connector.workers]
        assert sent == [logged_store_bytes(device, harness.world.jobs, slot_bytes) for device in harness.devices]
        assert sum(map(len, sent)) > 0, "no store was copied"
    finally:
        harness.close()


def test_control_every_rank_writes_is_caught_from_the_bytes_each_rank_sent() -> None:
    """Both halves of the rule, read from the counts alone: a rank sent bytes of a store it is not the writer of,
    and each store crossed PCIe once per rank, not once."""
    harness = replicated_ranks("every-rank-writes")
    try:
        store_then_reload(harness)
        stored = [job for job in harness.world.jobs.values() if job.kind == "store" and job.state == "done"]
        sent = [worker.store_bytes for worker in harness.connector.workers]
        found = replicated_single_writer_bytes(stored, sent, harness.connector.workers[0].pool.slot_bytes)
        assert any(" whose writer is rank " in line for line in found), found
        assert any(" crossed PCIe as " in line for line in found), found
    finally:
        harness.close()


def test_each_replicated_store_crosses_to_the_host_once_from_its_writer_rank() -> None:
    harness = replicated_ranks()
    try:
        store_then_reload(harness)
        stores = [job for job in harness.world.jobs.values() if job.kind == "store" and job.state == "done"]
        by_writer = [sum(len(job.cpu_slots) for job in stores if store_writer(job.job_id, 2) == rank)
                     for rank in (0, 1)]
        writes = [slot_writes(device) for device in harness.devices]
        assert sum(by_writer) > 0 and writes == by_writer, f"slot writes by rank {writes}, by writer {by_writer}"
        sent = [worker.store_bytes for worker in harness.connector.workers]
        assert replicated_single_writer_bytes(stores, sent, harness.connector.workers[0].pool.slot_bytes) == []
    finally:
        harness.close()


def test_control_every_rank_writes_is_caught_by_replicated_single_writer() -> None:
    harness = replicated_ranks("every-rank-writes")
    try:
        store_then_reload(harness)
        found = harness.final_violations()
        assert any(line.startswith("replicated-single-writer") for line in found), found
        assert not any(line.startswith(("output", "ready-means-written")) for line in found), \
            "the bytes are right either way: only the invariant shows the doubled PCIe traffic"
    finally:
        harness.close()


def test_two_mappings_of_one_shared_region_are_one_memory_and_its_creator_removes_it() -> None:
    devices = [SimDevice(), SimDevice()]
    creator = SharedHostMemory()
    first = HostPool(devices[0], 4, 64, creator)
    assert creator.path is not None
    second = HostPool(devices[1], 4, 64, SharedHostMemory(creator.path))
    second.slot(3).fill_(7)
    assert torch.equal(first.slot(3), torch.full((64,), 7, dtype=torch.uint8))
    assert creator.nbytes == 4 * 64 and [d.registered_bytes for d in devices] == [256, 256]
    second.close()
    first.close()
    assert not os.path.exists(creator.path) and [d.registered_bytes for d in devices] == [0, 0]


def test_a_rank_attaching_with_a_pool_of_another_size_is_refused_by_name() -> None:
    creator = SharedHostMemory()
    pool = HostPool(SimDevice(), 4, 64, creator)
    try:
        with pytest.raises(SharedRegionMismatch, match="holds 256 bytes; this rank's pool needs 512"):
            HostPool(SimDevice(), 8, 64, SharedHostMemory(creator.path))
    finally:
        pool.close()


def test_replicated_over_several_ranks_without_shared_host_memory_is_refused_before_any_pool() -> None:
    config = OffloadConfig(cpu_blocks=4, gpu_block_size=TP_SHAPE.block_size, num_workers=2, replicated=True)
    device = SimDevice()
    with pytest.raises(SharedHostMissing, match="worker 1: replicated KV over 2 ranks"):
        WorkerConnector(config, device, worker=1)
    assert device.host_bytes == 0


def test_store_bytes_of_a_worker_that_keeps_none_is_refused_by_name() -> None:
    """An engine's worker keeps no count per job (an entry per store for its lifetime): asking it is an error, not an
    empty count that would read as a rank that copied nothing."""
    worker = WorkerConnector(OffloadConfig(cpu_blocks=4, gpu_block_size=TP_SHAPE.block_size), SimDevice())
    with pytest.raises(StoreBytesNotKept, match="worker 0: store_bytes is kept only by a worker built with"):
        _ = worker.store_bytes


def test_the_oracle_names_the_mla_bytes_a_replicated_rank_stores() -> None:
    """The oracle's "mla" bytes are what the registered MLA-shaped caches hold, block for block."""
    rank = Rank(TP_SHAPE, 2, SimDevice(), index=1, world=2, replicated=True)
    tokens = torch.tensor(PROMPT[:TP_SHAPE.block_size])
    rank.model.write(torch.tensor([1]), tokens, 0)
    oracle = BlockOracle(TP_SHAPE, 1)
    expected = oracle.prefix_bytes(PROMPT[:TP_SHAPE.block_size], rank.held, "mla")
    held = torch.cat([cache[1].contiguous().view(torch.uint8).flatten() for cache in rank.kv_caches.values()])
    assert rank.layout == "mla" and torch.equal(held, expected)


# --- two rank processes: python -m kvfsm.tp --mla ------------------------------------------------------------------


def tp_run(tmp_path: Path, *args: str, device: str = "cpu") -> tuple[int, dict]:
    out = tmp_path / "run.json"
    repo = str(Path(__file__).parents[1])  # the rank processes import this checkout's kvfsm
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "kvfsm.tp", "--device", device, "--mla", *SMALL, "--json", str(out),
                           *args], capture_output=True, text=True, timeout=RUN_LIMIT_S, env=env)
    assert out.exists(), done.stdout + done.stderr
    return done.returncode, json.loads(out.read_text())


def test_two_gloo_ranks_store_reload_and_write_back_mla_byte_exact_with_one_host_copy(tmp_path: Path) -> None:
    """With a disk tier under a small pool and checksums: rank 0 alone writes back and fetches
    (`replicated-one-tier-move`), and the checksum table the two processes share lets rank 1 check its loads of
    slots rank 0 filled (none fails). One run for all of it: each gloo run costs seconds of process start."""
    code, run = tp_run(tmp_path, "--disk", str(tmp_path / "disk"), "--checksum", "--cpu-blocks", "8")
    assert run["found"] == [] and code == 0
    assert run["blocks_loaded"] > 0 and run["cpu_hit_tokens"] > 0, "nothing was reloaded"
    assert run["host_pool_bytes"] == run["one_copy_bytes"] > 0, "the ranks' host pools are not one copy"
    assert run["store_pcie_bytes"] == run["store_one_copy_bytes"] > 0, "the stores did not cross PCIe once"
    assert run["blocks_written_back"] > 0 and run["blocks_fetched"] > 0, "nothing went through the disk"
    assert run["loads_failed"] == 0, "a rank's load failed its checksum"


def test_two_gloo_ranks_with_mla_ride_out_a_failing_rank(tmp_path: Path) -> None:
    """Rank 1 writes every other store: those of its copies that fail fail the store everywhere, and the shared
    slot is never published."""
    code, run = tp_run(tmp_path, "--failing-rank", "1")
    assert run["found"] == [] and code == 0
    assert run["stores_failed"] + run["loads_failed"] > 0, "rank 1 failed no copy"


def test_control_every_rank_writes_is_caught_across_processes(tmp_path: Path) -> None:
    """Caught twice: by each rank's device log, and by the bytes each rank's worker sent (what a GPU run reads)."""
    code, run = tp_run(tmp_path, "--control", "every-rank-writes")
    assert code == 1 and any(line.startswith("rank 1: replicated-single-writer") for line in run["found"])
    assert any(line.startswith("replicated-single-writer: rank 1 copied") for line in run["found"]), run["found"]
    assert run["store_pcie_bytes"] == 2 * run["store_one_copy_bytes"] > 0


def test_with_mla_completing_on_the_first_report_is_caught_with_no_skew_and_no_failing_rank(tmp_path: Path) -> None:
    """The non-writer reports each store at once: a scheduler half that ends a job on its first report publishes the
    slot before the writer's copy completed, and a load reads it."""
    code, run = tp_run(tmp_path, "--control", "complete-on-first-report")
    assert code == 1 and any("every-rank-reports" in line for line in run["found"]), run["found"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_nccl_ranks_store_and_reload_mla_with_one_pinned_host_copy(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    subprocess.run([sys.executable, "-m", "kvfsm.tp", "--device", "cuda", "--mla", "--json", str(out)], check=False,
                   timeout=RUN_LIMIT_S)
    run = json.loads(out.read_text())
    assert run["found"] == [] and run["device"] == "cuda" and run["blocks_loaded"] > 0
    assert run["host_pool_bytes"] == run["one_copy_bytes"]
    assert run["store_pcie_bytes"] == run["store_one_copy_bytes"] > 0, "the stores did not cross PCIe once"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_on_two_gpus_control_every_rank_writes_is_caught_by_replicated_single_writer(tmp_path: Path) -> None:
    """A GPU keeps no device log: the bytes each rank's worker sent are what catch a rank copying another's store."""
    code, run = tp_run(tmp_path, "--control", "every-rank-writes", device="cuda")
    assert code == 1 and run["device"] == "cuda"
    assert any(line.startswith("replicated-single-writer: rank 1 copied") for line in run["found"]), run["found"]
    assert run["store_pcie_bytes"] == 2 * run["store_one_copy_bytes"] > 0


def test_the_mla_bench_moves_and_pins_one_copy_at_tp2_and_two_with_a_pool_per_rank() -> None:
    """`python -m kvfsm.bench mla`'s plumbing on SimDevices: the byte counts, not the bandwidth."""
    from kvfsm.bench import mla

    result = mla.run(mla.PLUMBING, cuda=False)
    ratios = {row["mode"]: (row["pcie_bytes"] / row["stored_bytes"], row["host_pool_bytes"] / row["stored_bytes"])
              for row in result["rows"]}
    assert ratios == {"TP=1": (1, 1), "TP=2, one host copy": (1, 1), "TP=2, a pool per rank": (2, 2)}
    assert all(row["byte_exact"] for row in result["rows"])


def test_the_mla_bench_refuses_figures_of_a_rep_whose_stores_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rep starts from a cleared pool and its failed jobs are read: a rep whose copies failed cannot borrow the
    bytes an earlier rep left (on two GPUs, rank 1's copies once failed at submission and the table still said
    byte-exact). Control: stores that fail from the second rep on."""
    from kvfsm.bench import mla
    from kvfsm.executor.sim import SimDevice
    from kvfsm.rank_invariants import STORE_JOBS

    enqueue = SimDevice.enqueue
    reps_started: list[int] = []

    def failing_after_first_rep(self: SimDevice, stream, actor, label, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        named = STORE_JOBS.match(label)
        if named and max(map(int, named.group(1).split(","))) >= mla.PLUMBING.jobs:
            reps_started.append(1)
            raise RuntimeError("injected: a copy refused at submission")
        return enqueue(self, stream, actor, label, fn, *args, **kwargs)

    monkeypatch.setattr(SimDevice, "enqueue", failing_after_first_rep)
    with pytest.raises(mla.StoresFailed, match="failed"):
        mla.run(dataclasses.replace(mla.PLUMBING, reps=2), cuda=False)
    assert reps_started


def test_the_mla_bench_on_a_host_of_one_gpu_refuses_by_name_before_touching_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfsm.bench import mla

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(mla.TwoDevicesNeeded, match="need 2 CUDA devices; this host has 1"):
        mla.devices(cuda=True)



def test_a_disk_tier_under_tensor_parallelism_without_mla_is_refused_by_name_before_any_process(
        tmp_path: Path) -> None:
    from kvfsm.demo import DemoConfig, DemoConfigError, DeviceKind
    from kvfsm.tp import Breaks, run_tp

    with pytest.raises(DemoConfigError, match="--disk under tensor parallelism needs --mla"):
        run_tp(DemoConfig(disk=tmp_path, device=DeviceKind.cpu), 2, Breaks())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_the_mla_bench_on_two_gpus_moves_and_pins_one_copy_byte_exact() -> None:
    """`python -m kvfsm.bench mla --quick` on two GPUs: each rank's sends on its own thread, one process; every
    rep's stores land (a failed one raises `StoresFailed`)."""
    from kvfsm.bench import mla

    result = mla.run(mla.QUICK)
    ratios = {row["mode"]: (row["pcie_bytes"] / row["stored_bytes"], row["host_pool_bytes"] / row["stored_bytes"])
              for row in result["rows"]}
    assert ratios == {"TP=1": (1, 1), "TP=2, one host copy": (1, 1), "TP=2, a pool per rank": (2, 2)}
    assert all(row["byte_exact"] and row["store_gbps"] > 0 for row in result["rows"])
