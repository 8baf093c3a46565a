"""The reference engine + kvfsm on a real GPU: real streams, events, pinned memory and copy engines.

The compute stream sleeps (`torch.cuda._sleep`) before every forward pass, so a copy that does not wait for the
right event overlaps the compute it should follow. kvfsm must keep outputs, CPU bytes and the spec's record
invariants intact in every trial; each mutant must corrupt data (or violate the spec) in some trial.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import initialize, run_state_machine_as_test

from kvfsm.testing.explorer_workloads import SMALL_WORKLOADS
from kvfsm.testing.harness import Harness
from kvfsm.testing.interleavings import PROMPTS, OffloadInterleavings

pytestmark = pytest.mark.gpu

REPEATS = 3
DELAY = 50_000_000  # cycles the compute stream sleeps before each forward (~25 ms: longer than a host step)


class SlowCopies:
    """Wraps a worker's transfers so each copy first sleeps on its own stream: a busy copy engine."""

    def __init__(self, harness: Harness) -> None:
        self._device = harness.device
        self._transfers = harness.connector.worker._transfers

    def __getattr__(self, name: str) -> object:
        return getattr(self._transfers, name)

    def _sleep(self, stream: str) -> None:
        self._device.enqueue(stream, stream, f"{stream} engine busy", lambda: torch.cuda._sleep(DELAY))

    def store_chunks(self, *args: object, **kwargs: object) -> object:
        self._sleep("store")
        return self._transfers.store_chunks(*args, **kwargs)

    def load_segments(self, *args: object, **kwargs: object) -> object:
        self._sleep("load")
        return self._transfers.load_segments(*args, **kwargs)

    def store_segments(self, *args: object, **kwargs: object) -> object:
        self._sleep("store")
        return self._transfers.store_segments(*args, **kwargs)


def _trial(mutant: str | None, workload: str, slow: str) -> list[str]:
    """One of the explorer's small workloads on the GPU, the host running ahead of a slow compute stream
    (`slow="compute"`), of slow copy engines (`slow="copies"`), or of neither (`slow="none"`)."""
    from kvfsm.executor.cuda import CudaDevice

    w = SMALL_WORKLOADS[workload]
    harness = Harness(CudaDevice(), num_gpu_blocks=w.num_gpu_blocks, cpu_blocks=w.cpu_blocks,
                      block_size_factor=w.block_size_factor, mutant=mutant,
                      compute_delay_cycles=DELAY if slow == "compute" else 0, per_layer=w.per_layer,
                      layer_loads=w.layer_loads, layer_stores=w.layer_stores, store_bound=w.store_bound)
    if slow == "copies":
        harness.connector.worker._transfers = SlowCopies(harness)  # type: ignore[assignment]
    try:
        for action in w.actions:
            action(harness)
        harness.drain()
        return harness.final_violations()
    except Exception as error:  # a mutant may also trip the spec's machines: that is a catch, too
        return [f"{type(error).__name__}: {error}"]
    finally:
        harness.close()


TRIALS = [(workload, slow, repeat) for workload in sorted(SMALL_WORKLOADS) for slow in ("none", "compute", "copies")
          for repeat in range(REPEATS)]


def test_kvfsm_keeps_every_trial_intact_on_a_delayed_compute_stream() -> None:
    bad = {trial: found for trial in TRIALS if (found := _trial(None, trial[0], trial[1]))}
    print(f"\nkvfsm: {len(bad)}/{len(TRIALS)} trials with a violation")
    assert not bad, bad


GPU_CAUGHT = ("no-compute-barrier", "no-lazy-fence", "no-load-dedup", "no-preemption-flush")
"""Mutants these timings expose on the GPU. `no-write-after-read-wait` and `unpinned-load` need a load to be
overtaken by work issued before it on another stream at one precise moment; fixed delays did not produce that
window on the H100 (0 of 27 trials), so those two are proven on SimDevice, where the schedule is chosen."""


@pytest.mark.parametrize("mutant", GPU_CAUGHT)
def test_mutant_corrupts_on_a_delayed_compute_stream(mutant: str) -> None:
    caught = {trial: found[0] for trial in TRIALS if (found := _trial(mutant, trial[0], trial[1]))}
    print(f"\n{mutant}: {len(caught)}/{len(TRIALS)} trials caught {sorted({(w, s) for w, s, _ in caught})}; "
          f"e.g. {next(iter(caught.values()), None)}")
    assert caught, f"{mutant} survived {len(TRIALS)} delayed trials"


class CudaInterleavings(OffloadInterleavings):
    """The generated interleavings on the GPU: the hardware picks the schedule; a rule delays compute."""

    @initialize(gpu_blocks=st.integers(6, 12), cpu_blocks=st.integers(2, 6), factor=st.sampled_from([1, 2]),
                prompts=st.lists(PROMPTS, min_size=1, max_size=3), per_layer=st.booleans(),
                layer_loads=st.booleans(), layer_stores=st.booleans())
    def setup(self, gpu_blocks: int, cpu_blocks: int, factor: int, prompts: list[tuple[tuple[int, ...], int]],
              per_layer: bool, layer_loads: bool, layer_stores: bool) -> None:
        from kvfsm.executor.cuda import CudaDevice

        self.harness = Harness(CudaDevice(), num_gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks,
                               block_size_factor=factor, mutant=self.mutant, per_layer=per_layer,
                               layer_loads=per_layer and layer_loads, layer_stores=per_layer and layer_stores)
        for prompt, max_new in prompts:
            self.h.add_request(prompt, max_new)

    def _choose_with(self, data: st.DataObject) -> None:
        """The GPU schedules itself; what hypothesis chooses instead is how long compute sleeps next step."""
        self.h.engine.compute_delay_cycles = data.draw(st.sampled_from([0, 200_000, 2_000_000]), label="delay")

    def run_device(self, data: st.DataObject, count: int, hold: frozenset[str]) -> None:  # type: ignore[override]
        """Nothing to pick: the GPU runs its streams by itself."""


def test_kvfsm_passes_generated_interleavings_on_the_gpu() -> None:
    run_state_machine_as_test(CudaInterleavings)
