"""Lower-tier scenarios the generated interleavings found, each replayed as one rule with a fixed schedule."""

from __future__ import annotations

from kvfsm.executor.sim import SimDevice
from kvfsm.testing.harness import Harness
from kvfsm.testing.interleavings import PREFIXES


def _warm_disk(**options: object) -> Harness:
    """A harness whose disk tier holds every prefix of the interleavings, pushed out of the CPU pool by the next."""
    h = Harness(SimDevice(), num_gpu_blocks=6, cpu_blocks=2, disk_slots=6, **options)  # type: ignore[arg-type]
    for prefix in PREFIXES:
        h.engine.reset_prefix_cache()
        h.add_request(prefix + (0,), 1)
        h.drain()
    return h


def _step_checked(h: Harness) -> None:
    h.engine.step()
    assert not (found := h.violations()), "\n".join(found)


def test_a_read_the_scheduler_has_not_heard_of_yet_leaves_its_entry_published() -> None:
    """`read-pins-entry` under async scheduling: the disk read of a fetch ends (the tier's poll publishes its
    entry again) a step before the worker's report reaches the scheduler, which still counts the fetch in flight."""
    h = _warm_disk(report_lag=1)
    h.add_request(PREFIXES[1], 1)
    _step_checked(h)  # the lookup finds the prefix on disk only: a fetch is ordered and its entries pinned
    h.io.run_all()  # the reads land in the CPU slots
    _step_checked(h)  # the worker polls them done; the scheduler hears of it a step later
    assert any(j.kind == "fetch" and j.in_flight for j in h.world.tier_jobs.values()), "the report is not late"
    h.drain()
    assert not (found := h.final_violations()), "\n".join(found)
    h.close()


def test_a_read_that_does_not_pin_its_entry_is_caught_on_the_same_schedule() -> None:
    """The control: with the tier's pin undone at once (`unpinned-tier-read`), the first step's read in flight
    holds an entry that is published, evictable, and `read-pins-entry` says so."""
    h = _warm_disk(report_lag=1, mutant="unpinned-tier-read")
    h.add_request(PREFIXES[1], 1)
    h.engine.step()
    assert any(line.startswith("read-pins-entry:") and "published while a read holds it" in line
               for line in h.violations())
    h.close()


def test_an_abort_before_an_inline_load_is_reported_drops_the_sample_computed_on_it() -> None:
    """Same-step per-layer loads: a request computed in its load step samples before the load is reported. Its
    load fails (the GPU block it read still holds the poison of its last owner, freed during the warm-up) and the
    request is aborted before the report; the connector releases an aborted request without a load outcome, so
    the engine must not keep that sample as output: it read KV that never landed."""
    h = _warm_disk(per_layer=True, layer_loads=True, writeback="on-evict")
    request = h.add_request(PREFIXES[0], 1)
    assert h.connector.scheduler.manager.catalogue, "the prefix is a CPU hit"
    h.faults.arm("load")
    h.engine.step()  # the load goes out and fails; the request computes on it in the same step
    assert request in h.engine.loading and h.engine.live[request].num_sampled == 1
    h.abort(request)
    h.drain()
    assert not (found := h.final_violations()), "\n".join(found)
    h.close()
