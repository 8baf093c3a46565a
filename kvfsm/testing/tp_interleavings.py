"""The generated interleavings with tensor parallelism: two ranks in one process, each holding one of the model's two
heads on its own `SimDevice`, each device advanced by its own drawn schedule, one scheduler half hearing both. In
about half the examples the KV is replicated (MLA-shaped: both ranks hold both heads), and the ranks share one host
pool into which each store is copied by its writer rank alone.

Everything else is `OffloadInterleavings`: the same rules (a failed transfer is armed on a drawn rank), the same
checks (the ordering invariants on each rank's device log, every rank's pool holding its heads' bytes). Whole
forwards only, and no lower tier: the tensor-parallel engine computes whole forwards, and a lower tier is one
worker's.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from kvfsm.executor.sim import SimDevice, first_runnable
from kvfsm.testing.harness import TP_SHAPE, Harness
from kvfsm.testing.interleavings import HOLDS, PROMPTS, OffloadInterleavings

RANKS = 2


class TensorParallelInterleavings(OffloadInterleavings):
    lower_tiers = ("none",)

    @initialize(gpu_blocks=st.integers(6, 12), cpu_blocks=st.integers(2, 6), factor=st.sampled_from([1, 2]),
                prompts=st.lists(PROMPTS, min_size=1, max_size=3), report_lag=st.sampled_from([0, 1, 2]),
                replicated=st.booleans())
    def setup(self, gpu_blocks: int, cpu_blocks: int, factor: int,  # type: ignore[override]
              prompts: list[tuple[tuple[int, ...], int]], report_lag: int, replicated: bool) -> None:
        self.harness = Harness([SimDevice() for _ in range(RANKS)], num_gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks,
                               block_size_factor=factor, mutant=self.mutant, shape=TP_SHAPE, report_lag=report_lag,
                               replicated=replicated)
        for prompt, max_new in prompts:
            self.h.add_request(prompt, max_new)

    def _choose_with(self, data: st.DataObject) -> None:
        for device in self.h.devices:
            device.scheduler = lambda options: data.draw(st.sampled_from(options), label="stream")

    @rule(data=st.data(), count=st.integers(1, 12), hold=HOLDS)
    def run_device(self, data: st.DataObject, count: int, hold: frozenset[str]) -> None:
        """Advance one rank's device (drawn) by `count` operations of the streams not in `hold`."""
        device = self.h.devices[data.draw(st.integers(0, RANKS - 1), label="rank")]
        for _ in range(count):
            options = [s for s in device.runnable() if s not in hold]
            if not options:
                return
            device.run_one(data.draw(st.sampled_from(options), label="stream"))

    def teardown(self) -> None:
        if self.harness is not None:
            for device in self.h.devices:
                device.scheduler = first_runnable
        super().teardown()


def tp_interleavings_for(mutant: str | None) -> type[TensorParallelInterleavings]:
    """The tensor-parallel state machine against kvfsm (None) or one of `kvfsm.testing.mutants.TP_MUTANTS`."""
    return type(f"TpInterleavings_{mutant or 'kvfsm'}".replace("-", "_"), (TensorParallelInterleavings,),
                {"mutant": mutant, "examples": 0})
