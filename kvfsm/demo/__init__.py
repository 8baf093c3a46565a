"""The demo: the reference engine serves returning prefixes twice, without offloading and with kvfsm.

GPU KV memory is deliberately too small for the workload (`kvfsm.workload`), so the engine's prefix cache forgets
prefixes before they return. Without offloading they are recomputed; with kvfsm they reload from the CPU pool.
Both runs must produce the same tokens, the spec's invariants must hold after every step of the kvfsm run, and no
request may read a poisoned block: anything else fails the run (exit code 1).

One concern per module, imported one way (each imports only those listed before it):
`switches` (the rules `--mutant` breaks on purpose), `config` (what a run is asked to do), `plan` (the device,
engine and kvfsm configuration it resolves to, checked before any work), `results` (what a run did, and the
verdict), `pacing` (the simulated GPU one engine step behind the host), `runs` (serving the arrivals and checking every step), `table` (the result as a rich table) and `cli`
(`python -m kvfsm.demo`). The names callers use (`tests/`, `kvfsm.tp`) are importable from here, each imported on
first use (`lazy_loader`), so `--help` never imports torch.
"""

import lazy_loader

_HOMES = {
    "cli": ("DISK_DEMO_CPU_BLOCKS", "SHOWN_BY_THE_WORKLOAD", "app", "main"),
    "config": ("GPU_BLOCK_TOKENS", "DemoConfig", "DemoConfigError", "DeviceKind", "Eviction"),
    "plan": ("CUDA_SHAPE", "SIM_SHAPE", "DemoPlan", "engine_config_for", "offload_config", "plan_demo",
             "resolve_device"),
    "pacing": ("OneStepBehind",),
    "results": ("EXAMPLES_KEPT", "DemoResult", "RunReport"),
    "runs": ("MAX_STEPS_PER_REQUEST", "REFUSALS", "DemoStalled", "run_demo", "run_once", "run_plan",
             "serve_arrivals"),
    "table": ("render",),
}
__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs=_HOMES)
