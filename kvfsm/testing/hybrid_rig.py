"""A hybrid KV cache driven through kvfsm's public API: a full-attention group, a sliding-window group and a state.

vLLM's hybrid allocator pages every KV-cache group from one pool of GPU blocks: a block id is one group's at a time,
and its bytes are the same tensors' whichever group holds it. The vLLM adapter (`kvfsm/integrations/vllm/groups.py`)
offloads each group as a request of its own inside one scheduler half (the full-attention group under the request's
id, another under `<id>@g<group>`, both by `kvfsm.connector.tracked_ids`, with keys of its own). This rig is the
engine around `kvfsm.Connector` that does the same without vLLM, so that a GPU can check the bytes:
- full attention keeps every block of a request;
- a sliding window keeps the blocks its window still reads, the engine's null block standing for the others (never
  stored, loaded or written). As a running request computes, its window leaves blocks behind: the rig takes them back
  in the step that may hand them out again and tells kvfsm (`slide`), as the adapter does, and hands the most recently
  freed blocks out first (the worst case of a pool under pressure);
- the state is a window of one block: the block at the end of a prefix holds the state after it, as vLLM's Mamba
  "align" mode keeps it, so it is stored, left behind and reloaded as a window is.
Every block handed out is poisoned on the compute stream before its step's loads and compute (a load that did not land
reads poison), and each request's compute writes random bytes of its own (`content`), so a reloaded block holding
another request's bytes, or none, differs from what its writer computed.

One thread: the rig is the engine's scheduler and its one worker, in one process. On `SimDevice` nothing runs until
driven; with `lag_copies` the store stream is left behind between steps (a copy engine backed up behind long stores:
the schedule a GPU reaches on its own when a store is long) and runs only when the host waits for it or drains.
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping

import torch

from kvfsm.checking import IntegrationCheck
from kvfsm.config import OffloadConfig
from kvfsm.connector import Connector
from kvfsm.connector.ledger import StepResult
from kvfsm.connector.metadata import ConnectorMetadata, ConnectorOutput, ScheduledRequest, SchedulerOutput
from kvfsm.connector.tracked_ids import TrackedIds
from kvfsm.executor import POISON_BYTE, Device, SimDevice, Touch
from kvfsm.executor.layouts import allocate_kv_caches
from kvfsm.testing.hybrid_cache import (
    NULL_BLOCK,
    NULL_FILL,
    BlockBytes,
    CacheGroup,
    GroupView,
    HybridShape,
    RigRequest,
    hash_chain,
)


class RigError(RuntimeError):
    """The rig's engine could not do what a scenario asked (no free block, a deferred lookup, a failed load)."""


class HybridRig:
    """The engine: requests added, stepped, finished and drained, each step through both halves of the connector.

    With `checked`, `checks` (`kvfsm.checking.IntegrationCheck`) trace every transition against the spec and evaluate
    the named invariants after each step (the device log too, on `SimDevice`) and `fence` on the rig's block tables;
    what they find is kept in `broken` (not raised), so a control's trial still reaches its bytes. Unchecked, the host
    runs a step as an engine in production would: at hundreds of blocks the checks cost it tens of milliseconds a
    step, longer than the copies a race on a GPU is about. `moved` counts the blocks of each direction's orders per
    tracked id."""

    def __init__(self, device: Device, shape: HybridShape, cpu_blocks: int, lag_copies: bool = False,
                 checked: bool = True) -> None:
        self.device, self.shape, self.groups = device, shape, shape.groups
        self.lag_copies = lag_copies
        tensors, _ = allocate_kv_caches(shape.layout, shape.layers, shape.gpu_blocks, shape.block_tokens, shape.heads,
                                        shape.head_dim, shape.dtype, device.tensor_device())
        for tensor in tensors.values():
            tensor.zero_()
        self.connector = Connector(OffloadConfig(cpu_blocks=cpu_blocks, gpu_block_size=shape.block_tokens,
                                                 admission="prompt-only"), device)
        self.bytes = BlockBytes(self.connector.register_kv_caches(tensors, shape.layout))
        self.bytes.fill([NULL_BLOCK], NULL_FILL)
        self.free = list(range(shape.gpu_blocks - 1, NULL_BLOCK, -1))
        """Blocks the allocator may hand out; the last is handed out first (the most recently freed)."""
        self.requests: dict[str, RigRequest] = {}
        self.tracked = TrackedIds()
        """Each group's tracked id's request (a request id may hold `@g` itself)."""
        self._new: list[RigRequest] = []
        self._handed: list[int] = []
        self._held: dict[str, list[int]] = {}
        """Ended requests' groups whose load still writes their blocks, by tracked id."""
        self._content: dict[tuple[int, int], torch.Tensor] = {}
        self._positions: dict[int, int] = {}
        """Per seed, the block positions its requests may write (the rows of its content)."""
        self.moved: Counter[tuple[str, str]] = Counter()
        self.broken: dict[str, list[str]] = {}
        self.checks = IntegrationCheck(self.connector, self, device) if checked else None

    # --- what the checks read of the engine (`kvfsm.checking.EngineTables`) ------------------------------------

    @property
    def has_work(self) -> bool:
        scheduler = self.connector.scheduler
        return (any(not r.ended for r in self.requests.values()) or bool(self._held)
                or any(job.in_flight for job in scheduler.jobs.values()))

    def block_tables(self) -> dict[str, list[int]]:
        return {g.tracked(r.req_id): [b for b in r.tables[g.name] if b != NULL_BLOCK]
                for r in self.requests.values() if not r.ended for g in self.groups if g.name in r.tables}

    def free_blocks(self) -> list[int]:
        return list(self.free)

    # --- requests ------------------------------------------------------------------------------------------------

    def add(self, req_id: str, seed: int, prompt_blocks: int, extra_tokens: int = 0) -> RigRequest:
        """A request of `prompt_blocks` full blocks and one token more (a prompt's last token is always computed),
        which may compute `extra_tokens` beyond its prompt; looked up and allocated in the next step."""
        self.tracked.make_all(req_id, (g.label for g in self.groups))
        bs = self.shape.block_tokens
        prompt = prompt_blocks * bs + 1
        positions = -(-(prompt + extra_tokens) // bs)
        if positions > self._positions.get(seed, positions) and (seed, 0) in self._content:
            raise RigError(f"{req_id}: seed {seed}'s content was made for {self._positions[seed]} blocks; add the "
                           "longest request of a seed first")
        self._positions[seed] = max(positions, self._positions.get(seed, 0))
        request = RigRequest(req_id, seed, prompt, hash_chain(seed, (prompt + extra_tokens) // bs), prompt)
        self.requests[req_id] = request
        self._new.append(request)
        return request

    def content(self, seed: int, group: CacheGroup) -> torch.Tensor:
        """The bytes a request of this seed computes into each block of `group`, one row per block position."""
        key = (seed, group.rank)
        if key not in self._content:
            device = self.bytes.caches.device
            generator = torch.Generator(device=device).manual_seed(seed * 8 + group.rank)
            rows, width, step = self._positions[seed], self.bytes.caches.gpu_block_bytes, self.bytes.chunk_blocks
            content = self._content[key] = torch.empty((rows, width), dtype=torch.uint8, device=device)
            for first in range(0, rows, step):
                content[first:first + step] = torch.randint(0, 256, (min(step, rows - first), width),
                                                            dtype=torch.uint8, generator=generator, device=device)
        return self._content[key]

    def null_intact(self) -> bool:
        """Whether the null block still holds what it was filled with."""
        width = self.bytes.caches.gpu_block_bytes
        row = torch.full((1, width), NULL_FILL, dtype=torch.uint8, device=self.bytes.caches.device)
        return self.bytes.differing([NULL_BLOCK], row) == 0

    def forget(self, seed: int) -> None:
        """Drop a seed's content (the GPU memory it holds) once nothing will compare against it."""
        for group in self.groups:
            self._content.pop((seed, group.rank), None)
        self._positions.pop(seed, None)

    def finish(self, req_id: str) -> None:
        """The request ends: its blocks go back at once, but a group whose load still writes them (kvfsm answers
        True) keeps them until a step releases it."""
        request = self.requests[req_id]
        for group in self.groups:
            tracked = group.tracked(req_id)
            blocks = [b for b in request.tables.pop(group.name, ()) if b != NULL_BLOCK]
            if self.connector.request_finished(tracked):
                self._held[tracked] = blocks
            else:
                self.free.extend(blocks)
        request.ended = True

    # --- steps ---------------------------------------------------------------------------------------------------

    def step(self, tokens: Mapping[str, int] | None = None) -> ConnectorMetadata:
        """One engine step: each running request in `tokens` computes that many tokens (its windows first give back
        what the tokens computed so far left behind); every request added since is looked up and allocated, and
        computes the rest of its prompt now unless it loads (then it waits for its load to be reported, and the
        caller schedules it once `loading` is empty)."""
        scheduler, worker = self.connector.scheduler, self.connector.worker
        scheduled = [(self.requests[req_id], count) for req_id, count in (tokens or {}).items()]
        left: dict[str, list[int]] = {}
        for request, count in scheduled:
            left.update(self._slide(request))
            self._grow(request, request.computed + count)
        for request in self._new:  # admitted after the running requests grew, as vLLM's scheduler does
            self._admit(request)
            if not request.loading:  # nothing to wait for: its prompt is computed in this step
                scheduled.append((request, request.num_tokens - request.computed))
        self._new = []
        for tracked, blocks in left.items():
            scheduler.slide(tracked, blocks)
        rows = [ScheduledRequest(g.tracked(r.req_id), tuple(r.tables[g.name]), r.computed + count)
                for r, count in scheduled for g in self.groups]
        meta = scheduler.build_connector_meta(SchedulerOutput(scheduled=rows))
        self.moved.update(("store", o.req_id) for o in meta.stores for _ in o.gpu_blocks)
        self.moved.update(("load", o.req_id) for o in meta.loads for _ in o.gpu_blocks)
        worker.bind_connector_metadata(meta)
        worker.handle_preemptions()
        handed, self._handed = self._handed, []
        if handed:
            self.device.enqueue("compute", "compute", "poison handed-out blocks",
                                lambda: self.bytes.fill(handed, POISON_BYTE), [Touch("write", "gpu", tuple(handed))])
        worker.start_load_kv()
        for request, count in scheduled:
            self._compute(request, count)
        worker.wait_for_save()
        self._advance()
        self._settle(scheduler.update_connector_output(ConnectorOutput(workers=(worker.get_finished(),))))
        if self.checks is not None:
            for name, lines in self.checks.violations().items():
                self.broken.setdefault(name, []).extend(lines)
        return meta

    def begin(self) -> None:
        """A new scenario on a drained rig: forget what the checks found, and on `SimDevice` the log of what ran (all
        of it ran: nothing issued from now on can run out of order with it, and the ordering checks grow with it)."""
        self.broken = {}
        if isinstance(self.device, SimDevice):
            self.device.accesses.clear()

    def drain(self, max_steps: int = 64) -> None:
        """Idle steps until no job is in flight and no ended request holds blocks (the host waits for the copies)."""
        for _ in range(max_steps):
            if not self._held and not any(job.in_flight for job in self.connector.scheduler.jobs.values()):
                return
            self.settle()
            self.step()
        raise RigError(f"jobs still in flight after {max_steps} idle steps")

    def settle(self) -> None:
        """Block the host until every stream ran what it was given (before bytes are compared)."""
        if isinstance(self.device, SimDevice):
            self.device.run_until_idle()
        else:
            torch.cuda.synchronize(self.bytes.caches.device)

    def close(self) -> None:
        if self.checks is not None:
            self.checks.close()
        self.connector.worker.shutdown()

    # --- the engine's side of a step ----------------------------------------------------------------------------

    def _take(self, count: int) -> list[int]:
        if count > len(self.free):
            raise RigError(f"{count} GPU blocks wanted, {len(self.free)} free: give the rig a larger pool")
        blocks = [self.free.pop() for _ in range(count)]
        self._handed.extend(blocks)
        return blocks

    def _slide(self, request: RigRequest) -> dict[str, list[int]]:
        """Each window's blocks the request's computed tokens left behind, taken back (the null block in their
        place), by tracked id."""
        left = {}
        for group in self.groups:
            table = request.tables[group.name]
            first = min(group.first_kept(request.computed, self.shape.block_tokens), len(table))
            if behind := [b for b in table[:first] if b != NULL_BLOCK]:
                table[:first] = [NULL_BLOCK] * first
                self.free.extend(behind)
                left[group.tracked(request.req_id)] = behind
        return left

    def _grow(self, request: RigRequest, tokens: int) -> None:
        """Blocks for `tokens` computed, in every group."""
        needed = -(-tokens // self.shape.block_tokens)
        for group in self.groups:
            table = request.tables[group.name]
            table.extend(self._take(needed - len(table)))

    def _admit(self, request: RigRequest) -> None:
        """Look every group up, offer the full group's hit only if every window holds its whole window where it ends
        (the adapter's first rule; its fall-back to a shorter hit whose windows are whole, `window_hit`, is not needed
        here: a reader's windows are whole where it looks), allocate (the null block below a reloaded window) and
        start the loads."""
        bs, scheduler = self.shape.block_tokens, self.connector.scheduler
        full, *windows = self.groups
        match = scheduler.get_num_new_matched_tokens(GroupView(request, full, bs), 0)
        if match is None:
            raise RigError(f"{request.req_id}: deferred (a block of its prefix is being stored or loaded)")
        end, whole = match[0] // bs, True
        for group in windows:
            start = group.first_kept(end * bs, bs)
            found = scheduler.get_num_new_matched_tokens(GroupView(request, group, bs), start * bs)
            if found is None:
                raise RigError(f"{group.tracked(request.req_id)}: deferred")
            whole = whole and start + found[0] // bs >= end
            scheduler.limit_match(group.tracked(request.req_id), end)
        if not whole:
            for group in self.groups:
                scheduler.limit_match(group.tracked(request.req_id), 0)
            end = 0
        needed = -(-request.num_tokens // bs)
        prompt_end = request.prompt_tokens // bs * bs
        for group in self.groups:
            first = group.first_kept(end * bs, bs)
            table = request.tables[group.name] = [NULL_BLOCK] * first + self._take(needed - first)
            view = GroupView(request, group, bs)
            scheduler.update_state_after_alloc(view, table, (end - first) * bs,
                                               store_from=group.first_kept(prompt_end, bs))
            if end > first:
                request.loading.add(view.request_id)
        request.computed = end * bs

    def _compute(self, request: RigRequest, count: int) -> None:
        """The step's forward for one request: it reads every block it holds and writes its content into the blocks
        its `count` new tokens fall in."""
        bs = self.shape.block_tokens
        positions = range(request.computed // bs, -(-(request.computed + count) // bs))
        writes = [([request.tables[g.name][p] for p in positions], self.content(request.seed, g)[positions.start:
                   positions.stop]) for g in self.groups]
        held = tuple(b for g in self.groups for b in request.tables[g.name] if b != NULL_BLOCK)
        written = tuple(b for blocks, _ in writes for b in blocks)

        def forward() -> None:
            for blocks, rows in writes:
                self.bytes.write(blocks, rows)

        self.device.enqueue("compute", "compute", f"forward of {request.req_id}", forward,
                            [Touch("read", "gpu", held), Touch("write", "gpu", written)])
        request.computed += count
        request.num_tokens = max(request.num_tokens, request.computed + 1)

    def _advance(self) -> None:
        """On `SimDevice`, run what the GPU would have run by the end of the step (nothing to do on CUDA)."""
        if not isinstance(self.device, SimDevice):
            return
        if not self.lag_copies:
            self.device.run_until_idle()
            return
        while runnable := [s for s in self.device.runnable() if s != "store"]:
            self.device.run_one(runnable[0])

    def _settle(self, result: StepResult) -> None:
        """Loads reported end their request's wait; groups held for a load give their blocks back once released."""
        if result.load_errors:
            raise RigError(f"loads failed: {result.load_errors}")
        for tracked in result.loaded:
            self.requests[self.tracked.owner(tracked)[0]].loading.discard(tracked)
        for tracked in result.released:
            self.free.extend(self._held.pop(tracked, ()))
