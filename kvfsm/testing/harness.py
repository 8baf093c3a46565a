"""One engine + connector + device under test, with every check the spec implies.

Shared by the hypothesis state machine, the exhaustive explorer and the GPU tests, so all three check the same
things: the spec's named invariants, trace conformance, the bytes of every CPU block that is ready, the absence of
poisoned reads, and — once drained — outputs equal to the run without offloading and nothing leaked.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import torch

from kvfsm.bindings import default_spec
from kvfsm.checking import DEVICE_LOG_INVARIANTS, TraceRecorder
from kvfsm.config import DiskTierConfig, LowerTierConfig, MooncakeTierConfig, OffloadConfig, ThresholdScope
from kvfsm.connector import Connector
from kvfsm.engine.config import EngineConfig
from kvfsm.engine.engine import Engine
from kvfsm.engine.model import ModelShape
from kvfsm.engine.oracle import BlockOracle, expected_tokens, poisoned
from kvfsm.engine.world import EngineWorld
from kvfsm.executor.device import Device
from kvfsm.executor.sim import SimDevice
from kvfsm.invariants import check_all
from kvfsm.machines import Backend, MachineSet
from kvfsm.rank_invariants import replicated_single_writer_bytes
from kvfsm.states import CpuBlockState
from kvfsm.states import TierEntryState as Entry
from kvfsm.testing.copy_faults import FaultInjector
from kvfsm.testing.mooncake_store import MooncakeFaults, tier_of
from kvfsm.testing.mutants import MUTANTS, TP_MUTANTS
from kvfsm.testing.tier_faults import TierFaults
from kvfsm.tiers.disk import DiskTier
from kvfsm.tiers.io import ManualIo

SHAPE = ModelShape(num_layers=2, num_heads=1, head_dim=4, block_size=2, vocab=997)
TP_SHAPE = ModelShape(num_layers=2, num_heads=2, head_dim=4, block_size=2, vocab=997)
"""Two heads, so that two tensor-parallel ranks hold one each."""


@dataclass
class Submitted:
    prompt: tuple[int, ...]
    max_new_tokens: int
    aborted: bool = False


class Harness:
    """`device` is one device, or one per tensor-parallel rank (each with its own worker half and faults).
    `staging_blocks` sizes the staging slots in GPU blocks, so a step's stores go out as a pipeline of several
    chunks (as a real cache's do) instead of one. `replicated`: every rank holds every head's KV (MLA-shaped) and
    the ranks share one host pool (with one device: a TP=1 engine of MLA-shaped caches). `keep_history=False` runs
    the connector as in production, keeping no ended job or released request: then only what it retains may be
    checked, not the invariants that read them."""

    def __init__(self, device: Device | Sequence[Device], num_gpu_blocks: int, cpu_blocks: int,
                 block_size_factor: int = 1,
                 mutant: str | None = None, max_batched_tokens: int = 32, shape: ModelShape = SHAPE,
                 compute_delay_cycles: int = 0, checksum: bool = False, backend: Backend = "table",
                 per_layer: bool = False, layer_loads: bool = False, layer_stores: bool = False,
                 disk_slots: int = 0, writeback: Literal["eager", "on-evict"] = "eager",
                 writeback_bound_blocks: int = 2, report_lag: int = 0, mooncake_master: str | None = None,
                 mooncake_options: dict[str, object] | None = None, tier_threads: bool = False,
                 staging_blocks: int | None = None, store_threshold: int = 1,
                 store_threshold_scope: ThresholdScope = "every-block",
                 keep_history: bool = True, eviction: str = "lru", shared_disk: Path | None = None,
                 replicated: bool = False, store_bound: int | None = None,
                 writeback_queue_blocks: int | None = None) -> None:
        """`shared_disk`: a directory the disk tier (`disk_slots`) shares with other engines of the toy model and
        keeps when the harness closes, instead of a private one removed then. `store_bound`: the CPU blocks of
        stores in flight beyond which new ones are shed; `writeback_queue_blocks`: the disk tier's eager queue
        bound (both back-pressure, None unbounded)."""
        self.devices = list(device) if isinstance(device, Sequence) else [device]
        self.device = self.devices[0]
        self.shape = shape
        cpu_block_bytes = block_size_factor * shape.gpu_block_bytes
        self.disk_dir = Path(tempfile.mkdtemp(prefix="kvfsm-disk-")) if disk_slots and not shared_disk else None
        # Removed by `close`, or else when the harness is collected or the process exits: many tests never close.
        self._remove_disk_dir = weakref.finalize(self, shutil.rmtree, self.disk_dir, True) if self.disk_dir else None
        names = dict(model_id="kvfsm-toy", kv_dtype=str(shape.dtype))
        tiers: tuple[LowerTierConfig, ...] = (DiskTierConfig(
            path=shared_disk or self.disk_dir, capacity_bytes=disk_slots * cpu_block_bytes, writeback=writeback,
            evict_lookahead_blocks=2, writeback_max_queued_blocks=writeback_queue_blocks,
            **(names if shared_disk else {})),) if disk_slots else ()
        if mooncake_master is not None:
            # A tenant of its own per harness: examples sharing one master never see each other's keys.
            options: dict[str, object] = dict(
                master=mooncake_master, **names, tenant=uuid.uuid4().hex,
                writeback=writeback, evict_lookahead_blocks=2, op_timeout_s=60.0, lookup_timeout_s=10.0)
            tiers += (MooncakeTierConfig(**(options | (mooncake_options or {}))),)  # type: ignore[arg-type]
        config = OffloadConfig(cpu_blocks=cpu_blocks, block_size_factor=block_size_factor,
                               gpu_block_size=shape.block_size, checksum=checksum, layer_loads=layer_loads,
                               layer_stores=layer_stores, lower_tiers=tiers,
                               writeback_max_bytes_in_flight=writeback_bound_blocks * cpu_block_bytes,
                               num_workers=len(self.devices), eviction=eviction,
                               staging_bytes=staging_blocks * shape.gpu_block_bytes if staging_blocks else None,
                               store_threshold=store_threshold, store_threshold_scope=store_threshold_scope,
                               replicated=replicated, store_max_blocks_in_flight=store_bound)
        self.io = ManualIo()
        """The tiers' I/O queue: tests choose when each read or write runs, as they choose device streams (unless
        `tier_threads`: the tiers' own threads, as in production)."""
        self.connector = Connector(config, self.devices, keep_history=keep_history,
                                   machines=MachineSet(default_spec(), backend=backend),
                                   tier_io=None if tier_threads else (lambda _: self.io))
        self.engine = Engine(EngineConfig(num_gpu_blocks=num_gpu_blocks, max_batched_tokens=max_batched_tokens,
                                          model=shape, compute_delay_cycles=compute_delay_cycles,
                                          per_layer=per_layer, report_lag=report_lag),
                             self.devices if len(self.devices) > 1 or replicated else self.device, self.connector)
        self.poll_lag = 0
        """SimDevice only: device operations run inside a step, just before the worker polls for finished jobs
        (on a GPU a job may finish before its own step ends)."""
        self._wrap_poll()
        self.rank_faults = [FaultInjector(worker._transfers) for worker in self.connector.workers]
        """Each rank's fault injector: arm one to fail that rank's next store or load while the others' succeed."""
        for worker, faults in zip(self.connector.workers, self.rank_faults):
            worker._transfers = faults  # type: ignore[assignment]
        self.faults = self.rank_faults[0]
        disks = [t for t in self.connector.worker.lower_tiers if isinstance(t, DiskTier)]
        self.disk: DiskTier | None = disks[0] if disks else None
        self.mooncake = tier_of(self.connector)
        self.mooncake_faults = MooncakeFaults(self.mooncake)
        self.tier_faults = TierFaults(self.disk)
        if mutant is not None:
            (MUTANTS | TP_MUTANTS)[mutant].apply(self.engine, self.connector)
        self.world = EngineWorld(self.engine, self.connector)
        self.rank_worlds = [EngineWorld(self.engine, self.connector, d) for d in self.devices[1:]]
        """The other ranks' device logs, for the invariants that read one."""
        self.oracle = BlockOracle(shape, block_size_factor)
        self.trace = TraceRecorder(self.connector.machines)
        self.submitted: dict[int, Submitted] = {}
        self._next_id = 0

    def _wrap_poll(self) -> None:
        worker, device = self.connector.worker, self.device
        poll = worker.get_finished

        def get_finished() -> object:
            for _ in range(self.poll_lag):
                options = getattr(device, "runnable", lambda: [])()
                if not options:
                    break
                device.run_one(device.scheduler(options))  # type: ignore[attr-defined]
            return poll()

        worker.get_finished = get_finished  # type: ignore[method-assign]

    # --- driving -------------------------------------------------------------------------------------------

    def add_request(self, prompt: Sequence[int], max_new_tokens: int, request_id: str | None = None) -> str:
        request_id = request_id or f"req-{self._next_id}"
        self._next_id += 1
        handle = self.engine.add_request(request_id, prompt, max_new_tokens)
        self.submitted[handle] = Submitted(tuple(prompt), max_new_tokens)
        self.oracle.learn(tuple(prompt), self.engine.live[request_id].block_hashes)
        return request_id

    def abort(self, request_id: str) -> None:
        request = self.engine.live.get(request_id)
        if request is not None:
            self.submitted[request.handle].aborted = True
            self.engine.abort(request_id)

    def drain(self, max_steps: int = 200) -> None:
        """Run the engine to idle, letting the device run everything between steps."""
        for _ in range(max_steps):
            if not self.engine.has_work:
                break
            self.engine.step()
            self.settle()
        self.settle()

    def settle(self) -> None:
        for device in self.devices:
            run = getattr(device, "run_until_idle", None)
            if run is not None:
                run()
            else:
                torch.cuda.synchronize()
        self.io.run_all()

    # --- checking ------------------------------------------------------------------------------------------

    def violations(self) -> list[str]:
        """Everything wrong right now: named invariants, trace conformance, bytes of ready CPU blocks."""
        found = [f"{name}: {line}" for name, lines in check_all(self.world).items() for line in lines]
        found += [f"{name} on rank {rank}: {line}" for rank, world in enumerate(self.rank_worlds, start=1)
                  for name, lines in check_all(world, DEVICE_LOG_INVARIANTS).items() for line in lines]
        found += [f"trace: {line}" for line in self.trace.check()]
        found += self._cpu_bytes()
        found += self._disk_bytes()
        found += self._mooncake_bytes()
        return found

    def forget_checked(self) -> None:
        """Once `violations` found nothing: drop from each simulated device's log the accesses of operations issued
        before the oldest one still queued. Every operation issued before them ran, and whatever runs from now on was
        issued after them, so no ordering invariant can find anything more in them (and the one that reads accesses
        one at a time, `replicated-single-writer`, judged each already). The checks after every rule then cost what
        is in flight, not the whole run's log, which they re-read each time (a third of the interleavings' time went
        there); `kvfsm.demo.pacing.OneStepBehind.forget_checked` does the same."""
        for device in self.devices:
            if isinstance(device, SimDevice):
                device.forget_accesses_before(device.oldest_queued())

    def _cpu_bytes(self) -> list[str]:
        """Every ready or loading CPU slot holds its prefix's bytes; with tensor parallelism, in every rank's pool,
        that rank's heads' bytes."""
        found = []
        ranks = self.engine.ranks.local if self.engine.ranks is not None else [None]
        for rank, worker in zip(ranks, self.connector.workers):
            heads, layout = (rank.held, rank.layout) if rank is not None else (None, "kv-first")
            where = f" of rank {rank.index}" if rank is not None else ""
            for block in self.connector.scheduler.manager.blocks:
                if block.state in (CpuBlockState.READY, CpuBlockState.LOADING) and block.block_hash is not None:
                    actual = worker.pool.slot(block.slot).cpu()
                    if not torch.equal(actual, self.oracle.cpu_block_bytes(block.block_hash, heads, layout)):
                        found.append(f"ready-means-written: CPU slot {block.slot}{where} does not hold the bytes of "
                                     "its prefix")
        return found

    @property
    def _tier_layout(self) -> str:
        """How the blocks a lower tier holds are laid out: MLA-shaped with replicated KV (every head's latent)."""
        return "mla" if self.connector.config.replicated else "kv-first"

    def _disk_bytes(self) -> list[str]:
        """Every published disk entry holds exactly the bytes of its prefix (a corruption injected on purpose aside:
        the fetch of a corrupted entry must fail, which the CPU bytes and outputs check). A shared disk's block of a
        prompt this engine never saw (an earlier engine wrote it) has no prefix to compare with here; if it is
        fetched, its bytes are checked as they land in the CPU pool."""
        if self.disk is None:
            return []
        found = []
        for entry in self.disk.entries:
            if entry.adopted and entry.key not in self.oracle.tokens:
                continue
            if entry.state in (Entry.PUBLISHED, Entry.READING) and not self.tier_faults.is_corrupted(entry):
                stored = self.disk.stored_bytes(entry.key)
                expected = self.oracle.cpu_block_bytes(entry.key, layout=self._tier_layout).numpy().tobytes()
                if stored != expected:
                    found.append(f"publish-after-write: disk key {entry.key:#x} does not hold the bytes of its prefix")
        return found

    def _mooncake_bytes(self) -> list[str]:
        """Every key the Mooncake tier counts as published is in the store with exactly the bytes of its prefix
        (keys corrupted or removed in the store on purpose aside: their fetch must fail)."""
        if self.mooncake is None:
            return []
        found = []
        spoiled = self.mooncake_faults.corrupted | self.mooncake_faults.removed
        for entry in self.mooncake.entries:
            if entry.state in (Entry.PUBLISHED, Entry.READING) and entry.key not in spoiled:
                stored = self.mooncake.stored_bytes(entry.key)
                if stored != self.oracle.cpu_block_bytes(entry.key, layout=self._tier_layout).numpy().tobytes():
                    found.append(f"publish-after-write: mooncake key {entry.key:#x} is not in the store with the "
                                 "bytes of its prefix")
        return found

    def final_violations(self) -> list[str]:
        """After `drain`: everything above, plus outputs equal to the run without offloading."""
        found = self.violations()
        outputs = self.engine.outputs()
        found += [f"output: request {h} read a poisoned KV block" for h in poisoned(outputs)]
        for handle, sub in self.submitted.items():
            if sub.aborted or handle not in outputs:
                continue
            expected = list(expected_tokens(sub.prompt, sub.max_new_tokens, self.shape))
            if outputs[handle] != expected:
                found.append(f"output: request {handle} gave {outputs[handle]}, without offloading {expected}")
        if self.engine.has_work:
            found.append("drained: the engine still has work after draining")
        found += [f"drained: request {r.req_id} is {r.state}, not released"
                  for r in self.connector.scheduler.tracked.values()]
        return found + self._single_writer_bytes()

    def _single_writer_bytes(self) -> list[str]:
        """With replicated KV: `replicated-single-writer` from the bytes each rank's worker sent, as `python -m
        kvfsm.tp --mla` checks it, so a harness on GPUs (which keep no device log) checks the rule too."""
        workers = self.connector.workers
        if not (self.connector.config.replicated and self.connector.keep_history):
            return []
        sent = [worker.store_bytes for worker in workers]
        return [f"replicated-single-writer: {line}"
                for line in replicated_single_writer_bytes(self.world.jobs.values(), sent, workers[0].pool.slot_bytes)]

    def close(self) -> None:
        """Stop tracing and release the pinned pool (on CUDA an unreleased registration outlives the memory)."""
        self.trace.close()
        for worker in self.connector.workers:
            worker.shutdown()
        if self._remove_disk_dir is not None:
            self._remove_disk_dir()
