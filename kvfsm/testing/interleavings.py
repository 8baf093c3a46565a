"""Hypothesis-generated interleavings, with rules derived from the spec's triggers.

Every trigger of every lifecycle is either provoked directly by a rule here (an external event: a preemption, an
abort, a cache reset, a failed transfer) or fired by the connector in the course of engine steps. `EXTERNAL` maps
the former to the harness action that provokes it, `STEP_DRIVEN` lists the latter, and the state machine gets one
rule per external trigger. `tests/test_interleavings.py` fails when the spec gains a trigger that is in neither,
so a new transition cannot go unexercised.
"""

from __future__ import annotations

from typing import Callable, Sequence

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfsm.executor.sim import SimDevice, first_runnable
from kvfsm.mooncake import available as mooncake_available
from kvfsm.states import TierEntryState as Entry
from kvfsm.states import TransferJobState
from kvfsm.testing.copy_faults import STAGES
from kvfsm.testing.harness import Harness
from kvfsm.testing.mooncake_store import shared_master
from kvfsm.testing.mutants import MUTANTS

Trigger = tuple[str, str]
COPYING = frozenset({TransferJobState.SUBMITTED})
"""Job states whose copy may be on a copy stream right now."""

STEP_DRIVEN: frozenset[Trigger] = frozenset({
    ("request", "lookup"), ("request", "allocate"), ("request", "load-done"), ("request", "load-failed"),
    ("request", "finish"), ("request", "job-done"), ("request", "skip-store"),
    ("transfer-job", "prepare"), ("transfer-job", "submit"), ("transfer-job", "flush"),
    ("transfer-job", "complete"), ("transfer-job", "land-segment"),
    ("cpu-block", "allocate"), ("cpu-block", "submit"), ("cpu-block", "store-done"), ("cpu-block", "store-failed"),
    ("cpu-block", "pin"), ("cpu-block", "unpin"), ("cpu-block", "evict"),
    ("gpu-block", "fence"), ("gpu-block", "unfence"), ("gpu-block", "free"), ("gpu-block", "reuse"),
    ("cpu-block", "write-back"), ("cpu-block", "written-back"), ("cpu-block", "allocate-fetch"),
    ("cpu-block", "fetch-done"),
    ("tier-entry", "reserve"), ("tier-entry", "write-done"), ("tier-entry", "pin"), ("tier-entry", "read-done"),
    ("tier-job", "submit"), ("tier-job", "complete"), ("tier-job", "fail"), ("tier-job", "release"),
    ("cpu-block", "abandon-fetch"), ("cpu-block", "abandon-write-back"), ("tier-job", "shed"),
    ("request", "slide"),
})


def _pick(candidates: Sequence[str], choice: int) -> str | None:
    return candidates[choice % len(candidates)] if candidates else None


def _with_jobs(harness: Harness, requests: Sequence[str], kind: str, states: frozenset[str]) -> list[str]:
    """Those of `requests` with a `kind` job in one of `states`, as the scheduler half sees it."""
    records = harness.connector.scheduler.requests
    return [r for r in requests if r in records
            and any(j.kind == kind and j.state in states for j in records[r].jobs.values())]


def _preempt(harness: Harness, choice: int) -> None:
    """Preempt a running request, every other time one whose store is already on the copy stream (vLLM 29870);
    half the time its blocks are reclaimed at once, as under memory pressure."""
    running = [r.request_id for r in harness.engine.running]
    copying = _with_jobs(harness, running, "store", COPYING)
    target = _pick(copying if copying and choice % 2 == 0 else running, choice // 4)
    if target is not None:
        harness.engine.preempt(target, reclaim=choice // 2 % 2 == 1)


def _abort(harness: Harness, choice: int) -> None:
    """Abort a live request, cycling through the cases that must not leak: one loading, one whose stores are
    being flushed, one whose stores are on the copy stream, then any."""
    live = sorted(harness.engine.live)
    cases = (
        [r for r in live if r in harness.engine.loading],
        _with_jobs(harness, live, "store", frozenset({TransferJobState.FLUSHED_ON_PREEMPT})),
        _with_jobs(harness, live, "store", COPYING | {TransferJobState.PENDING_STORE}),
        live,
    )
    wanted = cases[choice % len(cases)]
    target = _pick(wanted or live, choice // len(cases))
    if target is not None:
        harness.abort(target)


def _reset(harness: Harness, choice: int) -> None:
    harness.connector.reset_cache()


def _fail(harness: Harness, choice: int) -> None:
    """Arm one rank's next store or load to fail (with tensor parallelism the other ranks' copies succeed), when it
    is checked, when a step's jobs are merged into one pipeline, or after 0 to 3 of its pieces were enqueued."""
    harness.rank_faults[choice // 2 % len(harness.rank_faults)].arm(
        ("store", "load")[choice % 2], STAGES[choice // 2 % len(STAGES)], choice // 6 % 4)


def _fail_tier_write(harness: Harness, choice: int) -> None:
    harness.tier_faults.inject(("disk-full", "write-io-error")[choice % 2])


def _fail_tier_read(harness: Harness, choice: int) -> None:
    harness.tier_faults.inject(("read-io-error", "corrupt-block")[choice % 2], choice)
    harness.mooncake_faults.corrupt_value(choice)


def _evict_before_fetch(harness: Harness, choice: int) -> None:
    harness.tier_faults.inject("evict-before-fetch")
    harness.mooncake_faults.remove_in_store(choice)


def _forget_published(harness: Harness, choice: int) -> None:
    """A shared tier's keys become another engine's: forgotten here, the next lookup adopts them from the store."""
    harness.mooncake_faults.forget(choice)


def _stall(harness: Harness, choice: int) -> None:
    """The disk hangs past the deadline of every tier job in flight; the engine's next step finds them (before a
    read or write of theirs may land)."""
    harness.tier_faults.inject("stall")
    harness.engine.step()


def _tier_evict(harness: Harness, choice: int) -> None:
    harness.tier_faults.evict_one(choice)


EXTERNAL: dict[Trigger, Callable[[Harness, int], None]] = {
    ("request", "preempt"): _preempt,
    ("request", "abort"): _abort,
    ("cpu-block", "reset"): _reset,
    ("transfer-job", "fail"): _fail,
    ("tier-entry", "write-failed"): _fail_tier_write,
    ("tier-entry", "read-failed"): _fail_tier_read,
    ("cpu-block", "fetch-failed"): _evict_before_fetch,
    ("tier-entry", "evict"): _tier_evict,
    ("tier-job", "abandon"): _stall,
    ("tier-entry", "adopt"): _forget_published,
}

IN_FLIGHT: tuple[Trigger, ...] = (("request", "abort"), ("cpu-block", "reset"), ("request", "preempt"))
"""External triggers a step may provoke right after it, before the device ran any of its transfers: aborts during
loads and flushes, resets during loads and stores. (Hypothesis runs a random subset of the rules in each example,
so the separate rules alone rarely meet a transfer in flight.)"""

PREFIXES = ((11, 12, 13, 14), (11, 12, 13, 14, 15, 16), (21, 22, 23, 24))
PROMPTS = st.tuples(
    st.builds(lambda prefix, suffix: prefix + tuple(suffix), st.sampled_from(PREFIXES),
              st.lists(st.integers(0, 99), max_size=4)),
    st.integers(1, 3),
)
"""(prompt, max new tokens): prompts drawn so that prefixes are often shared."""


FETCH_FAULTS = ("evict-before-fetch", "read-io-error", "corrupt-block", "stall")
"""Faults `return_from_disk` may put under the fetch it causes (`kvfsm.testing.tier_faults.FAULTS`)."""

BOUNDS = st.sampled_from([None, None, 1, 2])
"""A back-pressure bound (stores in flight, a tier's write-back queue), in blocks: half the time none, else one
small enough that a step's stores reach it."""

HOLDS = st.sampled_from([frozenset(), frozenset({"store"}), frozenset({"load"}), frozenset({"store", "load"})])
"""Streams stalled while the device advances: copy engines lagging behind compute, one or both."""


class OffloadInterleavings(RuleBasedStateMachine):
    """The reference engine + kvfsm on a SimDevice whose every stream choice hypothesis makes."""

    mutant: str | None = None
    examples = 0
    lower_tiers: tuple[str, ...] = ("none", "disk", "mooncake") if mooncake_available() else ("none", "disk")
    """The lower tiers an example may draw: none, a 6-slot disk, or Mooncake Store (one real master shared by the
    process, a tenant per example). Mooncake is drawn half as often as each other one: its examples cost about a
    second more each (mostly the client's close), which the main suite's time budget counts."""

    def __init__(self) -> None:
        super().__init__()
        type(self).examples += 1
        self.harness: Harness | None = None

    @initialize(gpu_blocks=st.integers(6, 12), cpu_blocks=st.integers(1, 6), factor=st.sampled_from([1, 2]),
                prompts=st.lists(PROMPTS, min_size=1, max_size=3), per_layer=st.booleans(),
                layer_loads=st.booleans(), layer_stores=st.booleans(), data=st.data(),
                report_lag=st.sampled_from([0, 1, 2]), staging_blocks=st.sampled_from([None, 1, 2]),
                store_bound=BOUNDS)
    def setup(self, gpu_blocks: int, cpu_blocks: int, factor: int, prompts: list[tuple[tuple[int, ...], int]],
              per_layer: bool, layer_loads: bool, layer_stores: bool, data: st.DataObject,
              report_lag: int, staging_blocks: int | None, store_bound: int | None) -> None:
        """The engine computes whole forwards or layer by layer (calling the per-layer hooks, with or without
        loads computed in their own step and per-layer stores), unless the mutant under test needs one of them;
        with no lower tier, a disk tier or a Mooncake tier below the CPU pool (that tier, for a mutant of its
        rule). `report_lag` 1 or 2 delivers transfer reports that many steps late, as vLLM's async scheduling
        does, with or without a lower tier. A lower tier is warmed first: every prefix written back and pushed out
        of CPU, so lookups fetch from it and the GPU blocks freed meanwhile hold poison. `staging_blocks` 1 or 2
        sends a step's stores as a pipeline of one- or two-block chunks, so a store can fail part-way through.
        Back-pressure is drawn too: `store_bound` CPU blocks of stores in flight (None: unbounded), and an eager
        disk's write-back queue bound; a pool of one or two slots fills with jobs in flight, so lookups meet a tier's
        hit with no room for its fetch."""
        needs = MUTANTS[self.mutant] if self.mutant is not None else None
        if needs is not None and needs.per_layer is not None:
            per_layer = needs.per_layer
        layer_loads = per_layer and (layer_loads or (needs is not None and needs.layer_loads))
        layer_stores = per_layer and (layer_stores or (needs is not None and needs.layer_stores))
        fails_part_way = needs.fails_part_way if needs is not None else None
        if fails_part_way is not None:
            staging_blocks = 1
        if needs is not None and needs.store_bound is not None:
            store_bound = needs.store_bound
        if needs is not None and needs.max_cpu_blocks is not None:
            cpu_blocks = min(cpu_blocks, needs.max_cpu_blocks)
        shares = [tier for tier in self.lower_tiers for _ in range(1 if tier == "mooncake" else 2)]
        tier = data.draw(st.sampled_from(shares), label="lower tier")
        queue_bound = needs.queue_bound if needs is not None else None
        writeback = "eager" if tier == "none" or queue_bound is not None else data.draw(
            st.sampled_from(["eager", "on-evict"]), label="write-back")
        if tier == "disk" and writeback == "eager" and queue_bound is None:
            queue_bound = data.draw(BOUNDS, label="write-back queue bound")
        self.harness = Harness(SimDevice(), num_gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks,
                               block_size_factor=factor, mutant=self.mutant, per_layer=per_layer,
                               layer_loads=layer_loads, layer_stores=layer_stores,
                               disk_slots=6 if tier == "disk" else 0, writeback=writeback,
                               report_lag=report_lag,
                               staging_blocks=staging_blocks,
                               store_threshold=needs.store_threshold if needs is not None else 1,
                               store_bound=store_bound, writeback_queue_blocks=queue_bound,
                               mooncake_master=shared_master() if tier == "mooncake" else None)
        if tier != "none":  # warm the tier: each prefix stored, written back, and pushed out of CPU by the next
            for prefix in PREFIXES:
                self.h.engine.reset_prefix_cache()
                self.h.add_request(prefix + (0,), 1)
                self.h.drain()
        if fails_part_way is not None:  # the mutant's hunt: every such copy fails after its first piece
            self.h.faults.arm(fails_part_way, "copy", after=1, every=True)
        for prompt, max_new in prompts:
            self.h.add_request(prompt, max_new)

    @property
    def h(self) -> Harness:
        assert self.harness is not None
        return self.harness

    def _choose_with(self, data: st.DataObject) -> None:
        self.h.device.scheduler = lambda options: data.draw(st.sampled_from(options), label="stream")

    @rule(data=st.data(), arrivals=st.lists(PROMPTS, max_size=2), lag=st.integers(0, 6), forget=st.booleans(),
          poll_lag=st.sampled_from([0, 0, 3, 100]), hold=HOLDS, then=st.sampled_from([None, *IN_FLIGHT]),
          choice=st.integers(0, 23))
    def step(self, data: st.DataObject, arrivals: list[tuple[tuple[int, ...], int]], lag: int, forget: bool,
             poll_lag: int, hold: frozenset[str], then: Trigger | None, choice: int) -> None:
        """New requests arrive (after the GPU prefix cache is dropped if `forget`, so they reload from CPU), one
        engine step runs (the device running `poll_lag` operations inside it, before the worker polls: a job may
        finish within its own step), `then` is provoked while the step's transfers are still in flight, then `lag`
        device operations run with the `hold` streams stalled: the host runs ahead of the GPU by a chosen amount,
        and a copy stream can lag behind compute across steps."""
        self.h.poll_lag = poll_lag
        if forget:
            self.h.engine.reset_prefix_cache()
        for prompt, max_new in arrivals:
            if len(self.h.engine.live) < 5:
                self.h.add_request(prompt, max_new)
        self._choose_with(data)
        self.h.engine.step()
        if then is not None:
            EXTERNAL[then](self.h, choice)
        self.run_device(data, lag, hold)

    @rule(data=st.data(), count=st.integers(1, 12), hold=HOLDS)
    def run_device(self, data: st.DataObject, count: int, hold: frozenset[str]) -> None:
        """Advance the device by `count` operations of the streams not in `hold`, hypothesis picking the stream each
        time (delays compute too)."""
        device = self.h.device
        for _ in range(count):
            options = [s for s in device.runnable() if s not in hold]
            if not options:
                return
            device.run_one(data.draw(st.sampled_from(options), label="stream"))

    def _only_on_disk(self, choice: int) -> int | None:
        """A published disk key the CPU pool no longer holds, of a prefix this run served; None if there is none (or
        no disk, or the engine is full)."""
        h = self.h
        if h.disk is None or len(h.engine.live) >= 5:
            return None
        catalogue = h.connector.scheduler.manager.catalogue
        keys = sorted(e.key for e in h.disk.entries
                      if e.state == Entry.PUBLISHED and e.key not in catalogue and e.key in h.oracle.tokens)
        return keys[choice % len(keys)] if keys else None

    @rule(data=st.data(), choice=st.integers(0, 7), max_new=st.integers(1, 2),
          fault=st.sampled_from((None, *FETCH_FAULTS)))
    def return_from_disk(self, data: st.DataObject, choice: int, max_new: int, fault: str | None) -> None:
        """A prefix only the disk still holds comes back (the GPU forgot it too): its lookup fetches from disk. With
        a `fault`, that fetch meets it: the key evicted between the lookup and the read, an I/O error or a corrupted
        block under the read, or the disk hanging past the deadline of the read (and of any write-back queued with
        it) just after the step that queued it, found by the next step. Each must end as a failed or abandoned fetch
        the engine recomputes; the checks see nothing wrong loaded."""
        h = self.h
        key = self._only_on_disk(choice)
        if key is None:
            return
        assert h.disk is not None
        if fault == "corrupt-block":  # this key's block, not any published one
            published = sorted(e.key for e in h.disk.entries if e.state == Entry.PUBLISHED)
            h.tier_faults.inject(fault, published.index(key) + len(published) * choice)
        elif fault in ("evict-before-fetch", "read-io-error"):
            h.tier_faults.inject(fault)
        h.engine.reset_prefix_cache()
        h.add_request(h.oracle.tokens[key] + (1,), max_new)
        if fault is not None:
            self._choose_with(data)
            h.engine.step()
        if fault == "stall":  # the engine's next step finds the read past its deadline
            h.tier_faults.inject(fault)
            h.engine.step()

    @rule(data=st.data(), count=st.integers(1, 6))
    def run_io(self, data: st.DataObject, count: int) -> None:
        """Let `count` queued disk reads or writes happen, hypothesis picking which one each time."""
        queue = self.h.io.queue
        for _ in range(count):
            if not queue:
                return
            self.h.io.run_one(data.draw(st.integers(0, len(queue) - 1), label="io"))

    @invariant()
    def spec_holds(self) -> None:
        if self.harness is not None:
            assert not (found := self.h.violations()), "\n".join(found)
            self.h.forget_checked()

    def teardown(self) -> None:
        if self.harness is None:
            return
        self.h.device.scheduler = first_runnable
        try:
            self.h.drain()
            found = self.h.final_violations()
            assert not found, "\n".join(found)
        finally:
            if self.mutant is None:
                EXERCISED.update(self.h.trace.edges)
            self.h.close()


EXERCISED: set[tuple[str, str, str, str]] = set()
"""Every (lifecycle, source, trigger, dest) the interleavings took against kvfsm itself: the edge coverage."""


def _external_rule(trigger: Trigger, action: Callable[[Harness, int], None]) -> Callable[..., None]:
    @precondition(lambda self: self.harness is not None)  # never on timing-dependent state: GPU runs must replay
    @rule(choice=st.integers(0, 7))
    def provoke(self: OffloadInterleavings, choice: int) -> None:
        action(self.h, choice)

    provoke.__name__ = provoke.__qualname__ = f"provoke_{trigger[0]}_{trigger[1]}".replace("-", "_")
    return provoke


for _trigger, _action in EXTERNAL.items():
    _rule = _external_rule(_trigger, _action)
    setattr(OffloadInterleavings, _rule.__name__, _rule)


@rule(data=st.data(), steps=st.integers(1, 4))
def lag_a_load(self: OffloadInterleavings, data: st.DataObject, steps: int) -> None:
    """The load stream runs until the first layer of a load in flight landed, then stalls for `steps` engine steps
    whose compute and stores run: a load taken as landed before its last layer did is computed on while that layer
    is still on the wire. Only the hunts of mutants that need it (`Mutant.load_lags`) get this rule: it is one
    weighting of stream choices every example may draw (`run_device` holding the load stream), so kvfsm's own
    examples keep their draws."""
    worker, device = self.h.connector.worker, self.h.device
    segments = worker.events._segments
    loads = [segments[job.job_id] for job in worker.jobs.values()
             if job.kind == "load" and job.state in COPYING and job.segments > 1 and job.job_id in segments]
    for _ in range(64):
        if any(events and device.query(events[0]) for events in loads) or not (options := device.runnable()):
            break
        device.run_one("load" if "load" in options else data.draw(st.sampled_from(options), label="stream"))
    if not any(events and device.query(events[0]) and not device.query(events[-1]) for events in loads):
        return
    self.h.poll_lag = 0
    for _ in range(steps):
        self._choose_with(data)
        self.h.engine.step()
        self.run_device(data, 12, frozenset({"load"}))


def interleavings_for(mutant: str | None) -> type[OffloadInterleavings]:
    """The state machine against kvfsm (None) or against one of `kvfsm.testing.mutants.MUTANTS`; a mutant of a
    lower tier's rule always runs with that tier, and one that needs a lagging load stream gets `lag_a_load`."""
    tier = MUTANTS[mutant].tier if mutant is not None else None
    if mutant is None:
        tiers = OffloadInterleavings.lower_tiers
    else:  # a rule above the tiers shows without the (slower, networked) Mooncake tier
        tiers = (tier,) if tier is not None else ("none", "disk")
    rules = {"lag_a_load": lag_a_load} if mutant is not None and MUTANTS[mutant].load_lags else {}
    return type(f"Interleavings_{mutant or 'kvfsm'}".replace("-", "_"), (OffloadInterleavings,),
                {"mutant": mutant, "examples": 0, "lower_tiers": tiers, **rules})
