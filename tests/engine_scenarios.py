"""The scenario helpers every whole-engine connector test shares: a Harness of the reference engine + kvfsm on a
`SimDevice`, a prefix offloaded to CPU, a drain that returns the violations, a mutant or hook as a control.

They live in a module of their own (not a test module) so that the engine tests, split by rule family across
several files, and `test_connector_copy_faults.py` import them without importing each other's tests.
"""

from __future__ import annotations

from typing import Callable

from kvfsm.connector.metadata import ConnectorOutput
from kvfsm.connector.scheduler import StepResult
from kvfsm.executor.sim import SimDevice
from kvfsm.testing.harness import SHAPE, Harness
from kvfsm.testing.mutants import MUTANTS

SHAPE_LAYERS = SHAPE.num_layers
PREFIX = tuple(range(10, 28))
"""18 tokens: nine 2-token GPU blocks."""

Control = Callable[[Harness], None]


def harness(k: int = 1, gpu_blocks: int = 24, cpu_blocks: int = 16, control: Control | None = None) -> Harness:
    h = Harness(SimDevice(), num_gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks, block_size_factor=k)
    if control is not None:
        control(h)
    return h


def offload(h: Harness, prompt: tuple[int, ...] = PREFIX) -> None:
    """Run `prompt` to the end, then drop the GPU prefix cache: its prefix now lives only on CPU."""
    h.add_request(prompt, 1)
    h.drain()
    h.engine.reset_prefix_cache()


def finish(h: Harness) -> list[str]:
    h.drain()
    return h.final_violations()


def mutant(name: str) -> Control:
    return lambda h: MUTANTS[name].apply(h.engine, h.connector)


def on_results(h: Harness, hook: Callable[[StepResult], None]) -> None:
    """Let `hook` see (and, for a control, change) each StepResult before the engine acts on it."""
    update = h.connector.update_connector_output

    def hooked(output: ConnectorOutput) -> StepResult:
        result = update(output)
        hook(result)
        return result
    h.connector.update_connector_output = hooked  # type: ignore[method-assign]


def step_lagging(h: Harness) -> None:
    """One engine step with the device left where it is: the host runs ahead of the GPU."""
    h.engine.step()
