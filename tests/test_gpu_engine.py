"""The reference engine + kvfsm on a real GPU: real streams, events, pinned memory and copy engines.

The compute stream sleeps (`torch.cuda._sleep`) before every forward pass, so a copy that does not wait for the
right event overlaps the compute it should follow. kvfsm must keep outputs, CPU bytes and the spec's record
invariants intact in every trial; each mutant must corrupt data (or violate the spec) in some trial.
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, run_state_machine_as_test

from kvfsm.testing.harness import Harness
from kvfsm.testing.interleavings import PROMPTS, OffloadInterleavings
from kvfsm.testing.mutants import MUTANTS

pytestmark = pytest.mark.gpu

TRIALS = 10
DELAY = 50_000_000  # cycles the compute stream sleeps before each forward (~30 ms: longer than a host step)
P, Q = (11, 12, 13, 14), (21, 22, 23, 24)


def _trial(mutant: str | None, seed: int) -> list[str]:
    """A workload with a reload of a stored prefix, a preemption mid-store and reallocation under pressure."""
    from kvfsm.executor.cuda import CudaDevice

    harness = Harness(CudaDevice(), num_gpu_blocks=7, cpu_blocks=6, mutant=mutant, compute_delay_cycles=DELAY)
    engine = harness.engine
    try:
        harness.add_request(Q + (seed % 7,), 3)
        engine.step()
        harness.add_request(P + (1, 2), 2)
        for _ in range(3):
            engine.step()
        harness.settle()  # the first prefix is on CPU now; the GPU forgets it, so the next two reload it
        engine.step()
        engine.reset_prefix_cache()
        harness.add_request(P + (1, 2, 3), 2)
        harness.add_request(P + (1, 2, 4), 2)
        for _ in range(4):
            engine.step()
        harness.drain()
        return harness.final_violations()
    except Exception as error:  # a mutant may also trip the spec's machines: that is a catch, too
        return [f"{type(error).__name__}: {error}"]
    finally:
        harness.close()


def test_kvfsm_keeps_every_trial_intact_on_a_delayed_compute_stream() -> None:
    bad = {seed: found for seed in range(TRIALS) if (found := _trial(None, seed))}
    print(f"\nkvfsm: {len(bad)}/{TRIALS} trials with a violation")
    assert not bad, bad


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_mutant_corrupts_on_a_delayed_compute_stream(mutant: str) -> None:
    caught = {seed: found[0] for seed in range(TRIALS) if (found := _trial(mutant, seed))}
    print(f"\n{mutant}: {len(caught)}/{TRIALS} trials caught; e.g. {next(iter(caught.values()), None)}")
    assert caught, f"{mutant} survived {TRIALS} delayed trials"


class CudaInterleavings(OffloadInterleavings):
    """The generated interleavings on the GPU: the hardware picks the schedule; a rule delays compute."""

    @initialize(gpu_blocks=st.integers(6, 12), cpu_blocks=st.integers(2, 6), factor=st.sampled_from([1, 2]),
                prompts=st.lists(PROMPTS, min_size=1, max_size=3))
    def setup(self, gpu_blocks: int, cpu_blocks: int, factor: int, prompts: list[tuple[tuple[int, ...], int]]) -> None:
        from kvfsm.executor.cuda import CudaDevice

        self.harness = Harness(CudaDevice(), num_gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks,
                               block_size_factor=factor, mutant=self.mutant)
        for prompt, max_new in prompts:
            self.h.add_request(prompt, max_new)

    def _choose_with(self, data: st.DataObject) -> None:
        """The GPU schedules itself; what hypothesis chooses instead is how long compute sleeps next step."""
        self.h.engine.compute_delay_cycles = data.draw(st.sampled_from([0, 200_000, 2_000_000]), label="delay")

    def run_device(self, data: st.DataObject, count: int) -> None:  # type: ignore[override]
        """Nothing to pick: the GPU runs its streams by itself."""


def test_kvfsm_passes_generated_interleavings_on_the_gpu() -> None:
    run_state_machine_as_test(CudaInterleavings)
