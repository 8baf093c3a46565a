"""The connector under an engine that keeps stepping: GB/s of many steps' stores and loads, back to back.

`kvfsm.bench.connector` times one engine step by itself: its bookkeeping before the first copy and after the last
are in every figure, with nothing to overlap them. An engine that offloads under load keeps stepping instead: each
step orders the stores of what it just computed and the loads of returning prompts, and its bookkeeping runs while
the copies ordered by earlier steps are still moving. What limits it then is whether the connector keeps the copy
engines fed, which is what this prices: `steps` steps, each moving one region of the cache per direction, timed
from the first step's start until the last job is reported.

A stored request ends with the step that computed it and gives its blocks back at once: the step that computes into
its region again finds the stores still reading it flushed, and the worker waits for them before that forward pass
(`lazy-fence`). A loaded request holds its region until it is reported loaded (it then ends): the engine reuses a
load region only once every request on it was, blocking on the oldest job and stepping again until it was, as an
engine whose allocator is out of free blocks does. Store and load regions each rotate through `ROTATION`, so a
step's copies queue behind earlier steps' instead of waiting for them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvfsm.bench.connector import ConnectorRounds, Prompt, RoundMismatch

ROTATION = 5
"""Regions each direction rotates through. A region is reused only after every other region of its direction was, so
this is how many steps of copies queue before a step waits for the oldest (the flush of a store region's stores, or
a load region's loads): a store is sent the step after its compute, so its direction has one step less. On kv-first
caches both ways at once (H100, 2026-11-26, when a stored request still held its region until its store ended, a
wait for the same stores before the same step), the three-region rotation moved 0.78-0.88 of the ceiling, four
0.85-0.96, five 0.87-0.93: with fewer the engine waited for the stores of the step before last while the store
stream ran dry. One way, three regions already moved 0.96-0.98 (kv-first) and 0.98-1.0 (cross-layer)."""


def pool_blocks(region_blocks: int) -> int:
    """CPU blocks for sustained steps on regions of `region_blocks`: enough that the prompts loads bring back are
    never the least recently used blocks. A source region is touched once a rotation, and a store's blocks enter
    the eviction order when it completes, up to a rotation after it was ordered: so up to two rotations of stores
    can be younger than the next source region (with one region to spare it was evicted on the H100)."""
    return 3 * ROTATION * region_blocks


class SustainedSteps:
    """Steps an engine through `rounds`' connector, storing fresh prompts and loading stored ones region by region."""

    def __init__(self, rounds: ConnectorRounds) -> None:
        if len(rounds.regions) < 2 * ROTATION:
            raise ValueError(f"sustained steps need {2 * ROTATION} regions, the rounds have {len(rounds.regions)}")
        self.rounds = rounds
        self._holders: list[set[str]] = [set() for _ in rounds.regions]
        """Per region, the requests loading into its GPU blocks that were not reported loaded yet."""
        self._region_of: dict[str, int] = {}
        self._errors: dict[str, tuple[int, ...]] = {}
        self._sources: list[list[Prompt]] = []
        """Per source region j (the first `ROTATION`), its prompts as last stored: what loads bring back."""

    def store(self, steps: int) -> float:
        """Seconds for `steps` steps, each storing one region's fresh prompts (every region in turn)."""
        return self._run(steps, stores=range(len(self.rounds.regions)), loads=())

    def load(self, steps: int) -> float:
        """Seconds for `steps` steps, each loading the prompts stored from source region j into region
        `ROTATION + j`, j in turn (a prompt still loading is deferred, so no two steps load the same one)."""
        return self._run(steps, stores=(), loads=self._destinations())

    def both(self, steps: int) -> float:
        """Seconds for `steps` steps, each computing and storing fresh prompts on source region j while loading
        that region's earlier prompts, from the pool, into region `ROTATION + j`, j in turn."""
        return self._run(steps, stores=range(ROTATION), loads=self._destinations())

    def check_landed(self) -> None:
        """After `load` or `both`: every destination region holds, block for block, its source region's bytes."""
        for source in range(ROTATION):
            self.rounds.check_copied(source, ROTATION + source)

    def _destinations(self) -> range:
        """The regions loads go into, one per source region, whose fresh prompts are stored first (untimed; the
        stores of earlier calls may have evicted the last call's)."""
        self._sources = []
        for region in range(ROTATION):
            computed = self.rounds.admit_new(self.rounds.regions[region])
            self._step(computed)
            self.rounds.end_computed(computed)
            self._sources.append([prompt for prompt, _ in computed])
        self._drain()
        return range(ROTATION, 2 * ROTATION)

    def _run(self, steps: int, stores: Sequence[int], loads: Sequence[int]) -> float:
        """Seconds for `steps` engine steps, step i storing region `stores[i % len(stores)]`'s fresh prompts and
        loading source i's prompts into `loads[i % len(loads)]`, until every job was reported."""
        rounds = self.rounds
        if rounds.device.kind == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for step in range(steps):
            store_region = stores[step % len(stores)] if stores else None
            load_region = loads[step % len(loads)] if loads else None
            if load_region is not None:
                self._free(load_region)
                source = self._sources[step % len(loads)]
                for prompt in rounds.admit_returning(source, rounds.regions[load_region]):
                    self._region_of[prompt.request_id] = load_region
                    self._holders[load_region].add(prompt.request_id)
            computed = rounds.admit_new(rounds.regions[store_region]) if store_region is not None else []
            self._step(computed)
            self.rounds.end_computed(computed)
        self._drain()
        elapsed = time.perf_counter() - start
        if self._errors:
            raise RoundMismatch(f"load errors {self._errors}")
        return elapsed

    def _step(self, computed: list[tuple[Prompt, tuple[int, ...]]]) -> None:
        """One engine step (`ConnectorRounds.engine_step`), then what the engine does with its report: loaded
        requests end and free their region."""
        connector = self.rounds.connector
        result = self.rounds.engine_step(computed)
        self._errors.update(result.load_errors)
        for request_id in result.loaded:  # the engine computes the last token; the request then ends
            if connector.request_finished(request_id):
                raise RoundMismatch(f"{request_id}: a loaded request was held when it ended")
            self._holders[self._region_of.pop(request_id)].discard(request_id)

    def _free(self, region: int) -> None:
        """Block until every load into `region` was reported: wait for the oldest job, step, again."""
        while self._holders[region]:
            self._wait_oldest()

    def _drain(self) -> None:
        """Step until every load was reported and the stores of ended requests ended (an engine with nothing else
        to do steps while `stores_of_ended_requests`)."""
        while any(self._holders) or self.rounds.connector.stores_of_ended_requests:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        worker = self.rounds.connector.worker
        worker.wait(list(worker.jobs)[:1])  # none in flight: the next step sends what is still pending
        self._step([])
