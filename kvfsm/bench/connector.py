"""The connector end to end: GB/s of stores and loads as an engine drives `kvfsm.Connector`.

Unlike `kvfsm.bench.transfer`, which calls a mechanism directly, every byte here moves because the scheduler half
ordered it and the worker half executed the order through `handle_preemptions / start_load_kv / wait_for_save /
get_finished`, with every lifecycle change going through the spec's machines. A timed round is one engine step,
from `build_connector_meta` until `update_connector_output` has seen every job finish, so host-side bookkeeping,
submission and the copies themselves are all inside it.

The workload: prompts of `prompt_blocks` scattered GPU blocks (a random permutation of the cache, cut into equal
regions), stored from the first region into a pool that keeps evicting (LRU) and loaded back into the second by new
requests with the same prompt. The cache is Llama-3-8B-shaped (32 layers, 8 KV heads, 128 dims, bf16).

The engine here follows the connector's rules as an engine must, and checks they held, so a figure never describes a
run that broke them: a one-token request ends right after its prefill, its blocks back at once while its store is in
flight (`lazy-fence`), and a step that computes into blocks a store still reads finds that store flushed and waited
for before its forward pass.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from kvfsm.config import OffloadConfig
from kvfsm.connector import Connector, StepResult
from kvfsm.connector.metadata import ConnectorOutput, ScheduledRequest, SchedulerOutput
from kvfsm.executor.device import Device
from kvfsm.executor.layouts import allocate_kv_caches
from kvfsm.states import TransferJobState


class RoundMismatch(RuntimeError):
    """A timed round did not move what it ordered: the figure would describe some other work."""


@dataclass(frozen=True)
class Prompt:
    """The request view the connector reads."""

    request_id: str
    block_hashes: tuple[int, ...]
    num_tokens: int


class ConnectorRounds:
    """One registered connector and the engine steps that store, load, or do both, timed one step at a time."""

    def __init__(self, device: Device, layout: str, block_tokens: int, num_blocks: int, prompt_blocks: int,
                 num_layers: int = 32, num_heads: int = 8, head_dim: int = 128,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0, as_finished: bool = False,
                 regions: int = 2, cpu_blocks: int | None = None) -> None:
        if regions < 2 or num_blocks % (regions * prompt_blocks):
            raise ValueError(f"{num_blocks} GPU blocks do not split into {regions} (at least 2) regions of "
                             f"{prompt_blocks}-block prompts")
        self.device = device
        self.block_tokens = block_tokens
        self.prompt_blocks = prompt_blocks
        self.as_finished = as_finished
        tensors, groups = allocate_kv_caches(layout, num_layers, num_blocks, block_tokens, num_heads, head_dim,
                                             dtype, device.tensor_device())
        for tensor in tensors.values():
            tensor.view(torch.uint8).view(-1).random_(0, 256)
        # By default one and a half caches' worth of slots: with two regions, a both-ways step stores the first
        # while the prompts it stored before are loaded back into the second.
        config = OffloadConfig(cpu_blocks=cpu_blocks or 3 * num_blocks // 2, gpu_block_size=block_tokens)
        self.connector = Connector(config, device)
        self.caches = self.connector.register_kv_caches(tensors, layout, groups)
        self.tensors = tensors
        order = random.Random(seed).sample(range(num_blocks), num_blocks)
        size = num_blocks // regions
        self.regions = tuple(order[i * size:(i + 1) * size] for i in range(regions))
        """Equal parts of a random permutation of the cache's blocks; the rounds store from the first and load
        into the second (`kvfsm.bench.sustained` uses them all)."""
        self._round = 0
        self._stored: list[Prompt] = []

    @property
    def bytes_per_region(self) -> int:
        return len(self.regions[0]) * self.caches.gpu_block_bytes

    def _prompts(self, tag: str, chains: Sequence[tuple[int, ...]]) -> list[Prompt]:
        self._round += 1
        return [Prompt(f"{tag}{self._round}.{i}", chain, len(chain) * self.block_tokens + 1)
                for i, chain in enumerate(chains)]

    def _split(self, blocks: Sequence[int]) -> list[tuple[int, ...]]:
        n = self.prompt_blocks
        return [tuple(blocks[i:i + n]) for i in range(0, len(blocks), n)]

    def admit_new(self, blocks: Sequence[int]) -> list[tuple[Prompt, tuple[int, ...]]]:
        """Fresh prompts (never seen by the pool) on `blocks`, computed this step: their stores are ordered."""
        per_prompt = self._split(blocks)
        chains = [tuple((self._round + 1) << 40 | i << 20 | j for j in range(len(b))) for i, b in enumerate(per_prompt)]
        prompts = self._prompts("store", chains)
        for prompt, ids in zip(prompts, per_prompt):
            if self.connector.get_num_new_matched_tokens(prompt, 0) != (0, False):
                raise RoundMismatch(f"{prompt.request_id}: a fresh prompt hit the pool")
            self.connector.update_state_after_alloc(prompt, ids, 0)
        return list(zip(prompts, per_prompt))

    def admit_returning(self, stored: list[Prompt], blocks: Sequence[int]) -> list[Prompt]:
        """New requests for prompts stored earlier, allocated on `blocks`: their loads go out with the next step."""
        prompts = self._prompts("load", [p.block_hashes for p in stored])
        for prompt, ids in zip(prompts, self._split(blocks)):
            want = len(ids) * self.block_tokens
            if self.connector.get_num_new_matched_tokens(prompt, 0) != (want, True):
                raise RoundMismatch(f"{prompt.request_id}: the stored prompt is not all in the pool")
            self.connector.update_state_after_alloc(prompt, ids, want)
        return prompts

    def engine_step(self, computed: Sequence[tuple[Prompt, tuple[int, ...]]]) -> StepResult:
        """One engine step whose forward pass computes `computed` (none: an empty step): send what the connector
        ordered, let the step's stores be planned behind the forward, report what finished."""
        scheduled = tuple(ScheduledRequest(req_id=p.request_id, block_ids=ids,
                                           num_computed_tokens=len(ids) * self.block_tokens) for p, ids in computed)
        worker = self.connector.worker
        worker.bind_connector_metadata(self.connector.build_connector_meta(SchedulerOutput(scheduled=scheduled)))
        worker.handle_preemptions()
        self._check_fenced(computed)
        worker.start_load_kv()
        worker.wait_for_save()
        return self.connector.update_connector_output(ConnectorOutput(workers=(worker.get_finished(),)))

    def _check_fenced(self, computed: Sequence[tuple[Prompt, tuple[int, ...]]]) -> None:
        """Before the forward pass writes `computed`'s blocks: no store reading one may still run or be about to be
        sent (`lazy-fence`: the step that hands out a block an ended request's store reads flushes that store, and
        `handle_preemptions` waited for it). A store that enqueued nothing (failed before its first copy) reads
        nothing."""
        written = {block for _, ids in computed for block in ids}
        if not written:
            return
        worker = self.connector.worker
        for job in worker.jobs.values():
            if job.kind != "store" or written.isdisjoint(job.gpu_blocks):
                continue
            end = worker.events.end(job.job_id)
            if job.state == TransferJobState.PENDING_STORE or (end is not None and not worker.events.ended(job.job_id)):
                raise RoundMismatch(f"store job {job.job_id} still reads GPU blocks the step computes into "
                                    f"({job.state}): the step that handed them out did not fence them")

    def end_computed(self, computed: Sequence[tuple[Prompt, tuple[int, ...]]]) -> None:
        """One-token requests end with the step that computed their prompt: each gives its blocks back at once while
        its store is in flight (`lazy-fence`; the connector forgets it once the store ended)."""
        connector = self.connector
        for prompt, _ in computed:
            if connector.request_finished(prompt.request_id) or not connector.tracks(prompt.request_id):
                raise RoundMismatch(f"{prompt.request_id}: a computed prompt did not end with its blocks given back "
                                    "and its store in flight")

    def _compute_step(self, computed: list[tuple[Prompt, tuple[int, ...]]]) -> None:
        """The step whose forward pass computes `computed`: the scheduler orders their stores behind it."""
        self.engine_step(computed)
        self.end_computed(computed)
        self._stored = [p for p, _ in computed]

    def _timed_step(self, stored: int, loading: list[Prompt]) -> float:
        """One engine step with no compute: submit what is pending, then report every job (`_report`). Seconds.
        `stored`: how many prompts' stores the step sends; each must land whole."""
        connector, worker = self.connector, self.connector.worker
        stats = connector.scheduler.stats
        blocks_before = stats.blocks_stored
        if self.device.kind == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        meta = connector.build_connector_meta(SchedulerOutput())
        worker.bind_connector_metadata(meta)
        worker.handle_preemptions()
        worker.start_load_kv()
        loaded, errors = self._report()
        elapsed = time.perf_counter() - start
        if len(meta.loads) != len(loading) or loaded != {p.request_id for p in loading}:
            raise RoundMismatch(f"ordered {len(meta.loads)} loads, {len(loaded)} finished, "
                                f"expected {len(loading)}")
        want = stored * self.prompt_blocks
        if stats.blocks_stored - blocks_before != want or errors:
            raise RoundMismatch(f"{stats.blocks_stored - blocks_before} blocks stored of {want}; "
                                f"load errors {errors}")
        for prompt in loading:  # the engine would compute the last token; the request then ends
            connector.request_finished(prompt.request_id)
        return elapsed

    def _report(self) -> tuple[set[str], dict[str, tuple[int, ...]]]:
        """Block until the scheduler half saw every job finish; the loaded requests and the load errors.
        At the end of the step by default; with `as_finished`, as an engine that keeps stepping while copies run
        reports them: an empty engine step each time the oldest job's copies end, so the bookkeeping of earlier
        jobs overlaps the copies of later ones."""
        connector, worker = self.connector, self.connector.worker
        loaded: set[str] = set()
        errors: dict[str, tuple[int, ...]] = {}
        while True:
            worker.wait(list(worker.jobs)[:1] if self.as_finished else list(worker.jobs))
            result = connector.update_connector_output(ConnectorOutput(workers=(worker.get_finished(),)))
            loaded |= result.loaded
            errors.update(result.load_errors)
            if not worker.jobs:
                return loaded, errors
            worker.bind_connector_metadata(connector.build_connector_meta(SchedulerOutput()))
            worker.handle_preemptions()
            worker.start_load_kv()

    def store(self) -> float:
        """Seconds for one step that stores the first region's blocks (ordered by the step before)."""
        computed = self.admit_new(self.regions[0])
        self._compute_step(computed)
        return self._timed_step(len(computed), [])

    def load(self) -> float:
        """Seconds for one step that loads the last stored prompts into the second region."""
        if not self._stored:
            self.store()
        stored, self._stored = self._stored, []
        return self._timed_step(0, self.admit_returning(stored, self.regions[1]))

    def check_landed(self) -> None:
        """After `load`: every loaded GPU block holds the bytes of the block its prompt was stored from."""
        self.check_copied(0, 1)

    def check_copied(self, source: int, destination: int) -> None:
        """Region `destination` holds, block for block, region `source`'s bytes (its prompts were loaded there)."""
        src = torch.tensor(self.regions[source], device=self.caches.device)
        dst = torch.tensor(self.regions[destination], device=self.caches.device)
        for plane in self.caches.planes:
            if not torch.equal(plane.rows.index_select(1, src), plane.rows.index_select(1, dst)):
                raise RoundMismatch(f"{plane.name}: a block loaded into region {destination} differs from the "
                                    f"block of region {source} it was stored from")

    def both(self) -> float:
        """Seconds for one step that stores the first region while loading the last stored prompts into the
        second."""
        if not self._stored:
            self.store()
        stored = self._stored
        computed = self.admit_new(self.regions[0])
        self._compute_step(computed)
        return self._timed_step(len(computed), self.admit_returning(stored, self.regions[1]))

    def close(self) -> None:
        self.connector.worker.shutdown()
