"""A long run over failing tiers: does any bookkeeping structure grow with the run's length?

The reference engine serves round after round of fresh prefixes through a CPU pool, a disk tier and a Mooncake tier
(a real `mooncake_master`), with tier I/O on the tiers' own threads as in production and checksums on. Every path
that records something is taken over and over: in every other round every disk write fails (ENOSPC, through the
tier's I/O seam), so write-backs fail and keys are given up; each round's prefix is pushed out of the CPU pool by
another and looked up again, so it is fetched from the disk or the store; every other round that request is aborted
as its fetch is ordered, so the fetched blocks are never loaded; and a third of the way in the master is killed
(lookups, write-backs and fetches fail while it is down), then restarted two thirds in (the new master knows no
object, so fetches of what the tier published before miss). Once, the connector's cache is reset.

Every few rounds the census (`kvfsm.testing.census`) measures every structure reachable from the connector, and the
exported metrics' label sets. With `keep_history=False` none may grow by more than `retention_bound`, which the
configuration sets: every record the connector keeps exists for something the configuration sizes (a CPU slot, a GPU
block, a disk slot, a published key the Mooncake index remembers, a call the Mooncake client queues, a request in
flight), so a container holding more than all of them together keeps something whose reason ended, and grows with
the run. Each of `CONTROLS` puts back one kind of growth, and the soak names what outgrew the bound. The production
engine and the controls run in lockstep on one deployment, so they share the one outage, and each round runs every
engine at once on threads, so they wait out the outage's deadlines together.

`python -m kvfsm.testing.tier_soak --rounds 300` prints the figures; `tests/mooncake/test_tier_soak.py` runs a short
soak and its controls.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping

import typer

from kvfsm.config import DiskTierConfig, MooncakeTierConfig
from kvfsm.connector.prometheus import KvfsmCollector
from kvfsm.connector.tier_planner import TierPlanner
from kvfsm.executor.sim import SimDevice
from kvfsm.mooncake.local import DeploymentSettings, LocalMooncake
from kvfsm.testing.census import census, over
from kvfsm.testing.harness import Harness

STEP_BUDGET_S = 30.0
"""Longest one round may take to drain (a stuck engine fails the soak instead of hanging it)."""

STORE_BACK_S = 30.0
"""Longest the restarted master and its segment host may take to serve again."""


@dataclass(frozen=True)
class SoakShape:
    """The soak's configuration: small pools, so that every round evicts and the bound is tight."""

    rounds: int = 60
    cpu_blocks: int = 4
    gpu_blocks: int = 8
    disk_slots: int = 8
    index_keys: int = 4
    """`MooncakeTierConfig.index_keys`: published keys the Mooncake tier remembers."""
    prompt_blocks: int = 4
    live_requests: int = 1
    measure_every: int = 3
    """Rounds between censuses (one takes about a third of a round): a structure that grows with the run outgrows
    the bound whichever rounds are measured."""
    """Requests the soak has in the engine at once."""
    writeback_blocks: int = 8
    """`OffloadConfig.writeback_max_bytes_in_flight`, in CPU blocks: room for both tiers' write-backs of a prefix."""
    max_pending: int = 4
    """`MooncakeTierConfig.max_pending`: calls the Mooncake client queues."""
    timeouts: dict[str, float] = field(default_factory=lambda: dict(op_timeout_s=0.5, lookup_timeout_s=0.05,
                                                                      retry_after_s=0.5))
    """The Mooncake tier's deadlines: short, so the outage costs misses, not seconds per round."""


def soak_harness(master: str, shape: SoakShape, keep_history: bool = False) -> Harness:
    """An engine with a disk tier (written back on eviction) and a Mooncake tier (a tenant of its own, written back
    eagerly), tier I/O on threads, and checksums: each tier is then written and fetched from in some rounds."""
    return Harness(SimDevice(), num_gpu_blocks=shape.gpu_blocks, cpu_blocks=shape.cpu_blocks,
                   disk_slots=shape.disk_slots, writeback="on-evict", mooncake_master=master,
                   mooncake_options=dict(shape.timeouts, index_keys=shape.index_keys, max_pending=shape.max_pending,
                                         tenant=uuid.uuid4().hex, writeback="eager"),
                   writeback_bound_blocks=shape.writeback_blocks, tier_threads=True, keep_history=keep_history,
                   checksum=True)


def retention_bound(h: Harness, live_requests: int) -> int:
    """What the configuration sizes, summed: CPU slots, GPU blocks, each disk tier's slots, each Mooncake tier's
    remembered keys and queued calls, and the requests in flight."""
    config = h.connector.config
    cpu_block_bytes = config.block_size_factor * h.shape.gpu_block_bytes
    tiers = sum(t.capacity_bytes // cpu_block_bytes if isinstance(t, DiskTierConfig) else t.index_keys + t.max_pending
                for t in config.lower_tiers if isinstance(t, (DiskTierConfig, MooncakeTierConfig)))
    return h.connector.scheduler.manager.capacity + h.engine.pool.num_blocks + tiers + live_requests


def measure(h: Harness) -> Counter[str]:
    """The census of the connector, and the number of label sets of each exported metric."""
    sizes = census(h.connector)
    for family in KvfsmCollector.of(h.connector.scheduler).collect():
        sizes[f"metric {family.name}"] = len(family.samples)
    return sizes


@dataclass
class SoakReport:
    rounds: int
    bound: int
    grown: Counter[str]
    """Each structure's largest size after any round, less its size before the first: what the run added (the
    spec's compiled machines, the pools' fixed tables and the like add nothing)."""
    failures: Counter[str]
    """Tier keys that did not move, by reason: the soak must have taken the failure paths."""
    seconds: float
    """The whole soak's (every engine's rounds)."""

    @property
    def outgrown(self) -> dict[str, int]:
        """The structures that grew by more than the bound, with their growth."""
        return over(self.grown, self.bound)


def drive(h: Harness) -> None:
    """Run to idle, tier I/O included; the engine keeps stepping while the tiers' threads work."""
    deadline = time.monotonic() + STEP_BUDGET_S
    while h.engine.has_work or h.connector.moving_between_tiers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine did not drain within {STEP_BUDGET_S}s")
        h.engine.step()
        h.settle()
        if h.connector.moving_between_tiers:
            time.sleep(0.002)


def one_round(h: Harness, index: int, shape: SoakShape) -> None:
    """A fresh prefix served, pushed out of the CPU pool by another, and looked up again (fetched from a tier). By
    the round's place in four: disk writes fail in the first and third, and the lookup is aborted as its fetch is
    ordered in the second and third (so each tier's fetches are loaded in some rounds and never in others). The
    eighth round resets the connector's cache first (the disk forgets its keys; the store keeps them, to adopt);
    only once, since a reset empties the structures a leak would fill."""
    h.tier_faults.io.full = index % 4 in (0, 2)
    tokens = 2 * shape.prompt_blocks  # two tokens per GPU block (`harness.SHAPE`)
    prefix = tuple(range(1000 + 2 * tokens * index, 1000 + 2 * tokens * index + tokens))
    for prompt in (prefix + (1,), prefix[::-1] + (2,)):
        h.engine.reset_prefix_cache()
        h.add_request(prompt, 1)
        drive(h)
    h.engine.reset_prefix_cache()
    if index == 7:
        h.connector.reset_cache()
    request = h.add_request(prefix + (3,), 1)
    h.engine.step()
    if index % 4 in (1, 2):
        h.abort(request)
    drive(h)
    h.engine.finished.clear()  # the reference engine's own record of outputs, not the connector's
    for device in h.devices:
        device.accesses.clear()  # the simulated device's log, read only by checks


def store_serves(h: Harness, deadline_s: float) -> None:
    """Wait until the restarted master and its segment host take a write again."""
    assert h.mooncake is not None
    probe, deadline = f"probe-{uuid.uuid4().hex}", time.monotonic() + deadline_s
    while h.mooncake.client.raw().put(probe, b"x") != 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the store did not serve again within {deadline_s}s of the master's restart")
        time.sleep(0.1)


def soak(engines: Mapping[str, Harness], deployment: LocalMooncake, shape: SoakShape) -> dict[str, SoakReport]:
    """Run `shape.rounds` rounds on each engine, in lockstep (a round of each at once, each engine on a thread of its
    own), killing `deployment`'s master a third of the way in and restarting it two thirds in, so one outage serves
    every engine; measure each engine after every `measure_every`-th round of it and its last, once every engine's
    round ended. The threads are what keep the outage short: its rounds mostly wait for the store's deadlines (about
    two seconds an engine's round), which the engines then wait out together, not one after another."""
    started = time.monotonic()
    before = {name: measure(h) for name, h in engines.items()}
    largest: dict[str, Counter[str]] = {name: Counter() for name in engines}
    kill_at, restart_at = shape.rounds // 3, 2 * shape.rounds // 3
    with ThreadPoolExecutor(max_workers=len(engines), thread_name_prefix="kvfsm-soak") as pool:
        for index in range(shape.rounds):
            if index == kill_at:
                deployment.kill_master()
            if index == restart_at:
                deployment.restart_master()
                store_serves(next(iter(engines.values())), STORE_BACK_S)
            for _ in pool.map(lambda h: one_round(h, index, shape), engines.values()):
                pass  # a round that failed raises here
            if index % shape.measure_every == 0 or index == shape.rounds - 1:
                for name, h in engines.items():
                    largest[name] |= measure(h)
    seconds = time.monotonic() - started
    return {name: SoakReport(shape.rounds, retention_bound(h, shape.live_requests), largest[name] - before[name],
                             Counter(h.connector.scheduler.tiers.stats.failures), seconds)  # type: ignore[union-attr]
            for name, h in engines.items()}


# --- controls: the soak with one kind of growth put back ----------------------------------------------------


class _OriginsByHash(dict[int, tuple[int, str]]):
    """The tier planner's fetch origins keyed by block hash, as before the #37 fix: the origin of a block evicted or
    aborted before its load is never popped by a later fetch into its slot, and stays."""

    def __init__(self, planner: TierPlanner) -> None:
        super().__init__()
        self._blocks = planner.manager.blocks

    def update(self, pairs: object = (), /, **_: object) -> None:  # type: ignore[override]
        for slot, origin in pairs:  # type: ignore[attr-defined]
            self[self._blocks[slot].block_hash] = origin  # type: ignore[index]

    def pop(self, slot: int, default: object = None) -> object:  # type: ignore[override]
        return super().pop(self._blocks[slot].block_hash, default)  # type: ignore[arg-type]


def origins_by_hash(h: Harness) -> None:
    planner = h.connector.scheduler.tiers
    assert planner is not None
    planner._origin = _OriginsByHash(planner)


def index_unbounded(h: Harness) -> None:
    """The Mooncake tier remembers every key it wrote or adopted (the bound `index_keys` sets lifted)."""
    assert h.mooncake is not None
    h.mooncake.entries.bound = None


CONTROLS: dict[str, tuple[bool, Callable[[Harness], None] | None]] = {
    "history-kept": (True, None),
    "origins-by-hash": (False, origins_by_hash),
    "index-unbounded": (False, index_unbounded),
}
"""Per control: whether the connector keeps its history, and what it changes in the harness."""


def controlled_harness(master: str, shape: SoakShape, control: str | None) -> Harness:
    """The soak's harness, with the named control applied (None: as in production)."""
    keep_history, change = CONTROLS[control] if control is not None else (False, None)
    h = soak_harness(master, shape, keep_history)
    if change is not None:
        change(h)
    return h


def main(rounds: int = typer.Option(300, min=3, help="rounds to run")) -> None:
    """Soak a disk tier whose writes fail and a Mooncake tier whose master restarts, as in production and under each
    control; print what grew most, against the bound."""
    logging.getLogger("kvfsm").setLevel(logging.ERROR)  # every failed write would warn
    shape = SoakShape(rounds=rounds)
    with LocalMooncake(DeploymentSettings(segment_bytes=64 << 20)) as deployment:
        engines = {name: controlled_harness(str(deployment.address), shape, control)
                   for name, control in [("production", None), *((c, c) for c in CONTROLS)]}
        try:
            reports = soak(engines, deployment, shape)
        finally:
            for h in engines.values():
                h.close()
    production = reports["production"]
    typer.echo(f"{rounds} rounds of {len(engines)} engines in {production.seconds:.1f}s; bound {production.bound}")
    for name, report in reports.items():
        grew = ", ".join(f"{n} +{size}" for n, size in report.grown.most_common(4))
        typer.echo(f"{name}: tier failures {dict(report.failures)}; grew most: {grew}; "
                   f"outgrew the bound: {report.outgrown or 'nothing'}")


if __name__ == "__main__":
    typer.run(main)
