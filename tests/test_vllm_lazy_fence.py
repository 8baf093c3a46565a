"""`lazy-fence` under vLLM's real Scheduler: an ended request's blocks go back to vLLM at once, and the step that
hands one out again flushes the stores still reading it.

vLLM's own `OffloadingConnector` frees such blocks at once too and flushes a store only when vLLM re-allocates one of
its blocks. Each rule has its control, the adapter with the lazy fence dropped (`no-lazy-fence`: the step that hands
a block out flushes nothing), caught by `check_reuse` (vLLM's own tables, as the step goes to the workers) or by the
bytes a later reader reloads. Every run is traced against the spec, checked with the named invariants each step and
required drained at the end. Skipped when vLLM is not installed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from kvfsm.integrations.vllm.rig import BLOCK_SIZE, FakeWorker  # noqa: E402
from kvfsm.testing.mutants import MUTANTS  # noqa: E402
from vllm_harness import AdapterWorker, Driver, ReusedUnderStore  # noqa: E402
from vllm_support import PREFIX, make_driver, model  # noqa: E402,F401

pytestmark = pytest.mark.vllm

WRITER = PREFIX + [1, 2, 3]
"""Five blocks, four of them full (stored)."""
TAKER = list(range(3000, 3000 + 7 * BLOCK_SIZE + 1))
"""Eight blocks: in a pool of nine, four of them are blocks the writer just gave back."""
TIGHT = 10
"""GPU blocks (vLLM keeps one as its null block)."""


def drop_lazy_fence(d: Driver) -> None:
    """The control: the adapter's connector with `no-lazy-fence` (the step that hands a block out flushes nothing)."""
    d.connector.scheduler_side.kvfsm.ledger.flush_readers = lambda blocks, step: None  # type: ignore[method-assign]


def handed_out(d: Driver) -> list[int]:
    """The freed-while-read blocks each step handed out, as the connector found them."""
    found: list[int] = []
    fences = d.connector.scheduler_side.kvfsm.ledger.fences
    take = fences.take_handed_out

    def recorded(written):  # type: ignore[no-untyped-def]
        handed = take(written)
        found.extend(sorted(handed))
        return handed

    fences.take_handed_out = recorded  # type: ignore[method-assign]
    return found


def end_then_reuse(d: Driver, aborted: bool) -> None:
    """The writer ends (finishes, or is aborted mid-decode) with its store in flight; the next step vLLM hands four of
    its blocks to the taker."""
    d.add("writer", WRITER, max_tokens=10 if aborted else 1)
    d.step()
    assert d.log[-1].orders.stores, "the prefill step ordered no store"
    if aborted:
        d.scheduler.finish_requests("writer", RequestStatus.FINISHED_ABORTED)
    assert "writer" not in d.scheduler.requests, "vLLM kept the blocks of a request with only stores in flight"
    d.add("taker", TAKER, max_tokens=2)
    d.run()


def test_no_lazy_fence_is_a_mutant_of_the_spec() -> None:
    assert "lazy-fence" in MUTANTS["no-lazy-fence"].breaks


@pytest.mark.parametrize("aborted", [False, True], ids=["finished", "aborted"])
def test_the_step_that_hands_out_an_ended_requests_block_flushes_its_store(make_driver, aborted: bool) -> None:
    d = make_driver(FakeWorker(store_steps=5), gpu_blocks=TIGHT)
    handed = handed_out(d)
    end_then_reuse(d, aborted)
    (store,) = d.log[0].orders.stores
    assert handed, "vLLM handed out none of the writer's blocks"
    assert store.job_id in d.log[1].orders.flush, "the reusing step did not flush the store"
    assert d.connector.scheduler_side.kvfsm.stats.blocks_stored >= 4
    assert d.cpu_pool_drained()


@pytest.mark.parametrize("aborted", [False, True], ids=["finished", "aborted"])
def test_control_handing_out_a_block_without_the_lazy_fence_is_caught(make_driver, aborted: bool) -> None:
    d = make_driver(FakeWorker(store_steps=5), gpu_blocks=TIGHT)
    drop_lazy_fence(d)
    with pytest.raises(ReusedUnderStore, match="store job 0 of ended request writer"):
        end_then_reuse(d, aborted)


def reload_writer(d: Driver, worker: AdapterWorker) -> list[list[int]]:
    """After `end_then_reuse`: the writer's prefix reloaded from CPU into zeroed caches; the tokens each loaded
    block's bytes say it holds."""
    d.reset_gpu_prefix_cache()
    for cache in worker.caches.values():
        cache.zero_()  # whatever the reader finds now came from the CPU pool
    d.add("reader", PREFIX + [9], max_tokens=1)
    d.run()
    (load,) = [order for log in d.log for order in log.orders.loads if order.req_id == "reader"]
    return [worker.block_tokens(block) for block in load.gpu_blocks]


PREFIX_BYTES = [[t % 251 for t in PREFIX[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]] for i in range(4)]


def test_a_reused_block_is_stored_with_the_writers_bytes(make_driver) -> None:
    d = make_driver(AdapterWorker, gpu_blocks=TIGHT)
    handed = handed_out(d)
    end_then_reuse(d, aborted=False)
    assert handed
    assert reload_writer(d, d.worker) == PREFIX_BYTES  # type: ignore[arg-type]


def test_control_without_the_lazy_fence_the_store_copies_the_takers_bytes(make_driver, monkeypatch) -> None:
    """The byte check alone: `check_reuse` is switched off, the store of the writer runs after the taker's forward
    wrote its reused blocks, and the CPU pool publishes the taker's tokens under the writer's prefix."""
    d = make_driver(AdapterWorker, gpu_blocks=TIGHT)
    drop_lazy_fence(d)
    monkeypatch.setattr(d, "check_reuse", lambda output: None)
    end_then_reuse(d, aborted=False)
    assert reload_writer(d, d.worker) != PREFIX_BYTES  # type: ignore[arg-type]


def abort_storm(d: Driver, waves: int = 6, per_wave: int = 3) -> None:
    """Waves of requests, each aborted mid-decode two steps after it arrived, its stores still in flight; each wave
    arrives as the last one is aborted, in a pool too small to hold two waves, so it is handed their blocks."""
    for wave in range(waves):
        ids = [f"w{wave}-{i}" for i in range(per_wave)]
        for i, req_id in enumerate(ids):
            d.add(req_id, [5000 + 100 * (wave * per_wave + i) + t for t in range(2 * BLOCK_SIZE + 1)], max_tokens=40)
        d.step()
        d.step()
        d.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
    d.run(max_steps=200)


def preemption_storm(d: Driver, requests: int = 6) -> None:
    """Long decodes in a pool that runs out: vLLM preempts (stores flushed at once), and requests finish with
    stores in flight while the others grow into their blocks."""
    for i in range(requests):
        d.add(f"p{i}", [6000 + 100 * i + t for t in range(2 * BLOCK_SIZE + 1)], max_tokens=3 * BLOCK_SIZE + i * 4)
    d.run(max_steps=400)


STORMS = {"abort": (abort_storm, 14), "preemption": (preemption_storm, 14)}


@pytest.mark.parametrize("storm", sorted(STORMS))
def test_a_storm_with_stores_in_flight_hands_blocks_out_behind_the_lazy_fence(make_driver, storm: str) -> None:
    run, blocks = STORMS[storm]
    d = make_driver(FakeWorker(store_steps=3, load_steps=2), gpu_blocks=blocks)
    handed = handed_out(d)
    run(d)
    assert handed, "no block of an ended request was handed out while its store was in flight"
    assert d.cpu_pool_drained()


@pytest.mark.parametrize("storm", sorted(STORMS))
def test_control_a_storm_without_the_lazy_fence_is_caught(make_driver, storm: str) -> None:
    run, blocks = STORMS[storm]
    d = make_driver(FakeWorker(store_steps=3, load_steps=2), gpu_blocks=blocks)
    drop_lazy_fence(d)
    with pytest.raises(ReusedUnderStore):
        run(d)
