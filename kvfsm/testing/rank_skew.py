"""Rank skew on demand: one tensor-parallel rank's reports reach the scheduler half a fixed number of steps late.

On two GPUs every rank's copies of a step usually end within that step, so both ranks report each job in the same
output and a scheduler half that ends a job on its first report (`complete-on-first-report`) looks correct. A real
fleet has slow ranks: a busier PCIe link, a preempted host thread, a rank whose poll comes late. `LateReports`
holds what one rank's worker half saw finish for `steps` steps before passing it on, so the other ranks' reports of
each job always arrive first and a rule that needs every rank's report is exercised on every job. The rank's copies
and its device are untouched: only what the scheduler hears is late, as it is under vLLM's asynchronous
scheduling. kvfsm must pass with it (a job ends when its last rank reports); the tensor-parallel controls that end
a job early must be caught.

Threading: called on the rank's engine thread only, once per step (`WorkerConnector.get_finished`'s caller).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from kvfsm.connector.metadata import WorkerOutput


class LateReports:
    """A worker's `get_finished` whose outputs are delivered `steps` calls late (an empty output in their place
    until then), in order, none lost: the engine keeps stepping while the scheduler waits for them."""

    def __init__(self, get_finished: Callable[[], WorkerOutput], steps: int) -> None:
        self._get_finished = get_finished
        self._steps = steps
        self._held: deque[WorkerOutput] = deque()

    def __call__(self) -> WorkerOutput:
        output = self._get_finished()
        self._held.append(output)
        if len(self._held) > self._steps:
            return self._held.popleft()
        return WorkerOutput(worker=output.worker)
