"""Serving the demo's workload: the engine steps through the arrivals, with or without kvfsm, checked after each step.

`run_once` builds a fresh device, connector and engine for one run, serves the arrivals (`serve_arrivals`) and
records every invariant violation, refusal and trace drift in a `RunReport`; `run_plan` makes the two runs the
demo compares from a checked `DemoPlan`, and `run_demo` plans them first. `kvfsm.tp` steps its ranks with
`serve_arrivals` and serves its reference with `run_once`.
"""

from __future__ import annotations

import random
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

import torch
from rich.progress import Progress

from kvfsm.checking import TraceRecorder
from kvfsm.connector import Connector
from kvfsm.connector.refusals import UnknownJob, UnknownRequest
from kvfsm.demo.config import DemoConfig, DeviceKind
from kvfsm.demo.pacing import OneStepBehind
from kvfsm.demo.plan import DemoPlan, offload_config, plan_demo
from kvfsm.demo.results import DemoResult, RunReport
from kvfsm.demo.switches import MUTANTS
from kvfsm.engine.config import EngineConfig
from kvfsm.engine.engine import Engine
from kvfsm.engine.world import EngineWorld
from kvfsm.executor.cuda import CudaDevice
from kvfsm.executor.device import Device
from kvfsm.executor.sim import SimDevice
from kvfsm.invariants import check_all
from kvfsm.machines import IllegalTrigger
from kvfsm.manager.catalogue import ManagerError
from kvfsm.workload import Arrival, minimum_compute

MAX_STEPS_PER_REQUEST = 50
"""A run taking more engine steps than this per request (beyond the last arrival) has stalled."""
REFUSALS = (IllegalTrigger, ManagerError, UnknownJob, UnknownRequest)
"""What kvfsm raises when asked to move a lifecycle where the spec forbids (a control can provoke it)."""


class DemoStalled(RuntimeError):
    """The engine stopped making progress: a request never finished."""


def _new_device(kind: DeviceKind, seed: int) -> Device:
    """On the simulator, a seeded random schedule: stores, loads and compute interleave differently each step."""
    return CudaDevice() if kind is DeviceKind.cuda else SimDevice(random.Random(seed).choice)


def serve_arrivals(engine: Engine, arrivals: list[Arrival], after_step: Callable[[], None],
           progress: Callable[[int], None]) -> None:
    """Submit each request at its arrival step and step the engine until everything finished."""
    pending = deque(arrivals)
    limit = arrivals[-1].step + MAX_STEPS_PER_REQUEST * len(arrivals)
    clock = 0
    while pending or engine.has_work:
        while pending and pending[0].step <= clock:
            arrival = pending.popleft()
            engine.add_request(arrival.request_id, arrival.prompt, arrival.max_new_tokens)
        if not engine.has_work:
            clock = pending[0].step  # idle until the next arrival
            continue
        engine.step()
        after_step()
        progress(len(engine.finished))
        clock += 1
        if engine.step_count > limit:
            raise DemoStalled(f"{len(engine.live)} requests unfinished after {engine.step_count} steps")


def run_once(config: DemoConfig, kind: DeviceKind, engine_config: EngineConfig, arrivals: list[Arrival],
             offload: bool, progress: Callable[[int], None] = lambda finished: None) -> RunReport:
    """Serve the workload on a fresh device, with kvfsm if `offload`; checks every invariant after every step."""
    shape = engine_config.model
    device = _new_device(kind, config.seed)
    connector = None
    if offload:
        connector = Connector(offload_config(config, shape), device, keep_history=True)
    engine = Engine(engine_config, device, connector)
    if connector is not None and config.mutant is not None:
        MUTANTS[config.mutant].apply(engine, connector)
    report = RunReport(device=device.kind, outputs={}, steps=0, wall_s=0.0, gpu_hit_tokens=0, cpu_hit_tokens=0,
                       computed_tokens=0, preemptions=0)
    world = EngineWorld(engine, connector) if connector is not None else None
    trace = TraceRecorder(connector.machines) if connector is not None else None

    pacer = OneStepBehind(device) if isinstance(device, SimDevice) else None

    def check() -> None:
        if world is not None:
            checking = time.perf_counter()
            report.record(check_all(world))
            report.check_s += time.perf_counter() - checking

    def after_step() -> None:
        if pacer is not None:
            pacer.after_step()
        check()
        if pacer is not None:
            pacer.forget_checked()

    start = time.perf_counter()
    try:
        serve_arrivals(engine, arrivals, after_step, progress)
        if pacer is not None:
            pacer.finish()
        else:
            torch.cuda.synchronize()
        report.wall_s = time.perf_counter() - start - report.check_s
        check()  # engine and device are idle now, so `drained` is checked too
        if trace is not None and (drift := trace.check()):  # cumulative: every transition of the run
            report.record({"trace": drift})
    except REFUSALS as refusal:  # kvfsm refused what the spec forbids: the run stops there, and fails
        report.record({"refused": [f"{type(refusal).__name__}: {refusal}"]})
    finally:
        if trace is not None:
            trace.close()
        if connector is not None:
            connector.worker.shutdown()
    report.outputs = engine.outputs()
    report.steps = engine.step_count
    report.gpu_hit_tokens, report.cpu_hit_tokens = engine.gpu_hit_tokens, engine.cpu_hit_tokens
    report.computed_tokens, report.preemptions = engine.computed_tokens, engine.preemptions
    report.stats = connector.scheduler.stats if connector is not None else None
    planner = connector.scheduler.tiers if connector is not None else None
    report.tier_stats = planner.stats if planner is not None else None
    return report


@contextmanager
def _one_cpu_thread() -> Iterator[None]:
    """The simulator's tensors are tiny: torch's intra-op threads only spin, and on a busy 2-core machine that
    spinning made a run 30x slower (measured). One thread for the duration, then torch's setting is restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_plan(plan: DemoPlan, progress: Progress | None = None) -> DemoResult:
    """The planned workload served without offloading, then with kvfsm, on the same kind of device."""
    reports = []
    with _one_cpu_thread() if plan.kind is DeviceKind.cpu else nullcontext():
        for label, offload in (("without offloading", False), ("with kvfsm", True)):
            advance: Callable[[int], None] = lambda finished: None
            if progress is not None:
                task = progress.add_task(label, total=len(plan.arrivals))
                advance = lambda finished, task=task: progress.update(task, completed=finished)  # noqa: E731
            reports.append(run_once(plan.config, plan.kind, plan.engine, plan.arrivals, offload, advance))
    return DemoResult(plan.config, len(plan.arrivals), minimum_compute(plan.arrivals, plan.engine.model.block_size),
                      *reports)


def run_demo(config: DemoConfig, progress: Progress | None = None) -> DemoResult:
    """`config` checked (`plan_demo`: any refusal comes before either run), then served by `run_plan`."""
    return run_plan(plan_demo(config), progress)
