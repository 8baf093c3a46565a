"""The demo: the reference engine serves returning prefixes twice, without offloading and with kvfsm.

GPU KV memory is deliberately too small for the workload (`kvfsm.workload`), so the engine's prefix cache forgets
prefixes before they return. Without offloading they are recomputed; with kvfsm they reload from the CPU pool.
Both runs must produce the same tokens, the spec's invariants must hold after every step of the kvfsm run, and no
request may read a poisoned block: anything else fails the run (exit code 1).

One concern per module, imported one way (each imports only those listed before it):
`switches` (the rules `--mutant` breaks on purpose), `config` (what a run is asked to do, and the device and
engine it resolves to), `results` (what a run did, and the verdict), `pacing` (the simulated GPU one engine step
behind the host), `runs` (serving the arrivals and checking every step), `table` (the result as a rich table)
and `cli` (`python -m kvfsm.demo`). The names callers use (`tests/`, `kvfsm.tp`) are importable from here.
"""

from kvfsm.demo.cli import DISK_DEMO_CPU_BLOCKS, SHOWN_BY_THE_WORKLOAD, app, main
from kvfsm.demo.config import (CUDA_SHAPE, SIM_SHAPE, DemoConfig, DemoConfigError, DeviceKind, Eviction,
                               engine_config_for, resolve_device)
from kvfsm.demo.pacing import OneStepBehind
from kvfsm.demo.results import EXAMPLES_KEPT, DemoResult, RunReport
from kvfsm.demo.runs import MAX_STEPS_PER_REQUEST, REFUSALS, DemoStalled, run_demo, run_once, serve_arrivals
from kvfsm.demo.table import render

__all__ = [
    "CUDA_SHAPE", "DISK_DEMO_CPU_BLOCKS", "EXAMPLES_KEPT", "MAX_STEPS_PER_REQUEST", "REFUSALS", "SHOWN_BY_THE_WORKLOAD",
    "SIM_SHAPE", "DemoConfig", "DemoConfigError", "DemoResult", "DemoStalled", "DeviceKind", "Eviction",
    "OneStepBehind", "RunReport", "app", "engine_config_for", "main", "render", "resolve_device", "run_demo",
    "run_once", "serve_arrivals",
]
