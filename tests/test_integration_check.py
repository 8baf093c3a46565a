"""Any engine checks its own integration: `kvfsm.checking.IntegrationCheck` over the connector and the engine's
own block tables (`EngineTables`), run here on an engine that is not kvfsm's reference engine.

`TinyEngine` is the smallest engine docs/integration.md describes: first come first served, no GPU prefix cache,
no preemption, one step computes a whole prompt. Its runs pass every check; each control breaks the rule the
connector exists to keep (a GPU block a store still reads is not reused), once in what the engine does and once in
what its tables report, and the check names `fence` at the step it happens. The reference engine passes the same
check through its own tables (`kvfsm.engine.world.ReferenceTables`), preemptions included.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import pytest
import torch

from kvfsm import Connector, OffloadConfig
from kvfsm.checking import EngineTables, IntegrationCheck, InvariantViolation
from kvfsm.connector.metadata import ConnectorOutput, ScheduledRequest, SchedulerOutput
from kvfsm.engine.world import ReferenceTables
from kvfsm.executor import SimDevice, Touch
from kvfsm.testing.harness import Harness

BLOCK_SIZE = 2
PREFIX = tuple(range(100, 108))
"""Four full GPU blocks shared by the requests below."""


@dataclass
class TinyRequest:
    """What the connector reads of a request (`request_id`, `block_hashes`, `num_tokens`), and the engine's own."""

    request_id: str
    prompt: tuple[int, ...]
    blocks: list[int] = field(default_factory=list)
    computed: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt)

    @property
    def block_hashes(self) -> tuple[int, ...]:
        """A hash chain over the full blocks: equal prefixes give equal hashes."""
        hashes: list[int] = []
        for end in range(BLOCK_SIZE, len(self.prompt) + 1, BLOCK_SIZE):
            hashes.append(hash((hashes[-1] if hashes else 0, self.prompt[end - BLOCK_SIZE:end])))
        return tuple(hashes)


class TinyEngine:
    """An engine written against docs/integration.md alone; a freed block is the first it hands out again.
    `skips_flush_hook` is a control: it calls `handle_preemptions` only in steps that preempt (it never does), so
    the stores the connector flushes for blocks handed out again are not waited for."""

    def __init__(self, connector: Connector, device: SimDevice, num_blocks: int,
                 skips_flush_hook: bool = False) -> None:
        self.connector = connector
        self.device = device
        self.caches = {f"layer.{i}": torch.zeros(2, num_blocks, BLOCK_SIZE, 1, 4) for i in range(2)}
        connector.register_kv_caches(self.caches, "kv-first")
        self.free = deque(range(num_blocks))
        self.waiting: deque[TinyRequest] = deque()
        self.loading: dict[str, TinyRequest] = {}
        self.ready: list[TinyRequest] = []
        self.held: dict[str, TinyRequest] = {}
        self.skips_flush_hook = skips_flush_hook

    # --- EngineTables ---------------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.loading or self.ready or self.held or self.connector.stores_of_ended_requests)

    def block_tables(self) -> Mapping[str, Sequence[int]]:
        holding = [*self.loading.values(), *self.ready, *self.held.values()]
        return {request.request_id: request.blocks for request in holding}

    def free_blocks(self) -> Sequence[int]:
        return self.free

    # --- serving ----------------------------------------------------------------------------------------------

    def add(self, request_id: str, prompt: tuple[int, ...]) -> None:
        self.waiting.append(TinyRequest(request_id, prompt))

    def step(self) -> None:
        batch, self.ready = self.ready, []
        self._admit(batch)
        scheduled = tuple(ScheduledRequest(req_id=r.request_id, block_ids=tuple(r.blocks),
                                           num_computed_tokens=r.num_tokens) for r in batch)
        worker = self.connector.worker
        worker.bind_connector_metadata(self.connector.build_connector_meta(SchedulerOutput(scheduled=scheduled)))
        if not self.skips_flush_hook:
            worker.handle_preemptions()
        worker.start_load_kv()
        for request in batch:
            self._compute(request)
        worker.wait_for_save()
        result = self.connector.update_connector_output(ConnectorOutput(workers=(worker.get_finished(),)))
        for req_id in result.loaded:
            request = self.loading.pop(req_id)
            bad = result.load_errors.get(req_id, ())
            request.computed = min(request.blocks.index(b) for b in bad) * BLOCK_SIZE if bad else request.computed
            self.ready.append(request)
        for req_id in result.released:
            self.free.extendleft(self.held.pop(req_id).blocks)
        for request in batch:
            if self.connector.request_finished(request.request_id, aborted=False):
                self.held[request.request_id] = request
            else:
                self.free.extendleft(request.blocks)

    def _admit(self, batch: list[TinyRequest]) -> None:
        """FIFO; a deferred request (`None`) stays waiting and a later one may go first."""
        for request in list(self.waiting):
            need = -(-request.num_tokens // BLOCK_SIZE)
            match = self.connector.get_num_new_matched_tokens(request, 0)
            if match is None:
                continue
            if need > len(self.free):
                break
            self.waiting.remove(request)
            request.blocks = [self.free.popleft() for _ in range(need)]
            external, _ = match
            self.connector.update_state_after_alloc(request, request.blocks, external)
            request.computed = external
            if external:
                self.loading[request.request_id] = request
            else:
                batch.append(request)

    def _compute(self, request: TinyRequest) -> None:
        """The forward pass, on the compute stream, declaring the blocks it writes so the device log shows it."""
        start = request.computed
        caches, prompt, blocks = list(self.caches.values()), request.prompt, request.blocks

        def write() -> None:
            for position in range(start, len(prompt)):
                for cache in caches:
                    cache[:, blocks[position // BLOCK_SIZE], position % BLOCK_SIZE] = float(prompt[position])

        touched = tuple(sorted({blocks[p // BLOCK_SIZE] for p in range(start, len(prompt))}))
        self.device.enqueue("compute", "compute", f"forward {request.request_id}", write,
                            [Touch("write", "gpu", touched)])
        request.computed = len(prompt)


def serve(engine: TinyEngine, check: IntegrationCheck, arrivals: dict[int, list[tuple[str, tuple[int, ...]]]],
          max_steps: int = 40) -> int:
    """Add each request at its step, step until idle, let the device run and check after every step."""
    step = 0
    while step < max_steps and (engine.has_work or any(s > step for s in arrivals)):
        step += 1
        for request_id, prompt in arrivals.get(step, []):
            engine.add(request_id, prompt)
        engine.step()
        engine.device.run_until_idle()
        check.after_step(step)
    assert not engine.has_work, f"not idle after {max_steps} steps"
    return step


ARRIVALS = {1: [("writer", PREFIX + (1,))], 2: [("early-reader", PREFIX + (2,))], 8: [("reader", PREFIX + (3,))]}
"""A writer, a reader that arrives while the writer's store is in flight (deferred), and one that comes later."""


def tiny(**control: bool) -> tuple[TinyEngine, IntegrationCheck, Connector]:
    device = SimDevice()
    connector = Connector(OffloadConfig(cpu_blocks=16, gpu_block_size=BLOCK_SIZE), device)
    engine = TinyEngine(connector, device, num_blocks=16, **control)
    return engine, IntegrationCheck(connector, engine, device), connector


def test_the_tiny_engine_is_an_engine_the_check_reads() -> None:
    engine, check, _ = tiny()
    assert isinstance(engine, EngineTables)
    check.close()


def test_a_correct_integration_passes_every_check_and_reloads_from_cpu() -> None:
    engine, check, connector = tiny()
    serve(engine, check, ARRIVALS)
    check.close()
    stats = connector.scheduler.stats
    assert stats.blocks_stored == 4 and stats.blocks_loaded == 8 and stats.deferrals >= 1
    assert check.integration.idle and not check.violations()


REUSE_ARRIVALS = {1: [("writer", PREFIX + (1,))], 2: [("other", tuple(range(200, 209)))]}
"""A writer that ends with its store in flight, and a request handed its blocks at once."""


def test_an_ended_requests_blocks_handed_out_again_are_fenced_lazily() -> None:
    engine, check, connector = tiny()
    serve(engine, check, REUSE_ARRIVALS)
    check.close()
    assert connector.scheduler.stats.blocks_stored == 8 and not check.violations()


def test_a_block_reused_under_a_store_in_flight_is_caught_as_fence() -> None:
    """The control: without `handle_preemptions` the store flushed for a block handed out again is not waited for."""
    engine, check, _ = tiny(skips_flush_hook=True)
    with pytest.raises(InvariantViolation) as caught:
        serve(engine, check, REUSE_ARRIVALS)
    check.close()
    assert caught.value.step == 2 and "fence" in caught.value.names
    assert "store job" in str(caught.value)


def test_the_example_of_the_integration_page_runs() -> None:
    """docs/integration.md's "Checking your integration" example, run as printed with this file's `TinyEngine`."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "integration.md").read_text()
    section = page[page.index("## Checking your integration"):]
    example = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert example is not None
    scope: dict[str, object] = {"TinyEngine": TinyEngine}
    exec(example.group(1), scope)
    assert scope["step"] and not scope["engine"].has_work  # type: ignore[attr-defined]


def reference_run(mutant: str | None = None) -> tuple[Harness, IntegrationCheck]:
    """The reference engine through its own tables: its prefix stored by a request that ends in the step that
    orders the store, then reloaded by requests that are preempted along the way."""
    h = Harness(SimDevice(), num_gpu_blocks=12, cpu_blocks=32, max_batched_tokens=12, mutant=mutant)
    check = IntegrationCheck(h.connector, ReferenceTables(h.engine), h.devices)
    step = 0
    try:
        for wave in ([(PREFIX + (99,), 1)], [(PREFIX + (index,), 4) for index in range(5)]):
            for prompt, tokens in wave:
                h.add_request(prompt, tokens)
            while h.engine.has_work and step < 200:
                step += 1
                if step % 3 == 0 and h.engine.running:
                    h.engine.preempt(h.engine.running[0].request_id)
                h.engine.step()
                h.settle()
                check.after_step(step)
            h.engine.reset_prefix_cache()  # the prefix now lives only on CPU
    finally:
        check.close()
        h.close()
    return h, check


def test_the_reference_engine_passes_the_same_check_through_its_tables() -> None:
    """A preemption flushes stores in flight and hands their blocks back at once, which `fence` allows: the worker
    waits for a flushed store before anything writes its blocks."""
    h, check = reference_run()
    assert h.engine.preemptions and h.connector.scheduler.stats.blocks_loaded
    assert check.integration.idle and not check.violations()


def reuse_run(mutant: str | None = None) -> IntegrationCheck:
    """The reference engine through its own tables: a request ends in the step that orders its store, and the next
    step hands its blocks to another request (a tight pool)."""
    h = Harness(SimDevice(), num_gpu_blocks=8, cpu_blocks=32, mutant=mutant)
    check = IntegrationCheck(h.connector, ReferenceTables(h.engine), h.devices)
    arrivals = {1: (tuple(range(100, 112)), 1), 2: (tuple(range(60, 72)), 3)}
    step = 0
    try:
        while (h.engine.has_work or step < len(arrivals)) and step < 50:
            step += 1
            if step in arrivals:
                h.add_request(*arrivals[step])
            h.engine.step()
            check.after_step(step)
            h.settle()
    finally:
        check.close()
        h.close()
    return check


def test_the_reference_engine_hands_out_an_ended_requests_blocks_behind_the_lazy_fence() -> None:
    check = reuse_run()
    assert check.integration.idle and not check.violations()


def test_the_reference_engine_reusing_blocks_under_a_store_is_caught() -> None:
    """The control: the `no-lazy-fence` mutant hands out a finished request's blocks without flushing the stores
    still reading them."""
    with pytest.raises(InvariantViolation, match=r"lazy-fence: GPU block \d+ is fenced \(handed out again\)"):
        reuse_run("no-lazy-fence")
